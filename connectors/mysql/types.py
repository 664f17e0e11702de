"""MySQL/MariaDB column types -> kappaflow's change-event model, for the binlog and the snapshot alike.

Both capture paths describe a column with one normalised ``ColumnSpec`` (from a binlog
``TableMapEvent`` with ``binlog_row_metadata=FULL``, or from ``information_schema``), so
the schema of a table is the same whichever path saw it first, and a changed fingerprint
really means a changed table.

Type mapping (Debezium's MySQL mapping unless noted):

=====================================  ============================  =========================================
MySQL                                  FieldType                     Python value
=====================================  ============================  =========================================
TINYINT, SMALLINT, TINYINT UNSIGNED    INT16                         int
MEDIUMINT (+UNSIGNED), INT, SMALLINT U INT32                         int
INT UNSIGNED, BIGINT                   INT64                         int
BIGINT UNSIGNED                        DECIMAL(20,0)                 Decimal (Debezium's ``precise`` bigint
                                                                     mode: lossless, no wrap past 2^63)
DECIMAL(p,s)                           DECIMAL scale s               Decimal
FLOAT / DOUBLE                         FLOAT32 / FLOAT64             float (FLOAT: shortest float32 repr)
DATE                                   DATE                          date
TIME(fsp)                              INTERVAL                      timedelta (MySQL TIME spans
                                                                     -838:59:59..838:59:59, not a time of
                                                                     day; on the wire int64 micros like
                                                                     Debezium's MicroTime)
DATETIME(fsp)                          TIMESTAMP                     naive datetime (zone-less wall time,
                                                                     exactly as stored)
TIMESTAMP(fsp)                         TIMESTAMPTZ                   aware datetime in UTC
YEAR                                   YEAR                          int (0 for YEAR 0000)
BIT(1) / BIT(n)                        BOOLEAN / BITS                bool / bytes, little-endian like
                                                                     Debezium's io.debezium.data.Bits
ENUM / SET                             ENUM / SET                    str / frozenset[str]
JSON (MySQL type; MariaDB LONGTEXT     JSON                          parsed JSON (JSON_NULL for ``null``)
  with CHECK json_valid(col))
CHAR, VARCHAR, *TEXT                   STRING                        str
BINARY(n), VARBINARY, *BLOB, GEOMETRY  BYTES                         bytes (BINARY(n) right-padded with
                                                                     0x00 to n bytes, as SELECT returns it)
=====================================  ============================  =========================================

Time zones: the binlog stores TIMESTAMP as seconds since the epoch in UTC and
mysql-replication hands them over as naive UTC datetimes; the snapshot reads them
with the session ``time_zone='+00:00'``; both become aware UTC datetimes and are
written as ``ZonedTimestamp`` strings ending in ``Z``. DATETIME has no zone: it is
carried as the wall-clock value the application stored (``MicroTimestamp``), and no
server or session time zone is applied to it anywhere.

Zero dates (``0000-00-00``) become None in an optional column and the epoch in a NOT
NULL one, like Debezium.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import orjson

from kappaflow.errors import SourceError
from kappaflow.events.schema import Column, FieldType, TableSchema

try:  # numpy prints the shortest decimal that round-trips a float32 (pandas brings it)
    import numpy as _np

    def _f32(v: float) -> float:
        return float(repr(_np.float32(v)).removeprefix("np.float32(").removesuffix(")"))
except ImportError:  # pragma: no cover - numpy is always there with pandas
    import struct as _struct

    def _f32(v: float) -> float:
        exact = _struct.unpack("<f", _struct.pack("<f", v))[0]
        for digits in range(6, 10):
            r = float(f"{v:.{digits}g}")
            if _struct.unpack("<f", _struct.pack("<f", r))[0] == exact:
                return r
        return v


__all__ = [
    "ColumnSpec",
    "Converter",
    "binlog_converters",
    "snapshot_converters",
    "spec_from_information_schema",
    "spec_from_table_map",
    "table_schema",
]

UTC = _dt.UTC
_EPOCH_NAIVE = _dt.datetime(1970, 1, 1)
_EPOCH_UTC = _dt.datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_DATE = _dt.date(1970, 1, 1)
_US = _dt.timedelta(microseconds=1)

# binlog column type codes (mysql-replication's FIELD_TYPE)
_T_TINY, _T_SHORT, _T_LONG, _T_FLOAT, _T_DOUBLE = 1, 2, 3, 4, 5
_T_TIMESTAMP, _T_LONGLONG, _T_INT24, _T_DATE, _T_TIME, _T_DATETIME, _T_YEAR = 7, 8, 9, 10, 11, 12, 13
_T_VARCHAR, _T_BIT, _T_TIMESTAMP2, _T_DATETIME2, _T_TIME2 = 15, 16, 17, 18, 19
_T_JSON, _T_NEWDECIMAL, _T_ENUM, _T_SET = 245, 246, 247, 248
_T_TINY_BLOB, _T_MEDIUM_BLOB, _T_LONG_BLOB, _T_BLOB, _T_VAR_STRING, _T_STRING, _T_GEOMETRY = (
    249, 250, 251, 252, 253, 254, 255)

_INT_KINDS = {"tinyint", "smallint", "mediumint", "int", "bigint"}
_BINLOG_INT = {_T_TINY: "tinyint", _T_SHORT: "smallint", _T_INT24: "mediumint", _T_LONG: "int",
               _T_LONGLONG: "bigint"}
_TEXT_KINDS = {"tinytext": "text", "text": "text", "mediumtext": "text", "longtext": "text"}
_BLOB_KINDS = {"tinyblob": "blob", "blob": "blob", "mediumblob": "blob", "longblob": "blob"}


@dataclass(frozen=True, slots=True)
class ColumnSpec:
    """A column as both capture paths can see it (nothing the binlog cannot tell).

    ``kind`` is the normalised MySQL type family: tinyint..bigint, decimal, float,
    double, date, time, datetime, timestamp, year, bit, enum, set, json, char,
    varchar, text, binary, varbinary, blob, geometry.
    """

    name: str
    kind: str
    nullable: bool = True
    unsigned: bool = False
    precision: int | None = None  # decimal
    scale: int | None = None  # decimal
    fsp: int | None = None  # time/datetime/timestamp fractional digits
    bits: int | None = None  # bit(n)
    octets: int | None = None  # binary(n) byte length (for padding)
    values: tuple[str, ...] | None = None  # enum/set members

    def native_type(self) -> str:
        k = self.kind
        if k in _INT_KINDS:
            return f"{k} unsigned" if self.unsigned else k
        if k == "decimal":
            return f"decimal({self.precision},{self.scale})" + (" unsigned" if self.unsigned else "")
        if k in ("time", "datetime", "timestamp"):
            return f"{k}({self.fsp})" if self.fsp else k
        if k == "bit":
            return f"bit({self.bits})"
        if k == "binary":
            return f"binary({self.octets})"
        if k in ("float", "double") and self.unsigned:
            return f"{k} unsigned"
        return k

    def column(self) -> Column:
        """The kappaflow column for this MySQL column (see the module table)."""
        k, opt, native = self.kind, self.nullable, self.native_type()
        t: FieldType
        if k in _INT_KINDS:
            if k == "bigint" and self.unsigned:
                return Column(self.name, FieldType.DECIMAL, opt, scale=0, precision=20, native_type=native)
            t = {
                ("tinyint", False): FieldType.INT16, ("tinyint", True): FieldType.INT16,
                ("smallint", False): FieldType.INT16, ("smallint", True): FieldType.INT32,
                ("mediumint", False): FieldType.INT32, ("mediumint", True): FieldType.INT32,
                ("int", False): FieldType.INT32, ("int", True): FieldType.INT64,
                ("bigint", False): FieldType.INT64,
            }[(k, self.unsigned)]
            return Column(self.name, t, opt, native_type=native)
        if k == "decimal":
            return Column(self.name, FieldType.DECIMAL, opt, scale=self.scale, precision=self.precision,
                          native_type=native)
        if k == "bit":
            if self.bits == 1:
                return Column(self.name, FieldType.BOOLEAN, opt, native_type=native)
            return Column(self.name, FieldType.BITS, opt, length=self.bits, native_type=native)
        if k in ("enum", "set"):
            return Column(self.name, FieldType.ENUM if k == "enum" else FieldType.SET, opt,
                          allowed=self.values, native_type=native)
        t = {
            "float": FieldType.FLOAT32, "double": FieldType.FLOAT64, "date": FieldType.DATE,
            "time": FieldType.INTERVAL, "datetime": FieldType.TIMESTAMP, "timestamp": FieldType.TIMESTAMPTZ,
            "year": FieldType.YEAR, "json": FieldType.JSON, "char": FieldType.STRING,
            "varchar": FieldType.STRING, "text": FieldType.STRING, "binary": FieldType.BYTES,
            "varbinary": FieldType.BYTES, "blob": FieldType.BYTES, "geometry": FieldType.BYTES,
        }[k]
        return Column(self.name, t, opt, native_type=native)


# -- specs from the binlog -----------------------------------------------------------
def spec_from_table_map(col: Any, nullable: bool, json_hint: bool = False) -> ColumnSpec:
    """A ColumnSpec from a mysql-replication ``Column`` of a TableMapEvent (FULL row metadata).

    ``json_hint``: MariaDB stores JSON as LONGTEXT; the binlog cannot tell, so the caller
    passes what information_schema says (a ``json_valid`` check constraint).
    """
    t = col.type
    name = col.name
    binary = getattr(col, "character_set_name", None) == "binary" or getattr(col, "collation_name", None) == "binary"
    if t in _BINLOG_INT:
        return ColumnSpec(name, _BINLOG_INT[t], nullable, unsigned=bool(col.unsigned))
    if t == _T_NEWDECIMAL:
        return ColumnSpec(name, "decimal", nullable, unsigned=bool(col.unsigned), precision=col.precision,
                          scale=col.decimals)
    if t in (_T_FLOAT, _T_DOUBLE):
        return ColumnSpec(name, "float" if t == _T_FLOAT else "double", nullable, unsigned=bool(col.unsigned))
    if t == _T_DATE:
        return ColumnSpec(name, "date", nullable)
    if t in (_T_TIME, _T_TIME2):
        return ColumnSpec(name, "time", nullable, fsp=getattr(col, "fsp", 0) or 0)
    if t in (_T_DATETIME, _T_DATETIME2):
        return ColumnSpec(name, "datetime", nullable, fsp=getattr(col, "fsp", 0) or 0)
    if t in (_T_TIMESTAMP, _T_TIMESTAMP2):
        return ColumnSpec(name, "timestamp", nullable, fsp=getattr(col, "fsp", 0) or 0)
    if t == _T_YEAR:
        return ColumnSpec(name, "year", nullable)
    if t == _T_BIT:
        return ColumnSpec(name, "bit", nullable, bits=col.bits)
    if t == _T_ENUM:
        values = tuple(col.enum_values[1:]) if col.enum_values else None
        return ColumnSpec(name, "enum", nullable, values=values)
    if t == _T_SET:
        return ColumnSpec(name, "set", nullable, values=tuple(col.set_values) if col.set_values else None)
    if t == _T_JSON:
        return ColumnSpec(name, "json", nullable)
    if t in (_T_BLOB, _T_TINY_BLOB, _T_MEDIUM_BLOB, _T_LONG_BLOB):
        if binary:
            return ColumnSpec(name, "blob", nullable)
        return ColumnSpec(name, "json" if json_hint else "text", nullable)
    if t in (_T_VARCHAR, _T_VAR_STRING):
        return ColumnSpec(name, "varbinary" if binary else "varchar", nullable)
    if t == _T_STRING:
        if binary:
            return ColumnSpec(name, "binary", nullable, octets=col.max_length)
        return ColumnSpec(name, "char", nullable)
    if t == _T_GEOMETRY:
        return ColumnSpec(name, "geometry", nullable)
    raise SourceError(f"column {name!r}: binlog column type code {t} is not supported")


# -- specs from information_schema ---------------------------------------------------------
def _enum_values(column_type: str) -> tuple[str, ...]:
    """Members of ``enum('a','b')`` / ``set(...)`` as information_schema.COLUMN_TYPE spells them."""
    inner = column_type[column_type.index("(") + 1: column_type.rindex(")")]
    out: list[str] = []
    i = 0
    while i < len(inner):
        if inner[i] != "'":
            i += 1
            continue
        j = i + 1
        buf: list[str] = []
        while j < len(inner):
            ch = inner[j]
            if ch == "'" and j + 1 < len(inner) and inner[j + 1] == "'":
                buf.append("'")
                j += 2
                continue
            if ch == "\\" and j + 1 < len(inner):
                buf.append(inner[j + 1])
                j += 2
                continue
            if ch == "'":
                break
            buf.append(ch)
            j += 1
        out.append("".join(buf))
        i = j + 1
    return tuple(out)


def spec_from_information_schema(row: Mapping[str, Any], json_columns: Iterable[str] = ()) -> ColumnSpec:
    """A ColumnSpec from one ``information_schema.COLUMNS`` row (dict cursor, upper-case keys)."""
    name = row["COLUMN_NAME"]
    data_type = str(row["DATA_TYPE"]).lower()
    column_type = str(row["COLUMN_TYPE"]).lower()
    nullable = row["IS_NULLABLE"] == "YES"
    unsigned = " unsigned" in column_type
    if data_type in ("integer",):
        data_type = "int"
    if data_type in _INT_KINDS:
        return ColumnSpec(name, data_type, nullable, unsigned=unsigned)
    if data_type in ("decimal", "numeric"):
        return ColumnSpec(name, "decimal", nullable, unsigned=unsigned, precision=int(row["NUMERIC_PRECISION"]),
                          scale=int(row["NUMERIC_SCALE"]))
    if data_type in ("float", "double", "real"):
        kind = "float" if data_type == "float" else "double"
        return ColumnSpec(name, kind, nullable, unsigned=unsigned)
    if data_type in ("time", "datetime", "timestamp"):
        return ColumnSpec(name, data_type, nullable, fsp=int(row.get("DATETIME_PRECISION") or 0))
    if data_type in ("date", "year", "json", "geometry", "point", "linestring", "polygon", "multipoint",
                     "multilinestring", "multipolygon", "geometrycollection"):
        kind = data_type if data_type in ("date", "year", "json") else "geometry"
        return ColumnSpec(name, kind, nullable)
    if data_type == "bit":
        return ColumnSpec(name, "bit", nullable, bits=int(row["NUMERIC_PRECISION"]))
    if data_type in ("enum", "set"):
        return ColumnSpec(name, data_type, nullable, values=_enum_values(str(row["COLUMN_TYPE"])))
    if data_type in _TEXT_KINDS:
        return ColumnSpec(name, "json" if name in set(json_columns) else "text", nullable)
    if data_type in _BLOB_KINDS:
        return ColumnSpec(name, "blob", nullable)
    if data_type in ("char", "varchar", "varbinary"):
        return ColumnSpec(name, data_type, nullable)
    if data_type == "binary":
        return ColumnSpec(name, "binary", nullable, octets=int(row["CHARACTER_OCTET_LENGTH"]))
    raise SourceError(f"column {name!r}: MySQL type {column_type!r} is not supported")


def table_schema(topic: str, specs: Iterable[ColumnSpec], key: Iterable[str]) -> TableSchema:
    return TableSchema(topic, tuple(s.column() for s in specs), tuple(key))


# -- value converters ------------------------------------------------------------------------
Converter = Callable[[Any], Any]


def _parse_json(v: Any) -> Any:
    from kappaflow.events.values import JSON_NULL

    if type(v) is bytes:
        v = v.decode()
    # MySQL's binary JSON arrives parsed by mysql-replication (keys/strings may be bytes)
    r = (orjson.loads(v) if v else None) if type(v) is str else _unbytes(v)
    return JSON_NULL if r is None else r


def _unbytes(v: Any) -> Any:
    if type(v) is bytes:
        return v.decode()
    if type(v) is dict:
        return {(k.decode() if type(k) is bytes else k): _unbytes(x) for k, x in v.items()}
    if type(v) is list:
        return [_unbytes(x) for x in v]
    return v


def _as_bytes(v: Any) -> bytes:
    return v if type(v) is bytes else (v.encode("latin-1") if type(v) is str else bytes(v))


def _padder(n: int) -> Converter:
    def pad(v: Any) -> bytes:
        b = _as_bytes(v)
        return b + b"\x00" * (n - len(b)) if len(b) < n else b

    return pad


def _bits_from_str(nbytes: int) -> Converter:
    def conv(v: str) -> bytes:
        return int(v, 2).to_bytes(nbytes, "little")

    return conv


def _bits_from_bytes(nbytes: int) -> Converter:
    def conv(v: bytes) -> bytes:
        return int.from_bytes(v, "big").to_bytes(nbytes, "little")

    return conv


def _utc(v: _dt.datetime) -> _dt.datetime:
    return v.replace(tzinfo=UTC)


def _utc_or_zero(v: _dt.datetime) -> _dt.datetime | None:
    """Binlog TIMESTAMP 0 is the zero date (1970-01-01 00:00:00 UTC is outside TIMESTAMP's range)."""
    return None if v == _EPOCH_NAIVE else v.replace(tzinfo=UTC)


def _year(v: int) -> int:
    """YEAR 0000 is stored as 0, which mysql-replication turns into 1900 (not a valid YEAR)."""
    return 0 if v == 1900 else v


def _time_neg_fraction(v: _dt.timedelta) -> _dt.timedelta:
    """Fix mysql-replication's negative TIME(fsp) with a fraction: it returns -(I + 1 - f) for -(I + f).

    (Checked against SELECT for fsp 1..6, e.g. -01:00:00.25 comes back as -3600.75 s.)
    """
    us = v // _US
    if us >= 0:
        return v
    mag = -us
    frac = mag % 1_000_000
    if not frac:
        return v
    return _dt.timedelta(microseconds=-(mag - frac + 1_000_000 - frac))


def _bit1_str(v: str) -> bool:
    return v == "1"


def _bit1_bytes(v: bytes) -> bool:
    return v != b"\x00"


def _set_from_str(v: str) -> frozenset[str]:
    return frozenset(v.split(",")) if v else frozenset()


def binlog_converters(specs: Iterable[ColumnSpec]) -> tuple[tuple[str, Converter], ...]:
    """(column, converter) pairs for values as mysql-replication decodes them; identity columns are left out."""
    out: list[tuple[str, Converter]] = []
    for s in specs:
        k = s.kind
        conv: Converter | None = None
        if k == "bigint" and s.unsigned:
            conv = Decimal
        elif k == "float":
            conv = _f32
        elif k == "timestamp":
            conv = _utc_or_zero if s.nullable else _utc
        elif k == "year":
            conv = _year
        elif k == "time" and s.fsp:
            conv = _time_neg_fraction
        elif k == "bit":
            conv = _bit1_str if s.bits == 1 else _bits_from_str(((s.bits or 1) + 7) // 8)
        elif k == "set":
            conv = frozenset
        elif k == "json":
            conv = _parse_json
        elif k == "binary":
            conv = _padder(s.octets or 0)
        elif k in ("varbinary", "blob", "geometry"):
            conv = _as_bytes
        if conv is not None:
            out.append((s.name, conv))
    return tuple(out)


def binlog_zero_defaults(specs: Iterable[ColumnSpec]) -> dict[str, Any]:
    """Values to use when mysql-replication returned None for a NOT NULL column (zero dates, empty SET)."""
    out: dict[str, Any] = {}
    for s in specs:
        if s.kind == "set":
            out[s.name] = frozenset()  # an empty SET decodes to None in the library
        elif not s.nullable and s.kind == "date":
            out[s.name] = _EPOCH_DATE
        elif not s.nullable and s.kind == "datetime":
            out[s.name] = _EPOCH_NAIVE
    return out


def snapshot_select_expr(s: ColumnSpec, quoted: str) -> str:
    """The SELECT expression for a column (FLOAT through DOUBLE: the text protocol prints 6 digits)."""
    if s.kind == "float":
        return f"CAST({quoted} AS DOUBLE)"
    return quoted


def _zero_or(conv: Callable[[Any], Any] | None, zero: Any) -> Converter:
    def c(v: Any) -> Any:
        if type(v) is str:  # pymysql hands invalid/zero dates back as text
            return zero
        return conv(v) if conv is not None else v

    return c


def snapshot_converters(specs: Iterable[ColumnSpec]) -> tuple[tuple[str, Converter], ...]:
    """(column, converter) pairs for values as pymysql returns them (text protocol, time_zone +00:00)."""
    out: list[tuple[str, Converter]] = []
    for s in specs:
        k = s.kind
        conv: Converter | None = None
        if k == "bigint" and s.unsigned:
            conv = Decimal
        elif k == "float":
            conv = _f32
        elif k == "timestamp":
            conv = _zero_or(_utc, None if s.nullable else _EPOCH_UTC)
        elif k == "datetime":
            conv = _zero_or(None, None if s.nullable else _EPOCH_NAIVE)
        elif k == "date":
            conv = _zero_or(None, None if s.nullable else _EPOCH_DATE)
        elif k == "bit":
            conv = _bit1_bytes if s.bits == 1 else _bits_from_bytes(((s.bits or 1) + 7) // 8)
        elif k == "set":
            conv = _set_from_str
        elif k == "enum":
            conv = None
        elif k == "json":
            conv = _parse_json
        elif k in ("binary", "varbinary", "blob", "geometry"):
            conv = _as_bytes
        if conv is not None:
            out.append((s.name, conv))
    return tuple(out)


# -- binlog value -> JSON form in one step (the streaming hot path) ------------------------------


def _js_datetime(v: _dt.datetime) -> int:
    return (v - _EPOCH_NAIVE) // _US


def _js_timestamp(v: _dt.datetime) -> str:
    return v.isoformat() + "Z"  # mysql-replication's value is naive UTC


def _js_timestamp_or_zero(v: _dt.datetime) -> str | None:
    return None if v == _EPOCH_NAIVE else v.isoformat() + "Z"


def binlog_json_converters(specs: Iterable[ColumnSpec], columns: Iterable[Column], mode: str,
                           ) -> tuple[tuple[str, Converter], ...]:
    """(column, converter) from a mysql-replication value straight to its Debezium JSON form.

    Equal to ``make_encoder(column, mode)(binlog_converter(value))`` for every column (tests check
    it); TIMESTAMP and DATETIME skip the intermediate aware/naive datetime arithmetic.
    """
    from kappaflow.events.values import make_encoder

    specs, columns = tuple(specs), tuple(columns)
    py = dict(binlog_converters(specs))
    out: list[tuple[str, Converter]] = []
    for s, col in zip(specs, columns, strict=True):
        if s.kind == "timestamp":
            out.append((s.name, _js_timestamp_or_zero if s.nullable else _js_timestamp))
            continue
        if s.kind == "datetime":
            out.append((s.name, _js_datetime))
            continue
        p = py.get(s.name)
        enc = make_encoder(col, mode)
        if p is None and enc is None:
            continue
        if p is None:
            assert enc is not None
            out.append((s.name, enc))
        elif enc is None:
            out.append((s.name, p))
        else:
            out.append((s.name, _compose(enc, p)))
    return tuple(out)


def _compose(enc: Converter, p: Converter) -> Converter:
    def conv(v: Any) -> Any:
        r = p(v)
        return None if r is None else enc(r)

    return conv
