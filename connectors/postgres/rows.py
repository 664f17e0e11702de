"""Per-table codecs: schema, value converters and the fast Debezium JSON encoding.

A :class:`TableCodec` is built once per table (and again when a Relation message
changes the table's shape). It holds tuples of converters indexed like the
pgoutput tuple, so a row is converted with one pass over parallel tuples and no
type dispatch per value:

* ``py``: text -> the Python value of the event model (``ChangeEvent`` rows);
* ``js``: text -> the value's Debezium JSON form, i.e. exactly what
  ``EventCodec.encode_row_values`` makes of the Python value, computed directly
  from the text where that is cheaper (ints, strings, UUIDs, decimals in string
  mode need no intermediate object).

:meth:`TableCodec.encode_reads` turns a snapshot chunk (``COPY ... TO STDOUT`` text lines) into
``op=r`` records a column at a time, with the same per-value expressions where a column's values
cannot be taken in bulk; the bytes are those of the per-row path
(``tests/connectors/postgres/test_pg_snapshot_encoder.py``).

:meth:`TableCodec.encode_value` assembles the envelope bytes by formatting
pre-serialised pieces around one ``orjson.dumps`` of the row; the result is
byte-identical to ``EventCodec.encode_value`` of the equivalent ``ChangeEvent``
(``tests/connectors/postgres/test_pg_types.py`` checks that for every type).
"""

from __future__ import annotations

import datetime as _dt
import re
import struct
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import Any

import numpy as np
import orjson

from kappaflow.connectors.postgres import types as t
from kappaflow.connectors.postgres.decoder import UNCHANGED, RelColumn
from kappaflow.connectors.postgres.slots import ColumnInfo, TableInfo
from kappaflow.connectors.postgres.toast import TOAST_ROW_MIN, ToastState, toast_min
from kappaflow.connectors.postgres.types import Converter, TypeLookup
from kappaflow.errors import ValidationError
from kappaflow.events import Column, EventCodec, FieldType, TableSchema
from kappaflow.events.json import SOURCE_VERSION
from kappaflow.events.values import _enc_json, make_encoder

__all__ = ["ColumnCodec", "TableCodec", "column_codec", "copy_fields", "read_value"]

_u32 = struct.Struct(">I").unpack_from
# bytes that JSON strings must escape (orjson escapes exactly these; it writes other UTF-8 raw)
_JSON_ESCAPE = re.compile(rb'[\x00-\x1f"\\]')
_EPOCH = _dt.datetime(1970, 1, 1)
_US = _dt.timedelta(microseconds=1)
_EPOCH_ORDINAL = 719163

# -- fast text -> JSON converters (identical output to codec(py(text))) -------------------------

def _js_float(b: bytes) -> Any:
    f = float(b)
    if f - f == 0:
        return f
    if f != f:
        return "NaN"
    return "Infinity" if f > 0 else "-Infinity"


def _js_date(b: bytes) -> int:
    if b[:1] == b"-" or b[:1] == b"i":
        return t._date(b).toordinal() - _EPOCH_ORDINAL
    return _dt.date.fromisoformat(b.decode()).toordinal() - _EPOCH_ORDINAL


def _js_timestamp(b: bytes) -> int:
    return (t._timestamp(b) - _EPOCH) // _US


def _js_time(b: bytes) -> int:
    v = t._time(b)
    return v.hour * 3_600_000_000 + v.minute * 60_000_000 + v.second * 1_000_000 + v.microsecond


def _js_timestamptz_slow(b: bytes) -> str:
    v = t._timestamptz(b)
    off = v.utcoffset()
    if off:
        v = v - off
    return v.replace(tzinfo=None).isoformat() + "Z"


def _js_timestamptz(b: bytes) -> str:
    """'2024-01-02 03:04:05.12+00' (TimeZone=UTC) -> '2024-01-02T03:04:05.120000Z' by slicing.

    Same text as ``datetime.isoformat() + "Z"`` (6 fraction digits, none when zero);
    anything unusual (BC, years > 9999, infinity, other offsets) takes the datetime path.
    """
    n = len(b)
    if n == 22 and b[19:] == b"+00" and b[4] == 45 and b[10] == 32:
        return b[:10].decode() + "T" + b[11:19].decode() + "Z"
    if 24 <= n <= 29 and b[-3:] == b"+00" and b[4] == 45 and b[10] == 32 and b[19] == 46:
        return b[:10].decode() + "T" + b[11:19].decode() + (b[19:-3] + b"00000")[:7].decode() + "Z"
    return _js_timestamptz_slow(b)


def _cached(conv: Converter) -> Converter:
    """One-entry cache: timestamps and dates often repeat row after row (now() in a batch)."""
    last_in: list[Any] = [None, None]

    def cached(b: bytes) -> Any:
        if b == last_in[0]:
            return last_in[1]
        v = conv(b)
        last_in[0] = b
        last_in[1] = v
        return v

    return cached


# "19 digits in a row" (t._BIGINT: an integer orjson may not hold exactly) without a regex:
# digits mapped to "0", then one substring search -- a fraction of the regex's cost on long texts.
_DIGITS_TO_0 = bytes.maketrans(b"123456789", b"000000000")
_19_DIGITS = b"0" * 19


def _js_json(b: bytes) -> str:
    """json/jsonb text -> the codec's JSON string (parsed and re-serialised compactly)."""
    if len(b) < 19 or _19_DIGITS not in b.translate(_DIGITS_TO_0):
        return orjson.dumps(orjson.loads(b)).decode()
    return _enc_json(t._json(b))


