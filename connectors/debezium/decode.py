"""Records written by a real Debezium connector (through Kafka) -> kappaflow change events.

What arrives on Debezium's topics, and what becomes of it:

===========================================  =================================================================
Debezium record                              kappaflow
===========================================  =================================================================
change event, JsonConverter with schemas     ``ChangeEvent`` typed by the embedded Connect schema (Debezium
(``{"schema", "payload"}``), op c/u/d/r/t    logical types: io.debezium.time.*, Connect Decimal with the scale
                                             in the schema parameters, VariableScaleDecimal, Json, Uuid, Enum,
                                             EnumSet, Bits, Year, ...), written in kappaflow's own format
change event without schemas                 ``ChangeEvent`` with the JSON values as they are; the table's
                                             schema is inferred from them (ints, floats, strings, booleans,
                                             ``{"scale","value"}`` decimals, other objects as JSON)
record flattened by ``ExtractNewRecordState`` the row with the ``__*`` metadata fields removed; op from
                                             ``__op`` (``add.fields=op``), ``__deleted="true"`` is a delete
                                             (``delete.handling.mode=rewrite``); position from ``__lsn`` or
                                             ``__source_file``/``__source_pos`` when present
tombstone (null value)                       after an envelope delete: skipped (kappaflow writes its own
                                             tombstone after every delete); on a flattened topic
                                             (``delete.handling.mode=drop``/``none``): a delete of the key
transaction metadata (``<prefix>.transaction``) routed verbatim to ``<source>.__transactions``
heartbeat (``__debezium-heartbeat.*``)       skipped
schema change (``<prefix>`` topic, ``ddl``)  routed verbatim to ``<source>.__debezium_schema``
anything malformed                           ``ValidationError`` naming the field: the caller sends the record
                                             to the dead-letter topic with the reason and its position
===========================================  =================================================================

Positions: Debezium's own source block gives them (binlog ``file``/``pos``/``row``, PostgreSQL
``lsn``). A record that carries none (a flattened record without source fields) gets its Kafka
coordinates as a ``LedgerPosition`` (``partition << 48 | offset``): unique, and increasing per
input partition, which is where every key's changes are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

import orjson

from kappaflow.errors import ValidationError
from kappaflow.events import (
    BinlogPosition,
    ChangeEvent,
    Column,
    EventCodec,
    FieldType,
    LedgerPosition,
    Op,
    PgPosition,
    Position,
    Snapshot,
    SourceInfo,
    TableSchema,
)

__all__ = ["DebeziumDecoder", "Decoded"]

_OPS = {o.value: o for o in Op}


@dataclass(frozen=True, slots=True)
class Decoded:
    """What one Debezium record becomes.

    kind: "event" (``event``/``schema``/``topic`` set), "skip" (``reason``), "route"
    (``topic`` + the original key/value go there verbatim).
    """

    kind: str
    topic: str | None = None
    event: ChangeEvent | None = None
    schema: TableSchema | None = None
    reason: str = ""


def _kafka_position(partition: int, offset: int) -> Position:
    return LedgerPosition((partition << 48) | offset)


class DebeziumDecoder:
    """Stateful per source: remembers each input topic's shape (envelope or flattened) and the
    schemas inferred for schemaless tables."""

    def __init__(self, source: str, *, schemas_enabled: bool | None = None) -> None:
        self.source = source
        self.schemas_enabled = schemas_enabled
        self.codec = EventCodec()
        self.flattened: dict[str, bool] = {}
        self.inferred: dict[str, TableSchema] = {}

    # -- classification --------------------------------------------------------------
    def decode(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None) -> Decoded:
        """Classify and convert one record; raises ValidationError for malformed input."""
        if topic.startswith("__debezium-heartbeat"):
            return Decoded("skip", reason="heartbeat")
        if value is None:
            if self.flattened.get(topic, True):
                return self._flat_delete(topic, partition, offset, key)
            return Decoded("skip", reason="tombstone")
        try:
            doc = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise ValidationError(f"value: malformed JSON ({exc})") from None
        if type(doc) is not dict:
            raise ValidationError(f"value: expected a JSON object, got {type(doc).__name__}")
        schema_part, payload = None, doc
        if set(doc) == {"schema", "payload"}:
            schema_part, payload = doc["schema"], doc["payload"]
            if self.schemas_enabled is False:
                raise ValidationError("value: has a 'schema' part, but the source is configured with "
                                      "schemas_enabled=false")
        elif self.schemas_enabled:
            raise ValidationError("value: expected {\"schema\", \"payload\"} (schemas_enabled=true), got "
                                  f"keys {sorted(doc)[:6]}")
        if type(payload) is not dict:
            raise ValidationError(f"payload: expected a JSON object, got {type(payload).__name__}")
        if "status" in payload and payload.get("status") in ("BEGIN", "END") and "op" not in payload:
            return Decoded("route", topic=f"{self.source}.__transactions", reason="transaction metadata")
        if "ddl" in payload or "tableChanges" in payload:
            return Decoded("route", topic=f"{self.source}.__debezium_schema", reason="schema change")
        if set(payload) == {"ts_ms"}:
            return Decoded("skip", reason="heartbeat")
        if ("source" in payload and ("before" in payload or "after" in payload)) or "op" in payload:
            self.flattened[topic] = False
            return self._envelope(value, key, payload)
        self.flattened[topic] = True
        return self._flat(topic, partition, offset, key, schema_part, payload)

    # -- envelopes ---------------------------------------------------------------------
    def _envelope(self, value: bytes, key: bytes | None, payload: dict[str, Any]) -> Decoded:
        if "op" not in payload:
            raise ValidationError("op: missing (a Debezium envelope without an operation)")
        event = self.codec.decode_value(value)  # typed by the embedded schema, raw JSON without one
        src = event.source
        topic = f"{self.source}.{src.schema if src.schema is not None else src.db}.{src.table}"
        raw_key = self._raw_key(key)
        names = tuple(raw_key) if raw_key else ()
        doc = orjson.loads(value)
        if set(doc) == {"schema", "payload"} and doc["schema"] is not None:
            parsed = TableSchema.from_connect(doc["schema"])
            schema = TableSchema(topic, parsed.columns, names if names else parsed.key)
        else:
            before = None if event.before is None else _decode_inferred(event.before)
            after = None if event.after is None else _decode_inferred(event.after)
            event = replace(event, before=before, after=after)
            schema = self._infer(topic, [r for r in (before, after) if r is not None], raw_key)
        k: dict[str, Any] | None = None
        if event.op is not Op.TRUNCATE and schema.key:
            row = event.after if event.after is not None else event.before
            if row is not None and all(c in row for c in schema.key):
                k = {c: row[c] for c in schema.key}
            elif raw_key:
                k = dict(raw_key)
        event = replace(event, key=k, source=replace(src, name=self.source))
        return Decoded("event", topic=topic, event=event, schema=schema)

    def _infer(self, topic: str, rows: list[dict[str, Any]], key: Mapping[str, Any] | None = None) -> TableSchema:
        known = self.inferred.get(topic)
        cols = {c.name: c for c in known.columns} if known is not None else {}
        for row in rows:
            for name, v in row.items():
                if name in cols or v is None:
                    continue
                cols[name] = Column(name, _infer_type(v))
        keycols = tuple(key) if key else (known.key if known is not None else ())
        for k in keycols:
            if k not in cols:
                cols[k] = Column(k, _infer_type(key[k]) if key and key.get(k) is not None else FieldType.STRING)
        schema = TableSchema(topic, tuple(cols.values()), keycols)
        if known is None or schema.fingerprint() != known.fingerprint():
            self.inferred[topic] = schema
        return self.inferred[topic]

    # -- flattened records (ExtractNewRecordState) ------------------------------------
    def _flat(self, topic: str, partition: int, offset: int, key: bytes | None, schema_part: Any,
              payload: dict[str, Any]) -> Decoded:
        meta = {k: v for k, v in payload.items() if k.startswith("__")}
        row = {k: v for k, v in payload.items() if not k.startswith("__")}
        db, schema_name, table = self._names(topic, meta)
        out_topic = f"{self.source}.{schema_name if schema_name is not None else db}.{table}"
        if schema_part is not None:
            parsed = TableSchema.from_connect(schema_part)
            cols = tuple(c for c in parsed.columns if not c.name.startswith("__"))
            key_dict = self._raw_key(key)
            schema = TableSchema(out_topic, cols, tuple(key_dict) if key_dict else ())
            row = self.codec.decode_row_values(schema, row)
        else:
            key_dict = self._raw_key(key)
            row = _decode_inferred(row)
            schema = self._infer(out_topic, [row], key_dict)
        deleted = str(meta.get("__deleted", "false")).lower() == "true"
        op_code = meta.get("__op")
        if op_code is not None and op_code not in _OPS:
            raise ValidationError(f"__op: expected one of {list(_OPS)}, got {op_code!r}")
        op = Op.DELETE if deleted else (_OPS[op_code] if op_code is not None else Op.CREATE)
        k = {c: row[c] for c in schema.key} if schema.key and all(c in row for c in schema.key) else None
        if k is None and key is not None:
            k = self.codec.decode_key(key, schema)
        pos = self._flat_position(meta, partition, offset)
        ts = meta.get("__source_ts_ms", meta.get("__ts_ms", 0))
        src = SourceInfo(str(meta.get("__source_connector", "debezium")), self.source, db, schema_name, table, pos,
                         int(ts) if isinstance(ts, int | str) and str(ts).lstrip("-").isdigit() else 0,
                         meta.get("__source_txId"), Snapshot.FALSE)
        if op is Op.DELETE:
            event = ChangeEvent(op, k, row, None, src, int(meta.get("__ts_ms") or ts or 0))
        elif op is Op.UPDATE or op is Op.CREATE or op is Op.READ:
            event = ChangeEvent(op, k, None, row, src, int(meta.get("__ts_ms") or ts or 0))
        else:
            raise ValidationError(f"__op: {op.value!r} cannot be carried by a flattened record")
        return Decoded("event", topic=out_topic, event=event, schema=schema)

    def _flat_delete(self, topic: str, partition: int, offset: int, key: bytes | None) -> Decoded:
        """A tombstone on a flattened topic is the delete itself."""
        if key is None:
            return Decoded("skip", reason="tombstone without key")
        k = self._raw_key(key)
        if not k:
            raise ValidationError("key: a tombstone's key must be a JSON object of key columns")
        db, schema_name, table = self._names(topic, {})
        out_topic = f"{self.source}.{schema_name if schema_name is not None else db}.{table}"
        schema = self._infer(out_topic, [], k)
        src = SourceInfo("debezium", self.source, db, schema_name, table, _kafka_position(partition, offset), 0)
        event = ChangeEvent(Op.DELETE, dict(k), None, None, src, 0)
        return Decoded("event", topic=out_topic, event=event, schema=schema)

    def _raw_key(self, key: bytes | None) -> dict[str, Any] | None:
        if key is None:
            return None
        try:
            doc = orjson.loads(key)
        except orjson.JSONDecodeError as exc:
            raise ValidationError(f"key: malformed JSON ({exc})") from None
        if type(doc) is dict and set(doc) == {"schema", "payload"}:
            doc = doc["payload"]
        if doc is None:
            return None
        if type(doc) is not dict:
            raise ValidationError(f"key: expected a JSON object of key columns, got {type(doc).__name__}")
        return doc

    @staticmethod
    def _names(topic: str, meta: Mapping[str, Any]) -> tuple[str, str | None, str]:
        parts = topic.split(".")
        table = str(meta.get("__table") or parts[-1])
        middle = parts[-2] if len(parts) >= 3 else parts[0]
        if "__schema" in meta or str(meta.get("__source_connector", "")) == "postgresql":
            return str(meta.get("__db") or middle), str(meta.get("__schema") or middle), table
        return str(meta.get("__db") or middle), None, table

    @staticmethod
    def _flat_position(meta: Mapping[str, Any], partition: int, offset: int) -> Position:
        lsn = meta.get("__lsn", meta.get("__source_lsn"))
        if isinstance(lsn, int) and lsn >= 0:
            return PgPosition(lsn, 0)
        file, pos = meta.get("__source_file"), meta.get("__source_pos")
        if isinstance(file, str) and isinstance(pos, int):
            row = meta.get("__source_row", 0)
            return BinlogPosition(file, pos, row if isinstance(row, int) else 0)
        return _kafka_position(partition, offset)


def _infer_type(v: Any) -> FieldType:
    t = type(v)
    if t is bool:
        return FieldType.BOOLEAN
    if t is int:
        return FieldType.INT64
    if t is float:
        return FieldType.FLOAT64
    if t is str:
        return FieldType.STRING
    if t is Decimal:
        return FieldType.VARIABLE_DECIMAL
    return FieldType.JSON


def _decode_inferred(row: dict[str, Any]) -> dict[str, Any]:
    """Schemaless values: ``{"scale": s, "value": base64}`` is a VariableScaleDecimal; other objects stay JSON."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if type(v) is dict and set(v) == {"scale", "value"}:
            from binascii import a2b_base64

            if type(v["scale"]) is not int or type(v["value"]) is not str:
                raise ValidationError(f"after.{k}: expected a variable-scale decimal {{scale: int, value: base64}}")
            out[k] = Decimal(int.from_bytes(a2b_base64(v["value"]), "big", signed=True)).scaleb(-v["scale"])
        elif type(v) is dict and "value" in v and "scale" not in v:
            raise ValidationError(f"after.{k}: a decimal without its scale (expected {{scale, value}})")
        elif v is None:
            out[k] = None
        else:
            out[k] = v
    return out
