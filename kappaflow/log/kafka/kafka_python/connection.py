"""The kafka-python log's clients: created on first use, bounded connects, errors mapped."""

from __future__ import annotations

import threading
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition

from kappaflow.errors import LogError
from kappaflow.log.base import TopicConfig
from kappaflow.log.kafka.kafka_python.clients import connect, disable_auto_topic_creation, is_unknown_topic, map_error

__all__ = ["KafkaConnection"]


class KafkaConnection:
    """The clients of one kafka-python log and the state every role shares.

    Creates the admin client, the producer and the reader and probe consumers on first use
    (bounded connects, see ``clients``), maps kafka-python's errors onto kappaflow's; the role
    mixins (``topics``, ``append``, ``read``, ``groups``) build on it and `KafkaLog` (``log``)
    sets these attributes in its constructor.
    """

    _bootstrap: str
    _read_only: bool
    _client_id: str
    _linger_ms: int
    _batch_bytes: int
    _compression: str | None
    _replication_factor: int
    _timeout_s: float
    _connect_attempts: int
    _connect_backoff_s: float
    _connect_timeout_s: float
    _options: dict[str, dict[str, Any]]
    _lock: threading.Lock
    _read_lock: threading.Lock
    _probe_lock: threading.Lock
    _admin: KafkaAdminClient | None
    _producer: KafkaProducer | None
    _reader: KafkaConsumer | None
    _probe: KafkaConsumer | None
    _topics: dict[str, TopicConfig]
    _highwater: dict[TopicPartition, int]
    _reader_tp: TopicPartition | None
    _reader_next: int
    _closed: bool

    def _require_writer(self, what: str) -> None:
        if self._read_only:
            raise LogError(f"{what}: {self!r} is read-only; open it without read_only=True to write")

    # --- clients --------------------------------------------------------------------------
    def _common(self, role: str) -> dict[str, Any]:
        return {
            "bootstrap_servers": self._bootstrap.split(","),
            "client_id": f"{self._client_id}-{role}",
            "request_timeout_ms": int(self._timeout_s * 1000),
            "bootstrap_timeout_ms": int(self._connect_timeout_s * 1000),
            "reconnect_backoff_max_ms": 1000,
        }

    def _connect(self, what: str, make: Any) -> Any:
        if self._closed:
            raise LogError(f"{self!r} is closed")
        return connect(make, bootstrap=self._bootstrap, what=what,
                       attempts=self._connect_attempts, backoff_s=self._connect_backoff_s)

    def _admin_client(self) -> KafkaAdminClient:
        admin = self._admin
        if admin is None:
            with self._lock:
                if self._admin is None:
                    opts = {**self._common("admin"), **self._options["admin"]}
                    self._admin = self._connect("connecting the admin client", lambda: KafkaAdminClient(**opts))
                admin = self._admin
        return admin

    def _producer_client(self) -> KafkaProducer:
        producer = self._producer
        if producer is None:
            with self._lock:
                if self._producer is None:
                    opts = {
                        **self._common("producer"),
                        "enable_idempotence": True,
                        "acks": "all",
                        "linger_ms": self._linger_ms,
                        "batch_size": self._batch_bytes,
                        "compression_type": self._compression,
                        "max_request_size": max(8 * 1024 * 1024, 2 * self._batch_bytes),
                        "allow_auto_create_topics": False,
                        "max_block_ms": int(self._timeout_s * 1000),
                        "delivery_timeout_ms": int(self._timeout_s * 1000) + self._linger_ms,
                        **self._options["producer"],
                    }
                    producer = self._connect("connecting the producer", lambda: KafkaProducer(**opts))
                    disable_auto_topic_creation(producer)
                    self._producer = producer
                producer = self._producer
        return producer

    def _consumer(self, role: str, **overrides: Any) -> KafkaConsumer:
        opts = {
            **self._common(role),
            "group_id": None,
            "enable_auto_commit": False,
            "auto_offset_reset": "none",
            "allow_auto_create_topics": False,
            **overrides,
            **self._options["consumer"],
        }
        consumer: KafkaConsumer = self._connect(f"connecting the {role} consumer", lambda: KafkaConsumer(**opts))
        disable_auto_topic_creation(consumer)
        return consumer

    def _reader_client(self) -> KafkaConsumer:
        if self._reader is None:
            self._reader = self._consumer(
                "reader", fetch_max_wait_ms=50, max_partition_fetch_bytes=8 * 1024 * 1024, max_poll_records=10_000
            )
        return self._reader

    def _probe_client(self) -> KafkaConsumer:
        # Only reads high watermarks: one tiny fetch per partition, no CRC work, 1 ms broker wait
        # (0 makes tansu answer with no partitions at all).
        if self._probe is None:
            self._probe = self._consumer(
                "probe", fetch_max_wait_ms=1, max_partition_fetch_bytes=1, fetch_max_bytes=1, check_crcs=False
            )
        return self._probe

    def _fail(self, exc: BaseException, what: str, topic: str | None = None) -> LogError:
        if topic is not None and is_unknown_topic(exc):
            with self._lock:
                self._topics.pop(topic, None)
        return map_error(exc, bootstrap=self._bootstrap, what=what, topic=topic)