def _json_fragment(b: bytes) -> bytes:
    """json/jsonb text -> ``orjson.dumps(_js_json(b))`` without the intermediate str.

    orjson's compact output has no raw control characters, so quoting it as a JSON
    string only needs backslashes and quotes escaped.
    """
    if len(b) < 19 or _19_DIGITS not in b.translate(_DIGITS_TO_0):
        compact = orjson.dumps(orjson.loads(b))
        return b'"' + compact.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"'
    return orjson.dumps(_js_json(b))


def _tstz_fragment(b: bytes) -> bytes:
    """``orjson.dumps(_js_timestamptz(b))`` without the intermediate str (the same slicing)."""
    n = len(b)
    if n == 22 and b[19:] == b"+00" and b[4] == 45 and b[10] == 32:
        return b'"' + b[:10] + b"T" + b[11:19] + b'Z"'
    if 24 <= n <= 29 and b[-3:] == b"+00" and b[4] == 45 and b[10] == 32 and b[19] == 46:
        return b'"' + b[:10] + b"T" + b[11:19] + (b[19:-3] + b"00000")[:7] + b'Z"'
    return orjson.dumps(_js_timestamptz_slow(b))


# -- COPY ... TO STDOUT text lines (snapshots) ------------------------------------------------------

_COPY_ESCAPE = re.compile(rb"\\(.)", re.S)
_COPY_CHARS = {b"\\": b"\\", b"t": b"\t", b"n": b"\n", b"r": b"\r", b"b": b"\b", b"f": b"\f", b"v": b"\v"}
_NULL = b"\\N"


def _unescape(field: bytes) -> bytes:
    """Undo COPY TO's text-format escapes (backslash, tab, newline, CR, BS, FF, VT)."""
    return _COPY_ESCAPE.sub(lambda m: _COPY_CHARS.get(m.group(1), m.group(1)), field)


def copy_fields(line: bytes) -> list[bytes | None]:
    """One ``COPY ... TO STDOUT`` text line (newline included) -> its values, None for NULL."""
    return [None if f == _NULL else (_unescape(f) if b"\\" in f else f) for f in line[:-1].split(b"\t")]


_READ = b'{"before":null,"after":%s,"source":%s%d,"snapshot":true}},"transaction":null,"op":"r",%s}'


def read_value(after: bytes, src_prefix: bytes, index: int, times: bytes) -> bytes:
    """The ``op=r`` envelope of a snapshot row: ``after`` (row JSON), the source block's prefix up to
    the kf_pos index (:meth:`TableCodec.source_prefix`), the index, and the ``"ts_ms":..`` triple."""
    return _READ % (after, src_prefix, index, times)


# How a column's JSON fragments are made a column at a time (TableCodec.encode_reads); every kind
# falls back to the per-value expression of _fragment_code when its bulk form does not apply.
_RAW, _QUOTED, _TEXT, _BOOL, _FLOAT, _DISTINCT, _TSTZ, _MAP = range(8)
_BOOL_FRAG = {b"t": b"true", b"f": b"false"}
# what a text column (joined by tabs, no COPY escapes) must not hold to be quoted as it is: the bytes
# JSON escapes (orjson writes all other UTF-8 raw) but the tab, which cannot be in unescaped COPY text
_TEXT_BAD = re.compile(rb'[\x00-\x08\x0a-\x1f"\\]')


# timestamptz texts (TimeZone=UTC) joined by tabs: a fraction of 1-5 digits (trailing zeros dropped), and
# the whole column when every value is "YYYY-MM-DD HH:MM:SS[.ffffff]+00" (then its JSON is a few replaces)
_TSTZ_SHORT = re.compile(rb"\.(\d{1,5})\+00")
_TSTZ_COLUMN = re.compile(rb"(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{6})?\+00\t)*")


def _pad_fraction(m: re.Match[bytes]) -> bytes:
    return b"." + m.group(1).ljust(6, b"0") + b"+00"


def _utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


def _bulk(kind: int, one: Callable[[bytes], bytes], col: list[bytes]) -> list[bytes]:
    """JSON fragments of a column's values: none NULL, none with a COPY escape (no backslash)."""
    if kind == _RAW or not col:
        return col
    if kind == _QUOTED:
        return (b'"' + b'"\t"'.join(col) + b'"').split(b"\t")
    if kind == _TEXT:
        j = b"\t".join(col)
        if not _TEXT_BAD.search(j) and (j.isascii() or _utf8(j)):
            return (b'"' + j.replace(b"\t", b'"\t"') + b'"').split(b"\t")
    elif kind == _BOOL:
        try:
            return list(map(_BOOL_FRAG.__getitem__, col))
        except KeyError:
            pass
    elif kind == _FLOAT:
        try:
            out = orjson.dumps(list(map(float, col)))
        except ValueError:
            out = b"null"
        if b"null" not in out:  # NaN and infinities: one at a time ("NaN" strings)
            return out[1:-1].split(b",")
    elif kind == _DISTINCT:
        memo = {v: one(v) for v in set(col)}
        return list(map(memo.__getitem__, col))
    elif kind == _TSTZ:
        # what _tstz_fragment makes of each value: "YYYY-MM-DDTHH:MM:SS[.ffffff]Z", fraction padded to 6
        j = b"\t".join(col) + b"\t"
        if b"." in j:
            j = _TSTZ_SHORT.sub(_pad_fraction, j)
        if _TSTZ_COLUMN.fullmatch(j):
            return (b'"' + j[:-1].replace(b" ", b"T").replace(b"+00", b'Z"').replace(b"\t", b'\t"')).split(b"\t")
    return list(map(one, col))


