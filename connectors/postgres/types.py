"""PostgreSQL type OIDs -> kappaflow field types and text-format value converters.

pgoutput (protocol 1) and the snapshot both deliver values in PostgreSQL's *text*
output format, produced under the session settings the connector pins
(``TimeZone=UTC``, ``DateStyle=ISO``, ``IntervalStyle=iso_8601``,
``extra_float_digits=3``, ``bytea_output=hex``). One converter per column turns
those bytes into the Python value of the change-event model; converters are
resolved once per relation (a tuple), never per value.

Arrays, enums and domains are resolved through :class:`TypeInfo` records read
from ``pg_type`` (pgoutput only names user types in its Type message).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import orjson

from kappaflow.errors import ValidationError
from kappaflow.events import JSON_NULL

Converter = Callable[[bytes], Any]

# --- built-in type OIDs (pg_type.dat; stable across versions) ---------------------------------
BOOL, BYTEA, CHAR, NAME, INT8, INT2, INT4, TEXT, OID = 16, 17, 18, 19, 20, 21, 23, 25, 26
JSON, XML, FLOAT4, FLOAT8, MONEY, BPCHAR, VARCHAR = 114, 142, 700, 701, 790, 1042, 1043
DATE, TIME, TIMESTAMP, TIMESTAMPTZ, INTERVAL, TIMETZ = 1082, 1083, 1114, 1184, 1186, 1266
BIT, VARBIT, NUMERIC, UUID, JSONB, INET, CIDR, MACADDR = 1560, 1562, 1700, 2950, 3802, 869, 650, 829

# element OID -> array OID for the built-ins (user arrays come from pg_type.typelem)
BUILTIN_ARRAYS: dict[int, int] = {
    1000: BOOL, 1001: BYTEA, 1002: CHAR, 1003: NAME, 1005: INT2, 1007: INT4, 1009: TEXT, 1028: OID,
    1014: BPCHAR, 1015: VARCHAR, 1016: INT8, 1021: FLOAT4, 1022: FLOAT8, 1115: TIMESTAMP, 1182: DATE,
    1183: TIME, 1185: TIMESTAMPTZ, 1187: INTERVAL, 1270: TIMETZ, 1231: NUMERIC, 2951: UUID, 199: JSON,
    3807: JSONB, 1561: BIT, 1563: VARBIT, 143: XML, 791: MONEY, 1041: INET, 651: CIDR, 1040: MACADDR,
}

BUILTIN_NAMES: dict[int, str] = {
    BOOL: "bool", BYTEA: "bytea", CHAR: "char", NAME: "name", INT8: "int8", INT2: "int2", INT4: "int4",
    TEXT: "text", OID: "oid", JSON: "json", XML: "xml", FLOAT4: "float4", FLOAT8: "float8", MONEY: "money",
    BPCHAR: "bpchar", VARCHAR: "varchar", DATE: "date", TIME: "time", TIMESTAMP: "timestamp",
    TIMESTAMPTZ: "timestamptz", INTERVAL: "interval", TIMETZ: "timetz", BIT: "bit", VARBIT: "varbit",
    NUMERIC: "numeric", UUID: "uuid", JSONB: "jsonb", INET: "inet", CIDR: "cidr", MACADDR: "macaddr",
}

# Session settings every connection that reads values must use (the converters rely on them).
SESSION_OPTIONS = (
    "-c TimeZone=UTC -c DateStyle=ISO -c IntervalStyle=iso_8601 -c extra_float_digits=3 "
    "-c bytea_output=hex"
)


@dataclass(frozen=True, slots=True)
class TypeInfo:
    """What the catalog says about a non-builtin type (from pg_type / pg_enum)."""

    oid: int
    name: str  # e.g. "public.mood"
    typtype: str  # 'b' base, 'e' enum, 'd' domain, 'c' composite, 'r' range, 'm' multirange
    elem: int = 0  # array element OID (0 if not an array)
    base: int = 0  # domain base type OID
    base_typmod: int = -1
    labels: tuple[str, ...] = ()  # enum labels in sort order


TypeLookup = Callable[[int], "TypeInfo | None"]


# --- scalar converters -------------------------------------------------------------------------

def _text(b: bytes) -> str:
    return b.decode()


def _bool(b: bytes) -> bool:
    return b == b"t"


def _numeric(b: bytes) -> Decimal:
    return Decimal(b.decode())


def _float(b: bytes) -> float:
    return float(b)


def _bytea(b: bytes) -> bytes:
    # bytea_output=hex: "\x0a0b"
    if b[:2] != b"\\x":
        raise ValueError("expected hex bytea output starting with \\x")
    return bytes.fromhex(b[2:].decode())


_DATE_MAX = _dt.date.max
_DATE_MIN = _dt.date.min


def _date(b: bytes) -> _dt.date:
    if b == b"infinity":
        return _DATE_MAX
    if b == b"-infinity":
        return _DATE_MIN
    return _dt.date.fromisoformat(b.decode())


def _time(b: bytes) -> _dt.time:
    s = b.decode()
    if s.startswith("24:"):  # PostgreSQL allows 24:00:00; Python's time cannot hold it
        return _dt.time.max
    return _dt.time.fromisoformat(s)


_TS_MAX = _dt.datetime.max
_TS_MIN = _dt.datetime.min
_UTC = _dt.UTC


def _timestamp(b: bytes) -> _dt.datetime:
    if b == b"infinity":
        return _TS_MAX
    if b == b"-infinity":
        return _TS_MIN
    return _dt.datetime.fromisoformat(b.decode())


def _timestamptz(b: bytes) -> _dt.datetime:
    if b == b"infinity":
        return _TS_MAX.replace(tzinfo=_UTC)
    if b == b"-infinity":
        return _TS_MIN.replace(tzinfo=_UTC)
    # TimeZone=UTC: "2024-01-02 03:04:05.123456+00"
    return _dt.datetime.fromisoformat(b.decode())


# Debezium's MicroDuration: a month is 365.25 / 12 days.
_MICROS_PER_MONTH = 365.25 / 12 * 86_400_000_000
_ISO_INTERVAL = re.compile(
    r"^P(?:(-?\d+)Y)?(?:(-?\d+)M)?(?:(-?\d+)W)?(?:(-?\d+)D)?"
    r"(?:T(?:(-?\d+)H)?(?:(-?\d+)M)?(?:(-?\d+(?:\.\d+)?)S)?)?$"
)


def interval_micros(b: bytes) -> int:
    """IntervalStyle=iso_8601 text -> microseconds (months as 365.25/12 days, like Debezium)."""
    m = _ISO_INTERVAL.match(b.decode())
    if m is None:
        raise ValueError("expected an ISO 8601 interval like P1Y2M3DT4H5M6S")
    y, mo, w, d, h, mi, s = m.groups()
    months = int(y or 0) * 12 + int(mo or 0)
    micros = round(months * _MICROS_PER_MONTH)
    micros += (int(w or 0) * 7 + int(d or 0)) * 86_400_000_000
    micros += (int(h or 0) * 3600 + int(mi or 0) * 60) * 1_000_000
    if s:
        neg = s.startswith("-")
        whole, _, frac = s.lstrip("-").partition(".")
        sec = int(whole) * 1_000_000 + int((frac + "000000")[:6])
        micros += -sec if neg else sec
    return micros


def _interval(b: bytes) -> _dt.timedelta:
    return _dt.timedelta(microseconds=interval_micros(b))


def _uuid(b: bytes) -> uuid.UUID:
    return uuid.UUID(b.decode())


_BIGINT = re.compile(rb"\d{19}")


def _json(b: bytes) -> Any:
    # orjson turns integers beyond 64 bits into floats; the stdlib keeps them exact.
    r = json.loads(b) if _BIGINT.search(b) else orjson.loads(b)
    return JSON_NULL if r is None else r


def _bits(b: bytes) -> bytes:
    """bit(n)/varbit text "1011" -> little-endian bytes (Debezium's io.debezium.data.Bits)."""
    if not b:
        return b""
    return int(b, 2).to_bytes((len(b) + 7) // 8, "little")


def _bit1(b: bytes) -> bool:
    return b == b"1"


SCALARS: dict[int, Converter] = {
    BOOL: _bool, BYTEA: _bytea, CHAR: _text, NAME: _text, INT8: int, INT2: int, INT4: int, TEXT: _text,
    OID: int, JSON: _json, XML: _text, FLOAT4: _float, FLOAT8: _float, MONEY: _text, BPCHAR: _text,
    VARCHAR: _text, DATE: _date, TIME: _time, TIMESTAMP: _timestamp, TIMESTAMPTZ: _timestamptz,
    INTERVAL: _interval, TIMETZ: _text, BIT: _bits, VARBIT: _bits, NUMERIC: _numeric, UUID: _uuid,
    JSONB: _json, INET: _text, CIDR: _text, MACADDR: _text,
}


# --- arrays ------------------------------------------------------------------------------------

def parse_array(text: bytes, elem: Converter, delim: int = 44) -> list[Any]:
    """Parse PostgreSQL's array text output ('{1,NULL,"a b",{x}}') into nested lists.

    Quoted elements are unescaped; unquoted NULL is SQL NULL. Dimension decorations
    ('[0:1]={...}') are accepted and dropped.
    """
    s = text
    i = 0
    if s[:1] == b"[":
        eq = s.find(b"=")
        if eq < 0:
            raise ValueError("array dimension prefix without '='")
        i = eq + 1
    try:
        out, i = _parse_array_at(s, i, elem, delim)
    except IndexError:
        raise ValueError("unterminated array text") from None
    if i != len(s):
        raise ValueError(f"unexpected data after array at byte {i}")
    return out


def _parse_array_at(s: bytes, i: int, elem: Converter, delim: int) -> tuple[list[Any], int]:
    if s[i] != 123:  # '{'
        raise ValueError(f"expected '{{' at byte {i}")
    i += 1
    items: list[Any] = []
    n = len(s)
    if i < n and s[i] == 125:  # '}'
        return items, i + 1
    while True:
        c = s[i]
        if c == 123:
            sub, i = _parse_array_at(s, i, elem, delim)
            items.append(sub)
        elif c == 34:  # '"'
            i += 1
            buf = bytearray()
            while True:
                c = s[i]
                if c == 92:  # backslash
                    buf.append(s[i + 1])
                    i += 2
                elif c == 34:
                    i += 1
                    break
                else:
                    buf.append(c)
                    i += 1
            items.append(elem(bytes(buf)))
        else:
            j = i
            while s[j] != delim and s[j] != 125:
                j += 1
            tok = s[i:j]
            items.append(None if tok == b"NULL" else elem(tok.strip()))
            i = j
        c = s[i]
        if c == delim:
            i += 1
        elif c == 125:
            return items, i + 1
        else:
            raise ValueError(f"expected ',' or '}}' at byte {i}")


def array_converter(elem: Converter, delim: int = 44) -> Converter:
    def conv(b: bytes) -> list[Any]:
        return parse_array(b, elem, delim)

    return conv


def _enum_text(b: bytes) -> str:
    return b.decode()


def converter_for(oid: int, lookup: TypeLookup | None = None) -> Converter:
    """The text -> Python converter for a type OID (resolving arrays, enums and domains)."""
    conv = SCALARS.get(oid)
    if conv is not None:
        return conv
    elem = BUILTIN_ARRAYS.get(oid)
    if elem is not None:
        return array_converter(converter_for(elem, lookup))
    info = lookup(oid) if lookup is not None else None
    if info is None:
        return _text
    if info.elem:
        return array_converter(converter_for(info.elem, lookup))
    if info.typtype == "d":
        return converter_for(info.base, lookup)
    return _text  # enums, composites, ranges, extension types: their text form


def convert_or_raise(conv: Converter, raw: bytes, column: str, where: str) -> Any:
    """Apply a converter, turning any failure into a ValidationError that names the column."""
    try:
        return conv(raw)
    except (ValueError, InvalidOperation, IndexError, TypeError, orjson.JSONDecodeError) as exc:
        shown = raw[:60].decode(errors="replace")
        raise ValidationError(f"{where}: column {column!r}: cannot convert {shown!r}: {exc}") from None
