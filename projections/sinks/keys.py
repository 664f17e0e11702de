"""How a view row is named outside its view: the key's canonical text (document id, Redis key
suffix, dead-letter ``row_key``), key ordering without comparing None, and the version a change carries.

Versions: a latest-row view's row carries the log **offset** of its change (see
:func:`version_of`). Offsets are per partition and not comparable across partitions, but
every change of one key lives in one partition (the log partitions by key), so per key the
offset alone is strictly increasing, which is all a per-key version guard needs. Grouped
and custom views carry the engine's batch watermark instead (the sum of the next offsets of
all input partitions, growing with every batch). The sinks only require 0..2^63-1
(Elasticsearch external versions are Java longs) and compare versions per key.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import uuid
from typing import Any

import orjson

from kappaflow.errors import SinkError
from kappaflow.projections.sinks.codec import DUMPS_OPTS, json_default

MAX_VERSION = (1 << 63) - 1


def version_of(partition: int, offset: int) -> int:
    """The version a change carries: its log offset (see the module docstring)."""
    if not 0 <= offset <= MAX_VERSION:
        raise SinkError(f"log offset {offset} (partition {partition}): expected 0..2^63-1 to use as a version")
    return offset


def key_str(key: tuple[Any, ...] | Any) -> str:
    """The canonical text of a view key (document id, Redis key suffix).

    One column: the value's plain text (``42``, ``alice``, ``true``, ``2024-01-02``);
    several: a compact JSON array (``["eu",42]``), unambiguous whatever the values hold.
    """
    if isinstance(key, tuple | list):
        if len(key) == 1:
            return key_str(key[0])
        return orjson.dumps(list(key), default=json_default, option=DUMPS_OPTS).decode()
    if isinstance(key, str):
        return key
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, int | decimal.Decimal | uuid.UUID):
        return str(key)
    if isinstance(key, _dt.datetime | _dt.date | _dt.time):
        return key.isoformat()
    if isinstance(key, bytes):
        return base64.b64encode(key).decode()
    if isinstance(key, float):
        return repr(key)
    raise SinkError(f"view key: expected scalar key values, got {type(key).__name__}")


def sort_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """Order keys like a database would (NULLs last) without comparing None to values."""
    return tuple((v is None, v) for v in key)


__all__ = ["MAX_VERSION", "key_str", "sort_key", "version_of"]