def _column_fragments(kind: int, one: Callable[[bytes], bytes], col: list[bytes], escaped: bool) -> list[bytes]:
    """JSON fragments of one column's COPY text values (``escaped``: the chunk holds a backslash)."""
    if escaped:
        j = b"\t".join(col)
        slashes = j.count(b"\\")
        if slashes:
            if slashes != j.count(_NULL):  # COPY escapes: value by value (a NULL is a whole field)
                return [b"null" if f == _NULL else one(_unescape(f) if b"\\" in f else f) for f in col]
            if kind == _RAW:
                return j.replace(_NULL, b"null").split(b"\t")
            nxt = iter(_bulk(kind, one, [f for f in col if f != _NULL])).__next__
            return [b"null" if f == _NULL else nxt() for f in col]
    return _bulk(kind, one, col)


def _fragment(conv: Converter, *, cache: bool) -> Converter:
    """text -> the value's JSON bytes; optionally remembering the last one (repeated timestamps)."""
    dumps = orjson.dumps
    if not cache:
        def frag(b: bytes) -> bytes:
            return dumps(conv(b))

        return frag
    last: list[Any] = [None, None]

    def cached(b: bytes) -> bytes:
        if b == last[0]:
            return last[1]
        v = dumps(conv(b))
        last[0] = b
        last[1] = v
        return v

    return cached


def _compose(enc: Callable[[Any], Any], py: Converter) -> Converter:
    def conv(b: bytes) -> Any:
        return enc(py(b))

    return conv


@dataclass(frozen=True, slots=True)
class ColumnCodec:
    name: str
    column: Column
    py: Converter
    js: Converter
    toast_min: int | None  # None: never stored out of line; else min text length that could be


def _numeric_typmod(typmod: int) -> tuple[int | None, int | None]:
    if typmod < 4:
        return None, None
    precision = ((typmod - 4) >> 16) & 0xFFFF
    scale = (((typmod - 4) & 0x7FF) ^ 1024) - 1024  # PostgreSQL 15 allows negative scales
    return precision, scale


# Built-in types whose column type follows from the OID alone (typmod only adds detail elsewhere).
_PLAIN_TYPES: dict[int, FieldType] = {
    t.INT2: FieldType.INT16,
    t.INT4: FieldType.INT32,
    t.INT8: FieldType.INT64,
    t.OID: FieldType.INT64,
    t.FLOAT4: FieldType.FLOAT32,
    t.FLOAT8: FieldType.FLOAT64,
    t.BOOL: FieldType.BOOLEAN,
    t.BYTEA: FieldType.BYTES,
    t.DATE: FieldType.DATE,
    t.TIME: FieldType.TIME,
    t.TIMESTAMP: FieldType.TIMESTAMP,
    t.TIMESTAMPTZ: FieldType.TIMESTAMPTZ,
    t.INTERVAL: FieldType.INTERVAL,
    t.UUID: FieldType.UUID,
    t.JSON: FieldType.JSON,
    t.JSONB: FieldType.JSON,
}


def _field(name: str, oid: int, typmod: int, optional: bool, native: str | None,
           lookup: TypeLookup | None) -> tuple[Column, Converter]:
    """Column (event model) and text->Python converter for a type OID."""
    ft: FieldType
    kw: dict[str, Any] = {}
    py: Converter = t.converter_for(oid, lookup)
    plain = _PLAIN_TYPES.get(oid)
    if plain is not None:
        ft = plain
    elif oid == t.NUMERIC:
        precision, scale = _numeric_typmod(typmod)
        if scale is None:
            ft = FieldType.VARIABLE_DECIMAL
        else:
            ft = FieldType.DECIMAL
            kw = {"scale": scale, "precision": precision}
    elif oid == t.BIT and typmod == 1:
        ft, py = FieldType.BOOLEAN, t._bit1
    elif oid in (t.BIT, t.VARBIT):
        ft = FieldType.BITS
        if typmod > 0:
            kw = {"length": typmod}
    elif oid in t.SCALARS:
        ft = FieldType.STRING
    else:
        elem = t.BUILTIN_ARRAYS.get(oid)
        info = lookup(oid) if lookup is not None and elem is None else None
        if elem is None and info is not None and info.elem:
            elem = info.elem
        if elem is not None:
            item, _ = _field("item", elem, -1, True, None, lookup)
            ft = FieldType.ARRAY
            kw = {"items": item}
        elif info is not None and info.typtype == "d":
            base, _ = _field(name, info.base, info.base_typmod, optional, native or info.name, lookup)
            return base, py
        elif info is not None and info.typtype == "e":
            ft = FieldType.ENUM
            kw = {"allowed": info.labels}
        else:
            ft = FieldType.STRING
    return Column(name, ft, optional=optional, native_type=native, **kw), py


