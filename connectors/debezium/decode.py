"""Records written by a real Debezium connector (through Kafka) -> kappaflow change events.

What arrives on Debezium's topics, and what becomes of it:

===============================================  =============================================================
Debezium record                                  kappaflow
===============================================  =============================================================
change event (op c/u/d/r/t), JsonConverter with  ``ChangeEvent`` typed by the embedded Connect schema; every
or without schemas, from PostgreSQL, MySQL,      semantic type is kept for writing it back (``Column.logical``,
MariaDB, SQL Server, Oracle, Db2, MongoDB, any   see ``kappaflow.events.connect``); positions from the source
other connector                                  block (``kappaflow.events.sources``), ordered by ``ordering.py``
change event without schemas                     the values as they are; the table's schema is inferred and
                                                 widened as records show more (``infer.py``)
``__debezium_unavailable_value`` (any form)      the column is *unavailable*, never a value (``placeholder.py``)
snapshot reads (initial, blocking, incremental)  ordered after what their partition delivered (``ordering.py``)
record flattened by ``ExtractNewRecordState``    the row without its ``__*`` metadata fields; ``__op`` is the
                                                 op, ``__deleted: "true"`` a delete (rewrite mode), ``{"schema",
                                                 "payload": null}`` or a null value a delete of the record key;
                                                 the position from ``__lsn``/``__source_*`` fields when present
tombstone (null value)                           after its delete: nothing (kappaflow writes its own); alone (the
                                                 delete was compacted away): a delete of the key
``op: "m"`` (PostgreSQL logical message)         a record on the event topic ``<source>.message``
CloudEvents (``CloudEventsConverter``, JSON      the envelope rebuilt from ``data`` and the ``iodebezium*``
``data``)                                        attributes; Avro ``data`` is refused, naming the format
transaction metadata (``<prefix>.transaction``)  routed verbatim to ``<source>.transaction``
heartbeat (``__debezium-heartbeat.*``)           skipped
schema change (``<prefix>`` topic, ``ddl``)      routed verbatim to ``<source>.__debezium_schema``
anything malformed                               ``ValidationError`` naming the field: the caller sends the
                                                 record to the dead-letter topic with the reason and position
===============================================  =============================================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import orjson

from kappaflow.connectors.debezium.cloudevents import envelope_from_cloudevent, is_cloudevent
from kappaflow.connectors.debezium.infer import InferredSchemas, decode_schemaless_row
from kappaflow.connectors.debezium.mongodb import apply_update, is_mongodb, mongodb_schema
from kappaflow.connectors.debezium.ordering import PartitionOrder
from kappaflow.connectors.debezium.placeholder import DEFAULT_PLACEHOLDER, Placeholder, screen_for
from kappaflow.errors import ValidationError
from kappaflow.events import (
    ChangeEvent,
    EventCodec,
    FieldType,
    Op,
    Position,
    Snapshot,
    SourceInfo,
    TableSchema,
    TransactionInfo,
)
from kappaflow.events._fast import fast_frozen_init
from kappaflow.events.connect import parse_value_schema
from kappaflow.events.sources import layout_for_connector

__all__ = ["Converted", "DebeziumDecoder", "Decoded"]

_OPS = {o.value: o for o in Op}
# Column types whose JSON value is the Python value (a key column of these needs no decoding)
_AS_IS = frozenset({FieldType.INT8, FieldType.INT16, FieldType.INT32, FieldType.INT64, FieldType.YEAR,
                    FieldType.STRING, FieldType.ENUM, FieldType.BOOLEAN})


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class Converted:
    """A change event converted from Debezium's JSON straight to the JSON kappaflow writes
    (``DebeziumDecoder.convert``): ``before``/``after`` are in the output codec's JSON form, ready for
    ``EventCodec.encode_converted``; ``key`` holds the key columns' Python values."""

    op: Op
    key: dict[str, Any] | None
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    source: SourceInfo
    ts_ms: int
    transaction: TransactionInfo | None
    ts_us: int | None
    ts_ns: int | None
    wire_before: dict[str, Any] | None  # the rows as the record had them
    wire_after: dict[str, Any] | None
    rows: Callable[[Any, str], Any]  # the record schema's row decoder (decodes in place)

    def event(self) -> ChangeEvent:
        """The event ``DebeziumDecoder.decode`` makes of the same record (Python values)."""
        before = None if self.wire_before is None else self.rows(dict(self.wire_before), "before")
        after = None if self.wire_after is None else self.rows(dict(self.wire_after), "after")
        return ChangeEvent(self.op, self.key, before, after, self.source, self.ts_ms, self.transaction, (),
                           self.ts_us, self.ts_ns)


