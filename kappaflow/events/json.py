"""Debezium JsonConverter-compatible JSON for change events (orjson underneath).

Value messages are Debezium envelopes (``before``/``after``/``source``/``op``/
``ts_ms``/``transaction``); with ``include_schema=True`` they are wrapped as
``{"schema": <Connect schema>, "payload": <envelope>}`` exactly like
JsonConverter with ``schemas.enable=true``. kappaflow adds ``source.kf_pos``
(the exact Position) and, when some column values are unknown, a top-level
``kf_unavailable`` list. A column absent from a row is absent in the JSON too
(Debezium would write null); None is written as null.

Speed: per schema the codec builds, once, a tuple of (column, converter) for
the columns whose JSON form differs from the Python value, plus the rendered
Connect schema as an ``orjson.Fragment``; encoding an event then builds plain
dicts and calls ``orjson.dumps`` once. Errors are located only after a failure
(a slow second pass names the field), so the fast path has no checks beyond
the converters themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

import orjson

from kappaflow import __version__
from kappaflow.errors import ValidationError
from kappaflow.events.connect import connect_envelope_schema, connect_key_schema, table_from_connect
from kappaflow.events.model import ChangeEvent, Op, Snapshot, SourceInfo, TransactionInfo
from kappaflow.events.position import Position
from kappaflow.events.schema import DECIMAL_MODES, Column, FieldType, TableSchema
from kappaflow.events.sources import (
    layout_for_connector,
    layout_for_position,
    layout_for_source,
    position_parsers,
    source_block,
)
from kappaflow.events.values import (
    JSON_NULL,
    NumericDecimal,
    Wire,
    default_wire,
    describe,
    identity_check,
    make_decoder,
    make_encoder,
    make_transcoder,
    short_repr,
)

__all__ = [
    "JSON_NULL",
    "EventCodec",
    "decode_row_values",
    "encode_row_values",
    "op_header",
    "tombstone_for",
    "topic_name",
]

SOURCE_VERSION = f"kappaflow-{__version__}"
_UTC_Z = orjson.OPT_UTC_Z

RowFn = Callable[[dict[str, Any]], dict[str, Any]]


class _UnknownColumn(Exception):
    pass


# -- row converters (built once per schema and mode) ---------------------------------------------
def _row_encoder(schema: TableSchema, mode: str, native: bool) -> RowFn:
    """A function converting a row dict to its JSON form, specialised to the schema.

    Generated code (like ``dataclasses`` does): one straight-line get/convert per
    column that needs converting, converters bound as locals, no loop or dispatch.
    """
    convs = [(c.name, enc) for c in schema.columns if (enc := make_encoder(c, mode, native)) is not None]
    issuperset = frozenset(c.name for c in schema.columns).issuperset

    if not convs:

        def conv_plain(row: dict[str, Any]) -> dict[str, Any]:
            if not issuperset(row):
                raise _UnknownColumn
            return row

        return conv_plain

    params = ", ".join(f"_f{i}=_f{i}" for i in range(len(convs)))
    lines = [
        f"def conv(row, _issuperset=_issuperset, {params}):",
        "    if not _issuperset(row):",
        "        raise _UnknownColumn",
        "    out = row.copy()",
    ]
    ns: dict[str, Any] = {"_issuperset": issuperset, "_UnknownColumn": _UnknownColumn}
    for i, (name, fn) in enumerate(convs):
        ns[f"_f{i}"] = fn
        lines += [f"    v = out.get({name!r})", "    if v is not None:", f"        out[{name!r}] = _f{i}(v)"]
    lines.append("    return out")
    exec("\n".join(lines), ns)
    return ns["conv"]


def _identity_checker(col: Column) -> Callable[[Any], bool] | None:
    """Python-side type check for columns whose value JSON carries as-is (validate=True)."""
    t = col.type
    if t in (FieldType.INT8, FieldType.INT16, FieldType.INT32, FieldType.INT64, FieldType.YEAR):
        lo, hi = {
            FieldType.INT8: (-(1 << 7), (1 << 7) - 1),
            FieldType.INT16: (-(1 << 15), (1 << 15) - 1),
            FieldType.INT64: (-(1 << 63), (1 << 63) - 1),
        }.get(t, (-(1 << 31), (1 << 31) - 1))
        return lambda v: type(v) is int and lo <= v <= hi
    if t is FieldType.STRING or t is FieldType.ENUM:
        return lambda v: type(v) is str
    if t is FieldType.BOOLEAN:
        return lambda v: type(v) is bool
    if t is FieldType.UUID:
        return lambda v: isinstance(v, UUID)
    return None


def _row_validator(schema: TableSchema) -> Callable[[dict[str, Any]], None]:
    checks = tuple((c.name, chk) for c in schema.columns if (chk := _identity_checker(c)) is not None)

    def validate(row: dict[str, Any]) -> None:
        for name, chk in checks:
            v = row.get(name)
            if v is not None and not chk(v):
                raise _UnknownColumn  # any exception: the slow pass names the field
        return None

    return validate


def _row_decoder(schema: TableSchema, wires: Mapping[str, Wire] | None, mode: str) -> Callable[[Any, str], Any]:
    """A function decoding a row dict in place from its JSON form, specialised to the schema.

    Generated code like ``_row_encoder``: per column one get, then an inline type check for the
    types JSON carries as-is (``identity_check``) or a call of the column's converter. ``i``
    tracks the column being decoded, so a failure names it (``_failed``).
    """
    decs = tuple(
        (
            c.name,
            make_decoder(c, wires[c.name] if wires is not None else default_wire(c, mode)),
            c,
        )
        for c in schema.columns
    )
    names = frozenset(c.name for c in schema.columns)

    def _bad_row(row: Any, path: str) -> None:
        if row is not None:
            raise ValidationError(f"{path}: expected an object of column values or null, got {short_repr(row)}")

    def _unknown(row: dict[str, Any], path: str) -> None:
        unknown = sorted(set(row) - names)
        raise ValidationError(f"{path}.{unknown[0]}: column not in schema {schema.name!r} (columns: {sorted(names)})")

    def _failed(row: dict[str, Any], path: str, i: int) -> None:
        n, _fn, col = decs[i]
        w = wires[n] if wires is not None else default_wire(col, mode)
        raise ValidationError(f"{path}.{n}: expected {describe(col, w)}, got {short_repr(row[n])}") from None

    ns: dict[str, Any] = {"_issuperset": names.issuperset, "_bad_row": _bad_row, "_unknown": _unknown,
                          "_failed": _failed, "_NumericDecimal": NumericDecimal, "_Bad": _BadWire}
    lines = [
        "def dec(row, path):",
        "    if type(row) is not dict:",
        "        return _bad_row(row, path)",
        "    if not _issuperset(row):",
        "        _unknown(row, path)",
        "    i = 0",
        "    try:",
    ]
    for i, (name, fn, col) in enumerate(decs):
        lines += [f"        i = {i}", f"        v = row.get({name!r})"]
        check = identity_check(col, fn)
        if check is not None:
            lines.append(f"        if v is not None and not ({check}): raise _Bad")
        else:
            ns[f"_f{i}"] = fn
            lines += ["        if v is not None:", f"            row[{name!r}] = _f{i}(v)"]
    lines += [
        "        pass",
        "    except _NumericDecimal:",
        "        raise",
        "    except Exception:",
        "        _failed(row, path, i)",
        "    return row",
    ]
    exec("\n".join(lines), ns)
    dec: Callable[[Any, str], Any] = ns["dec"]
    return dec


class _BadWire(Exception):
    """A wire value failed an inline check of a generated row decoder (named by ``_failed``)."""


def _row_transcoder(schema: TableSchema, wires: Mapping[str, Wire], mode: str) -> RowFn:
    """A function taking a row as a message's JSON has it (a dict, checked by the caller) to the row
    ``_row_encoder(schema, mode, native=True)`` makes of ``_row_decoder(schema, wires)``'s row, without
    the Python values in between where that is exact (``make_transcoder``). Returns a new dict (the
    input is left alone); raises on any value the decoder refuses (or may refuse), naming nothing:
    the caller then takes the decode/encode path, whose errors name the field.
    """
    names = frozenset(c.name for c in schema.columns)
    ns: dict[str, Any] = {"_issuperset": names.issuperset, "_Bad": _BadWire}
    lines = ["def tr(row):", "    if not _issuperset(row):", "        raise _Bad", "    out = row.copy()"]
    for i, c in enumerate(schema.columns):
        check, conv = make_transcoder(c, wires[c.name], mode)
        lines.append(f"    v = row.get({c.name!r})")
        if check is not None:
            lines.append(f"    if v is not None and not ({check}): raise _Bad")
        else:
            ns[f"_f{i}"] = conv
            lines += ["    if v is not None:", f"        out[{c.name!r}] = _f{i}(v)"]
    lines.append("    return out")
    exec("\n".join(lines), ns)
    tr: RowFn = ns["tr"]
    return tr


def _raw_rows(row: Any, path: str) -> Any:
    if row is None or type(row) is dict:
        return row
    raise ValidationError(f"{path}: expected an object of column values or null, got {short_repr(row)}")


# -- source blocks ---------------------------------------------------------------------------------
# One layout per connector (kappaflow.events.sources): the common fields, the connector's, kf_pos.


def _str_field(s: Mapping[str, Any], key: str, optional: bool = False) -> Any:
    v = s.get(key)
    if type(v) is str or (optional and v is None):
        return v
    what = "missing" if key not in s else f"got {short_repr(v)}"
    raise ValidationError(f"source.{key}: expected a string, {what}")


_SNAPSHOTS = {s.value: s for s in Snapshot}
_OPS = {o.value: o for o in Op}

# Places a decoded record: called with (the position its source block names, or None; the block; its
# snapshot value), returns the position the event gets (e.g. Debezium records' order, connectors/debezium).
PositionHook = Callable[[Position | None, Mapping[str, Any], Snapshot], Position]


def _opt_int(s: Mapping[str, Any], key: str) -> int | None:
    v = s.get(key)
    if v is None or type(v) is int:
        return v
    if type(v) is str and v.lstrip("-").isdigit():  # Debezium's documentation shows some quoted
        return int(v)
    raise ValidationError(f"source.{key}: expected an integer or null, got {short_repr(v)}")


def _decode_source(s: Any, place: PositionHook | None = None, name_as: str | None = None) -> SourceInfo:
    if type(s) is not dict:
        raise ValidationError(f"source: expected an object, got {short_repr(s)}")
    get = s.get
    connector: str = _str_field(s, "connector")
    layout = layout_for_connector(connector)
    name, db, ts_ms = get("name"), get("db"), get("ts_ms")
    table = get(layout.table_key)
    schema = get(layout.schema_key) if layout.schema_key is not None else None
    if not (
        type(name) is str
        and type(db) is str
        and type(table) is str
        and (schema is None or type(schema) is str)
        and type(ts_ms) is int
    ):
        for key in ("name", "db", layout.table_key, layout.schema_key):
            if key is not None:
                _str_field(s, key, optional=key == layout.schema_key)
        raise ValidationError(f"source.ts_ms: expected an integer (ms since the epoch), got {short_repr(ts_ms)}")
    snap = get("snapshot")
    snapshot = _SNAPSHOTS.get(snap) if type(snap) is str else _snapshot_from(snap)
    if snapshot is None:
        raise ValidationError(f"source.snapshot: expected one of {list(_SNAPSHOTS)}, got {snap!r}")
    tx_id = get("txId")
    if tx_id is not None and type(tx_id) is not int and type(tx_id) is not str:
        raise ValidationError(f"source.txId: expected an integer, a string or null, got {short_repr(tx_id)}")
    kf = get("kf_pos")
    position: Position | None
    if type(kf) is dict:  # a kind's own parser first (the hot path), the full checks otherwise
        kind = kf.get("kind")
        parse = (_PARSERS or _load_parsers()).get(kind) if type(kind) is str else None
        position = parse(kf) if parse is not None else None
        if position is None:
            position = _position_from(kf)
    elif kf is not None:
        position = _position_from(kf)
    else:
        in_snapshot = snapshot is not Snapshot.FALSE and snapshot is not Snapshot.INCREMENTAL
        position = layout.position(s, in_snapshot)
        if position is None and place is None:
            raise ValidationError(
                f"source.kf_pos: missing, and the {connector} source block names no position "
                f"(expected {_POSITION_FIELDS.get(layout.kind, 'position fields')})")
    if place is not None:
        position = place(position, s, snapshot)
    ts_us, ts_ns = get("ts_us"), get("ts_ns")
    if ts_us is not None or ts_ns is not None:
        if type(ts_us) is not int or type(ts_ns) is not int:
            ts_us, ts_ns = _opt_int(s, "ts_us"), _opt_int(s, "ts_ns")
        if ts_us == ts_ms * 1000 and ts_ns == ts_ms * 1_000_000:
            ts_us = ts_ns = None
    assert position is not None
    info = SourceInfo(connector, name if name_as is None else name_as, db, schema, table, position, ts_ms, tx_id,
                      snapshot, ts_us, ts_ns)
    extra = layout.extra_from(s, info)  # what the (placed) position does not say the same
    if extra is not None:
        _set_extra(info, extra)
    return info


_set_extra = SourceInfo.__dict__["extra"].__set__  # set once, right after construction


_POSITION_FIELDS = {"pg": "'lsn'", "binlog": "binlog 'file'/'pos'", "sqlserver": "'commit_lsn'/'change_lsn'",
                    "db2": "'commit_lsn'/'change_lsn'", "oracle": "'scn'/'commit_scn'", "mongodb": "'ord'"}


def _snapshot_from(snap: Any) -> Snapshot:
    if snap is None or snap is False:
        return Snapshot.FALSE
    if snap is True:  # Debezium 0.x/1.0 wrote a boolean
        return Snapshot.TRUE
    raise ValidationError(f"source.snapshot: expected a string, got {short_repr(snap)}")


_PARSERS: dict[str, Callable[[dict[str, Any]], Position | None]] = {}


def _load_parsers() -> dict[str, Callable[[dict[str, Any]], Position | None]]:
    """Position kind -> the hot-path ``kf_pos`` parser its connector registered (loaded on first use)."""
    _PARSERS.update(position_parsers())
    return _PARSERS


def _position_from(kf: Any) -> Position:
    try:
        return Position.from_dict(kf)
    except ValidationError as e:
        raise ValidationError(f"source.kf_pos: {e}") from None


def _merge_exact(edited: Any, exact: Any) -> Any:
    """``edited`` with its floats replaced by the exact decimals at the same place in ``exact``."""
    if type(edited) is dict and type(exact) is dict:
        return {k: _merge_exact(v, exact.get(k)) for k, v in edited.items()}
    if type(edited) is list and type(exact) is list and len(edited) == len(exact):
        return [_merge_exact(a, b) for a, b in zip(edited, exact, strict=True)]
    if type(edited) is float and type(exact) is Decimal:
        return exact
    return edited


def _envelope_int(payload: Mapping[str, Any], key: str) -> int | None:
    v = payload.get(key)
    if v is None or type(v) is int:
        return v
    if type(v) is str and v.isdigit():  # quoted in some of Debezium's documentation
        return int(v)
    raise ValidationError(f"{key}: expected an integer or null, got {short_repr(v)}")


def _envelope_times(payload: Mapping[str, Any], source: SourceInfo) -> tuple[int, int | None, int | None]:
    """The envelope's ``ts_ms`` (the source's when null), ``ts_us`` and ``ts_ns`` (None when they
    only repeat ``ts_ms``)."""
    ts_ms = payload.get("ts_ms")
    if ts_ms is None:
        ts_ms = source.ts_ms
    elif type(ts_ms) is not int:
        if type(ts_ms) is str and ts_ms.isdigit():  # quoted in some of Debezium's documentation
            ts_ms = int(ts_ms)
        else:
            raise ValidationError(
                f"ts_ms: expected an integer (ms since the epoch) or null, got {short_repr(ts_ms)}")
    ts_us, ts_ns = payload.get("ts_us"), payload.get("ts_ns")
    if ts_us is not None or ts_ns is not None:
        if type(ts_us) is not int or type(ts_ns) is not int:
            ts_us, ts_ns = _envelope_int(payload, "ts_us"), _envelope_int(payload, "ts_ns")
        if ts_us == ts_ms * 1000 and ts_ns == ts_ms * 1_000_000:
            ts_us = ts_ns = None
    return ts_ms, ts_us, ts_ns


def _decode_transaction(t: Any) -> TransactionInfo | None:
    if t is None:
        return None
    if type(t) is not dict:
        raise ValidationError(f"transaction: expected an object or null, got {short_repr(t)}")
    tid = t.get("id")
    if type(tid) is not str:
        raise ValidationError(f"transaction.id: expected a string, got {short_repr(tid)}")
    orders = []
    for k in ("total_order", "data_collection_order"):
        v = t.get(k)
        if type(v) is str and v.isdigit():  # Debezium's docs show them quoted
            v = int(v)
        if type(v) is not int:
            raise ValidationError(f"transaction.{k}: expected an integer, got {short_repr(v)}")
        orders.append(v)
    return TransactionInfo(tid, orders[0], orders[1])


# -- generic key values (no schema at hand) -------------------------------------------------------
def _encode_any(v: Any) -> Any:
    """Deterministic JSON form of a key value by its Python type (used without a schema)."""
    t = type(v)
    if t is int or t is str or t is bool or v is None:
        return v
    if t is float:
        return make_encoder(Column("_", FieldType.FLOAT64), "string")(v)  # type: ignore[misc]
    if isinstance(v, Decimal):
        return format(v, "f") if v.is_finite() else str(v)
    if isinstance(v, datetime):
        if v.tzinfo is None:
            return (v - datetime(1970, 1, 1)) // timedelta(microseconds=1)
        return make_encoder(Column("_", FieldType.TIMESTAMPTZ), "string")(v)  # type: ignore[misc]
    if isinstance(v, date):
        return v.toordinal() - 719163
    if isinstance(v, time):
        return make_encoder(Column("_", FieldType.TIME), "string")(v)  # type: ignore[misc]
    if isinstance(v, timedelta):
        return v // timedelta(microseconds=1)
    if isinstance(v, UUID):
        return str(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return make_encoder(Column("_", FieldType.BYTES), "string")(bytes(v))  # type: ignore[misc]
    raise ValidationError(f"key: cannot encode {short_repr(v)} without a schema")


# -- the codec ---------------------------------------------------------------------------------------
class EventCodec:
    """Encode/decode change events as Debezium JsonConverter JSON.

    ``decimal_mode``: "string" (kappaflow's default, "12.34"), "precise" (Debezium's
    default: Connect Decimal, base64 unscaled bytes) or "double". ``include_schema``:
    wrap messages as ``{"schema", "payload"}`` (JsonConverter schemas.enable=true).
    ``validate``: also type-check values JSON carries as-is (ints, strings, booleans,
    UUIDs) when encoding; off by default because connectors produce typed values.
    """

    __slots__ = (
        "_connect_cache", "_dec_key", "_enc_key", "_last_schema_part", "_schema_bytes_cache", "decimal_mode",
        "include_schema", "validate", "version",
    )

    def __init__(
        self,
        decimal_mode: str = "string",
        include_schema: bool = False,
        *,
        validate: bool = False,
        version: str = SOURCE_VERSION,
    ) -> None:
        if decimal_mode not in DECIMAL_MODES:
            raise ValidationError(f"decimal_mode: expected one of {list(DECIMAL_MODES)}, got {decimal_mode!r}")
        if type(include_schema) is not bool:
            raise ValidationError(f"include_schema: expected true or false, got {include_schema!r}")
        self.decimal_mode = decimal_mode
        self.include_schema = include_schema
        self.validate = validate
        self.version = version
        self._enc_key = ("enc", decimal_mode, include_schema, validate)
        self._dec_key = ("dec", decimal_mode)
        self._connect_cache: dict[Any, tuple[Any, Any]] = {}
        # schema-part bytes -> plan, so repeated schemas are neither parsed nor compared
        self._schema_bytes_cache: dict[bytes, tuple[TableSchema, Callable[[Any, str], Any]]] = {}
        # the schema part the last message had, with its plan: compared in place (no slice, no hash)
        self._last_schema_part: tuple[bytes, tuple[TableSchema, Callable[[Any, str], Any]]] | None = None

    def __repr__(self) -> str:
        return f"EventCodec(decimal_mode={self.decimal_mode!r}, include_schema={self.include_schema!r})"

    # -- plans -------------------------------------------------------------------------------------
    def _enc_plan(self, schema: TableSchema) -> tuple[Any, ...]:
        plan = schema._cache.get(self._enc_key)
        if plan is None:
            mode = self.decimal_mode
            validator = _row_validator(schema) if self.validate else None
            plan = schema._cache[self._enc_key] = (
                _row_encoder(schema, mode, True),  # for orjson.dumps(option=OPT_UTC_Z)
                validator,
                {},  # position kind -> rendered Connect schema (orjson.Fragment)
                _row_encoder(schema, mode, False),  # plain JSON values (encode_row_values)
            )
        return plan

    def _schema_fragment(self, schema: TableSchema, plan: tuple[Any, ...], source: SourceInfo) -> Any:
        layout = layout_for_source(source)
        frags = plan[2]
        key: Any = (layout.kind, source.position.kind)
        if layout.extra_keys is None and source.extra:  # the fields vary with what was read
            key = (layout.kind, source.position.kind, tuple(source.extra))
        frag = frags.get(key)
        if frag is None:
            frag = frags[key] = orjson.Fragment(
                orjson.dumps(connect_envelope_schema(schema, self.decimal_mode, layout.kind, source))
            )
        return frag

    def _dec_plan(self, schema: TableSchema) -> Callable[[Any, str], Any]:
        plan = schema._cache.get(self._dec_key)
        if plan is None:
            plan = schema._cache[self._dec_key] = _row_decoder(schema, None, self.decimal_mode)
        return plan

    def _plan_from_connect(self, wire_schema: Any) -> tuple[TableSchema, Callable[[Any, str], Any]]:
        name = wire_schema.get("name") if isinstance(wire_schema, dict) else None
        hit = self._connect_cache.get(name)
        if hit is not None and hit[0] == wire_schema:
            return hit[1]
        table, wires = table_from_connect(wire_schema)
        table._cache["wires"] = wires  # for transcoder()
        plan = (table, _row_decoder(table, wires, self.decimal_mode))
        if len(self._connect_cache) > 1024:
            self._connect_cache.clear()
        self._connect_cache[name] = (wire_schema, plan)
        return plan

    # -- values ------------------------------------------------------------------------------------
    def encode_value(self, event: ChangeEvent, schema: TableSchema) -> bytes:
        """The value bytes of a change event (a Debezium envelope)."""
        plan = schema._cache.get(self._enc_key) or self._enc_plan(schema)
        conv = plan[0]
        try:
            before = event.before
            after = event.after
            if plan[1] is not None:
                if before is not None:
                    plan[1](before)
                if after is not None:
                    plan[1](after)
            return self._envelope_bytes(schema, plan, event.op, None if before is None else conv(before),
                                        None if after is None else conv(after), event.source, event.ts_ms,
                                        event.transaction, event.ts_us, event.ts_ns, event.unavailable)
        except ValidationError:
            raise
        except Exception as exc:
            raise self._diagnose(event, schema, exc) from None

    def encode_converted(self, schema: TableSchema, op: Op, before: dict[str, Any] | None,
                         after: dict[str, Any] | None, source: SourceInfo, ts_ms: int,
                         transaction: TransactionInfo | None = None, ts_us: int | None = None,
                         ts_ns: int | None = None) -> bytes:
        """``encode_value`` of an event whose rows are already in this codec's JSON form (made by
        ``transcoder``), byte for byte. Raises whatever orjson raises on a value it cannot write:
        ``encode_value`` of the decoded event then says which field."""
        plan = schema._cache.get(self._enc_key) or self._enc_plan(schema)
        return self._envelope_bytes(schema, plan, op, before, after, source, ts_ms, transaction, ts_us, ts_ns, ())

    def _envelope_bytes(self, schema: TableSchema, plan: tuple[Any, ...], op: Op, before: Any, after: Any,
                        src: SourceInfo, ts_ms: int, tx: TransactionInfo | None, ts_us: int | None,
                        ts_ns: int | None, unavailable: tuple[str, ...]) -> bytes:
        """The envelope of rows in their JSON form."""
        payload = {
            "before": before,
            "after": after,
            "source": source_block(src, self.version),
            "transaction": None
            if tx is None
            else {"id": tx.id, "total_order": tx.total_order, "data_collection_order": tx.data_collection_order},
            "op": op,
            "ts_ms": ts_ms,
            "ts_us": ts_us if ts_us is not None else ts_ms * 1000,
            "ts_ns": ts_ns if ts_ns is not None else ts_ms * 1_000_000,
        }
        if unavailable:
            payload["kf_unavailable"] = list(unavailable)
        if self.include_schema:
            frag = self._schema_fragment(schema, plan, src)
            return orjson.dumps({"schema": frag, "payload": payload}, option=_UTC_Z)
        return orjson.dumps(payload, option=_UTC_Z)

    def transcoder(self, table: TableSchema) -> RowFn | None:
        """For a table this codec read from a message's Connect schema (``split_envelope``): a function
        taking a row as such messages write it straight to this codec's JSON form of it -- what
        ``encode_value`` writes of the decoded row -- for ``encode_converted`` (see ``_row_transcoder``:
        it raises, naming nothing, on any value it does not take, the decode/encode path names the
        field). None for a table not read from a Connect schema."""
        key = ("transcode", self.decimal_mode)
        tr = table._cache.get(key)
        if tr is None:
            wires = table._cache.get("wires")
            if wires is None:
                return None
            tr = table._cache[key] = _row_transcoder(table, wires, self.decimal_mode)
        return tr

    def encode_row_values(self, schema: TableSchema, row: dict[str, Any]) -> dict[str, Any]:
        """A row's column values in their JSON form (the fast path connectors can reuse)."""
        plan = schema._cache.get(self._enc_key) or self._enc_plan(schema)
        try:
            if plan[1] is not None:
                plan[1](row)
            return plan[3](row)
        except Exception as exc:
            raise self._diagnose_row(row, "row", schema, exc) from None

    def decode_row_values(self, schema: TableSchema, row: dict[str, Any]) -> dict[str, Any]:
        """Inverse of ``encode_row_values`` (decodes a copy; the input is left alone)."""
        return self._dec_plan(schema)(dict(row), "row")

    def _diagnose(self, event: ChangeEvent, schema: TableSchema, exc: Exception) -> ValidationError:
        for part in ("before", "after"):
            row = getattr(event, part)
            if row is not None:
                err = self._diagnose_row(row, part, schema, exc, generic=False)
                if err is not None:
                    return err
        try:
            layout_for_position(event.source.position)
        except ValidationError as e:
            return e
        try:
            orjson.dumps(source_block(event.source, self.version))
        except Exception:
            return ValidationError(f"source: cannot be encoded as JSON ({exc}); check tx_id, ts_ms and names")
        return ValidationError(f"event: cannot be encoded as JSON: {type(exc).__name__}: {exc}")

    def _diagnose_row(
        self, row: Any, path: str, schema: TableSchema, exc: Exception, generic: bool = True
    ) -> Any:
        if not isinstance(row, dict):
            return ValidationError(f"{path}: expected a dict of column -> value, got {short_repr(row)}")
        names = {c.name for c in schema.columns}
        for k in row:
            if k not in names:
                return ValidationError(
                    f"{path}.{k}: column not in schema {schema.name!r} (columns: {sorted(names)})"
                )
        mode = self.decimal_mode
        for c in schema.columns:
            v = row.get(c.name)
            if v is None:
                continue
            enc = make_encoder(c, mode)
            chk = _identity_checker(c) if enc is None else None
            try:
                if chk is not None and self.validate and not chk(v):
                    raise TypeError
                orjson.dumps(enc(v) if enc is not None else v)
            except Exception:
                return ValidationError(
                    f"{path}.{c.name}: expected {describe(c, default_wire(c, mode))}, got {short_repr(v)}"
                )
        if generic:
            return ValidationError(f"{path}: cannot be encoded as JSON: {type(exc).__name__}: {exc}")
        return None

    _SCHEMA_HEAD = b'{"schema":'
    _PAYLOAD_SEP = b',"payload":'

    def _split_schema_part(self, data: Any) -> tuple[Any, dict[str, Any]] | None:
        """For ``{"schema":S,"payload":P}`` bytes whose S is cached: (plan, parsed P).

        JsonConverter writes the schema first and compactly. The first ``,"payload":``
        after it ends S: a JSON string cannot contain that byte sequence (its quotes
        would be escaped), and a cached S is known to be one complete JSON value.

        Debezium repeats one schema on every record of a table, so the schema part of the last
        message is tried first, compared in place: a cached part holds no ``,"payload":`` (it
        ended at the first one), so when the message has that part at 10, followed by the
        separator, the first separator is there -- the same split as searching for it.
        """
        if type(data) is not bytes or not data.startswith(self._SCHEMA_HEAD) or not self._schema_bytes_cache:
            return None
        if data[-1:] != b"}":
            return None
        last = self._last_schema_part
        if last is not None and data.startswith(last[0], 10) and data.startswith(self._PAYLOAD_SEP,
                                                                                  i := 10 + len(last[0])):
            plan = last[1]
        else:
            i = data.find(self._PAYLOAD_SEP, 10)
            if i < 0:
                return None
            part = data[10:i]
            hit = self._schema_bytes_cache.get(part)
            if hit is None:
                return None
            plan = hit
            self._last_schema_part = (part, hit)
        try:
            payload = orjson.loads(data[i + 11 : -1])
        except orjson.JSONDecodeError:
            return None  # the full parse reports the error
        if type(payload) is not dict:
            return None
        return plan, payload

    def _remember_schema_part(self, data: Any, wire_schema: Any, plan: tuple[TableSchema, Any]) -> None:
        if type(data) is not bytes or not data.startswith(self._SCHEMA_HEAD):
            return
        i = data.find(self._PAYLOAD_SEP, 10)
        if i < 0:
            return
        part = data[10:i]
        try:
            if orjson.loads(part) != wire_schema:
                return
        except orjson.JSONDecodeError:
            return
        if len(self._schema_bytes_cache) >= 256:
            self._schema_bytes_cache.clear()
        self._schema_bytes_cache[part] = plan
        self._last_schema_part = (part, plan)

    def decode_value(
        self,
        data: bytes | str | None,
        schema: TableSchema | None = None,
        *,
        place: PositionHook | None = None,
    ) -> ChangeEvent:
        """Parse value bytes into a ChangeEvent.

        Messages with an embedded ``schema`` are decoded by it. Schemaless messages are
        decoded by ``schema``; without one, row values stay raw JSON types. The event's
        key is taken from the row (``schema.key`` or the embedded ``kf.key``); use
        ``decode_record`` to take it from the record key instead. ``place`` gives the event its
        position from the one its source block names (None when it names none, else an error).
        """
        return self.decode_envelope(data, schema, place=place)[0]

    def decode_envelope(
        self,
        data: bytes | str | None,
        schema: TableSchema | None = None,
        *,
        place: PositionHook | None = None,
        parsed: dict[str, Any] | None = None,
        source_name: str | None = None,
    ) -> tuple[ChangeEvent, TableSchema | None]:
        """``decode_value`` that also returns the table schema the message's ``schema`` part
        describes (None without one). ``parsed``: the message already parsed (and edited) by the
        caller, decoded instead of ``data``; ``source_name``: the source's name to give the event."""
        try:
            return self._decode_value(data, schema, place, parsed, source_name)
        except NumericDecimal:
            # a Connect Decimal written as a JSON number (decimal.format=NUMERIC): parse exactly
            import json

            try:
                exact = json.loads(data, parse_float=Decimal)  # type: ignore[arg-type]
            except ValueError as e:
                raise ValidationError(f"value: malformed JSON ({e})") from None
            if parsed is not None:  # keep the caller's edits: take only the exact numbers
                exact = _merge_exact(parsed, exact)
            return self._decode_value(data, schema, place, exact, source_name)

    def split_envelope(self, data: Any) -> tuple[TableSchema, Callable[[Any, str], Any], dict[str, Any]] | None:
        """For ``{"schema": S, "payload": P}`` bytes whose schema part S this codec decoded before: (the
        table S describes, its row decoder, P parsed); None for anything else (``decode_envelope`` reads
        those). The row decoder, ``rows(row, "after")``, decodes a row in place as ``decode_envelope`` does."""
        fast = self._split_schema_part(data)
        if fast is None:
            return None
        (table, rows), payload = fast
        return table, rows, payload

    def envelope_meta(
        self, payload: Mapping[str, Any], *, place: PositionHook | None = None, source_name: str | None = None,
    ) -> tuple[SourceInfo, int, int | None, int | None, TransactionInfo | None]:
        """An envelope's source block, ``ts_ms``, ``ts_us``, ``ts_ns`` and transaction block, decoded and
        checked as ``decode_envelope`` does (in its order; the op and rows are the caller's)."""
        source = _decode_source(payload.get("source"), place, source_name)
        ts_ms, ts_us, ts_ns = _envelope_times(payload, source)
        return source, ts_ms, ts_us, ts_ns, _decode_transaction(payload.get("transaction"))

    def _decode_value(
        self, data: Any, schema: TableSchema | None, place: PositionHook | None, parsed: Any,
        source_name: str | None = None,
    ) -> tuple[ChangeEvent, TableSchema | None]:
        if data is None:
            raise ValidationError("value: null (a tombstone) is not a change event")
        table: TableSchema | None = schema
        wire_table: TableSchema | None = None
        fast = self._split_schema_part(data) if parsed is None else None
        if fast is not None:  # a schema seen before: parse only the payload
            (table, rows), payload = fast
            wire_table = table
            if schema is not None and not table.key and schema.key:
                table = schema
        else:
            if parsed is not None:
                obj = parsed
            else:
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError as e:
                    raise ValidationError(f"value: malformed JSON ({e})") from None
            if type(obj) is not dict:
                raise ValidationError(f"value: expected a JSON object (Debezium envelope), got {short_repr(obj)}")
            if "payload" in obj and "schema" in obj and len(obj) == 2:
                payload = obj["payload"]
                wire_schema = obj["schema"]
                if wire_schema is not None:
                    table, rows = self._plan_from_connect(wire_schema)
                    wire_table = table
                    if parsed is None:
                        self._remember_schema_part(data, wire_schema, (table, rows))
                    if schema is not None and not table.key and schema.key:
                        table = schema
                else:
                    rows = self._dec_plan(schema) if schema is not None else _raw_rows
                if type(payload) is not dict:
                    raise ValidationError(
                        f"payload: expected a JSON object (Debezium envelope), got {short_repr(payload)}"
                    )
            else:
                payload = obj
                rows = self._dec_plan(schema) if schema is not None else _raw_rows

        op_code = payload.get("op")
        op = _OPS.get(op_code) if type(op_code) is str else None
        if op is None:
            if "op" not in payload:
                raise ValidationError("op: missing (not a Debezium change event envelope?)")
            raise ValidationError(f"op: expected one of {list(_OPS)}, got {op_code!r}")
        source = _decode_source(payload.get("source"), place, source_name)
        try:
            before = rows(payload.get("before"), "before")
            after = rows(payload.get("after"), "after")
        except ValidationError as e:
            raise ValidationError(
                f"{e} (op {op.value!r} on {source.name}/{source.table} at position {source.position})"
            ) from None
        ts_ms, ts_us, ts_ns = _envelope_times(payload, source)
        unavailable = payload.get("kf_unavailable") or ()
        if unavailable:
            if type(unavailable) is not list or not all(type(u) is str for u in unavailable):
                raise ValidationError(f"kf_unavailable: expected a list of column names, got {short_repr(unavailable)}")
            unavailable = tuple(unavailable)
        key = None
        if table is not None and table.key:
            row = after if after is not None else before
            if row is not None:
                try:
                    key = {k: row[k] for k in table.key}
                except KeyError:
                    key = None
        return ChangeEvent(
            op=op,
            key=key,
            before=before,
            after=after,
            source=source,
            ts_ms=ts_ms,
            transaction=_decode_transaction(payload.get("transaction")),
            unavailable=unavailable,
            ts_us=ts_us,
            ts_ns=ts_ns,
        ), wire_table

    def decode_record(
        self, key: bytes | None, value: bytes | None, schema: TableSchema | None = None
    ) -> ChangeEvent | None:
        """A log record -> ChangeEvent, with the key from the record key; None for a tombstone."""
        if value is None:
            return None
        event = self.decode_value(value, schema)
        k = self.decode_key(key, schema)
        if k is not None and k != event.key:
            from dataclasses import replace

            event = replace(event, key=k)
        return event

    # -- keys --------------------------------------------------------------------------------------
    def encode_key(self, key: Mapping[str, Any] | None, schema: TableSchema | None = None) -> bytes | None:
        """Record key bytes: the key columns in key order (``{"id": 1}`` when schemaless).

        None (a table without a key) gives None. Pass the schema: without it values are
        encoded by their Python type and ``include_schema`` is impossible.
        """
        if key is None:
            return None
        if not isinstance(key, Mapping):
            raise ValidationError(f"key: expected a dict of key column -> value, got {short_repr(key)}")
        if schema is None:
            if self.include_schema:
                raise ValidationError("key: include_schema=True needs the table schema to render the key schema")
            return orjson.dumps({k: _encode_any(v) for k, v in key.items()})
        plan = schema._cache.get(("key", *self._enc_key))
        if plan is None:
            kcols = schema.key_schema().columns
            encs = tuple((c.name, make_encoder(c, self.decimal_mode), c) for c in kcols)
            frag = (
                orjson.Fragment(orjson.dumps(connect_key_schema(schema, self.decimal_mode)))
                if self.include_schema and schema.key
                else None
            )
            plan = schema._cache[("key", *self._enc_key)] = (encs, frag, frozenset(schema.key))
        encs, frag, names = plan
        if len(key) != len(names) or not names.issuperset(key):
            missing = sorted(names - set(key))
            extra = sorted(set(key) - names)
            what = f"missing key column(s) {missing}" if missing else f"not key column(s) {extra}"
            raise ValidationError(f"key: {what} of {schema.name!r} (key: {list(schema.key)})")
        out = {}
        for name, enc, col in encs:
            v = key[name]
            try:
                out[name] = v if (enc is None or v is None) else enc(v)
            except Exception:
                raise ValidationError(
                    f"key.{name}: expected {describe(col, default_wire(col, self.decimal_mode))}, got {short_repr(v)}"
                ) from None
        try:
            if frag is not None:
                return orjson.dumps({"schema": frag, "payload": out})
            return orjson.dumps(out)
        except orjson.JSONEncodeError as e:
            raise ValidationError(f"key: cannot be encoded as JSON ({e})") from None

    def decode_key(self, data: bytes | str | None, schema: TableSchema | None = None) -> dict[str, Any] | None:
        """Record key bytes -> the key dict (None for a null key)."""
        if data is None:
            return None
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise ValidationError(f"key: malformed JSON ({e})") from None
        dec: Callable[[Any, str], Any] | None = None
        if type(obj) is dict and "payload" in obj and "schema" in obj and len(obj) == 2:
            wire_schema, obj = obj["schema"], obj["payload"]
            if wire_schema is not None:
                dec = self._plan_from_connect(wire_schema)[1]
        if obj is None:
            return None
        if type(obj) is not dict:
            raise ValidationError(f"key: expected a JSON object of key columns, got {short_repr(obj)}")
        if dec is None and schema is not None:
            ks = schema._cache.get("key_schema")
            if ks is None:
                ks = schema._cache["key_schema"] = schema.key_schema()
            dec = self._dec_plan(ks)
        return obj if dec is None else dec(obj, "key")

    def tombstone_for(self, event: ChangeEvent, schema: TableSchema | None = None) -> tuple[bytes | None, None]:
        """(key bytes, None): the record that lets compaction remove the event's key."""
        key = event.key
        if key is None and schema is not None and schema.key:
            row = event.before if event.before is not None else event.after
            if row is not None and all(k in row for k in schema.key):
                key = {k: row[k] for k in schema.key}
        if key is None:
            raise ValidationError("key: the event has no key, so there is nothing for a tombstone to remove")
        return self.encode_key(key, schema), None


