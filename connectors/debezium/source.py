"""Read the topics of a real Debezium connector from Kafka and feed kappaflow topics with them.

Projections then consume ``<source>.<db|schema>.<table>`` exactly like the topics kappaflow's
own connectors write: same key (``{"id": 1}``), same value (the Debezium envelope with
``source.kf_pos``; decimals as strings by default, every other semantic type as Debezium wrote
it), a tombstone after every delete, ``op=t`` markers plus a delete (the row the log last
held) and a tombstone per key for a truncate (``connectors/truncate.py``). What Debezium
writes besides change events is skipped or routed (see ``decode.py``); a record that
cannot be decoded goes to ``kf.dead_letter.source.<source>`` (``kappaflow/deadletters.py``; before:
``<source>.__dead_letter``) with the reason and its Kafka position (topic, partition, offset), and
the rest goes on.

Tables without a key (Debezium's record key is null: no primary key, ``REPLICA IDENTITY FULL``
or ``DEFAULT``) go to an append-only topic (cleanup policy ``delete``), in the order of their
input partition; ``key_columns`` can name the columns that identify a row instead, like
Debezium's ``message.key.columns``. A latest-row view over an append-only topic is refused when
the projection is loaded (``kappaflow.projections``): it has no key to keep the latest row of.

Columns Debezium sent as unavailable (unchanged TOAST, ``placeholder.py``) are filled from the
last value their key has in the log (keyed state, rebuilt from the log after a restart); a
column with no known value stays unavailable (absent from ``after``, named in
``kf_unavailable``).

Commit order (the same as the database connectors, ``connectors/writer.py``):

1. the converted records (and dead letters, routed records) are appended to the log, each with
   the Kafka coordinates it came from (header ``kf.source``: ``topic/partition/offset``);
2. the next Kafka offset to read per input partition, with the ordering state of every input
   partition (``ordering.py``), is appended to the offsets topic;
3. there is nothing to acknowledge upstream: the Debezium topics are only read (no consumer
   group is committed; the offsets live in kappaflow's log with the data).

A crash between 1 and 2 re-reads the records after the last saved offsets. Only the last
batch can have been written without its offset (the writer appends batches one at a time, the
offset after the records), so at start the tail of every partition this source writes is read
back to the first record from before the saved offsets: a record read again whose coordinates
are at or below the last ones in the partition it goes to is already there and is not
written twice. The ordering state saved with the offsets gives a record read again the same
position as the first time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import orjson

from kappaflow.connectors.base import OP_HEADER, POSITION_HEADER, CaptureSummary, Connector, StopSignal, TrustedRecord
from kappaflow.connectors.debezium.decode import Converted, DebeziumDecoder, Decoded
from kappaflow.connectors.debezium.kafka_input import SWITCH_AFTER, DebeziumInput, check_switch_after
from kappaflow.connectors.debezium.ordering import PartitionOrder
from kappaflow.connectors.debezium.placeholder import DEFAULT_PLACEHOLDER, ToastState
from kappaflow.connectors.offsets import OFFSETS_TOPIC, OffsetStore
from kappaflow.connectors.truncate import TRUNCATE_KEY, live_rows, truncate_records
from kappaflow.connectors.writer import Batch, CaptureWriter, FaultHook
from kappaflow.deadletters import dead_letter_topic
from kappaflow.errors import ConfigError, KappaflowError, SourceError, ValidationError
from kappaflow.events import ChangeEvent, EventCodec, Op, TableSchema
from kappaflow.log.base import CleanupPolicy, Log, Record, TopicConfig
from kappaflow.log.partitioner import partition_for

__all__ = ["SOURCE_HEADER", "TRUNCATE_KEY", "DebeziumSource"]

SOURCE_HEADER = "kf.source"
_OP_HEADERS = {o: (OP_HEADER, o.value.encode()) for o in Op}


def _where(header: bytes) -> tuple[str, int, int] | None:
    try:
        topic, p, o = header.decode().rsplit("/", 2)
        return topic, int(p), int(o)
    except (ValueError, UnicodeDecodeError):
        return None


class DebeziumSource(Connector):
    """A kappaflow source fed by Debezium's Kafka topics."""

    def __init__(self, *, name: str, log: Log, bootstrap: str, topics: list[str], schemas_enabled: bool | None = None,
                 decimal_mode: str = "string", partitions: int = 4, kafka_options: dict[str, Any] | None = None,
                 batch_records: int = 5000, poll_timeout_ms: int = 200, fault: FaultHook | None = None,
                 threaded_writer: bool = True, key_columns: dict[str, list[str]] | None = None,
                 unavailable_placeholder: str = DEFAULT_PLACEHOLDER, switch_after: int = SWITCH_AFTER) -> None:
        if not topics:
            raise ConfigError(f"sources.{name}.topics: expected at least one Debezium topic")
        self.switch_after = check_switch_after(name, switch_after)
        self.name = name
        self.log = log
        self.bootstrap = bootstrap
        self.topics = list(topics)
        self.decoder = DebeziumDecoder(name, schemas_enabled=schemas_enabled, placeholder=unavailable_placeholder,
                                       key_columns=key_columns)
        self.codec = EventCodec(decimal_mode)
        self.partitions = partitions
        self.kafka_options = dict(kafka_options or {})
        self.batch_records = batch_records
        self.poll_timeout_ms = poll_timeout_ms
        self.fault = fault
        self.threaded_writer = threaded_writer
        self.dead_letter_topic = dead_letter_topic("source", name)  # kappaflow/deadletters.py
        self.summary = CaptureSummary(source=name, connector="debezium")
        self.skipped: dict[str, int] = {}
        self.dead_letters = 0
        self.duplicates = 0
        self._topic_parts: dict[str, int] = {}
        self._compacted: dict[str, bool] = {}
        self.schema_topic = f"{name}.__schema"
        self._schemas: dict[str, str] = {}
        self._pending: dict[tuple[str, int | None], list[Record]] = {}  # partition None: by key
        self._pending_count = 0
        self.toast = ToastState()
        # (input topic, input partition, output topic, output partition) -> last input offset already there
        self._written: dict[tuple[str, int, str, int], int] = {}
        self._writer: CaptureWriter | None = None
        self._where = b""
        self._src: tuple[str, bytes] = (SOURCE_HEADER, b"")
        self._in: tuple[str, int, int] = ("", 0, 0)

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
                   schemas_enabled=cfg.schemas_enabled, decimal_mode=cfg.decimal_mode,
                   key_columns=dict(cfg.key_columns),
                   unavailable_placeholder=getattr(cfg, "unavailable_placeholder", DEFAULT_PLACEHOLDER),
                   switch_after=getattr(cfg, "switch_after", SWITCH_AFTER), **options)

    # -- Kafka ---------------------------------------------------------------------------
    def _consumer(self) -> DebeziumInput:
        """Debezium's topics through a read-only log on their cluster, with the configured Kafka client."""
        return DebeziumInput(self.name, self.bootstrap, self.topics, self.kafka_options,
                             switch_after=self.switch_after)

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
            self._compacted[topic] = existing.compacted
        return n

    # -- conversion ----------------------------------------------------------------------
    def _records(self, d: Decoded, in_partition: int) -> None:
        c = d.converted
        if c is not None:  # rows already in the JSON this source writes
            assert d.schema is not None and d.topic is not None
            if d.schema.key and not self.toast.tracked(d.topic):
                self._converted(d.topic, d.schema, c)
                return
            d = replace(d, event=c.event(), converted=None)  # keyless, or the rows are needed for repairs
        assert d.event is not None and d.schema is not None and d.topic is not None
        ev, schema, topic = d.event, d.schema, d.topic
        if ev.op is Op.TRUNCATE:
            self._schema_record(topic, schema, ev.source.position)
            self._truncate(topic, ev, schema)
            return
        if not schema.key:  # a table without a key: an append-only topic, in input partition order
            n = self._ensure(topic, compacted=False)
            if self._compacted[topic]:
                raise ValidationError(
                    f"key: null, but {topic!r} holds a keyed table (a compacted topic): the table lost its primary "
                    "key, or another table maps to the same topic; give the table its key back, or declare "
                    f"key_columns for {topic[len(self.name) + 1:]!r}")
            self._schema_record(topic, schema, ev.source.position)
            self._add(topic, [TrustedRecord(None, self.codec.encode_value(ev, schema),
                                            (_OP_HEADERS[ev.op], self._src))], in_partition % n)
            return
        key = self._keyed(topic, schema, ev.key)
        self._schema_record(topic, schema, ev.source.position)
        if ev.unavailable or self.toast.tracked(topic):
            ev = self._repair(topic, key, ev, schema, d.patch)
        self._keyed_records(topic, key, self.codec.encode_value(ev, schema), ev.op, ev.source.position)

    def _converted(self, topic: str, schema: TableSchema, c: Converted) -> None:
        """``_records`` of a keyed event ``DebeziumDecoder.convert`` converted (the same bytes)."""
        key = self._keyed(topic, schema, c.key)
        self._schema_record(topic, schema, c.source.position)
        try:
            value = self.codec.encode_converted(schema, c.op, c.before, c.after, c.source, c.ts_ms, c.transaction,
                                                c.ts_us, c.ts_ns)
        except Exception:  # encode_value of the event names what cannot be written
            value = self.codec.encode_value(c.event(), schema)
        self._keyed_records(topic, key, value, c.op, c.source.position)

    def _keyed(self, topic: str, schema: TableSchema, k: dict[str, Any] | None) -> bytes:
        """The record key of an event of a keyed table (its topic checked, created if new)."""
        if k is None or len(k) != len(schema.key):
            raise ValidationError(f"key: the record names no value for the key column(s) {list(schema.key)} of "
                                  f"{schema.name!r}")
        self._ensure(topic)
        if not self._compacted[topic]:
            raise ValidationError(f"key: {topic!r} is an append-only topic (its table had no key), this record has "
                                  f"key columns {list(schema.key)}: key_columns or the table's key changed")
        key = self.codec.encode_key(k, schema)
        assert key is not None
        return key

    def _keyed_records(self, topic: str, key: bytes, value: bytes, op: Op, position: Any) -> None:
        """An event's record, and after a delete the tombstone (with the delete's position)."""
        if op is Op.DELETE:
            ph = (POSITION_HEADER, orjson.dumps(position.to_dict()))
            self._add(topic, [TrustedRecord(key, value, (_OP_HEADERS[op], self._src)),
                              TrustedRecord(key, None, (_OP_HEADERS[op], ph, self._src))], None)
        else:
            self._add(topic, [TrustedRecord(key, value, (_OP_HEADERS[op], self._src))], None)

    def _truncate(self, topic: str, ev: ChangeEvent, schema: TableSchema) -> None:
        """An op=t marker in every partition, then a delete (the row the log last held) and the tombstone
        of every key the topic holds."""
        n = self._ensure(topic, compacted=bool(schema.key))
        assert self._writer is not None
        self._flush(None)
        self._writer.drain()
        value = self.codec.encode_value(ev, schema)
        oph = _OP_HEADERS[Op.TRUNCATE]
        ph = (POSITION_HEADER, orjson.dumps(ev.source.position.to_dict()))
        d_headers = (_OP_HEADERS[Op.DELETE], ph, self._src)
        for p in range(n):  # marker, then each live row's delete and tombstone (connectors/truncate.py)
            self._add(topic, truncate_records(value, live_rows(self.log, topic, p), (oph, ph, self._src),
                                              d_headers, (oph, ph, self._src)), p)
        self.toast.clear(topic)

    def _repair(self, topic: str, key: bytes, ev: ChangeEvent, schema: TableSchema,
                patch: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> ChangeEvent:
        """Fill unavailable columns from the key's last values in the log (then apply ``patch``, a
        MongoDB update description); keep the state current."""
        if ev.unavailable:
            if self.toast.learn(topic, ev.unavailable) or topic not in self.toast.loaded:
                self._load_toast(topic, schema)
            if ev.after is not None:
                known = self.toast.lookup(topic, key)
                after = dict(ev.after)
                still = []
                for c in ev.unavailable:
                    if c in known:
                        after[c] = known[c]
                    else:
                        still.append(c)
                if patch is not None and not still:
                    after = patch(after)
                ev = replace(ev, after=after, unavailable=tuple(still))
        self.toast.remember(topic, key, ev.after, ev.unavailable)
        return ev

    def _load_toast(self, topic: str, schema: TableSchema) -> None:
        """The tracked columns' last values per key, from what the topic holds (once per column set)."""
        assert self._writer is not None
        if self._pending:
            self._flush(None)
        self._writer.drain()
        self.toast.clear(topic)
        cols = self.toast.tracked(topic) or set()
        if topic in self.log.list_topics():
            for p in range(self.log.partitions(topic)):
                for rec in self.log.iter_partition(topic, p):
                    if rec.key is None or rec.key == TRUNCATE_KEY:
                        continue
                    if rec.value is None:
                        self.toast.remember(topic, rec.key, None)
                        continue
                    doc = orjson.loads(rec.value)
                    doc = doc.get("payload", doc) if "schema" in doc else doc
                    after = doc.get("after")
                    if after is None:
                        self.toast.remember(topic, rec.key, None)
                        continue
                    wire = {c: after[c] for c in cols if c in after}
                    typed = self.codec.decode_row_values(_only(schema, wire), wire)
                    self.toast.remember(topic, rec.key, typed, doc.get("kf_unavailable") or ())
        self.toast.loaded.add(topic)

    def _schema_record(self, topic: str, schema: TableSchema, position: Any) -> None:
        """``<source>.__schema`` like kappaflow's own connectors: key ``"db.table"``, value the TableSchema."""
        qualified = topic[len(self.name) + 1:]
        fp = schema.fingerprint()
        if self._schemas.get(qualified) == fp:
            return
        pos = position.to_dict()
        self._ensure(self.schema_topic, partitions=1)
        value = dict(schema.to_dict())
        value.update({"kf_pos": pos, "table": qualified, "ts_ms": int(time.time() * 1000), "change": "CREATE"
                      if qualified not in self._schemas else "ALTER", "ddl": None})
        self._add(self.schema_topic, [TrustedRecord(orjson.dumps(qualified), orjson.dumps(value))], 0)
        self._schemas[qualified] = fp

    def _load_schemas(self) -> None:
        if self.schema_topic not in self.log.list_topics():
            return
        for rec in self.log.iter_partition(self.schema_topic, 0):
            if rec.key is None:
                continue
            name = orjson.loads(rec.key)
            if rec.value is None:
                self._schemas.pop(name, None)
            else:
                schema = TableSchema.from_dict(orjson.loads(rec.value))
                self._schemas[name] = schema.fingerprint()
                self.decoder.inferred.restore(schema)
                self.decoder.known[schema.name] = schema

    def _dead_letter(self, msg: Any, reason: str) -> None:
        self._ensure(self.dead_letter_topic, compacted=False, partitions=1)
        value = msg.value
        doc = {
            "reason": reason, "topic": msg.topic, "partition": msg.partition, "offset": msg.offset,
            "timestamp_ms": getattr(msg, "timestamp_ms", None),
            "key": None if msg.key is None else msg.key.decode("utf-8", "replace"),
            "value": None if value is None else value.decode("utf-8", "replace"),
        }
        self._add(self.dead_letter_topic, [TrustedRecord(msg.key, orjson.dumps(doc), (
            ("kf.error", reason.encode()[:500]), self._src))], 0)
        self.dead_letters += 1

    def _add(self, topic: str, recs: list[Record], partition: int | None) -> None:
        """Queue records for (topic, partition) -- each carries the input coordinates (header
        ``kf.source``, ``self._src``) -- unless a run before a crash wrote them already (see the
        module docstring).

        ``partition`` None: records of one key, partitioned by the log (murmur2 of the key, as
        ``partition_for``), so a flush appends each keyed topic's records in one call -- one
        durable transaction per topic, not one per partition."""
        in_topic, in_p, in_off = self._in
        if self._written:
            p = partition if partition is not None else partition_for(recs[0].key, self._topic_parts[topic])
            done = self._written.get((in_topic, in_p, topic, p))
            if done is not None and in_off <= done:
                self.duplicates += len(recs)
                return
        buf = self._pending.get((topic, partition))
        if buf is None:
            buf = self._pending[(topic, partition)] = []
        buf.extend(recs)
        self._pending_count += len(recs)

    def _flush(self, offsets: dict[str, Any] | None) -> None:
        """Hand the pending records (schema records first) and then the offsets to the writer."""
        assert self._writer is not None
        pending, self._pending = self._pending, {}
        self._pending_count = 0
        if not pending and offsets is None:
            return
        out = Batch(offset=offsets)
        schema = pending.pop((self.schema_topic, 0), None)
        if schema:
            out.add(self.schema_topic, schema, 0)
        for (topic, partition), recs in pending.items():
            out.add(topic, recs, partition)
        self.summary.records += out.records
        self._writer.submit(out)

    def _find_written(self, saved: dict[str, dict[str, int]]) -> None:
        """Records of the last batch before a crash that are in the log without their offset."""
        self._written.clear()
        skip = {OFFSETS_TOPIC, self.schema_topic}
        for topic, cfg in self.log.list_topics().items():
            if not topic.startswith(f"{self.name}.") or topic in skip:
                continue
            for p in range(cfg.partitions):
                end = self.log.end_offset(topic, p)
                window = 256
                while end > 0:
                    start = max(0, end - window)
                    older = False
                    for rec in self.log.iter_partition(topic, p, start, end):
                        h = next((v for k, v in rec.headers if k == SOURCE_HEADER), None)
                        w = _where(h) if h is not None else None
                        if w is None:
                            continue
                        nxt = int(saved.get(w[0], {}).get(str(w[1]), 0))
                        if w[2] >= nxt:
                            k = (w[0], w[1], topic, p)
                            self._written[k] = max(self._written.get(k, -1), w[2])
                        else:
                            older = True
                    if older:
                        break
                    end = start
                    window *= 4

    # -- the loop --------------------------------------------------------------------------
    def run(self, stop: StopSignal | None = None, *, until_caught_up: bool = False) -> CaptureSummary:
        stop = stop or StopSignal()
        started = time.monotonic()
        summary = self.summary = CaptureSummary(source=self.name, connector="debezium")  # this run's
        self.skipped, self.dead_letters, self.duplicates = {}, 0, 0
        offsets = OffsetStore(self.log)
        stored = offsets.load(self.name)
        if stored is not None and stored.get("kind") != "debezium":
            raise SourceError(f"source {self.name!r}: the stored offset is a {stored.get('kind')!r} offset, not a "
                              "Debezium one; use another source name")
        self._load_schemas()
        position: dict[str, dict[str, int]] = {t: dict(v) for t, v in ((stored or {}).get("topics") or {}).items()}
        self.decoder.order = PartitionOrder.from_dict((stored or {}).get("order"))
        self._find_written(position)
        consumer = self._consumer()
        writer = self._writer = CaptureWriter(self.log, offsets, self.name, threaded=self.threaded_writer,
                                              fault=self.fault)
        try:
            consumer.assign(stored)
            summary.phase = "streaming"
            idle_polls = 0
            while not stop.is_set():
                polled = consumer.poll(self.poll_timeout_ms, self.batch_records)
                if not polled:
                    idle_polls += 1
                    if until_caught_up and idle_polls >= 2 and consumer.caught_up():
                        break
                    continue
                idle_polls = 0
                one = self._one
                for tp, msgs in polled.items():
                    for msg in msgs:
                        one(msg)
                    position.setdefault(tp.topic, {})[str(tp.partition)] = msgs[-1].offset + 1
                self._flush({"kind": "debezium", "topics": position, "order": self.decoder.order.to_dict()})
            self._flush({"kind": "debezium", "topics": position, "order": self.decoder.order.to_dict()})
            writer.drain()
        finally:
            writer.close()
            consumer.close()
            summary.phase = "stopped"
            summary.stopped_reason = stop.reason or ("caught up" if until_caught_up else "")
            summary.position = orjson.dumps(position).decode()
            summary.acknowledged = summary.position
            summary.duplicates_skipped = self.duplicates
            summary.elapsed_s = time.monotonic() - started
            for k, v in writer.per_topic.items():
                summary.per_topic[k] = summary.per_topic.get(k, 0) + v
        return summary

    def _one(self, msg: Any) -> None:
        self._in = (msg.topic, msg.partition, msg.offset)
        self._where = f"{msg.topic}/{msg.partition}/{msg.offset}".encode()
        self._src = (SOURCE_HEADER, self._where)
        try:
            value = msg.value
            d = self.decoder.convert(msg.topic, msg.partition, msg.offset, msg.key, value, self.codec,
                                     # (only a tombstone's delete uses it)
                                     timestamp_ms=msg.timestamp_ms if value is None else None)
            if d.kind == "event":
                self._records(d, msg.partition)
                self.summary.events += 1
            elif d.kind == "message":
                assert d.topic is not None
                n = self._ensure(d.topic, compacted=False)
                self._add(d.topic, [TrustedRecord(d.key, d.value, (("kf.op", b"m"), self._src))],
                          partition_for(d.key, n))
                self.summary.events += 1
            elif d.kind == "route":
                assert d.topic is not None
                self._ensure(d.topic, compacted=False, partitions=1)
                self._add(d.topic, [TrustedRecord(msg.key, msg.value, (self._src,))], 0)
            else:
                self.skipped[d.reason] = self.skipped.get(d.reason, 0) + 1
        except (ValidationError, ValueError, TypeError, KeyError) as exc:
            reason = str(exc) if isinstance(exc, KappaflowError) else f"{type(exc).__name__}: {exc}"
            self._dead_letter(msg, f"{reason} (at {msg.topic} partition {msg.partition} offset {msg.offset})")

    def status(self) -> dict[str, Any]:
        """Stored Kafka offsets per input partition and the kappaflow topics' end offsets (read-only log ok)."""
        topics = self.log.list_topics()
        stored = OffsetStore(self.log).load(self.name) if OFFSETS_TOPIC in topics else None
        if stored is not None:
            stored = {k: v for k, v in stored.items() if k != "order"}
        return {"source": self.name, "connector": "debezium", "offset": stored, "input_topics": self.topics,
                "bootstrap": self.bootstrap,
                "topics": {t: sum(self.log.end_offsets(t).values()) for t in topics if t.startswith(f"{self.name}.")}}


def _only(schema: TableSchema, row: dict[str, Any]) -> TableSchema:
    """The schema restricted to the row's columns (decoding a part of a row)."""
    cols = tuple(c for c in schema.columns if c.name in row)
    return TableSchema(schema.name, cols, ())