@fast_frozen_init  # one per record
@dataclass(frozen=True, slots=True)
class Decoded:
    """What one Debezium record becomes.

    kind: "event" (``event``/``schema``/``topic`` set), "skip" (``reason``), "route" (``topic``:
    the original key/value go there verbatim), "message" (``topic``, ``key``, ``value``: a record
    for an event topic).
    """

    kind: str
    topic: str | None = None
    event: ChangeEvent | None = None
    schema: TableSchema | None = None
    reason: str = ""
    key: bytes | None = None
    value: bytes | None = None
    patch: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # MongoDB: the update to the repaired row
    converted: Converted | None = None  # kind "event" from ``convert``: the event, already in JSON form


class DebeziumDecoder:
    """Stateful per source: each input topic's shape, inferred schemas, the order per input partition.

    ``key_columns``: ``{"<schema or db>.<table>": [columns]}`` for tables whose records have a
    null key (no primary key): those columns become the key, like Debezium's
    ``message.key.columns``; other keyless tables go to append-only topics.
    """

    def __init__(self, source: str, *, schemas_enabled: bool | None = None,
                 placeholder: str = DEFAULT_PLACEHOLDER, key_columns: Mapping[str, list[str]] | None = None) -> None:
        self.source = source
        self.schemas_enabled = schemas_enabled
        self.codec = EventCodec()
        self.placeholder = Placeholder(placeholder)
        self.key_columns = {k: tuple(v) for k, v in (key_columns or {}).items()}
        self.inferred = InferredSchemas()
        self.order = PartitionOrder()
        self.flattened: dict[str, bool] = {}
        self.out_topics: dict[str, str] = {}  # input topic -> kappaflow topic
        self.known: dict[str, TableSchema] = {}  # kappaflow topic -> last schema (for key-only deletes)
        self.last_source: dict[str, SourceInfo] = {}  # kappaflow topic -> the last event's source block
        self._keyed: dict[tuple[int, tuple[str, ...], str], tuple[TableSchema, TableSchema]] = {}
        self._named: dict[tuple[str | None, str, str], tuple[str, str]] = {}  # (schema, db, table) -> names
        self._key_schemas: dict[bytes, tuple[str, ...]] = {}

    # -- classification --------------------------------------------------------------------------
    def decode(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None, *,
               timestamp_ms: int | None = None) -> Decoded:
        """Classify and convert one record; raises ValidationError for malformed input.

        ``timestamp_ms``: the Kafka record's timestamp (the time of a delete made from a tombstone).
        """
        if topic.startswith("__debezium-heartbeat"):
            return Decoded("skip", reason="heartbeat")
        if value is None:
            return self._key_delete(topic, partition, offset, key, "tombstone", timestamp_ms or 0)
        if self.flattened.get(topic) is not True:
            try:
                ev, table = self.codec.decode_envelope(value, place=self._placer(topic, partition, offset),
                                                       source_name=self.source)
            except ValidationError:
                pass  # not a plain envelope (or a bad one): the full classification says which
            else:
                self.flattened[topic] = False
                gone = self._scan(ev)
                return self._event(topic, partition, offset, key, ev, table, gone)
        return self._slow(topic, partition, offset, key, value)

    def convert(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                out: EventCodec, *, timestamp_ms: int | None = None) -> Decoded:
        """``decode``, for a source writing with codec ``out``: a change event whose schema part was
        seen before (Debezium repeats it on every record of a table) is converted from its JSON
        straight to ``out``'s (``Decoded.converted``, with ``event`` None), without the Python values
        in between; anything else -- other records, a row with an odd value or with a placeholder,
        ``decimal.format=NUMERIC`` -- is decoded by ``decode``, which also says what is wrong."""
        if value is not None and key is not None and self.flattened.get(topic) is False:
            d = self._converted(topic, partition, offset, key, value, out)
            if d is not None:
                return d
        return self.decode(topic, partition, offset, key, value, timestamp_ms=timestamp_ms)

    def _converted(self, topic: str, partition: int, offset: int, key: bytes, value: bytes,
                   out: EventCodec) -> Decoded | None:
        """``convert``'s fast path; None (having changed nothing) when ``decode`` must read the record."""
        split = self.codec.split_envelope(value)
        if split is None:
            return None
        table, rows, payload = split
        op_code = payload.get("op")
        op = _OPS.get(op_code) if type(op_code) is str else None
        if op is None or op is Op.TRUNCATE or "kf_unavailable" in payload:
            return None
        before, after = payload.get("before"), payload.get("after")
        if op is Op.DELETE:
            if after is not None or type(before) is not dict:
                return None
        elif type(after) is not dict or (before is not None and type(before) is not dict):
            return None
        tr = out.transcoder(table)
        if tr is None:
            return None
        screen = screen_for(table)
        suspect = self.placeholder.suspect
        if screen and ((after is not None and suspect(screen, after)) or (before is not None
                                                                          and suspect(screen, before))):
            return None
        try:
            b = None if before is None else tr(before)
            a = None if after is None else tr(after)
        except Exception:
            return None  # decode() names the field (or reads what the fast path does not)
        # from here on the record is placed: decode's order of checks and fall-backs
        try:
            src, ts_ms, ts_us, ts_ns, tx = self.codec.envelope_meta(
                payload, place=self._placer(topic, partition, offset), source_name=self.source)
        except ValidationError:
            return self._slow(topic, partition, offset, key, value)
        self.flattened[topic] = False
        _qualified, out_topic, names = self._target(topic, key, src)
        schema = self._with_key(out_topic, table, names)
        if schema.key or out_topic not in self.known:
            self.known[out_topic] = schema
        k: dict[str, Any] | None = None
        if schema.key:
            plain = schema._cache.get("kf.plain_key")
            if plain is None:
                plain = schema._cache["kf.plain_key"] = all(schema.column(c).type in _AS_IS for c in schema.key)
            if plain:  # the written row holds the key columns' values as they are
                k = self._row_key(schema, a if a is not None else b, key, None)
            else:
                wire = after if after is not None else before
                assert wire is not None
                k = self._row_key(schema, rows(dict(wire), "after" if after is not None else "before"), key, None)
        self._noted(topic, partition, offset, key, op, out_topic, src)
        return Decoded("event", topic=out_topic, schema=schema, converted=Converted(
            op, k, b, a, src, ts_ms, tx, ts_us, ts_ns, before, after, rows))

    def _slow(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes) -> Decoded:
        try:
            doc = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise ValidationError(f"value: malformed JSON ({exc})") from None
        if type(doc) is not dict:
            raise ValidationError(f"value: expected a JSON object, got {type(doc).__name__}")
        if is_cloudevent(doc):
            doc = envelope_from_cloudevent(doc)
        schema_part, payload = None, doc
        if len(doc) == 2 and "schema" in doc and "payload" in doc:
            schema_part, payload = doc["schema"], doc["payload"]
            if self.schemas_enabled is False:
                raise ValidationError("value: has a 'schema' part, but the source is configured with "
                                      "schemas_enabled=false")
            if payload is None:  # ExtractNewRecordState's delete (delete.handling.mode=none) with a schema
                return self._key_delete(topic, partition, offset, key, "delete", 0)
        elif self.schemas_enabled:
            raise ValidationError("value: expected {\"schema\", \"payload\"} (schemas_enabled=true), got "
                                  f"keys {sorted(doc)[:6]}")
        if type(payload) is not dict:
            raise ValidationError(f"payload: expected a JSON object, got {type(payload).__name__}")
        if payload.get("status") in ("BEGIN", "END") and "op" not in payload:
            return Decoded("route", topic=f"{self.source}.transaction", reason="transaction metadata")
        if "ddl" in payload or "tableChanges" in payload:
            return Decoded("route", topic=f"{self.source}.__debezium_schema", reason="schema change")
        if set(payload) == {"ts_ms"}:
            return Decoded("skip", reason="heartbeat")
        if payload.get("op") == "m":
            return self._message(topic, partition, offset, payload)
        if "op" in payload or ("source" in payload and ("before" in payload or "after" in payload)):
            self.flattened[topic] = False
            _complete_source(payload, schema_part, topic)
            if is_mongodb(payload):
                return self._mongodb(topic, partition, offset, key, value, payload)
            unavailable = self.placeholder.strip(payload.get("after") if type(payload.get("after")) is dict else None)
            if type(payload.get("before")) is dict:
                self.placeholder.strip(payload["before"])
            wrapped = {"schema": schema_part, "payload": payload} if schema_part is not None else payload
            ev, table = self.codec.decode_envelope(value, place=self._placer(topic, partition, offset),
                                                   parsed=wrapped, source_name=self.source)
            return self._event(topic, partition, offset, key, ev, table, tuple(unavailable))
        self.flattened[topic] = True
        return self._flat(topic, partition, offset, key, schema_part, payload)

    # -- envelopes -------------------------------------------------------------------------------
    def _placer(self, topic: str, partition: int, offset: int) -> Callable[[Position | None, Any, Any], Position]:
        order = self.order

        def place(own: Position | None, block: Any, snapshot: Any) -> Position:
            return order.place(topic, partition, offset, own)

        return place

    def _scan(self, ev: ChangeEvent) -> tuple[str, ...]:
        """Placeholders found in a decoded event's rows (removed from them): the after image's names."""
        scan = self.placeholder.scan
        if ev.before is not None:
            scan(ev.before)
        return tuple(scan(ev.after)) if ev.after is not None else ()

    def _event(self, topic: str, partition: int, offset: int, key: bytes | None, ev: ChangeEvent,
               table: TableSchema | None, unavailable: tuple[str, ...]) -> Decoded:
        """The decoded envelope (already named and placed) as an event of its kappaflow topic."""
        src = ev.source
        qualified, out, names = self._target(topic, key, src)
        raw_key: dict[str, Any] | None = None
        before, after = ev.before, ev.after
        if table is not None:
            schema = self._with_key(out, table, names)
        else:  # schemaless: JSON values, the schema inferred from them
            before = None if before is None else decode_schemaless_row(before, "before")
            after = None if after is None else decode_schemaless_row(after, "after")
            raw_key = _raw_key(key)
            schema = self.inferred.observe(out, [r for r in (before, after) if r is not None],
                                           raw_key if not self.key_columns.get(qualified) else None)
            if names and schema.key != names:
                schema = self._with_key(out, schema, names)
        if schema.key or out not in self.known:
            self.known[out] = schema
        k: dict[str, Any] | None = None
        if ev.op is not Op.TRUNCATE and schema.key:
            k = self._row_key(schema, after if after is not None else before, key, raw_key)
        self._noted(topic, partition, offset, key, ev.op, out, src)
        if ev.unavailable:
            unavailable = tuple(dict.fromkeys((*ev.unavailable, *unavailable)))
        ev = ChangeEvent(ev.op, k, before, after, src, ev.ts_ms, ev.transaction, unavailable, ev.ts_us, ev.ts_ns)
        return Decoded("event", topic=out, event=ev, schema=schema)

    def _target(self, topic: str, key: bytes | None, src: SourceInfo) -> tuple[str, str, tuple[str, ...]]:
        """An event's ``<schema or db>.<table>``, its kappaflow topic (remembered for the input topic),
        and its key column names (``key_columns``, else the record key's)."""
        names_of = (src.schema, src.db, src.table)
        named = self._named.get(names_of)
        if named is None:
            qualified = f"{src.schema if src.schema is not None else src.db}.{src.table}"
            if len(self._named) > 4096:
                self._named.clear()
            named = self._named[names_of] = (qualified, f"{self.source}.{qualified}")
        qualified, out = named
        self.out_topics[topic] = out
        return qualified, out, self.key_columns.get(qualified) or self._key_names(key)

    @staticmethod
    def _row_key(schema: TableSchema, row: dict[str, Any] | None, key: bytes | None,
                 raw_key: dict[str, Any] | None) -> dict[str, Any] | None:
        """The key columns' values from the row, else (a row without them) from the record key."""
        try:
            k = None if row is None else {c: row[c] for c in schema.key}
        except KeyError:
            k = None
        if k is None:
            raw_key = raw_key if raw_key is not None else _raw_key(key)
            if raw_key:
                k = {c: raw_key[c] for c in schema.key if c in raw_key}
        return k

    def _noted(self, topic: str, partition: int, offset: int, key: bytes | None, op: Op, out: str,
               src: SourceInfo) -> None:
        """The partition's delete/tombstone pairing and the table's last source block, after an event."""
        if op is Op.DELETE:
            self.order.note_delete(topic, partition, offset, key)
        else:
            self.order.note_other(topic, partition)
        self.last_source[out] = src

    def _mongodb(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes,
                 payload: dict[str, Any]) -> Decoded:
        """A MongoDB change event: rows of (id, document), see ``mongodb.py``."""
        raw_key = _raw_key(key)
        if not raw_key or type(raw_key.get("id")) is not str:
            raise ValidationError("key: a MongoDB change event's key is {\"id\": \"<_id as extended JSON>\"}, got "
                                  f"{key!r:.80}")
        key_id = raw_key["id"]
        src = payload["source"]
        out = f"{self.source}.{src.get('db')}.{src.get('collection')}"
        patch = None
        unavailable: tuple[str, ...] = ()
        rows = dict(payload)
        for part in ("before", "after"):
            v = payload.get(part)
            rows[part] = None if v is None else {"id": key_id, "document": v}
        if payload.get("op") == "d" and rows["before"] is None:
            rows["before"] = {"id": key_id}
        if payload.get("op") == "u" and rows["after"] is None:
            desc = payload.get("updateDescription")
            if type(desc) is not dict:
                raise ValidationError("after: a MongoDB update without the document needs its updateDescription")
            rows["after"] = {"id": key_id}
            unavailable = ("document",)

            def patch(row: dict[str, Any], desc: dict[str, Any] = desc) -> dict[str, Any]:
                doc = row.get("document")
                return {**row, "document": apply_update(doc, desc)} if isinstance(doc, dict) else row

        ev, _ = self.codec.decode_envelope(value, mongodb_schema(out), place=self._placer(topic, partition, offset),
                                           parsed=rows, source_name=self.source)
        d = self._event(topic, partition, offset, key, ev, mongodb_schema(out), unavailable)
        return replace(d, patch=patch) if patch is not None else d

    def _key_names(self, key: bytes | None) -> tuple[str, ...]:
        """The record key's column names; a key written with its schema part is parsed once per schema."""
        if key is None:
            return ()
        if key.startswith(b'{"schema":'):
            i = key.find(b',"payload":')
            if i > 0:
                part = key[10:i]
                hit = self._key_schemas.get(part)
                if hit is None:
                    doc = _raw_key(key)
                    hit = tuple(doc) if doc else ()
                    if len(self._key_schemas) > 1024:
                        self._key_schemas.clear()
                    self._key_schemas[part] = hit
                return hit
        doc = _raw_key(key)
        return tuple(doc) if doc else ()

    def _with_key(self, out: str, table: TableSchema, names: tuple[str, ...]) -> TableSchema:
        """The record's table schema named after the kappaflow topic, keyed by ``names``."""
        if table.name == out and table.key == names:
            return table
        ck = (id(table), names, out)
        cached = self._keyed.get(ck)
        if cached is not None and cached[0] is table:  # (an id can be reused once a table is gone)
            return cached[1]
        cols = table.columns
        missing = [n for n in names if n not in {c.name for c in cols}]
        if missing:
            raise ValidationError(f"key: column(s) {missing} are not columns of {out!r} "
                                  f"(columns: {[c.name for c in cols]})")
        if len(self._keyed) > 4096:
            self._keyed.clear()
        hit = TableSchema(out, cols, names)
        self._keyed[ck] = (table, hit)
        return hit

    # -- deletes of a key ------------------------------------------------------------------------
    def _key_delete(self, topic: str, partition: int, offset: int, key: bytes | None, what: str,
                    ts_ms: int) -> Decoded:
        """A tombstone, or ExtractNewRecordState's delete without a row: delete the record key,
        unless it is the tombstone that follows Debezium's delete event (kappaflow wrote its own)."""
        if key is None:
            return Decoded("skip", reason=f"{what} without key")
        if what == "tombstone" and self.order.tombstone_follows_delete(topic, partition, key):
            return Decoded("skip", reason="tombstone")
        k = _raw_key(key)
        if not k:
            raise ValidationError(f"key: a {what}'s key must be a JSON object of key columns")
        out = self.out_topics.get(topic) or self._topic_from_name(topic)
        qualified = out[len(self.source) + 1:]
        schema = self.known.get(out)
        if schema is None or not schema.key:
            schema = self.inferred.observe(out, [], k)
            self.known[out] = schema
        try:
            typed = self.codec.decode_key(key, schema)
        except ValidationError:
            typed = dict(k)
        assert typed is not None
        pos = self.order.place(topic, partition, offset, None)
        self.order.note_delete(topic, partition, offset, key)
        last = self.last_source.get(out)
        if last is not None:  # the table's source block as its last event had it, at the new position
            src = SourceInfo(last.connector, self.source, last.db, last.schema, last.table, pos, ts_ms)
        else:
            schema_name, _, table = qualified.partition(".")
            src = SourceInfo("debezium", self.source, schema_name, schema_name, table, pos, ts_ms)
        event = ChangeEvent(Op.DELETE, typed, dict(typed), None, src, ts_ms)
        return Decoded("event", topic=out, event=event, schema=schema)

    def _topic_from_name(self, topic: str) -> str:
        """``<prefix>.<schema or db>.<table>`` -> ``<source>.<schema or db>.<table>``."""
        parts = topic.split(".")
        if len(parts) < 3:
            raise ValidationError(f"topic {topic!r}: expected '<prefix>.<schema or db>.<table>' to name the table "
                                  "of a record without a value")
        return f"{self.source}.{parts[-2]}.{parts[-1]}"

    # -- logical decoding messages (op "m") ------------------------------------------------------
    def _message(self, topic: str, partition: int, offset: int, payload: dict[str, Any]) -> Decoded:
        """``pg_logical_emit_message`` -> a record on ``<source>.message`` (an event topic)."""
        msg = payload.get("message")
        if type(msg) is not dict or type(msg.get("prefix")) is not str:
            raise ValidationError(f"message: expected {{\"prefix\": string, \"content\": ...}}, got {msg!r:.80}")
        content = msg.get("content")
        if content is not None and type(content) is not str:
            raise ValidationError(f"message.content: expected the content as the binary handling mode writes it "
                                  f"(a string), got {content!r:.60}")
        src = payload.get("source") or {}
        layout = layout_for_connector(str(src.get("connector", "")))
        own = layout.position(src, False) if type(src) is dict else None
        pos = self.order.place(topic, partition, offset, own)
        self.order.note_other(topic, partition)
        tx = src.get("txId") if type(src) is dict else None
        doc = {
            "prefix": msg["prefix"],
            "content": content,
            "transactional": tx is not None,
            # an event topic's order and duplicate check: unique and increasing per key (a prefix's
            # messages are in one partition), the same when the record is read again
            "position": offset,
            "txId": tx,
            "lsn": src.get("lsn") if type(src) is dict else None,
            "ts_ms": src.get("ts_ms") if type(src) is dict else None,
            "kf_pos": pos.to_dict(),
        }
        return Decoded("message", topic=f"{self.source}.message", key=msg["prefix"].encode(),
                       value=orjson.dumps(doc), reason="logical decoding message")

    # -- flattened records (ExtractNewRecordState) -----------------------------------------------
    def _flat(self, topic: str, partition: int, offset: int, key: bytes | None, schema_part: Any,
              payload: dict[str, Any]) -> Decoded:
        meta = {k[2:]: v for k, v in payload.items() if k.startswith("__")}
        row = {k: v for k, v in payload.items() if not k.startswith("__")}
        unavailable = tuple(self.placeholder.strip(row))
        db, schema_name, table = self._names(topic, meta)
        qualified = f"{schema_name if schema_name is not None else db}.{table}"
        out = f"{self.source}.{qualified}"
        self.out_topics[topic] = out
        key_dict = _raw_key(key)
        names = self.key_columns.get(qualified) or (tuple(key_dict) if key_dict else ())
        if schema_part is not None:
            parsed = parse_value_schema(schema_part)
            cols = tuple(c for c in parsed.columns if not c.name.startswith("__") and c.name not in unavailable)
            base = TableSchema(out, cols, ())
            schema = self._with_key(out, base, tuple(n for n in names if n in {c.name for c in cols}))
            row = self.codec.decode_row_values(schema, row)
        else:
            row = decode_schemaless_row(row, "value")
            schema = self.inferred.observe(out, [row], key_dict if not self.key_columns.get(qualified) else None)
            if names and schema.key != names:
                schema = self._with_key(out, schema, names)
        self.known[out] = schema
        deleted = str(meta.get("deleted", "false")).lower() == "true"
        op_code = meta.get("op")
        if op_code is not None and op_code not in _OPS:
            raise ValidationError(f"__op: expected one of {list(_OPS)}, got {op_code!r}")
        op = Op.DELETE if deleted or op_code == "d" else (_OPS[op_code] if op_code is not None else Op.CREATE)
        if op is Op.TRUNCATE:
            raise ValidationError("__op: 't' cannot be carried by a flattened record (the SMT drops truncates)")
        k = {c: row[c] for c in schema.key} if schema.key and all(c in row for c in schema.key) else None
        if k is None and key is not None and schema.key:
            k = self.codec.decode_key(key, schema)
        connector = str(meta.get("source_connector") or "debezium")
        layout = layout_for_connector(connector)
        block = _flat_source_block(meta)
        snapshot = _SNAPSHOTS.get(str(meta.get("source_snapshot", "false")), Snapshot.FALSE)
        own = layout.position(block, snapshot not in (Snapshot.FALSE, Snapshot.INCREMENTAL)) if block else None
        if own is None:
            for guess in ("postgresql", "mysql", "sqlserver", "oracle", "db2", "mongodb"):
                own = layout_for_connector(guess).position(block, False) if block else None
                if own is not None:
                    break
        pos = self.order.place(topic, partition, offset, own)
        if op is Op.DELETE:
            self.order.note_delete(topic, partition, offset, key)
        else:
            self.order.note_other(topic, partition)
        ts = _int_or(meta.get("source_ts_ms", meta.get("ts_ms")), 0)
        src = SourceInfo(connector, self.source, db, schema_name, table, pos, ts, meta.get("source_txId"), snapshot)
        when = _int_or(meta.get("ts_ms"), ts)
        if op is Op.DELETE:
            event = ChangeEvent(op, k, row, None, src, when)
        else:
            event = ChangeEvent(op, k, None, row, src, when, unavailable=unavailable)
        return Decoded("event", topic=out, event=event, schema=schema)

    @staticmethod
    def _names(topic: str, meta: Mapping[str, Any]) -> tuple[str, str | None, str]:
        parts = topic.split(".")
        table = str(meta.get("table") or meta.get("source_table") or parts[-1])
        middle = parts[-2] if len(parts) >= 3 else parts[0]
        schema = meta.get("schema") or meta.get("source_schema")
        db = str(meta.get("db") or meta.get("source_db") or middle)
        if schema or str(meta.get("source_connector", "")) == "postgresql":
            return db, str(schema or middle), table
        return db, None, table