def _fast_js(col: Column, oid: int, py: Converter, decimal_mode: str) -> Converter:
    ft = col.type
    if ft in (FieldType.INT16, FieldType.INT32, FieldType.INT64) and oid in (t.INT2, t.INT4, t.INT8, t.OID):
        return int
    if ft is FieldType.STRING and py is t._text:
        return t._text
    if ft is FieldType.UUID or ft is FieldType.ENUM:
        return t._text
    if ft is FieldType.BOOLEAN:
        return py
    if ft in (FieldType.DECIMAL, FieldType.VARIABLE_DECIMAL) and decimal_mode == "string" and oid == t.NUMERIC:
        return t._text
    if ft in (FieldType.FLOAT32, FieldType.FLOAT64):
        return _js_float
    if ft is FieldType.DATE and py is t._date:
        return _cached(_js_date)
    if ft is FieldType.TIMESTAMP and py is t._timestamp:
        return _cached(_js_timestamp)
    if ft is FieldType.TIMESTAMPTZ and py is t._timestamptz:
        return _cached(_js_timestamptz)
    if ft is FieldType.TIME and py is t._time:
        return _js_time
    if ft is FieldType.JSON and py is t._json:
        return _js_json
    if ft is FieldType.INTERVAL and py is t._interval:
        return t.interval_micros
    enc = make_encoder(col, decimal_mode)
    return py if enc is None else _compose(enc, py)


def column_codec(name: str, oid: int, typmod: int, *, optional: bool = True, storage: str = "x",
                 native: str | None = None, lookup: TypeLookup | None = None,
                 decimal_mode: str = "string") -> ColumnCodec:
    if native is None:
        native = t.BUILTIN_NAMES.get(oid)
        if native is None and oid in t.BUILTIN_ARRAYS:
            native = "_" + t.BUILTIN_NAMES.get(t.BUILTIN_ARRAYS[oid], "unknown")
        if native is None and lookup is not None:
            info = lookup(oid)
            native = info.name if info is not None else None
    col, py = _field(name, oid, typmod, optional, native, lookup)
    return ColumnCodec(name, col, py, _fast_js(col, oid, py, decimal_mode), toast_min(oid, storage))


