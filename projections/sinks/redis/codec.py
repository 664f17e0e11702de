"""Redis wire values: RESP encoding of large commands, rows as hash fields and back, milliseconds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from kappaflow.projections.sinks.base import (
    ViewSpec,
)
from kappaflow.projections.sinks.codec import encode_json


def _resp(args: Sequence[bytes]) -> bytes:
    """RESP encoding of one command (arguments already bytes): several times faster than
    redis-py's generic packer for commands with thousands of arguments."""
    parts = [b"*%d\r\n" % len(args)]
    parts.extend(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
    return b"".join(parts)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _ms(seconds: float | None) -> bytes:
    return b"0" if seconds is None else b"%d" % max(1, round(seconds * 1000))


def _hash_fields(row: Mapping[str, Any]) -> list[bytes]:
    out: list[bytes] = []
    for name, value in row.items():
        if value is None:
            continue  # an absent field is NULL
        if isinstance(value, str):
            b = value.encode()
        elif isinstance(value, bool):
            b = b"true" if value else b"false"
        elif isinstance(value, int | float):
            b = repr(value).encode()
        else:
            b = encode_json({"v": value})[5:-1]  # the value's JSON text
        out += [name.encode(), b]
    return out


def _typed_hash(view: ViewSpec, fields: Mapping[str, str]) -> dict[str, Any]:
    """Hash fields (text) -> JSON-like values RowDecoder understands."""
    from pyspark.sql import types as st

    doc: dict[str, Any] = {}
    for col in view.columns:
        v = fields.get(col.name)
        if v is None:
            continue
        t = col.type
        if isinstance(t, st.StringType | st.CharType | st.VarcharType):
            doc[col.name] = v
        elif isinstance(t, st.BooleanType):
            doc[col.name] = v == "true"
        elif isinstance(t, st.ByteType | st.ShortType | st.IntegerType | st.LongType):
            doc[col.name] = int(v)
        elif isinstance(t, st.FloatType | st.DoubleType):
            doc[col.name] = float(v)
        else:
            try:
                doc[col.name] = orjson.loads(v)
            except orjson.JSONDecodeError:
                doc[col.name] = v
    return doc