_SNAPSHOTS = {s.value: s for s in Snapshot}


_CONNECTOR_OF_SOURCE = {"io.debezium.connector.mongo.Source": "mongodb"}


def _complete_source(payload: dict[str, Any], schema_part: Any, topic: str) -> None:
    """Fill what a documented record leaves out of its source block (the Oracle connector's
    examples have no ``connector``/``db``/``schema``/``table``): the connector from the source
    struct's name, the schema and table from the topic ``<prefix>.<schema>.<table>``."""
    src = payload.get("source")
    if type(src) is not dict or ("connector" in src and ("table" in src or "collection" in src)):
        return
    if "connector" not in src and isinstance(schema_part, dict):
        for f in schema_part.get("fields") or ():
            name = f.get("name") if isinstance(f, dict) and f.get("field") == "source" else None
            if isinstance(name, str) and name.startswith("io.debezium.connector.") and name.endswith(".Source"):
                src["connector"] = _CONNECTOR_OF_SOURCE.get(name, name.split(".")[3])
    parts = topic.split(".")
    if len(parts) >= 3:
        src.setdefault("table", parts[-1])
        src.setdefault("schema", parts[-2])
        src.setdefault("db", "")


def _int_or(v: Any, default: int) -> int:
    if type(v) is int:
        return v
    if type(v) is str and v.lstrip("-").isdigit():  # add.fields values are documented quoted
        return int(v)
    return default