_DEFAULT_CODEC = EventCodec()
_OP_HEADERS = {o: (("kf.op", o.value.encode()),) for o in Op}


def encode_row_values(schema: TableSchema, row: dict[str, Any], decimal_mode: str = "string") -> dict[str, Any]:
    """A row's values in their JSON form (see ``EventCodec.encode_row_values``)."""
    codec = _DEFAULT_CODEC if decimal_mode == "string" else EventCodec(decimal_mode)
    return codec.encode_row_values(schema, row)


def decode_row_values(schema: TableSchema, row: dict[str, Any], decimal_mode: str = "string") -> dict[str, Any]:
    """Row values from their JSON form back to Python values."""
    codec = _DEFAULT_CODEC if decimal_mode == "string" else EventCodec(decimal_mode)
    return codec.decode_row_values(schema, row)


def tombstone_for(
    event: ChangeEvent, schema: TableSchema | None = None, codec: EventCodec | None = None
) -> tuple[bytes | None, None]:
    """(key bytes, None) for the tombstone that follows a delete (see EventCodec.tombstone_for)."""
    return (codec or _DEFAULT_CODEC).tombstone_for(event, schema)


def op_header(event: ChangeEvent) -> tuple[tuple[str, bytes], ...]:
    """Record headers carrying the op: ``(("kf.op", b"c"),)``."""
    return _OP_HEADERS[event.op]


def topic_name(source: SourceInfo) -> str:
    """``<source>.<schema>.<table>`` (PostgreSQL) or ``<source>.<db>.<table>`` (MySQL)."""
    return f"{source.name}.{source.schema if source.schema is not None else source.db}.{source.table}"
