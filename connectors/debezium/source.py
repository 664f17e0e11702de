"""Read the topics of a real Debezium connector from Kafka and feed kappaflow topics with them.

Projections then consume ``<source>.<db|schema>.<table>`` exactly like the topics kappaflow's
own connectors write: same key (``{"id": 1}``), same value (kappaflow's envelope with
``source.kf_pos``; decimals as strings by default), a tombstone after every delete, ``op=t``
markers plus a delete (the row the log last held) and a tombstone per key for a truncate. What
Debezium writes besides change events is skipped or routed (see ``decode.py``); a record that
cannot be decoded goes to ``<source>.__dead_letter`` with the reason and its Kafka position
(topic, partition, offset), and the rest goes on.

Commit order (the same as the database connectors, ``connectors/writer.py``):

1. the converted records (and dead letters, routed records) are appended to the log;
2. the next Kafka offset to read per input partition is appended to the offsets topic;
3. there is nothing to acknowledge upstream: the Debezium topics are only read (no consumer
   group is committed; the offsets live in kappaflow's log with the data).

A crash between 1 and 2 re-reads the records after the last saved offsets; they carry the same
source positions, so they are recognised as duplicates downstream (the sinks' position guard).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from kappaflow.connectors.base import OP_HEADER, POSITION_HEADER, CaptureSummary, Connector, StopSignal, TrustedRecord
from kappaflow.connectors.debezium.decode import DebeziumDecoder, Decoded
from kappaflow.connectors.debezium.kafka_input import DebeziumInput
from kappaflow.connectors.offsets import OffsetStore
from kappaflow.connectors.truncate import TRUNCATE_KEY, live_rows, truncate_records
from kappaflow.connectors.writer import Batch, CaptureWriter, FaultHook
from kappaflow.errors import ConfigError, KappaflowError, SourceError, ValidationError
from kappaflow.events import EventCodec, Op
from kappaflow.log.base import CleanupPolicy, Log, Record, TopicConfig

__all__ = ["TRUNCATE_KEY", "DebeziumSource"]


class DebeziumSource(Connector):
    """A kappaflow source fed by Debezium's Kafka topics."""

    def __init__(self, *, name: str, log: Log, bootstrap: str, topics: list[str], schemas_enabled: bool | None = None,
                 decimal_mode: str = "string", partitions: int = 4, kafka_options: dict[str, Any] | None = None,
                 batch_records: int = 5000, poll_timeout_ms: int = 200, fault: FaultHook | None = None,
                 threaded_writer: bool = True) -> None:
        if not topics:
            raise ConfigError(f"sources.{name}.topics: expected at least one Debezium topic")
        self.name = name
        self.log = log
        self.bootstrap = bootstrap
        self.topics = list(topics)
        self.decoder = DebeziumDecoder(name, schemas_enabled=schemas_enabled)
        self.codec = EventCodec(decimal_mode)
        self.partitions = partitions
        self.kafka_options = dict(kafka_options or {})
        self.batch_records = batch_records
        self.poll_timeout_ms = poll_timeout_ms
        self.fault = fault
        self.threaded_writer = threaded_writer
        self.dead_letter_topic = f"{name}.__dead_letter"
        self.summary = CaptureSummary(source=name, connector="debezium")
        self.skipped: dict[str, int] = {}
        self.dead_letters = 0
        self._topic_parts: dict[str, int] = {}
        self.schema_topic = f"{name}.__schema"
        self._schemas: dict[str, str] = {}
        self._pending: dict[tuple[str, int | None], list[Record]] = {}

    @classmethod
    def from_config(cls, cfg: Any, log: Log, *, log_kafka: Any = None, **options: Any) -> DebeziumSource:
        """From a ``kappaflow.config.DebeziumSourceConfig`` (+ ``partitions``...).

        The Kafka client settings (client, security) are the source's own ``[sources.NAME.kafka]``,
        else ``log_kafka`` (the configuration's ``[log.kafka]``, a ``KafkaClientConfig``).
        """
        kafka = cfg.kafka or log_kafka
        if kafka is not None:
            options.setdefault("kafka_options", kafka.open_options())
        return cls(name=cfg.name, log=log, bootstrap=cfg.bootstrap, topics=list(cfg.topics),
                   schemas_enabled=cfg.schemas_enabled, decimal_mode=cfg.decimal_mode, **options)

    # -- Kafka ---------------------------------------------------------------------------
    def _consumer(self) -> DebeziumInput:
        """Debezium's topics through a read-only log on their cluster, with the configured Kafka client."""
        return DebeziumInput(self.name, self.bootstrap, self.topics, self.kafka_options)

    # -- topics ----------------------------------------------------------------------------
    def _ensure(self, topic: str, compacted: bool = True, partitions: int | None = None) -> int:
        n = self._topic_parts.get(topic)
        if n is None:
            existing = self.log.list_topics().get(topic)
            if existing is None:
                existing = self.log.create_topic(topic, TopicConfig(
                    partitions=partitions or self.partitions,
                    cleanup_policy=CleanupPolicy.COMPACT if compacted else CleanupPolicy.DELETE), exist_ok=True)
            n = self._topic_parts[topic] = existing.partitions
        return n

    # -- conversion ----------------------------------------------------------------------
    def _records(self, d: Decoded, batch: Batch, writer: CaptureWriter) -> None:
        assert d.event is not None and d.schema is not None and d.topic is not None
        ev, schema, topic = d.event, d.schema, d.topic
        n = self._ensure(topic)
        self._schema_record(topic, schema, ev.source.position.to_dict(), batch)
        ph = (POSITION_HEADER, orjson.dumps(ev.source.position.to_dict()))
        oph = (OP_HEADER, ev.op.value.encode())
        value = self.codec.encode_value(ev, schema)
        if ev.op is Op.TRUNCATE:
            self._flush(batch, writer, None)
            writer.drain()
            for p in range(n):  # marker, then each live row's delete and tombstone (connectors/truncate.py)
                recs = truncate_records(value, live_rows(self.log, topic, p), (oph, ph),
                                        ((OP_HEADER, b"d"), ph), (oph, ph))
                self._add(topic, recs, p)
            return
        if ev.key is None:
            raise ValidationError(f"key: table {schema.name!r} has no key columns (the Debezium record key is null); "
                                  "kappaflow topics are compacted by key")
        key = self.codec.encode_key(ev.key, schema)
        recs = [TrustedRecord(key, value, (oph, ph))]
        if ev.op is Op.DELETE:
            recs.append(TrustedRecord(key, None, (oph, ph)))
        self._add(topic, recs)

    def _schema_record(self, topic: str, schema: Any, pos: dict[str, Any], batch: Batch) -> None:
        """``<source>.__schema`` like kappaflow's own connectors: key ``"db.table"``, value the TableSchema."""
        qualified = topic[len(self.name) + 1:]
        fp = schema.fingerprint()
        if self._schemas.get(qualified) == fp:
            return
        self._ensure(self.schema_topic, partitions=1)
        value = dict(schema.to_dict())
        value.update({"kf_pos": pos, "table": qualified, "ts_ms": int(time.time() * 1000), "change": "CREATE"
                      if qualified not in self._schemas else "ALTER", "ddl": None})
        self._add(self.schema_topic, [TrustedRecord(orjson.dumps(qualified), orjson.dumps(value))])
        self._schemas[qualified] = fp

    def _load_schemas(self) -> None:
        from kappaflow.events import TableSchema

        if self.schema_topic not in self.log.list_topics():
            return
        for rec in self.log.iter_partition(self.schema_topic, 0):
            if rec.key is None:
                continue
            name = orjson.loads(rec.key)
            if rec.value is None:
                self._schemas.pop(name, None)
            else:
                self._schemas[name] = TableSchema.from_dict(orjson.loads(rec.value)).fingerprint()

    def _dead_letter(self, batch: Batch, msg: Any, reason: str) -> None:
        self._ensure(self.dead_letter_topic, compacted=False, partitions=1)
        value = msg.value
        doc = {
            "reason": reason, "topic": msg.topic, "partition": msg.partition, "offset": msg.offset,
            "timestamp_ms": getattr(msg, "timestamp_ms", None),
            "key": None if msg.key is None else msg.key.decode("utf-8", "replace"),
            "value": None if value is None else value.decode("utf-8", "replace"),
        }
        where = f"{msg.topic}/{msg.partition}/{msg.offset}".encode()
        self._add(self.dead_letter_topic, [TrustedRecord(msg.key, orjson.dumps(doc), (
            ("kf.error", reason.encode()[:500]), ("kf.source", where)))])
        self.dead_letters += 1

    def _add(self, topic: str, recs: list[Record], partition: int | None = None) -> None:
        self._pending.setdefault((topic, partition), []).extend(recs)

    def _flush(self, batch: Batch, writer: CaptureWriter, offsets: dict[str, Any] | None) -> None:
        """Hand the pending records (schema records first) and then the offsets to the writer."""
        pending, self._pending = self._pending, {}
        if not pending and offsets is None:
            return
        out = Batch(offset=offsets)
        schema = pending.pop((self.schema_topic, None), None)
        if schema:
            out.add(self.schema_topic, schema)
        for (topic, partition), recs in pending.items():
            out.add(topic, recs, partition)
        self.summary.records += out.records
        writer.submit(out)

    # -- the loop --------------------------------------------------------------------------
    def run(self, stop: StopSignal | None = None, *, until_caught_up: bool = False) -> CaptureSummary:
        stop = stop or StopSignal()
        started = time.monotonic()
        summary = self.summary = CaptureSummary(source=self.name, connector="debezium")  # this run's
        self.skipped, self.dead_letters = {}, 0
        offsets = OffsetStore(self.log)
        stored = offsets.load(self.name)
        if stored is not None and stored.get("kind") != "debezium":
            raise SourceError(f"source {self.name!r}: the stored offset is a {stored.get('kind')!r} offset, not a "
                              "Debezium one; use another source name")
        self._load_schemas()
        consumer = self._consumer()
        writer = CaptureWriter(self.log, offsets, self.name, threaded=self.threaded_writer, fault=self.fault)
        position: dict[str, dict[str, int]] = {t: dict(v) for t, v in ((stored or {}).get("topics") or {}).items()}
        try:
            consumer.assign(stored)
            summary.phase = "streaming"
            batch = Batch()
            idle_polls = 0
            while not stop.is_set():
                polled = consumer.poll(self.poll_timeout_ms, self.batch_records)
                if not polled:
                    idle_polls += 1
                    if until_caught_up and idle_polls >= 2 and consumer.caught_up():
                        break
                    continue
                idle_polls = 0
                for tp, msgs in polled.items():
                    for msg in msgs:
                        self._one(msg, batch, writer)
                        position.setdefault(tp.topic, {})[str(tp.partition)] = msg.offset + 1
                self._flush(batch, writer, {"kind": "debezium", "topics": position})
            self._flush(batch, writer, {"kind": "debezium", "topics": position})
            writer.drain()
        finally:
            writer.close()
            consumer.close()
            summary.phase = "stopped"
            summary.stopped_reason = stop.reason or ("caught up" if until_caught_up else "")
            summary.position = orjson.dumps(position).decode()
            summary.acknowledged = summary.position
            summary.elapsed_s = time.monotonic() - started
            for k, v in writer.per_topic.items():
                summary.per_topic[k] = summary.per_topic.get(k, 0) + v
        return summary

    def _one(self, msg: Any, batch: Batch, writer: CaptureWriter) -> None:
        try:
            d = self.decoder.decode(msg.topic, msg.partition, msg.offset, msg.key, msg.value)
            if d.kind == "event":
                self._records(d, batch, writer)
                self.summary.events += 1
            elif d.kind == "route":
                assert d.topic is not None
                self._ensure(d.topic, compacted=False, partitions=1)
                self._add(d.topic, [TrustedRecord(msg.key, msg.value, (("kf.source", f"{msg.topic}/{msg.partition}/"
                                                                         f"{msg.offset}".encode()),))])
            else:
                self.skipped[d.reason] = self.skipped.get(d.reason, 0) + 1
        except (ValidationError, ValueError, TypeError, KeyError) as exc:
            reason = str(exc) if isinstance(exc, KappaflowError) else f"{type(exc).__name__}: {exc}"
            self._dead_letter(batch, msg, f"{reason} (at {msg.topic} partition {msg.partition} offset {msg.offset})")

    def status(self) -> dict[str, Any]:
        """Stored Kafka offsets per input partition and the kappaflow topics' end offsets (read-only log ok)."""
        from kappaflow.connectors.offsets import OFFSETS_TOPIC

        topics = self.log.list_topics()
        stored = OffsetStore(self.log).load(self.name) if OFFSETS_TOPIC in topics else None
        return {"source": self.name, "connector": "debezium", "offset": stored, "input_topics": self.topics,
                "bootstrap": self.bootstrap,
                "topics": {t: sum(self.log.end_offsets(t).values()) for t in topics if t.startswith(f"{self.name}.")}}