class TableCodec(ToastState):
    """Everything needed to turn one table's pgoutput/snapshot tuples into log records."""

    def __init__(self, *, source: str, db: str, schema: str, table: str, columns: Sequence[ColumnCodec],
                 key: Sequence[str], codec: EventCodec, relid: int = 0, replica_identity: str = "d",
                 type_oids: Sequence[int] = (), typmods: Sequence[int] = (), track_toast: bool = True) -> None:
        self.source = source
        self.db = db
        self.pg_schema = schema
        self.table = table
        self.qualified = f"{schema}.{table}"
        self.topic = f"{source}.{schema}.{table}"
        self.relid = relid
        self.replica_identity = replica_identity
        self.columns = tuple(columns)
        self.type_oids = tuple(type_oids)
        # the type modifiers (numeric precision/scale, varchar length): ALTER ... TYPE numeric(12,4) keeps
        # the OID, changes the decimal's scale, so a shape is (name, OID, modifier) per column
        self.typmods = tuple(typmods) if typmods else (-1,) * len(self.type_oids)
        self.names = tuple(c.name for c in self.columns)
        index = {n: i for i, n in enumerate(self.names)}
        missing = [k for k in key if k not in index]
        if missing:
            raise ValidationError(f"table {self.qualified}: key column(s) {missing} are not among its columns "
                                  f"{list(self.names)}")
        self.key = tuple(key)
        self.key_idx = tuple(index[k] for k in self.key)
        self.schema = TableSchema(self.topic, tuple(c.column for c in self.columns), self.key)
        self.codec = codec
        self.py = tuple(c.py for c in self.columns)
        self.js = tuple(c.js for c in self.columns)
        self.init_toast_state(tuple(c.toast_min for c in self.columns), track_toast)
        # set by the capture for tables whose inserted rows a RecordMapper turns into records
        self.mapper: Any = None
        self._single_key = len(self.key_idx) == 1
        self.ident_idx: tuple[int, ...] = self.key_idx
        self.fast = self._build_fast()
        self.fast_json = self._build_fast_json()
        self.values_json = self._build_values_json()
        self._reads: tuple[list[tuple[int, Callable[[bytes], bytes]]], bytes, bytes] | None = None
        head = orjson.dumps({"version": SOURCE_VERSION, "connector": "postgresql", "name": source})[:-1]
        self._src_head = head + b',"ts_ms":'
        self._src_db = b',"db":' + orjson.dumps(db) + b',"sequence":"['
        self._src_mid = b',"schema":' + orjson.dumps(schema) + b',"table":' + orjson.dumps(table) + b',"txId":'

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_table_info(cls, info: TableInfo, *, source: str, db: str, codec: EventCodec,
                        lookup: TypeLookup | None) -> TableCodec:
        cols = [
            column_codec(c.name, c.type_oid, c.typmod, optional=not c.not_null, storage=c.storage,
                         native=c.type_name, lookup=lookup, decimal_mode=codec.decimal_mode)
            for c in info.columns
        ]
        return cls(source=source, db=db, schema=info.schema, table=info.name, columns=cols, key=info.key,
                   codec=codec, relid=info.oid, replica_identity=info.replica_identity,
                   type_oids=[c.type_oid for c in info.columns], typmods=[c.typmod for c in info.columns])

    @classmethod
    def from_relation(cls, rel_columns: Sequence[RelColumn], *, info: TableInfo, relid: int, replica_identity: str,
                      source: str, db: str, codec: EventCodec, lookup: TypeLookup | None,
                      native_of: Callable[[int, int], str | None] | None = None) -> TableCodec:
        """The table's shape as the WAL describes it (a Relation message), enriched by the catalog.

        The Relation message is authoritative for which columns exist at this WAL
        position; nullability, storage and the native type name come from the catalog
        when it knows the column with the same type. The native name spells the type
        modifier ("numeric(8,2)"): when the catalog has moved on to another modifier (WAL
        read after an ``ALTER ... TYPE``), `native_of(oid, typmod)` (the server's
        ``format_type``) names the WAL's own, so re-reading old WAL records its real shape.
        """
        cols = []
        for rc in rel_columns:
            ci: ColumnInfo | None = info.column(rc.name)
            same = ci is not None and ci.type_oid == rc.type_oid
            native = ci.type_name if ci is not None and same and ci.typmod == rc.typmod else None
            if native is None and native_of is not None:
                native = native_of(rc.type_oid, rc.typmod)
            cols.append(column_codec(
                rc.name, rc.type_oid, rc.typmod,
                optional=not (ci.not_null if ci is not None and same else False),
                storage=ci.storage if ci is not None and same else "x",
                native=native,
                lookup=lookup, decimal_mode=codec.decimal_mode,
            ))
        names = {c.name for c in cols}
        key = tuple(k for k in info.key if k in names)
        if len(key) != len(info.key):
            raise ValidationError(
                f"table {info.qualified}: the WAL's Relation message lacks key column(s) "
                f"{[k for k in info.key if k not in names]} (columns now: {sorted(names)})")
        return cls(source=source, db=db, schema=info.schema, table=info.name, columns=cols, key=key, codec=codec,
                   relid=relid, replica_identity=replica_identity, type_oids=[c.type_oid for c in rel_columns],
                   typmods=[c.typmod for c in rel_columns])

    def _build_fast(self) -> Callable[[bytes, int], tuple[dict[str, Any], int, bool] | None]:
        """Generate a parser for this table's TupleData that converts while it parses.

        Unrolled per column (no per-value dispatch); handles text ('t') and NULL ('n')
        values. Returns ``(row, end, big)`` where ``big`` says a toastable value was long
        enough to be kept as keyed state, or None for anything else (unchanged TOAST,
        binary values, a different column count): the caller then takes the generic path,
        which also produces the precise error for malformed input.
        """
        n = len(self.names)
        env: dict[str, Any] = {"_u32": _u32}
        toast = dict(self.toast)
        lines = ["def fast(buf, pos):",
                 f"    if buf[pos] != {n >> 8} or buf[pos + 1] != {n & 0xFF}:",
                 "        return None",
                 "    pos += 2",
                 "    big = False"]
        for i, conv in enumerate(self.js):
            if conv is int:
                expr = "int(buf[pos + 5:e])"
            elif conv is t._text:
                expr = "buf[pos + 5:e].decode()"
            else:
                env[f"c{i}"] = conv
                expr = f"c{i}(buf[pos + 5:e])"
            lines += [
                "    k = buf[pos]",
                "    if k == 116:",
                "        e = pos + 5 + _u32(buf, pos + 1)[0]",
                f"        v{i} = {expr}",
            ]
            if i in toast:
                lines += [f"        if e - pos - 5 > {toast[i]}:", "            big = True"]
            lines += [
                "        pos = e",
                "    elif k == 110:",
                f"        v{i} = None",
                "        pos += 1",
                "    else:",
                "        return None",
            ]
        items = ", ".join(f"{name!r}: v{i}" for i, name in enumerate(self.names))
        lines.append(f"    return {{{items}}}, pos, big")
        exec(compile("\n".join(lines), f"<pgoutput row parser {self.qualified}>", "exec"), env)
        return env["fast"]

    def _fragment_code(self, env: dict[str, Any]) -> list[str]:
        """Per column, one Python expression turning its text ``r`` into its JSON bytes.

        Integers, numerics (string mode) and plain ASCII text need no conversion at all:
        their PostgreSQL text already is their JSON text (quoted for strings).
        """
        env.update({"_dumps": orjson.dumps, "_esc": _JSON_ESCAPE.search})
        decimal_string = self.codec.decimal_mode == "string"
        out = []
        for i, (conv, col) in enumerate(zip(self.js, self.columns, strict=True)):
            ft = col.column.type
            if conv is int:
                out.append("r")
            elif conv is t._text and ft in (FieldType.STRING, FieldType.ENUM, FieldType.UUID):
                out.append("b'\"' + r + b'\"' if r.isascii() and not _esc(r) else _dumps(r.decode())")
            elif conv is t._text and decimal_string and ft in (FieldType.DECIMAL, FieldType.VARIABLE_DECIMAL):
                out.append("b'\"' + r + b'\"'")
            elif conv is t._bool:
                out.append("b'true' if r == b't' else b'false'")
            elif conv is _js_json:
                env[f"c{i}"] = _json_fragment
                out.append(f"c{i}(r)")
            else:
                env[f"c{i}"] = _fragment(conv, cache=ft in (FieldType.DATE, FieldType.TIMESTAMP,
                                                           FieldType.TIMESTAMPTZ, FieldType.TIME))
                out.append(f"c{i}(r)")
        return out

    def _join_code(self, env: dict[str, Any]) -> tuple[str, str]:
        parts = []
        for i, name in enumerate(self.names):
            env[f"n{i}"] = (b"{" if i == 0 else b",") + orjson.dumps(name) + b":"
            parts += [f"n{i}", f"f{i}"]
        env["close"] = b"}"
        key_parts = []
        for j, i in enumerate(self.key_idx):
            env[f"k{j}"] = (b"{" if j == 0 else b",") + orjson.dumps(self.names[i]) + b":"
            key_parts += [f"k{j}", f"f{i}"]
        return f"b''.join(({', '.join(parts)}, close))", f"b''.join(({', '.join(key_parts)}, close))"

    def _build_fast_json(self) -> Callable[[bytes, int], tuple[bytes, bytes, int, bool] | None]:
        """Generate a parser that goes straight from TupleData to the row's JSON bytes.

        Returns ``(row_json, key_json, end, big)``: exactly ``orjson.dumps(json_row(raw))``
        and ``key_of(...)``, without building the dict. Same fallbacks as :meth:`_build_fast`.
        """
        n = len(self.names)
        env: dict[str, Any] = {"_u32": _u32}
        exprs = self._fragment_code(env)
        row, key = self._join_code(env)
        toast = dict(self.toast)
        # helpers and constants bound as default arguments: local lookups instead of global ones
        helpers = ", ".join(f"{k}={k}" for k in sorted(env) if not k.startswith("__"))
        lines = [f"def fast_json(buf, pos, {helpers}):",
                 f"    if buf[pos] != {n >> 8} or buf[pos + 1] != {n & 0xFF}:",
                 "        return None",
                 "    pos += 2",
                 "    big = False"]
        for i, expr in enumerate(exprs):
            lines += ["    if buf[pos] == 116:",
                      "        s = pos + 5",
                      "        pos = s + _u32(buf, pos + 1)[0]",
                      "        r = buf[s:pos]",
                      f"        f{i} = {expr}"]
            if i in toast:
                lines += [f"        if pos - s > {toast[i]}:", "            big = True"]
            lines += ["    elif buf[pos] == 110:",
                      f"        f{i} = b'null'",
                      "        pos += 1",
                      "    else:",
                      "        return None"]
        lines.append(f"    return {row}, {key}, pos, big")
        exec(compile("\n".join(lines), f"<pgoutput JSON row parser {self.qualified}>", "exec"), env)
        return env["fast_json"]

    def _build_values_json(self) -> Callable[[Sequence[bytes | None]], tuple[bytes, bytes, bool]]:
        """Like :meth:`_build_fast_json`, from a sequence of text values (None = NULL): snapshot rows."""
        env: dict[str, Any] = {}
        exprs = self._fragment_code(env)
        toast = dict(self.toast)
        lines = ["def values_json(vals):", "    big = False"]
        for i, expr in enumerate(exprs):
            lines += [f"    r = vals[{i}]",
                      "    if r is None:",
                      f"        f{i} = b'null'",
                      "    else:",
                      f"        f{i} = {expr}"]
            if i in toast:
                lines += [f"        if len(r) > {toast[i]}:", "            big = True"]
        row, key = self._join_code(env)
        lines.append(f"    return {row}, {key}, big")
        exec(compile("\n".join(lines), f"<snapshot JSON row builder {self.qualified}>", "exec"), env)
        return env["values_json"]

    def _build_reads(self) -> tuple[list[tuple[int, Callable[[bytes], bytes]]], bytes, bytes]:
        """Per column its bulk kind and per-value fragment function; the row and key templates.

        The per-value functions are the expressions of :meth:`_fragment_code` (those of the
        streaming path), so any value a bulk form does not take is encoded exactly as before.
        """
        env: dict[str, Any] = {}
        exprs = self._fragment_code(env)
        src = "\n".join(f"def one{i}(r):\n    return {e}" for i, e in enumerate(exprs))
        exec(compile(src, f"<snapshot value encoders {self.qualified}>", "exec"), env)
        decimal_string = self.codec.decimal_mode == "string"
        plan: list[tuple[int, Callable[[bytes], bytes]]] = []
        for i, (conv, cc) in enumerate(zip(self.js, self.columns, strict=True)):
            ft = cc.column.type
            one = env[f"one{i}"]
            if conv is int:
                kind = _RAW
            elif conv is t._text and ft in (FieldType.STRING, FieldType.ENUM, FieldType.UUID):
                kind = _TEXT
            elif conv is t._text and decimal_string and ft in (FieldType.DECIMAL, FieldType.VARIABLE_DECIMAL):
                kind = _QUOTED
            elif conv is t._bool:
                kind = _BOOL
            elif conv is _js_json:
                # value by value: map(orjson.dumps, map(orjson.loads, col)) measured 3x slower than this
                kind, one = _MAP, _json_fragment
            elif conv is _js_float:
                kind = _FLOAT
            elif ft is FieldType.TIMESTAMPTZ and cc.py is t._timestamptz:
                kind, one = _TSTZ, _tstz_fragment
            elif ft is FieldType.DATE:
                kind = _DISTINCT  # few distinct dates in a chunk, as a rule
            else:
                kind = _MAP
            plan.append((kind, one))

        def template(idx: Sequence[int]) -> bytes:  # '{"name":%s,"name":%s}', a literal % doubled
            return b"{" + b",".join(orjson.dumps(self.names[i]).replace(b"%", b"%%") + b":%s" for i in idx) + b"}"

        return plan, template(range(len(self.names))), template(self.key_idx)

    def _read_fragments(self, lines: Sequence[bytes]) -> tuple[list[list[bytes]], list[bytes]] | None:
        """Per column the JSON fragments of the lines' values, and the values (COPY text, row after
        row); None when the lines do not split into as many values as there are columns (the per-row
        path then says what is wrong)."""
        if self._reads is None:
            self._reads = self._build_reads()
        plan = self._reads[0]
        ncol = len(plan)
        n = len(lines)
        blob = b"".join(lines)
        # newlines and tabs inside values are escaped by COPY: one split gives every value
        flat = blob.replace(b"\n", b"\t").split(b"\t")
        if len(flat) != n * ncol + 1 or flat[-1] or not blob.endswith(b"\n"):
            return None
        escaped = b"\\" in blob
        end = n * ncol
        return [_column_fragments(kind, one, flat[i:end:ncol], escaped) for i, (kind, one) in enumerate(plan)], flat

    def encode_reads(self, lines: Sequence[bytes], src_prefix: bytes, times: bytes, first_index: int,
                     drop: Container[bytes] = frozenset()) -> tuple[list[bytes], list[bytes]]:
        """``op=r`` records of ``COPY ... TO STDOUT`` text lines: their keys and values.

        Byte for byte what :meth:`values_json` of :func:`copy_fields` and :func:`read_value` make line
        by line, but a column at a time: the lines are split once, each column's JSON fragments are
        made in bulk where its type allows (integers and string-mode numerics as they are, a text
        column quoted as a whole after one check, floats in one ``orjson.dumps``, a date once per
        distinct value, timestamps with a few operations on the whole column) and by the streaming
        path's per-value expressions otherwise, and each row is one ``%`` formatting of a per-table
        template. Rows whose key is in ``drop`` are left out; the kept rows take the indexes
        ``first_index, first_index + 1, ...``. Long rows are remembered in the TOAST state, as in
        streaming.
        """
        if not lines:
            return [], []
        try:
            split = self._read_fragments(lines)
        except Exception:  # a value the bulk forms cannot take: the per-row path raises the precise error
            split = None
        if split is None:
            return self._encode_reads_by_row(lines, src_prefix, times, first_index, drop)
        cols, flat = split
        assert self._reads is not None
        _plan, row_t, key_t = self._reads
        keys = list(map(key_t.__mod__, zip(*[cols[i] for i in self.key_idx], strict=True)))
        keep: list[bool] | None = None
        if drop:
            gone = list(map(drop.__contains__, keys))
            if any(gone):
                keep = [not g for g in gone]
                cols = [list(compress(c, keep)) for c in cols]
                keys = list(compress(keys, keep))
        # _READ with the row template and this chunk's constants in place (a literal % doubled);
        # one % per row measured 3x cheaper than joining all the rows' pieces at once
        value_t = (b'{"before":null,"after":' + row_t + b',"source":' + src_prefix.replace(b"%", b"%%")
                   + b'%d,"snapshot":true}},"transaction":null,"op":"r",' + times.replace(b"%", b"%%") + b"}")
        values = list(map(value_t.__mod__, zip(*cols, range(first_index, first_index + len(keys)), strict=True)))
        self._remember_reads(lines, keep, flat)
        return keys, values

    def _encode_reads_by_row(self, lines: Sequence[bytes], src_prefix: bytes, times: bytes, first_index: int,
                             drop: Container[bytes]) -> tuple[list[bytes], list[bytes]]:
        """:meth:`encode_reads` line by line (the reference, and the path for lines it cannot split)."""
        keys: list[bytes] = []
        values: list[bytes] = []
        keep: list[bool] = []
        index = first_index
        for line in lines:
            after, key, _big = self.values_json(copy_fields(line))
            if key in drop:
                keep.append(False)
                continue
            keep.append(True)
            keys.append(key)
            values.append(read_value(after, src_prefix, index, times))
            index += 1
        self._remember_reads(lines, keep)
        return keys, values

    def _remember_reads(self, lines: Sequence[bytes], keep: Sequence[bool] | None,
                        flat: Sequence[bytes] | None = None) -> None:
        """Keep the long values of the rows read (those kept) in the TOAST state, as streaming does.

        ``flat``: the lines' values, row after row; the rows with a toastable value longer than its
        minimum as COPY text (never shorter than the value) are the only ones looked at then.
        """
        if self.toast_state is None or max(map(len, lines)) < TOAST_ROW_MIN:
            return
        n = len(lines)
        rows: Sequence[int] = range(n)
        if flat is not None:
            ncol = len(self.names)
            long = np.fromiter(map(len, lines), np.int64, n) >= TOAST_ROW_MIN
            big = np.zeros(n, dtype=bool)
            for i, mn in self.toast:
                big |= np.fromiter(map(len, flat[i:n * ncol:ncol]), np.int64, n) > mn
            rows = np.flatnonzero(long & big).tolist()
        for r in rows:
            line = lines[r]
            if len(line) >= TOAST_ROW_MIN and (keep is None or keep[r]):
                raw = copy_fields(line)
                _after, key, big_row = self.values_json(raw)
                if big_row:
                    self.remember(key, self.json_row(raw), raw)

    def same_shape(self, rel_columns: Sequence[RelColumn]) -> bool:
        return len(rel_columns) == len(self.names) and all(
            rc.name == n and rc.type_oid == o and rc.typmod == m
            for rc, n, o, m in zip(rel_columns, self.names, self.type_oids, self.typmods, strict=True))

    # -- conversion --------------------------------------------------------------------------
    def json_row(self, raw: Sequence[Any]) -> dict[str, Any]:
        """JSON-form row from a raw tuple; UNCHANGED values are left in place for the caller."""
        out = {}
        try:
            for name, conv, v in zip(self.names, self.js, raw, strict=True):
                out[name] = v if (v is None or v is UNCHANGED) else conv(v)
        except ValueError as exc:
            if len(raw) != len(self.names):
                raise ValidationError(f"table {self.qualified}: row has {len(raw)} values, the relation "
                                      f"{len(self.names)} columns {list(self.names)}") from None
            raise self._convert_error(raw, "js") from exc
        except Exception as exc:
            raise self._convert_error(raw, "js") from exc
        return out

    def py_row(self, raw: Sequence[Any]) -> dict[str, Any]:
        """Python-value row (event model) from a raw tuple; UNCHANGED columns are omitted."""
        out = {}
        for name, conv, v in zip(self.names, self.py, raw, strict=True):
            if v is UNCHANGED:
                continue
            out[name] = None if v is None else t.convert_or_raise(conv, v, name, f"table {self.qualified}")
        return out

    def _convert_error(self, raw: Sequence[Any], which: str) -> ValidationError:
        convs = self.js if which == "js" else self.py
        for name, conv, v in zip(self.names, convs, raw, strict=False):
            if v is None or v is UNCHANGED:
                continue
            try:
                conv(v)
            except Exception as exc:
                shown = bytes(v[:60]).decode(errors="replace")
                native = self.schema.column(name).native_type
                return ValidationError(f"table {self.qualified}: column {name!r} ({native}): cannot convert "
                                       f"{shown!r}: {type(exc).__name__}: {exc}")
        return ValidationError(f"table {self.qualified}: cannot convert row")

    def key_of(self, row: dict[str, Any]) -> bytes:
        """Record key bytes (schemaless Debezium JSON key) from a JSON-form row."""
        if self._single_key:
            k = self.key[0]
            return orjson.dumps({k: row[k]})
        return orjson.dumps({k: row[k] for k in self.key})

    def key_from_raw(self, raw: Sequence[Any]) -> bytes:
        js = self.js
        if self._single_key:
            i = self.key_idx[0]
            return orjson.dumps({self.key[0]: js[i](raw[i])})
        return orjson.dumps({self.names[i]: js[i](raw[i]) for i in self.key_idx})

    # -- envelope ----------------------------------------------------------------------------
    def source_parts(self, ts_ms: int, snapshot: str, tx_id: int | None, lsn: int,
                     last_commit_lsn: int | None, xmin: int | None = None) -> tuple[bytes, bytes, bytes]:
        """The source block around the change's own LSN, which it holds twice (Debezium 2.6+ order)::

            a + b"%d" % change_lsn + b + b"%d" % change_lsn + c + b"%d" % index + b',"snapshot":false}}'

        ``sequence`` is Debezium's ``["<last committed LSN>","<this change's LSN>"]`` and ``lsn``
        the change's LSN; ``kf_pos`` holds the transaction's commit LSN and the change's index.
        ``xmin``: the slot's xmin when the connector reads it (Debezium's ``xmin.fetch.interval.ms``).
        """
        last = b"null" if not last_commit_lsn else b'\\"%d\\"' % last_commit_lsn
        a = b'%s%d,"snapshot":"%s"%s%s,\\"' % (self._src_head, ts_ms, snapshot.encode(), self._src_db, last)
        b = b'\\"]","ts_us":%d,"ts_ns":%d%s%s,"lsn":' % (
            ts_ms * 1000, ts_ms * 1_000_000, self._src_mid, b"null" if tx_id is None else b"%d" % tx_id)
        c = b',"xmin":%s,"kf_pos":{"kind":"pg","lsn":%d,"index":' % (b"null" if xmin is None else b"%d" % xmin, lsn)
        return a, b, c

    def source_prefix(self, ts_ms: int, snapshot: str, tx_id: int | None, lsn: int,
                      last_commit_lsn: int | None = None, change_lsn: int | None = None) -> bytes:
        """Source block up to the kf_pos index: ``... "kf_pos":{"kind":"pg","lsn":L,"index":``
        (the change's LSN ``change_lsn``, by default the commit LSN ``lsn``)."""
        a, b, c = self.source_parts(ts_ms, snapshot, tx_id, lsn, last_commit_lsn)
        cl = b"%d" % (lsn if change_lsn is None else change_lsn)
        return a + cl + b + cl + c


def encode_envelope(before: bytes, after: bytes, src_prefix: bytes, index: int, snapshot: bool, op: bytes,
                    ts_ms: int, tx: bytes, unavailable: Sequence[str] = ()) -> bytes:
    """Debezium envelope bytes from pre-serialised parts (see the module docstring)."""
    out = b'{"before":%s,"after":%s,"source":%s%d,"snapshot":%s}},"transaction":%s,"op":"%s","ts_ms":%d,' \
          b'"ts_us":%d,"ts_ns":%d' % (before, after, src_prefix, index, b"true" if snapshot else b"false", tx, op,
                                       ts_ms, ts_ms * 1000, ts_ms * 1_000_000)
    if unavailable:
        return out + b',"kf_unavailable":' + orjson.dumps(list(unavailable)) + b"}"
    return out + b"}"


def tx_block(tx_id: str, total_order: int, collection_order: int) -> bytes:
    return b'{"id":"%s","total_order":%d,"data_collection_order":%d}' % (tx_id.encode(), total_order,
                                                                          collection_order)
