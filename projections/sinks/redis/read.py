"""Reading live rows from an application: :func:`get` and :func:`get_many` follow the view's pointer
and read the rows in one atomic script call, never confused by a rebuild switching namespaces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from kappaflow.projections.sinks.keys import key_str
from kappaflow.projections.sinks.redis.codec import _s
from kappaflow.projections.sinks.redis.scripts import _evalsha


def _read(client: Any, base: str, keys: Sequence[Any], build: str = "") -> list[Any]:
    """Entries for `keys` read from `build` (default: the one the pointer names), in one atomic call."""
    res = _evalsha(client, "read", [f"{base}:current"], [f"{base}:", build, *(key_str(k) for k in keys)])
    if not res:
        return [False] * len(keys)
    return list(res[1:]) + [False] * (len(keys) - (len(res) - 1))


def _plain(entry: Any) -> dict[str, Any] | None:
    if not entry:
        return None
    kind, payload = _s(entry[0]), entry[1]
    if kind == "s":
        doc = orjson.loads(payload)
        if not isinstance(doc, dict) or doc.get("_kf_deleted"):
            return None
        doc.pop("_kf_v", None)
        return doc
    out = {_s(payload[i]): _s(payload[i + 1]) for i in range(0, len(payload), 2)}
    if "_kf_deleted" in out:
        return None
    out.pop("_kf_v", None)
    return out


def get(client: Any, view: str, key: Any, *, prefix: str = "kf") -> dict[str, Any] | None:
    """The live row of `view` for `key` (a value, or a tuple for composite keys), or None.

    Follows the pointer and reads the row in one atomic script call, so it is never
    confused by a rebuild switching namespaces underneath it. JSON rows come back as
    decoded dicts, hash rows as {field: text}; kappaflow's ``_kf_v`` is removed. Usable
    with any redis-py client: ``get(redis.Redis.from_url(url), "customers", 42)``.
    """
    return _plain(_read(client, f"{prefix}:{view}", [key])[0])


def get_many(client: Any, view: str, keys: Sequence[Any], *, prefix: str = "kf") -> list[dict[str, Any] | None]:
    """Like :func:`get` for several keys, all read from the same build in one call."""
    if not keys:
        return []
    return [_plain(e) for e in _read(client, f"{prefix}:{view}", keys)]
