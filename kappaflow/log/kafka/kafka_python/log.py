"""The Kafka log backend (kafka-python): the same contract as the embedded log, on a Kafka cluster.

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
  at creation and read back with DescribeConfigs. `TopicConfig.max_record_bytes` limits one
  record's payload (key + value + header keys and values), the same rule as the embedded
  log, while Kafka's `max.message.bytes` limits a record *batch*. The topic therefore gets
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
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka import errors as kerr
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.structs import OffsetAndMetadata

from kappaflow.errors import (
    ConfigError,
    LogError,
    LogUnavailableError,
    RecordTooLargeError,
    UnknownTopicError,
    ValidationError,
)
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
    validate_topic_name,
)
from kappaflow.log.base import (
    TopicPartition as TP,
)
from kappaflow.log.kafka.common import (
    BATCH_FRAMING,
    KafkaOptions,
    KafkaSecurity,
    checked_append,
    creation_configs,
    describe_key,
    partitions_of,
    topic_config_from,
)
from kappaflow.log.kafka.kafka_python.clients import (
    connect,
    disable_auto_topic_creation,
    is_too_large,
    is_unknown_topic,
    map_error,
    security_options,
    split_options,
)

__all__ = ["BATCH_FRAMING", "KafkaLog"]


class KafkaLog(Log):
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

    # --- topics ---------------------------------------------------------------------------
    def _describe(self, names: list[str] | None) -> dict[str, TopicConfig]:
        """Configs of existing topics among `names` (all user topics for None), from the broker."""
        admin = self._admin_client()
        try:
            metadata = admin.describe_topics(names)
            found = {
                t["name"]: len(t["partitions"])
                for t in metadata
                if t.get("error_code", 0) == 0 and not t.get("is_internal")
                and (names is not None or not t["name"].startswith("__"))  # listed: internal ones hidden
                and t["partitions"]
            }
            described: dict[str, Any] = {}
            if found:
                # config_filter "all": brokers (tansu) may report explicitly set values as defaults.
                resources = [ConfigResource(ConfigResourceType.TOPIC, name) for name in found]
                described = admin.describe_configs(resources, config_filter="all").get("topic", {})
        except kerr.KafkaError as exc:
            raise self._fail(exc, "describing topics") from None
        return {name: topic_config_from(name, parts, _value_reader(described.get(name, {})))
                for name, parts in sorted(found.items())}

    def _topic(self, name: str) -> TopicConfig:
        """The topic's config, cached for the life of this object (topic configs are fixed)."""
        config = self._topics.get(name)
        if config is None:
            validate_topic_name(name)
            config = self._describe([name]).get(name)
            if config is None:
                raise UnknownTopicError(name)
            with self._lock:
                self._topics[name] = config
        return config

    def create_topic(self, name: str, config: TopicConfig | None = None, *, exist_ok: bool = True) -> TopicConfig:
        self._require_writer(f"creating topic {name!r}")
        validate_topic_name(name)
        if config is not None and not isinstance(config, TopicConfig):
            raise ConfigError(f"topic {name!r} config: expected a TopicConfig, got {type(config).__name__}")
        existing = self._describe([name]).get(name)
        if existing is None:
            wanted = config or TopicConfig()
            spec = {
                "num_partitions": wanted.partitions,
                "replication_factor": self._replication_factor,
                "configs": creation_configs(wanted),
            }
            admin = self._admin_client()
            try:
                admin.create_topics({name: spec}, timeout_ms=int(self._timeout_s * 1000))
                admin.wait_for_topics([name], timeout_ms=int(self._timeout_s * 1000))
            except kerr.TopicAlreadyExistsError:
                existing = self._describe([name]).get(name)  # created concurrently: compare below
                if existing is None:
                    raise LogError(f"topic {name!r}: the broker says it exists but does not describe it "
                                   "(being deleted?); retry", retry=None) from None
            except (kerr.InvalidReplicationFactorError, kerr.InvalidConfigurationError,
                    kerr.PolicyViolationError, kerr.InvalidPartitionsError, kerr.InvalidTopicError) as exc:
                raise ConfigError(f"topic {name!r}: the broker rejected the topic config {wanted} "
                                  f"(replication_factor={self._replication_factor}): {exc}") from None
            except kerr.KafkaError as exc:
                raise self._fail(exc, f"creating topic {name!r}") from None
            else:
                with self._lock:
                    self._topics[name] = wanted
                return wanted
        if not exist_ok:
            raise ConfigError(f"topic {name!r} already exists")
        if config is not None and config != existing:
            raise ConfigError(
                f"topic {name!r} already exists with a different config: existing {existing}, requested {config}"
            )
        with self._lock:
            self._topics[name] = existing
        return existing

    def delete_topic(self, name: str) -> None:
        self._require_writer(f"deleting topic {name!r}")
        validate_topic_name(name)
        # Detach our consumers first: a consumer still assigned to the topic keeps asking the
        # broker about it, and tansu (like Kafka with auto.create.topics.enable) recreates it.
        with self._read_lock:
            if self._reader is not None and any(tp.topic == name for tp in self._reader.assignment()):
                self._reader.unsubscribe()
                self._reader_tp = None
                self._reader_next = -1
        with self._probe_lock:
            if self._probe is not None and any(tp.topic == name for tp in self._probe.assignment()):
                self._probe.unsubscribe()
        admin = self._admin_client()
        try:
            admin.delete_topics([name], timeout_ms=int(self._timeout_s * 1000))
        except kerr.KafkaError as exc:
            raise self._fail(exc, f"deleting topic {name!r}", topic=name) from None
        with self._lock:
            self._topics.pop(name, None)
            for tp in [tp for tp in self._highwater if tp.topic == name]:
                del self._highwater[tp]
        # Deletion is asynchronous on Kafka: wait (bounded) until metadata no longer shows it.
        deadline = time.monotonic() + self._timeout_s
        while name in self._describe([name]):
            if time.monotonic() > deadline:
                raise LogUnavailableError(
                    f"topic {name!r} still listed {self._timeout_s:.0f}s after deletion (a client still "
                    "using it may have recreated it through auto topic creation)")
            time.sleep(0.05)

    def list_topics(self) -> dict[str, TopicConfig]:
        topics = self._describe(None)
        with self._lock:
            self._topics.update(topics)
        return topics

    def topic_config(self, name: str) -> TopicConfig:
        return self._topic(name)

    def partitions(self, topic: str) -> int:
        return self._topic(topic).partitions

    # --- write ----------------------------------------------------------------------------
    def append(self, topic: str, records: Sequence[Record], *, partition: int | None = None) -> list[Appended]:
        self._require_writer(f"appending to topic {topic!r}")
        config = self._topic(topic)
        n = len(records)
        if n == 0:
            return []
        keys, values = checked_append(topic, config, records, partition)
        parts = partitions_of(keys, config.partitions, partition)
        producer = self._producer_client()
        send = producer.send
        futures: list[Any] = []
        add = futures.append
        try:
            for i, rec in enumerate(records):
                headers = rec.headers
                add(send(topic, value=values[i], key=keys[i], headers=list(headers) if headers else None,
                         partition=parts[i], timestamp_ms=rec.timestamp_ms))
        except (TypeError, ValueError) as exc:
            producer.flush(self._timeout_s)
            raise ValidationError(
                f"topic {topic!r} record {len(futures)}: {exc}; {len(futures)} earlier records of this append "
                "were sent") from None
        except kerr.KafkaError as exc:
            raise self._append_failure(topic, exc, len(futures), n) from None
        try:
            producer.flush(self._timeout_s)
        except kerr.KafkaError as exc:
            raise self._append_failure(topic, exc, 0, n) from None
        out: list[Appended] = []
        push = out.append
        for i, f in enumerate(futures):
            if not f.succeeded():
                error = f.exception if f.is_done else kerr.KafkaTimeoutError("record not acknowledged in time")
                ok = sum(map(bool, (g.succeeded() for g in futures)))
                if is_too_large(error):
                    raise RecordTooLargeError(
                        f"topic {topic!r} record {i} (key {describe_key(keys[i])}): the broker rejected it as too "
                        f"large for max.message.bytes ({error}); {ok} of {n} records of this append were "
                        "acknowledged") from None
                raise self._append_failure(topic, error, ok, n) from None
            md = f.value
            push(Appended(md.partition, md.offset))
        return out

    def _append_failure(self, topic: str, exc: BaseException, acknowledged: int, total: int) -> LogError:
        err = self._fail(exc, f"appending to topic {topic!r} ({acknowledged} of {total} records acknowledged)",
                         topic=topic)
        if isinstance(err, LogUnavailableError) or not is_unknown_topic(exc):
            # A timeout on a topic deleted meanwhile looks like an unreachable broker: tell them apart.
            try:
                if topic not in self._describe([topic]):
                    with self._lock:
                        self._topics.pop(topic, None)
                    return UnknownTopicError(topic)
            except LogError:
                pass
        return err

    # --- read -----------------------------------------------------------------------------
    def read(self, topic: str, partition: int, offset: int, max_records: int = 10_000) -> list[LogRecord]:
        config = self._topic(topic)
        check_partition(topic, partition, config.partitions)
        check_read_args(topic, partition, offset, max_records)
        tp = TopicPartition(topic, partition)
        with self._read_lock:
            try:
                return self._read_locked(tp, offset, max_records)
            except kerr.KafkaError as exc:
                self._reader_next = -1
                raise self._fail(exc, f"reading topic {topic!r} partition {partition} at offset {offset}",
                                 topic=topic) from None

    def _read_locked(self, tp: TopicPartition, offset: int, max_records: int) -> list[LogRecord]:
        consumer = self._reader_client()
        if self._reader_tp != tp:
            consumer.assign([tp])
            self._reader_tp = tp
            self._reader_next = -1
        if self._reader_next != offset:
            consumer.seek(tp, offset)
            self._reader_next = offset
        end: int | None = None
        hw = max(consumer.highwater(tp) or -1, self._highwater.get(tp, -1))
        if hw <= offset:
            # Possibly at the end: ask the broker now rather than waiting out a fetch.
            end = self._end_offsets(tp.topic, [tp.partition])[tp.partition]
            if offset >= end:
                return []
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                batch = consumer.poll(timeout_ms=100, max_records=max_records).get(tp)
            except kerr.OffsetOutOfRangeError:
                batch = None
                end = self._end_offsets(tp.topic, [tp.partition])[tp.partition]
                if offset >= end:
                    self._reader_next = -1
                    return []
                start = self._start_offset(tp)
                consumer.seek(tp, start)  # below the log start: the first record >= offset is there
            if batch:
                hw = consumer.highwater(tp)
                if hw is not None and hw > self._highwater.get(tp, -1):
                    self._highwater[tp] = hw
                topic, partition = tp
                out = [
                    LogRecord(topic, partition, r.offset, r.key, r.value,
                              tuple(r.headers) if r.headers else (), r.timestamp)
                    for r in batch
                ]
                self._reader_next = out[-1].offset + 1
                if out[0].offset < offset:
                    out = [r for r in out if r.offset >= offset]
                if out:
                    return out
                continue
            position = consumer.position(tp)
            if end is None:
                end = self._end_offsets(tp.topic, [tp.partition])[tp.partition]
            if position is not None and position >= end:
                # Only non-data batches (transaction markers, compacted gaps) lay between offset and end.
                self._reader_next = position
                return []
            if time.monotonic() > deadline:
                raise LogUnavailableError(
                    f"reading topic {tp.topic!r} partition {tp.partition} at offset {offset}: no records from "
                    f"the broker at {self._bootstrap} within {self._timeout_s:.0f}s although its end is {end}"
                )

    def _start_offset(self, tp: TopicPartition) -> int:
        with self._probe_lock:
            probe = self._probe_client()
            return int(probe.beginning_offsets([tp], timeout_ms=int(self._timeout_s * 1000))[tp])

    def end_offset(self, topic: str, partition: int) -> int:
        check_partition(topic, partition, self._topic(topic).partitions)
        return self._end_offsets(topic, [partition])[partition]

    def end_offsets(self, topic: str) -> dict[int, int]:
        return self._end_offsets(topic, list(range(self._topic(topic).partitions)))

    def _end_offsets(self, topic: str, partitions: list[int]) -> dict[int, int]:
        """End offsets that neither miss the tail nor trust a lagging ListOffsets answer.

        1. `lo` = ListOffsets(latest) per partition. Correct on Kafka; on tansu it is the base
           offset of the last batch + 1, i.e. it can point *inside* the last batch.
        2. If the highest high watermark seen by any fetch of this object is >= lo, it is the end (a high
           watermark h >= lo was observed when the batch holding offset lo-1 already
           existed, so no batch was written between that fetch and step 1, and h is the end
           as of step 1). Otherwise fetch at lo (a valid offset on both brokers) and wait
           until such a high watermark arrives.
        3. end = max(lo, that high watermark).
        """
        tps = [TopicPartition(topic, p) for p in partitions]
        timeout_ms = int(self._timeout_s * 1000)
        seen = self._highwater
        with self._probe_lock:
            try:
                probe = self._probe_client()
                lo = probe.end_offsets(tps, timeout_ms=timeout_ms)
                ends: dict[int, int] = {}
                pending = []
                for tp in tps:
                    hw = seen.get(tp)
                    if hw is not None and hw >= lo[tp]:
                        ends[tp.partition] = hw
                    else:
                        pending.append(tp)
                if pending:
                    # Only the partitions being probed are assigned: no pause/resume (kafka-python
                    # 3.0 can strand parked data of a resumed partition and never fetch it again).
                    if probe.assignment() != set(pending):
                        probe.assign(pending)
                    for tp in pending:
                        probe.seek(tp, lo[tp])
                    deadline = time.monotonic() + self._timeout_s
                    while pending:
                        probe.poll(timeout_ms=5, max_records=1)
                        for tp in list(pending):
                            hw = probe.highwater(tp)
                            if hw is not None and hw >= lo[tp]:
                                ends[tp.partition] = seen[tp] = max(hw, seen.get(tp, 0))
                                pending.remove(tp)
                                probe.seek(tp, hw)  # drop its buffered records; fetches here are now empty
                        if pending and time.monotonic() > deadline:
                            raise LogUnavailableError(
                                f"end offset of topic {topic!r} partitions {[tp.partition for tp in pending]}: "
                                f"no fetch answer from the broker at {self._bootstrap} within {self._timeout_s:.0f}s"
                            )
            except kerr.KafkaError as exc:
                raise self._fail(exc, f"end offsets of topic {topic!r}", topic=topic) from None
        return {tp.partition: max(int(lo[tp]), ends[tp.partition]) for tp in tps}

    # --- consumer groups ------------------------------------------------------------------
    def commit(self, group: str, offsets: Mapping[TP, int]) -> None:
        check_group(group)
        request: dict[TopicPartition, OffsetAndMetadata] = {}
        for tp, nxt in offsets.items():
            topic, partition = split_commit_key(tp)
            check_partition(topic, partition, self._topic(topic).partitions)
            check_commit_offset(topic, partition, nxt)
            request[TopicPartition(topic, partition)] = OffsetAndMetadata(nxt, "", -1)
        if not request:
            return
        try:
            result = self._admin_client().alter_group_offsets(group, request)
        except kerr.KafkaError as exc:
            raise self._fail(exc, f"committing offsets of group {group!r}") from None
        failed = {tp: err for tp, err in result.items() if err is not kerr.NoError}
        if failed:
            tp, err = next(iter(failed.items()))
            if issubclass(err, kerr.UnknownTopicOrPartitionError):
                raise UnknownTopicError(tp.topic)
            if issubclass(err, kerr.UnknownMemberIdError | kerr.RebalanceInProgressError | kerr.IllegalGenerationError):
                raise LogError(
                    f"committing offsets of group {group!r}: the group has active members ({err.__name__}); "
                    "Kafka accepts commits from outside only for an empty group"
                )
            raise map_error(err(), bootstrap=self._bootstrap,
                            what=f"committing offsets of group {group!r} ({len(failed)} partitions failed)")

    def committed(self, group: str, topic: str) -> dict[int, int]:
        check_group(group)
        config = self._topic(topic)
        tps = [TopicPartition(topic, p) for p in range(config.partitions)]
        try:
            result = self._admin_client().list_group_offsets({group: tps}).get(group, {})
        except kerr.KafkaError as exc:
            raise self._fail(exc, f"fetching committed offsets of group {group!r}", topic=topic) from None
        return {tp.partition: int(om.offset) for tp, om in sorted(result.items())
                if tp.topic == topic and om.offset is not None and om.offset >= 0}

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


def _value_reader(entries: Mapping[str, Any]) -> Any:
    """`value(key)` over kafka-python's DescribeConfigs entries ({name: {"value": ...}})."""
    def value(key: str) -> str | None:
        entry = entries.get(key)
        return None if entry is None else entry.get("value")
    return value
