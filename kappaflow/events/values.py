"""Per-type value converters between Python values and Debezium's JSON encodings.

Converters are built once per column (``make_encoder`` / ``make_decoder``) and
then applied without any per-value type dispatch: the codec keeps a tuple of
(column name, converter) per schema. Encoders return None for types that JSON
carries as-is (ints, strings, booleans, UUIDs via orjson), so those columns
cost nothing on the hot path.

Converters raise plain Python exceptions on bad values; the codec catches them
and raises ``ValidationError`` naming the field path and the expected encoding
(``describe``), so the per-value fast path carries no error-formatting code.
"""

from __future__ import annotations

import json
import re
import uuid
from binascii import a2b_base64, b2a_base64
from collections.abc import Callable
from datetime import UTC, date, datetime, time, timedelta
from decimal import MAX_EMAX, MAX_PREC, MIN_EMIN, Context, Decimal, Inexact, InvalidOperation
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from kappaflow.errors import ValidationError
from kappaflow.events.types import FieldType

if TYPE_CHECKING:
    from kappaflow.events.schema import Column

__all__ = [
    "JSON_NULL",
    "NumericDecimal",
    "Wire",
    "decode_default",
    "default_wire",
    "describe",
    "encode_default",
    "identity_check",
    "make_decoder",
    "make_encoder",
    "make_transcoder",
    "short_repr",
    "time_unit",
]

Encoder = Callable[[Any], Any]
Decoder = Callable[[Any], Any]
Converter = Callable[[Any], Any]


class _JsonNull:
    """A JSON column whose document is the JSON literal ``null`` (not SQL NULL).

    Python's None already means SQL NULL in row dicts, so a JSON column holding
    the document ``null`` needs its own value. Nested nulls inside a document are
    plain None.
    """

    _instance: _JsonNull | None = None
    __slots__ = ()

    def __new__(cls) -> _JsonNull:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "JSON_NULL"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:  # pickles as the module-level singleton (Spark workers)
        return "JSON_NULL"


JSON_NULL = _JsonNull()


class Wire(NamedTuple):
    """How one column is represented on the wire (decided by the message's schema).

    mode: decimal handling ("string" | "precise" | "double");
    unit: time unit of TIME/TIMESTAMP ("us" | "ms" | "ns"); items: element wire of ARRAY.
    """

    mode: str = "string"
    unit: str = "us"
    items: Wire | None = None


# Connect/Debezium semantic name -> the unit its integer time values count.
_TIME_UNITS = {
    "io.debezium.time.Time": "ms",
    "org.apache.kafka.connect.data.Time": "ms",
    "io.debezium.time.MicroTime": "us",
    "io.debezium.time.NanoTime": "ns",
    "io.debezium.time.Timestamp": "ms",
    "org.apache.kafka.connect.data.Timestamp": "ms",
    "io.debezium.time.MicroTimestamp": "us",
    "io.debezium.time.NanoTimestamp": "ns",
}


def time_unit(col: Column) -> str:
    """The unit of a TIME/TIMESTAMP column's integer wire values: "ms", "us" (kappaflow's
    default) or "ns", from the semantic name the column keeps (``Column.logical``)."""
    return _TIME_UNITS.get(col.logical, "us") if col.logical is not None else "us"


def default_wire(col: Column, mode: str) -> Wire:
    if col.type is FieldType.ARRAY and col.items is not None:
        return Wire(mode, time_unit(col), default_wire(col.items, mode))
    return Wire(mode, time_unit(col), None)


# -- shared constants -------------------------------------------------------------
_EPOCH_ORDINAL = 719163  # date(1970, 1, 1).toordinal()
_EPOCH = datetime(1970, 1, 1)
_US = timedelta(microseconds=1)
_MS = timedelta(milliseconds=1)
_DAY_US = 86_400_000_000
# Debezium's stand-ins for PostgreSQL's +/-infinity timestamps (PgStatement's values).
_PG_TS_POS_INFINITY_US = 9223372036825200000
_PG_TS_NEG_INFINITY_US = -9223372036832400000
# Exact decimal arithmetic: never round, never overflow silently.
_CTX = Context(prec=MAX_PREC, Emax=MAX_EMAX, Emin=MIN_EMIN, traps=[InvalidOperation, Inexact])
_quantize = _CTX.quantize  # bound Context methods: ~3x faster than Decimal.quantize(context=...)
_scaleb = _CTX.scaleb
_UTC = UTC
_NONFINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}
_BIGINT_RE = re.compile(r"\d{19}")
_INT_RANGES = {
    FieldType.INT8: (-(1 << 7), (1 << 7) - 1),
    FieldType.INT16: (-(1 << 15), (1 << 15) - 1),
    FieldType.INT32: (-(1 << 31), (1 << 31) - 1),
    FieldType.INT64: (-(1 << 63), (1 << 63) - 1),
    FieldType.YEAR: (-(1 << 31), (1 << 31) - 1),
}


