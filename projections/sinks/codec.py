"""JSON documents <-> the view's typed rows, for the document sinks (search, Redis).

Encoding: decimals as exact text, bytes as base64, intervals as microseconds. Decoding turns
stored JSON back into the Python types the view's Spark schema promises (``fetch``/``scan``
return the same values as the PostgreSQL sink).
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
from collections.abc import Mapping
from typing import Any

import orjson

from kappaflow.projections.sinks.base import VERSION, ViewSpec


def json_default(obj: Any) -> Any:
    if isinstance(obj, decimal.Decimal):
        return str(obj)  # exact; search numeric fields accept numeric strings
    if isinstance(obj, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(obj)).decode()
    if isinstance(obj, _dt.timedelta):
        return (obj.days * 86_400 + obj.seconds) * 1_000_000 + obj.microseconds
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    if hasattr(obj, "isoformat"):  # pandas.Timestamp and friends
        return obj.isoformat()
    if hasattr(obj, "tolist"):  # numpy arrays / scalars
        return obj.tolist()
    raise TypeError(f"cannot encode a {type(obj).__name__} as JSON")


DUMPS_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def encode_json(row: Mapping[str, Any]) -> bytes:
    return orjson.dumps(row, default=json_default, option=DUMPS_OPTS)


# --- decoding stored JSON back to the view's types ----------------------------------------
def _decoder(dt: Any) -> Any:
    """A function JSON value -> Python value for Spark type `dt` (None for identity)."""
    from pyspark.sql import types as st

    if isinstance(dt, st.DecimalType):
        return lambda v: decimal.Decimal(str(v))
    if isinstance(dt, st.DateType):
        return lambda v: _dt.date.fromisoformat(v) if isinstance(v, str) else v
    if isinstance(dt, st.TimestampNTZType):
        return lambda v: _dt.datetime.fromisoformat(v) if isinstance(v, str) else v
    if isinstance(dt, st.TimestampType):
        def ts(v: Any) -> Any:
            if not isinstance(v, str):
                return v
            d = _dt.datetime.fromisoformat(v)
            return d if d.tzinfo else d.replace(tzinfo=_dt.UTC)
        return ts
    if isinstance(dt, st.BinaryType):
        return lambda v: base64.b64decode(v) if isinstance(v, str) else v
    if isinstance(dt, st.DayTimeIntervalType):
        return lambda v: _dt.timedelta(microseconds=v) if isinstance(v, int) else v
    if isinstance(dt, st.FloatType | st.DoubleType):
        return lambda v: float(v) if isinstance(v, int | str) else v
    if isinstance(dt, st.ArrayType):
        inner = _decoder(dt.elementType)
        if inner is None:
            return None
        return lambda v: [None if x is None else inner(x) for x in v] if isinstance(v, list) else v
    if isinstance(dt, st.StructType):
        subs = [(f.name, _decoder(f.dataType)) for f in dt.fields]
        if all(d is None for _, d in subs):
            return None

        def struct(v: Any) -> Any:
            if not isinstance(v, dict):
                return v
            return {n: (v.get(n) if d is None or v.get(n) is None else d(v[n])) for n, d in subs}
        return struct
    if isinstance(dt, st.MapType):
        vd = _decoder(dt.valueType)
        if vd is None:
            return None
        return lambda v: {k: None if x is None else vd(x) for k, x in v.items()} if isinstance(v, dict) else v
    return None


class RowDecoder:
    """Stored JSON documents -> rows typed like the view (plus ``_kf_version``)."""

    def __init__(self, view: ViewSpec) -> None:
        self.view = view
        self.names = view.column_names
        self.decoders = [(c.name, d) for c in view.columns if (d := _decoder(c.type)) is not None]

    def row(self, doc: Mapping[str, Any], version: int | None) -> dict[str, Any]:
        out = {n: doc.get(n) for n in self.names}
        for name, dec in self.decoders:
            v = out[name]
            if v is not None:
                out[name] = dec(v)
        out[VERSION] = version
        return out

    def key(self, row: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(row[k] for k in self.view.key)


__all__ = ["DUMPS_OPTS", "RowDecoder", "encode_json", "json_default"]
