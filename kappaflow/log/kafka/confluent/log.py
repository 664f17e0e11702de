"""The Kafka log on librdkafka (confluent-kafka): the log contract at C speed.

The same contract and guarantees as the kafka-python client (`kappaflow.log.kafka.KafkaLog`),
on librdkafka's producer and consumers; each role has a module of its own:

* `topics` -- create / describe / delete on the admin client (configs as in the kafka-python
  client: `max.message.bytes = max_record_bytes + BATCH_FRAMING`);
* `append` -- the idempotent producer (`acks=all`), partitions chosen by kappaflow's murmur2,
  durable when `append` returns (every delivery report is in), nothing left queued on failure;
* `read` -- the reader and probe consumers, read_committed, and end offsets that hold on the
  test broker's lagging ListOffsets answer;
* `groups` -- committed offsets of a consumer group through the admin client;
* `clients` -- configs, bounded connects, security mapping and error mapping.

Known limits: a record timestamp of 0 cannot be written (librdkafka reads 0 as "now"; the append
is refused naming the record). Compaction is the broker's job (`compact()` is a no-op). Topic
configs and the highest high watermark seen are cached per object, as in the kafka-python client.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from kappaflow.errors import LogError, ValidationError
from kappaflow.log.base import (
    Appended,
    CompactionStats,
    Log,
    LogRecord,
    Record,
    TopicConfig,
    check_commit_offset,
    check_group,
    check_partition,
    check_read_args,
    split_commit_key,
)
from kappaflow.log.base import TopicPartition as TP
from kappaflow.log.kafka.common import KafkaOptions, KafkaSecurity
from kappaflow.log.kafka.confluent.append import Appender
from kappaflow.log.kafka.confluent.clients import ErrorLatch, base_config, connect, user_config
from kappaflow.log.kafka.confluent.groups import GroupOffsets
from kappaflow.log.kafka.confluent.read import KafkaColumns, Reader
from kappaflow.log.kafka.confluent.topics import TopicAdmin

__all__ = ["ConfluentKafkaLog"]

C = TypeVar("C")


class ConfluentKafkaLog(Log):
    """The log on a Kafka cluster through librdkafka: `open_log("kafka://host:9092", client="confluent")`.

    Options are those of `KafkaLog` (linger_ms, batch_bytes, compression, replication_factor,
    request_timeout_s, connect_*, security, read_only), except that `client_options`,
    `producer_options` and `consumer_options` are librdkafka properties (dotted names such as
    ``linger.ms``, ``fetch.wait.max.ms``).
    """

    supports_on_demand_compaction: ClassVar[bool] = False
    client_name: ClassVar[str] = "confluent"

    def __init__(
        self,
        bootstrap: str,
        *,
        client_id: str = "kappaflow",
        linger_ms: int = 20,
        batch_bytes: int = 1024 * 1024,
        compression: str | None = None,
        replication_factor: int = -1,
        request_timeout_s: float = 30.0,
        connect_attempts: int = 3,
        connect_backoff_s: float = 0.25,
        connect_timeout_s: float = 1.0,
        client_options: Mapping[str, Any] | None = None,
        producer_options: Mapping[str, Any] | None = None,
        consumer_options: Mapping[str, Any] | None = None,
        security: KafkaSecurity | Mapping[str, Any] | None = None,
        read_only: bool = False,
    ) -> None:
        o = self._opts = KafkaOptions.checked(
            bootstrap, client_id=client_id, linger_ms=linger_ms, batch_bytes=batch_bytes, compression=compression,
            replication_factor=replication_factor, request_timeout_s=request_timeout_s,
            connect_attempts=connect_attempts, connect_backoff_s=connect_backoff_s,
            connect_timeout_s=connect_timeout_s, read_only=read_only, security=security)
        self._client_conf = user_config("client", client_options)
        self._producer_conf = user_config("producer", producer_options)
        self._consumer_conf = user_config("consumer", consumer_options)
        self._latch = ErrorLatch()
        self._lock = threading.Lock()  # client creation
        self._clients: dict[str, Any] = {}
        self._closed = False
        self._topics = TopicAdmin(self._admin_client, bootstrap=o.bootstrap, timeout_s=o.timeout_s,
                                  replication_factor=o.replication_factor)
        self._appender = Appender(self._producer_client, bootstrap=o.bootstrap, timeout_s=o.timeout_s,
                                  topics=self._topics, drop_producer=self._drop_producer)
        self._reader = Reader(self._reader_client, self._probe_client, self._admin_client, bootstrap=o.bootstrap,
                              timeout_s=o.timeout_s, topics=self._topics)
        self._groups = GroupOffsets(self._admin_client, timeout_s=o.timeout_s, topics=self._topics)

    def __repr__(self) -> str:
        return f"ConfluentKafkaLog({self._opts.bootstrap!r}{', read_only=True' if self._opts.read_only else ''})"

    @property
    def bootstrap(self) -> str:
        return self._opts.bootstrap

    @property
    def read_only(self) -> bool:
        return self._opts.read_only

    def _require_writer(self, what: str) -> None:
        if self._opts.read_only:
            raise LogError(f"{what}: {self!r} is read-only; open it without read_only=True to write")

    # --- clients (created on first use, one of each per log) --------------------------------------
    def _client(self, role: str, factory: Callable[[dict[str, Any]], C], extra: Mapping[str, Any]) -> C:
        client = self._clients.get(role)
        if client is None:
            with self._lock:
                if self._closed:
                    raise LogError(f"{self!r} is closed")
                client = self._clients.get(role)
                if client is None:
                    o = self._opts
                    conf = base_config(o, role, self._latch, {**extra, **self._client_conf})
                    client = connect(lambda: factory(conf), _metadata,
                                     bootstrap=o.bootstrap, what=f"connecting the {role} client",
                                     attempts=o.connect_attempts, backoff_s=o.connect_backoff_s,
                                     timeout_s=o.connect_timeout_s, latch=self._latch)
                    self._clients[role] = client
        return client

    def _admin_client(self) -> AdminClient:
        return self._client("admin", AdminClient, {"allow.auto.create.topics": False})

    def _producer_client(self) -> Producer:
        o = self._opts
        timeout_ms = int(o.timeout_s * 1000)
        return self._client("producer", Producer, {
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": o.linger_ms,
            "batch.size": o.batch_bytes,
            "compression.type": o.compression or "none",
            "message.max.bytes": max(8 * 1024 * 1024, 2 * o.batch_bytes),
            "message.timeout.ms": timeout_ms + o.linger_ms,  # the bound on one record's delivery, retries included
            "request.timeout.ms": timeout_ms,
            "queue.buffering.max.messages": 1_000_000,
            "allow.auto.create.topics": False,
            **self._producer_conf,
        })

    def _consumer_conf_for(self, role: str, tuning: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "group.id": f"{self._opts.client_id}-{role}",  # required by librdkafka; never joined
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",  # below the log start: the first record >= offset is there
            "enable.partition.eof": True,
            "allow.auto.create.topics": False,
            "isolation.level": "read_committed",
            **tuning,
            **self._consumer_conf,
        }

    def _reader_client(self) -> Consumer:
        return self._client("reader", Consumer, self._consumer_conf_for("reader", {
            "fetch.wait.max.ms": 50, "max.partition.fetch.bytes": 8 * 1024 * 1024,
            "fetch.max.bytes": 64 * 1024 * 1024,
            # A full prefetch queue postpones the next fetch by this long (1 s by default), which a
            # reader draining the queue faster than that then waits out (see the probe below).
            "fetch.queue.backoff.ms": 10}))

    def _probe_client(self) -> Consumer:
        # Only reads high watermarks: tiny fetches, 1 ms broker wait (0 makes tansu answer with
        # no partitions at all), next to no prefetch. With so small a queue every fetch answer
        # "exceeds" it, and librdkafka then postpones the partition's next fetch by
        # fetch.queue.backoff.ms (1 s by default): an end-offset probe of a second partition
        # waited that second. 1 ms keeps a probe one round trip.
        return self._client("probe", Consumer, self._consumer_conf_for("probe", {
            "fetch.wait.max.ms": 1, "max.partition.fetch.bytes": 1, "fetch.max.bytes": 1000,
            "queued.min.messages": 1, "queued.max.messages.kbytes": 1, "message.max.bytes": 1000,
            "fetch.queue.backoff.ms": 1}))

    def _drop_producer(self) -> None:
        with self._lock:
            self._clients.pop("producer", None)

    def _reset_clients(self, roles: Sequence[str]) -> None:
        with self._lock:
            gone = {role: self._clients.pop(role) for role in roles if role in self._clients}
        self._close_clients(gone)

    def _close_clients(self, clients: Mapping[str, Any]) -> None:
        for role, client in clients.items():
            try:
                if role == "producer":
                    client.flush(self._opts.timeout_s)
                elif role in ("reader", "probe"):
                    client.close()
            except Exception:  # closing is best effort; the process may be exiting
                pass

    # --- topics -----------------------------------------------------------------------------------
    def create_topic(self, name: str, config: TopicConfig | None = None, *, exist_ok: bool = True) -> TopicConfig:
        self._require_writer(f"creating topic {name!r}")
        return self._topics.create(name, config, exist_ok=exist_ok)

    def delete_topic(self, name: str) -> None:
        """Delete, then start every client afresh.

        Why: librdkafka 2.16 can crash (SIGSEGV in its metadata cache) when a client that knew a
        topic meets its deletion and a later recreation; clients that never saw it are safe, and
        deleting topics is rare (tests, maintenance), so reconnecting costs nothing that matters.
        """
        self._require_writer(f"deleting topic {name!r}")
        # a consumer still assigned to the topic keeps asking about it
        self._reader.forget(name, lambda: self._reset_clients(("reader", "probe")))
        self._topics.delete(name)
        self._reset_clients(("producer", "admin"))

    def list_topics(self) -> dict[str, TopicConfig]:
        return self._topics.list()

    def topic_config(self, name: str) -> TopicConfig:
        return self._topics.config(name)

    def partitions(self, topic: str) -> int:
        return self._topics.config(topic).partitions

    # --- write ------------------------------------------------------------------------------------
    def append(self, topic: str, records: Sequence[Record], *, partition: int | None = None) -> list[Appended]:
        self._require_writer(f"appending to topic {topic!r}")
        config = self._topics.config(topic)
        if not records:
            return []
        return self._appender.append(topic, config, records, partition, results=True)

    def append_quiet(self, topic: str, records: Sequence[Record], *, partition: int | None = None) -> None:
        self._require_writer(f"appending to topic {topic!r}")
        config = self._topics.config(topic)
        if records:
            self._appender.append(topic, config, records, partition, results=False)

    # --- read -------------------------------------------------------------------------------------
    def read(self, topic: str, partition: int, offset: int, max_records: int = 10_000) -> list[LogRecord]:
        config = self._topics.config(topic)
        check_partition(topic, partition, config.partitions)
        check_read_args(topic, partition, offset, max_records)
        return self._reader.read(topic, partition, offset, max_records)

    def read_columns(self, topic: str, partition: int, start: int = 0, end: int | None = None, *,
                     batches_per_fetch: int = 16) -> Iterator[KafkaColumns]:
        """Records with ``start <= offset < end`` as columns (see `Reader.read_columns`)."""
        config = self._topics.config(topic)
        check_partition(topic, partition, config.partitions)
        check_read_args(topic, partition, start, 1)
        if end is not None and (type(end) is not int or end < 0):
            raise ValidationError(f"topic {topic!r} partition {partition} end: expected an int >= 0 or None, "
                                  f"got {end!r}")
        return self._reader.read_columns(topic, partition, start, end, batches_per_fetch)

    def end_offset(self, topic: str, partition: int) -> int:
        check_partition(topic, partition, self._topics.config(topic).partitions)
        return self._reader.end_offsets(topic, [partition])[partition]

    def end_offsets(self, topic: str) -> dict[int, int]:
        return self._reader.end_offsets(topic, list(range(self._topics.config(topic).partitions)))

    # --- consumer groups --------------------------------------------------------------------------
    def commit(self, group: str, offsets: Mapping[TP, int]) -> None:
        check_group(group)
        request: dict[tuple[str, int], int] = {}
        for tp, nxt in offsets.items():
            topic, partition = split_commit_key(tp)
            check_partition(topic, partition, self._topics.config(topic).partitions)
            request[(topic, partition)] = check_commit_offset(topic, partition, nxt)
        if request:
            self._groups.commit(group, request)

    def committed(self, group: str, topic: str) -> dict[int, int]:
        check_group(group)
        return self._groups.committed(group, topic, self._topics.config(topic).partitions)

    # --- maintenance ------------------------------------------------------------------------------
    def compact(self, topic: str, *, now_ms: int | None = None) -> CompactionStats:
        """No-op: Kafka's log cleaner compacts `cleanup.policy=compact` topics on its own schedule."""
        self._topics.config(topic)
        if now_ms is not None and type(now_ms) is not int:
            raise ValidationError(f"compact now_ms: expected an int, got {now_ms!r}")
        return CompactionStats(topic=topic)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clients, self._clients = self._clients, {}
        self._reader.close()
        self._close_clients(clients)


def _metadata(client: Any, timeout_s: float) -> object:
    """One metadata request: answered only by a reachable broker (every librdkafka client has it)."""
    return client.list_topics(timeout=timeout_s)