def short_repr(v: Any, limit: int = 80) -> str:
    r = repr(v)
    if len(r) > limit:
        r = r[: limit - 3] + "..."
    return f"{type(v).__name__} {r}"


def _b64(b: bytes) -> str:
    return b2a_base64(b, newline=False).decode("ascii")


def _unb64(s: str) -> bytes:
    if type(s) is not str:
        raise TypeError("expected a base64 string")
    return a2b_base64(s, strict_mode=True)


def _twos(i: int) -> bytes:
    """Big-endian two's complement, minimal length: Java's BigInteger.toByteArray()."""
    return i.to_bytes((i.bit_length() if i >= 0 else (~i).bit_length()) // 8 + 1, "big", signed=True)


# -- encoders (Python -> JSON-able) ---------------------------------------------------
def _enc_float(v: float) -> Any:
    if v - v == 0:  # finite
        return v
    if v != v:
        return "NaN"
    return "Infinity" if v > 0 else "-Infinity"


def _as_decimal(v: Any) -> Decimal:
    if type(v) is int:
        return Decimal(v)
    if isinstance(v, Decimal):
        return v
    raise TypeError("expected decimal.Decimal")


def _fixed_str_encoder(scale: int) -> Encoder:
    q = Decimal(1).scaleb(-scale)

    def enc(v: Decimal) -> str:
        # Quantized to the column's scale so equal numbers give equal bytes (keys!).
        try:
            d = _quantize(v, q)
        except (InvalidOperation, TypeError):
            d = _as_decimal(v)
            if d.is_infinite():
                return str(d)  # "Infinity" / "-Infinity" (PostgreSQL >= 14 numeric)
            d = _quantize(d, q)
        s = str(d)
        return format(d, "f") if "E" in s else s

    return enc


def _fixed_precise_encoder(scale: int) -> Encoder:
    def enc(v: Decimal) -> str:
        try:
            n = _scaleb(v, scale)
        except TypeError:
            n = _scaleb(_as_decimal(v), scale)
        i = int(n)  # ValueError for NaN, OverflowError for infinity: precise mode cannot carry them
        if i != n:
            raise Inexact(f"more than {scale} fractional digits")
        return _b64(_twos(i))

    return enc


def _var_str_encoder(v: Decimal) -> str:
    d = v if isinstance(v, Decimal) else _as_decimal(v)
    if not d.is_finite():
        return str(d)
    s = str(d)
    return format(d, "f") if "E" in s else s


def _var_precise_encoder(v: Decimal) -> dict[str, Any]:
    d = _as_decimal(v)
    exp = d.as_tuple().exponent
    if type(exp) is not int:
        raise ValueError("NaN/Infinity cannot be carried in precise decimal mode")
    return {"scale": -exp, "value": _b64(_twos(int(_scaleb(d, -exp))))}


def _double_decimal_encoder(v: Decimal) -> Any:
    return _enc_float(float(_as_decimal(v)))


def _enc_date(v: date) -> int:
    return v.toordinal() - _EPOCH_ORDINAL


def _enc_time(v: time) -> int:
    return v.hour * 3_600_000_000 + v.minute * 60_000_000 + v.second * 1_000_000 + v.microsecond


def _enc_timestamp(v: datetime) -> int:
    return (v - _EPOCH) // _US  # TypeError for an aware datetime: TIMESTAMP is naive


def _enc_time_ms(v: time) -> int:
    return _enc_time(v) // 1000


def _enc_time_ns(v: time) -> int:
    return _enc_time(v) * 1000


def _enc_timestamp_ms(v: datetime) -> int:
    return (v - _EPOCH) // _MS


def _enc_timestamp_ns(v: datetime) -> int:
    return ((v - _EPOCH) // _US) * 1000


def _enc_timestamptz(v: datetime) -> str:
    off = v.utcoffset()
    if off is None:
        raise TypeError("expected an aware datetime")
    if off:
        v = v - off
    return v.replace(tzinfo=None).isoformat() + "Z"


def _enc_timestamptz_native(v: datetime) -> Any:
    """For orjson with OPT_UTC_Z: a UTC datetime, which orjson formats ~10x faster than
    isoformat() and byte-identical to ``_enc_timestamptz``."""
    if v.tzinfo is _UTC and type(v) is datetime:
        return v
    if v.utcoffset() is None:
        raise TypeError("expected an aware datetime")
    if type(v) is not datetime:
        return _enc_timestamptz(v)
    return v.astimezone(_UTC)


def _enc_interval(v: timedelta) -> int:
    return v // _US


def _enc_bytes(v: bytes) -> str:
    return b2a_base64(v, newline=False).decode("ascii")


def _enc_json(v: Any) -> str:
    if v is JSON_NULL:
        return "null"
    if v is None:
        raise TypeError("None is SQL NULL, not a JSON document")
    try:
        return orjson.dumps(v).decode()
    except orjson.JSONEncodeError:
        # e.g. integers beyond 64 bits, which orjson refuses and PostgreSQL's jsonb keeps
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _set_encoder(allowed: tuple[str, ...] | None) -> Encoder:
    order = {a: i for i, a in enumerate(allowed or ())}
    n = len(order)

    def key(x: str) -> tuple[int, str]:
        return (order.get(x, n), x)

    def enc(v: Any) -> str:
        if type(v) is str:
            return v
        items = list(v)
        if not all(type(x) is str for x in items):
            raise TypeError("expected set members as strings")
        return ",".join(sorted(items, key=key))

    return enc


def _array_encoder(item: Encoder | None) -> Encoder:
    if item is None:

        def enc_plain(v: Any) -> list[Any]:
            if isinstance(v, (str, bytes, dict)):
                raise TypeError("expected a list")
            return v if type(v) is list else list(v)

        return enc_plain

    def enc(v: Any) -> list[Any]:
        if isinstance(v, (str, bytes, dict)):
            raise TypeError("expected a list")
        return [None if x is None else item(x) for x in v]

    return enc


def _struct_encoder(fields: tuple[tuple[str, Encoder | None], ...]) -> Encoder:
    convs = tuple((n, e) for n, e in fields if e is not None)

    def enc(v: Any) -> dict[str, Any]:
        if type(v) is not dict:
            raise TypeError("expected a dict of struct fields")
        if not convs:
            return v
        out = dict(v)
        for name, e in convs:
            x = out.get(name)
            if x is not None:
                out[name] = e(x)
        return out

    return enc


def _map_encoder(string_keys: bool, key: Encoder | None, value: Encoder | None) -> Encoder:
    """Connect maps in JSON: an object when the keys are strings, else an array of [key, value]
    pairs (what JsonConverter writes)."""

    def enc(v: Any) -> Any:
        if type(v) is not dict:
            raise TypeError("expected a dict")
        if string_keys:
            return v if value is None else {k: None if x is None else value(x) for k, x in v.items()}
        return [[k if key is None else key(k), x if x is None or value is None else value(x)] for k, x in v.items()]

    return enc


def make_encoder(col: Column, mode: str, native: bool = False) -> Encoder | None:
    """The Python -> JSON converter for a column, or None when JSON carries the value as-is.

    ``native=True``: the result goes straight to ``orjson.dumps(..., option=OPT_UTC_Z)``,
    which may then format some values itself (UTC datetimes); otherwise every result is
    a plain JSON type.
    """
    t = col.type
    if t is FieldType.DECIMAL:
        scale = col.scale if col.scale is not None else 0
        if mode == "precise":
            return _fixed_precise_encoder(scale)
        if mode == "double":
            return _double_decimal_encoder
        return _fixed_str_encoder(scale)
    if t is FieldType.VARIABLE_DECIMAL:
        if mode == "precise":
            return _var_precise_encoder
        if mode == "double":
            return _double_decimal_encoder
        return _var_str_encoder
    if t is FieldType.FLOAT32 or t is FieldType.FLOAT64:
        return _enc_float
    if t is FieldType.DATE:
        return _enc_date
    if t is FieldType.TIME:
        unit = time_unit(col)
        return _enc_time_ms if unit == "ms" else _enc_time_ns if unit == "ns" else _enc_time
    if t is FieldType.TIMESTAMP:
        unit = time_unit(col)
        return _enc_timestamp_ms if unit == "ms" else _enc_timestamp_ns if unit == "ns" else _enc_timestamp
    if t is FieldType.TIMESTAMPTZ:
        return _enc_timestamptz_native if native else _enc_timestamptz
    if t is FieldType.INTERVAL:
        return _enc_interval
    if t is FieldType.BYTES or t is FieldType.BITS:
        return _enc_bytes
    if t is FieldType.JSON:
        return _enc_json
    if t is FieldType.SET:
        return _set_encoder(col.allowed)
    if t is FieldType.ARRAY:
        assert col.items is not None
        return _array_encoder(make_encoder(col.items, mode, False))
    if t is FieldType.STRUCT:
        assert col.fields is not None
        return _struct_encoder(tuple((f.name, make_encoder(f, mode, False)) for f in col.fields))
    if t is FieldType.MAP:
        assert col.fields is not None
        k, v = col.fields
        return _map_encoder(k.type is FieldType.STRING, make_encoder(k, mode, False), make_encoder(v, mode, False))
    # INT*, BOOLEAN, STRING, ENUM, YEAR: as-is; UUID: orjson writes str(uuid).
    return None


# -- decoders (JSON -> Python) ----------------------------------------------------------
class _BadValue(Exception):
    """A wire value of the wrong shape; the codec turns it into a ValidationError."""


class NumericDecimal(Exception):
    """A Connect Decimal written as a JSON number (JsonConverter ``decimal.format=NUMERIC``).

    A float parse may have lost digits, so the codec re-parses the message with exact decimals
    (``json.loads(parse_float=Decimal)``) and decodes it again."""


def _int_decoder(lo: int, hi: int) -> Decoder:
    def dec(v: Any) -> int:
        if type(v) is int and lo <= v <= hi:
            return v
        raise _BadValue

    return dec


def _dec_float(v: Any) -> float:
    t = type(v)
    if t is float or t is int or t is Decimal:
        return float(v)
    if t is str:
        return _NONFINITE[v]
    raise _BadValue


def _dec_bool(v: Any) -> bool:
    if type(v) is bool:
        return v
    raise _BadValue


def _dec_str(v: Any) -> str:
    if type(v) is str:
        return v
    raise _BadValue


def _dec_decimal_str(v: Any) -> Decimal:
    t = type(v)
    if t is str or t is Decimal:
        return Decimal(v)
    if t is int:
        return Decimal(v)
    if t is float:
        return Decimal(repr(v))
    raise _BadValue


def _dec_decimal_double(v: Any) -> Decimal:
    t = type(v)
    if t is Decimal:
        return v
    if t is float or t is int:
        return Decimal(repr(float(v)))
    if t is str and v in _NONFINITE:
        return Decimal(v)
    raise _BadValue


def _fixed_precise_decoder(scale: int) -> Decoder:
    q = Decimal(1).scaleb(-scale)

    def dec(v: Any) -> Decimal:
        t = type(v)
        if t is str:
            return Decimal(int.from_bytes(_unb64(v), "big", signed=True)).scaleb(-scale, _CTX)
        if t is Decimal or t is int:  # decimal.format=NUMERIC, parsed exactly
            return _quantize(Decimal(v), q)
        if t is float:
            raise NumericDecimal
        raise _BadValue

    return dec


def _dec_var_precise(v: Any) -> Decimal:
    if type(v) is not dict or type(v.get("scale")) is not int:
        raise _BadValue
    return Decimal(int.from_bytes(_unb64(v["value"]), "big", signed=True)).scaleb(-v["scale"], _CTX)


def _dec_date(v: Any) -> date:
    if type(v) is not int:
        raise _BadValue
    return date.fromordinal(v + _EPOCH_ORDINAL)


def _time_decoder(unit: str) -> Decoder:
    def dec(v: Any) -> time:
        if type(v) is not int:
            raise _BadValue
        if unit == "ms":
            v *= 1000
        elif unit == "ns":
            v //= 1000
        if not 0 <= v < _DAY_US:
            raise _BadValue
        s, us = divmod(v, 1_000_000)
        m, s = divmod(s, 60)
        h, m = divmod(m, 60)
        return time(h, m, s, us)

    return dec


def _timestamp_decoder(unit: str) -> Decoder:
    if unit == "us":

        def dec_us(v: Any) -> datetime:
            if type(v) is not int:
                raise _BadValue
            try:
                return _EPOCH + timedelta(microseconds=v)
            except OverflowError:
                if v == _PG_TS_POS_INFINITY_US:
                    return datetime.max
                if v == _PG_TS_NEG_INFINITY_US:
                    return datetime.min
                raise

        return dec_us
    factor = 1000 if unit == "ms" else None

    def dec(v: Any) -> datetime:
        if type(v) is not int:
            raise _BadValue
        us = v * factor if factor else v // 1000
        return _EPOCH + timedelta(microseconds=us)

    return dec


def _dec_timestamptz(v: Any) -> datetime:
    if type(v) is not str:
        raise _BadValue
    d = datetime.fromisoformat(v)
    if d.tzinfo is None:
        raise _BadValue
    return d


def _dec_interval(v: Any) -> timedelta:
    if type(v) is not int:
        raise _BadValue
    return timedelta(microseconds=v)


def _dec_uuid(v: Any) -> uuid.UUID:
    if type(v) is not str:
        raise _BadValue
    return uuid.UUID(v)


def _dec_bytes(v: Any) -> bytes:
    return _unb64(v)


def _dec_json(v: Any) -> Any:
    if type(v) is not str:
        raise _BadValue
    # orjson turns integers beyond 64 bits into floats; the stdlib keeps them exact.
    r = json.loads(v) if _BIGINT_RE.search(v) else orjson.loads(v)
    return JSON_NULL if r is None else r


def _dec_set(v: Any) -> frozenset[str]:
    if type(v) is not str:
        raise _BadValue
    return frozenset(v.split(",")) if v else frozenset()


def _struct_decoder(fields: tuple[tuple[str, Decoder], ...], names: frozenset[str]) -> Decoder:
    def dec(v: Any) -> dict[str, Any]:
        if type(v) is not dict or not names.issuperset(v):
            raise _BadValue
        out = dict(v)
        for name, d in fields:
            x = out.get(name)
            if x is not None:
                out[name] = d(x)
        return out

    return dec


def _map_decoder(string_keys: bool, key: Decoder, value: Decoder) -> Decoder:
    def dec(v: Any) -> dict[Any, Any]:
        if string_keys and type(v) is dict:
            return {k: None if x is None else value(x) for k, x in v.items()}
        if type(v) is list:  # [[key, value], ...]: maps whose keys are not strings
            out = {}
            for pair in v:
                if type(pair) is not list or len(pair) != 2:
                    raise _BadValue
                out[key(pair[0])] = None if pair[1] is None else value(pair[1])
            return out
        raise _BadValue

    return dec


def _array_decoder(item: Decoder) -> Decoder:
    def dec(v: Any) -> list[Any]:
        if type(v) is not list:
            raise _BadValue
        return [None if x is None else item(x) for x in v]

    return dec


def make_decoder(col: Column, wire: Wire) -> Decoder:
    """The JSON -> Python converter for a column as represented by ``wire``; it checks the type."""
    t = col.type
    if t in _INT_RANGES:
        return _int_decoder(*_INT_RANGES[t])
    if t is FieldType.STRING or t is FieldType.ENUM:
        return _dec_str
    if t is FieldType.BOOLEAN:
        return _dec_bool
    if t is FieldType.FLOAT32 or t is FieldType.FLOAT64:
        return _dec_float
    if t is FieldType.DECIMAL or t is FieldType.VARIABLE_DECIMAL:
        if wire.mode == "precise":
            if t is FieldType.DECIMAL:
                return _fixed_precise_decoder(col.scale or 0)
            return _dec_var_precise
        if wire.mode == "double":
            return _dec_decimal_double
        return _dec_decimal_str
    if t is FieldType.DATE:
        return _dec_date
    if t is FieldType.TIME:
        return _time_decoder(wire.unit)
    if t is FieldType.TIMESTAMP:
        return _timestamp_decoder(wire.unit)
    if t is FieldType.TIMESTAMPTZ:
        return _dec_timestamptz
    if t is FieldType.INTERVAL:
        return _dec_interval
    if t is FieldType.UUID:
        return _dec_uuid
    if t is FieldType.BYTES or t is FieldType.BITS:
        return _dec_bytes
    if t is FieldType.JSON:
        return _dec_json
    if t is FieldType.SET:
        return _dec_set
    if t is FieldType.ARRAY:
        assert col.items is not None
        return _array_decoder(make_decoder(col.items, wire.items or default_wire(col.items, wire.mode)))
    if t is FieldType.STRUCT:
        assert col.fields is not None
        return _struct_decoder(tuple((f.name, make_decoder(f, default_wire(f, wire.mode))) for f in col.fields),
                               frozenset(f.name for f in col.fields))
    if t is FieldType.MAP:
        assert col.fields is not None
        k, v = col.fields
        return _map_decoder(k.type is FieldType.STRING, make_decoder(k, default_wire(k, wire.mode)),
                            make_decoder(v, default_wire(v, wire.mode)))
    raise AssertionError(f"unhandled field type {t}")  # pragma: no cover


def identity_check(col: Column, dec: Decoder) -> str | None:
    """For generated row decoders: a Python expression on ``v`` (a non-None wire value) that is
    true exactly when ``dec`` accepts ``v`` and returns it unchanged, or None when ``dec``
    converts. Checking inline spares a call per column for the types JSON carries as-is."""
    if dec is _dec_str:
        return "type(v) is str"
    if dec is _dec_bool:
        return "type(v) is bool"
    if col.type in _INT_RANGES:
        lo, hi = _INT_RANGES[col.type]
        return f"type(v) is int and {lo} <= v <= {hi}"
    return None


# -- wire -> wire (a message's JSON straight to the JSON kappaflow writes) ------------------------
_TS_US_RANGE = ((datetime.min - _EPOCH) // _US, (datetime.max - _EPOCH) // _US)
_DATE_RANGE = (1 - _EPOCH_ORDINAL, date.max.toordinal() - _EPOCH_ORDINAL)
_INTERVAL_RANGE = (timedelta.min // _US, timedelta.max // _US)


def _fixed_bytes_to_text(scale: int) -> Converter:
    """A Connect Decimal (base64 two's-complement bytes, ``scale``) -> its text, digit for digit what
    ``_fixed_str_encoder(scale)`` makes of ``_fixed_precise_decoder(scale)``'s Decimal (plain notation,
    exactly ``scale`` fractional digits), without the Decimal."""

    def conv(v: Any) -> str:
        if type(v) is not str:  # decimal.format=NUMERIC: the decode/encode path
            raise _BadValue
        i = int.from_bytes(a2b_base64(v, strict_mode=True), "big", signed=True)
        if not scale:
            return str(i)
        digits = str(-i if i < 0 else i).rjust(scale + 1, "0")
        text = f"{digits[:-scale]}.{digits[-scale:]}"
        return "-" + text if i < 0 else text

    return conv


def _composed(dec: Decoder, enc: Encoder | None) -> Converter:
    if enc is None:
        return dec

    def conv(v: Any) -> Any:
        return enc(dec(v))

    return conv


def make_transcoder(col: Column, wire: Wire, mode: str) -> tuple[str | None, Converter | None]:
    """How a column's value goes from a message's JSON (``wire``) to the JSON kappaflow writes with
    decimal ``mode`` -- ``make_encoder(col, mode, native=True)`` of ``make_decoder(col, wire)`` -- without
    the Python value in between where that is exact.

    Returns ``(check, None)`` when the value is written as it came: ``check`` is a Python expression on
    ``v`` (non-None) that is true exactly for the values the decoder accepts and the encoder gives back
    unchanged (ints, strings, booleans; dates, times, timestamps and intervals in the unit they are
    written in, within the range the Python types hold); else ``(None, conv)``, a converter that raises
    on any value the decoder refuses (and may refuse more: the caller then decodes and encodes, and
    that path names the field).
    """
    dec = make_decoder(col, wire)
    check = identity_check(col, dec)
    if check is not None:
        return check, None
    t = col.type
    unit = time_unit(col)
    span: tuple[int, int] | None = None
    if t is FieldType.DATE:
        span = _DATE_RANGE
    elif t is FieldType.INTERVAL:
        span = _INTERVAL_RANGE
    elif t is FieldType.TIMESTAMP and wire.unit == unit and unit in ("us", "ms"):
        lo, hi = _TS_US_RANGE
        span = (lo, hi) if unit == "us" else (-(-lo // 1000), hi // 1000)
    elif t is FieldType.TIME and wire.unit == unit and unit in ("us", "ms"):
        span = (0, _DAY_US - 1) if unit == "us" else (0, _DAY_US // 1000 - 1)
    if span is not None:
        return f"type(v) is int and {span[0]} <= v <= {span[1]}", None
    if t is FieldType.DECIMAL and wire.mode == "precise" and mode == "string" and (col.scale or 0) >= 0:
        return None, _fixed_bytes_to_text(col.scale or 0)
    return None, _composed(dec, make_encoder(col, mode, True))


# -- descriptions for error messages ------------------------------------------------------
_UNIT_WORD = {"us": "micros", "ms": "millis", "ns": "nanos"}


def describe(col: Column, wire: Wire) -> str:
    """What a value of ``col`` must look like (for 'expected ...' in error messages)."""
    t = col.type
    if t in _INT_RANGES:
        bits = {FieldType.INT8: 8, FieldType.INT16: 16, FieldType.INT32: 32, FieldType.INT64: 64}.get(t, 32)
        return f"{t.value} (an integer within {bits} bits)"
    if t is FieldType.DECIMAL or t is FieldType.VARIABLE_DECIMAL:
        scale = f" with at most {col.scale} fractional digits" if t is FieldType.DECIMAL else ""
        if wire.mode == "precise":
            if t is FieldType.DECIMAL:
                return f"decimal as base64 two's-complement bytes (scale {col.scale}; Python decimal.Decimal{scale})"
            return "variable-scale decimal {scale, value} (Python decimal.Decimal)"
        if wire.mode == "double":
            return "decimal as a number (Python decimal.Decimal)"
        return f"decimal string (Python decimal.Decimal{scale})"
    return {
        FieldType.FLOAT32: "float (a number, or 'NaN'/'Infinity'/'-Infinity')",
        FieldType.FLOAT64: "float (a number, or 'NaN'/'Infinity'/'-Infinity')",
        FieldType.BOOLEAN: "boolean",
        FieldType.STRING: "string",
        FieldType.ENUM: "enum string",
        FieldType.DATE: "date as int days since 1970-01-01 (Python datetime.date)",
        FieldType.TIME: f"time as int {_UNIT_WORD.get(wire.unit, wire.unit)} since midnight (Python datetime.time)",
        FieldType.TIMESTAMP: (
            f"timestamp as int {_UNIT_WORD.get(wire.unit, wire.unit)} since the epoch "
            "(Python naive datetime.datetime)"
        ),
        FieldType.TIMESTAMPTZ: "ISO-8601 timestamp with zone (Python aware datetime.datetime)",
        FieldType.INTERVAL: "interval as int micros (Python datetime.timedelta)",
        FieldType.UUID: "UUID string (Python uuid.UUID)",
        FieldType.BYTES: "base64 string (Python bytes)",
        FieldType.BITS: "bits as base64 string (Python bytes)",
        FieldType.JSON: "JSON document text (Python parsed JSON; JSON_NULL for the literal null)",
        FieldType.SET: "comma-separated set string (Python frozenset of str)",
        FieldType.ARRAY: f"array of {col.items.type.value if col.items else '?'} (Python list)",
        FieldType.STRUCT: f"struct of {[f.name for f in col.fields or ()]} (Python dict)",
        FieldType.MAP: "map (a JSON object, or [key, value] pairs; Python dict)",
    }.get(t, t.value)


# -- defaults (stored in schemas in wire form) ------------------------------------------------
def encode_default(col: Column, value: Any, mode: str, path: str) -> Any:
    enc = make_encoder(col, mode)
    if enc is None:
        return value
    try:
        return enc(value)
    except Exception:
        raise ValidationError(
            f"{path}: expected {describe(col, default_wire(col, mode))}, got {short_repr(value)}"
        ) from None


def decode_default(col: Column, value: Any, path: str, wire: Wire | None = None) -> Any:
    w = wire if wire is not None else default_wire(col, "string")
    try:
        return make_decoder(col, w)(value)
    except Exception:
        raise ValidationError(f"{path}: expected {describe(col, w)}, got {short_repr(value)}") from None

