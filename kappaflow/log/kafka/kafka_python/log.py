"""The Kafka log backend (kafka-python): the same contract as the embedded log, on a Kafka cluster.

`KafkaLog` puts the roles together, one module each: `connection` (the clients), `topics`, `append`,
`read`, `groups` (consumer group offsets); `clients` holds the kafka-python plumbing.

How each part of the contract maps onto Kafka:

* **append**: one idempotent producer (`enable_idempotence`, `acks=all`), partition chosen
  by kappaflow's `partition_for` (murmur2, like Java clients) and passed explicitly. The
  call returns after `flush()` and after every record's future resolved, so each returned
  (partition, offset) is acknowledged by all in-sync replicas. Size and key rules are
  checked for the whole batch before anything is sent (a rejected append writes nothing).
  Kafka has no cross-batch atomicity without transactions: if the broker fails *during*
  an append, some records may be durable and the error says how many.
* **read**: one reused consumer (no group) assigned to the partition being read and moved
  with `seek()` only when the caller jumps; sequential reads reuse its prefetched data.
* **end_offset**: ListOffsets(latest) is not trusted alone. Some brokers (tansu, the test
  broker) answer it with the base offset of the last batch + 1, which would hide the tail.
  The answer is max(ListOffsets, the high watermark of a fetch at that offset); any high
  watermark >= the ListOffsets answer is provably current (see `_end_offsets`). On a
  correct broker the fetch is skipped when the known high watermark already covers it.
* **commit / committed**: OffsetCommit / OffsetFetch to the group coordinator through the
  admin client, without joining the group (like Java's `AdminClient.alterConsumerGroupOffsets`).
  Kafka rejects commits for a group that has active members; that is reported.
* **compact**: Kafka's log cleaner compacts on its own schedule (`min.cleanable.dirty.ratio`,
  `segment.ms`); there is no on-demand call. `compact()` is a no-op returning empty stats and
  `supports_on_demand_compaction` is False so callers (and the contract suite) can tell.
* **topic configs**: `cleanup.policy`, `delete.retention.ms` and `max.message.bytes` are set
  at creation and read back with DescribeConfigs (`common.creation_configs` /
  `common.topic_config_from`, shared with the confluent client); `retention.ms` and
  `retention.bytes` too when the TopicConfig sets them (-1: kept for ever, for topics that keep
  every version -- ``connectors/history.py``), else the broker's default applies.
  `TopicConfig.max_record_bytes` limits one record's payload (key + value + header keys and
  values), the same rule as the embedded log, while Kafka's `max.message.bytes` limits a record
  *batch*. The topic therefore gets
  `max.message.bytes = max_record_bytes + 97` (the v2 framing of a batch holding one record:
  61-byte batch header, at most 21 bytes of record fields, 3 varints of at most 5 bytes) and
  reading the config back subtracts it again. Every record is checked before anything is
  sent, by the payload rule and (with headers) by Kafka's exact batch size, so an append
  the broker would reject for size writes nothing.

Known limits: reads are read_uncommitted (records of aborted transactions written by
*other*, transactional producers are visible; kappaflow's own producer is not
transactional). Topic configs and the highest high watermark seen are cached per
`KafkaLog` object (topic configs are fixed at creation); a topic deleted and recreated by
another process needs a new `KafkaLog`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, ClassVar

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition

from kappaflow.errors import ValidationError
from kappaflow.log.base import CompactionStats, Log, TopicConfig
from kappaflow.log.kafka.common import BATCH_FRAMING, KafkaOptions, KafkaSecurity
from kappaflow.log.kafka.kafka_python.append import KafkaAppend
from kappaflow.log.kafka.kafka_python.clients import security_options, split_options
from kappaflow.log.kafka.kafka_python.groups import KafkaGroups
from kappaflow.log.kafka.kafka_python.read import KafkaRead

__all__ = ["BATCH_FRAMING", "KafkaLog"]


class KafkaLog(KafkaAppend, KafkaRead, KafkaGroups, Log):
    """The log on a Kafka cluster: `KafkaLog("host:9092")` or `open_log("kafka://host:9092")`.

    Options:
      linger_ms, batch_bytes, compression: producer batching (defaults favour throughput:
        20 ms, 512 KiB, none).
      replication_factor: for new topics; -1 = the broker's default.
      request_timeout_s: bound on every broker round trip and on waiting for acks.
      connect_attempts, connect_backoff_s, connect_timeout_s: a broker that is down is
        reported as LogUnavailableError after `connect_attempts` tries of
        `connect_timeout_s` each, sleeping `connect_backoff_s` (doubling) in between.
      security: a `KafkaSecurity` (or a table of its fields): SSL, SASL PLAIN/SCRAM, mapped to
        kafka-python's options for every client.
      client_options: extra kafka-python options (client_rack, ...), routed to the producer,
        consumers and admin client that accept each one.
      producer_options / consumer_options: kafka-python options for the producer only / the
        consumers only (`[log.kafka.producer]` / `[log.kafka.consumer]`).
      read_only: refuse append and topic creation/deletion (a reader, as for the embedded
        log); committing consumer offsets stays allowed.
    """

    supports_on_demand_compaction: ClassVar[bool] = False

    def __init__(
        self,
        bootstrap: str,
        *,
        client_id: str = "kappaflow",
        linger_ms: int = 20,
        batch_bytes: int = 512 * 1024,
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
        o = KafkaOptions.checked(
            bootstrap, client_id=client_id, linger_ms=linger_ms, batch_bytes=batch_bytes, compression=compression,
            replication_factor=replication_factor, request_timeout_s=request_timeout_s,
            connect_attempts=connect_attempts, connect_backoff_s=connect_backoff_s,
            connect_timeout_s=connect_timeout_s, read_only=read_only, security=security)
        self._bootstrap = o.bootstrap
        self._read_only = o.read_only
        self._client_id = o.client_id
        self._linger_ms = o.linger_ms
        self._batch_bytes = o.batch_bytes
        self._compression = o.compression
        self._replication_factor = o.replication_factor
        self._timeout_s = o.timeout_s
        self._connect_attempts = o.connect_attempts
        self._connect_backoff_s = o.connect_backoff_s
        self._connect_timeout_s = o.connect_timeout_s
        self._options = split_options(
            client_options, {"producer": KafkaProducer, "consumer": KafkaConsumer, "admin": KafkaAdminClient},
            security=security_options(o.security),
            only={"producer": producer_options, "consumer": consumer_options})
        self._lock = threading.Lock()  # client creation, topic cache
        self._read_lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self._admin: KafkaAdminClient | None = None
        self._producer: KafkaProducer | None = None
        self._reader: KafkaConsumer | None = None
        self._probe: KafkaConsumer | None = None
        self._topics: dict[str, TopicConfig] = {}
        # Highest high watermark seen per partition, from any fetch (see _end_offsets).
        self._highwater: dict[TopicPartition, int] = {}
        self._reader_tp: TopicPartition | None = None
        self._reader_next = -1  # the reader's position when it is known to be valid, else -1
        self._closed = False

    def __repr__(self) -> str:
        return f"KafkaLog({self._bootstrap!r}{', read_only=True' if self._read_only else ''})"

    @property
    def bootstrap(self) -> str:
        return self._bootstrap

    @property
    def read_only(self) -> bool:
        return self._read_only

    # --- maintenance ----------------------------------------------------------------------
    def compact(self, topic: str, *, now_ms: int | None = None) -> CompactionStats:
        """No-op: Kafka's log cleaner compacts `cleanup.policy=compact` topics on its own schedule."""
        self._topic(topic)
        if now_ms is not None and type(now_ms) is not int:
            raise ValidationError(f"compact now_ms: expected an int, got {now_ms!r}")
        return CompactionStats(topic=topic)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            clients: list[Any] = [self._producer, self._reader, self._probe, self._admin]
            self._producer = self._reader = self._probe = self._admin = None
        for client in clients:
            if client is None:
                continue
            try:
                if isinstance(client, KafkaProducer):
                    client.close(timeout=self._timeout_s)
                else:
                    client.close()
            except Exception:  # closing is best effort; the process may be exiting
                pass