def _flat_source_block(meta: Mapping[str, Any]) -> dict[str, Any]:
    """ExtractNewRecordState's ``add.fields`` as a source block (``__lsn`` or ``__source_lsn``,
    ``__source_file``, ...), numbers given as text converted."""
    block: dict[str, Any] = {}
    for k, v in meta.items():
        name = k[7:] if k.startswith("source_") else k
        if name in ("lsn", "pos", "row", "server_id", "ord", "event_serial_no", "ts_ms") and type(v) is str \
                and v.isdigit():
            v = int(v)
        block.setdefault(name, v)
    return {k: v for k, v in block.items() if k in ("lsn", "file", "pos", "row", "gtid", "server_id", "change_lsn",
                                                    "commit_lsn", "event_serial_no", "scn", "commit_scn", "ord",
                                                    "ts_ms") and v is not None}


def _raw_key(key: bytes | None) -> dict[str, Any] | None:
    if key is None:
        return None
    try:
        doc = orjson.loads(key)
    except orjson.JSONDecodeError as exc:
        raise ValidationError(f"key: malformed JSON ({exc})") from None
    if type(doc) is dict and len(doc) == 2 and "schema" in doc and "payload" in doc:
        doc = doc["payload"]
    if doc is None:
        return None
    if type(doc) is not dict:
        raise ValidationError(f"key: expected a JSON object of key columns, got {type(doc).__name__}")
    return doc
