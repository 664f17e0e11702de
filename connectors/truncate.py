"""What a TRUNCATE becomes in the log, for every connector (PostgreSQL, MySQL, Debezium topics).

In each partition of the table's topic, in ONE append (all-or-nothing per partition, so the
duplicate check after a restart stays exact):

1. the ``op=t`` marker (record key ``{}``), Debezium's truncate event: "everything before this
   in this partition is gone";
2. for every key the partition still holds, in key order, the row's **delete**: an ``op=d``
   change event whose ``before`` is the row as the log last held it, with the truncate's
   source position and ``"kf_truncate": true``, then the key's tombstone.

Why deletes and not only tombstones: a tombstone has no row, so a consumer keyed by anything
but the record key (a custom fold counting ``pgbench_history`` rows per teller) cannot tell
which of its rows the truncate removed. The delete carries the removed row; the tombstone
after it lets compaction empty the topic like the table. Latest-row and grouped views treat
both as deletes of the key, as before. The rows come from the log (the connector has drained
its writer first), so they are exactly the rows every consumer has seen.
"""

from __future__ import annotations

from typing import Any

import orjson

from kappaflow.connectors.base import TrustedRecord
from kappaflow.log.base import Headers, Log, Record

__all__ = ["TRUNCATE_KEY", "live_rows", "truncate_records"]

TRUNCATE_KEY = b"{}"


def live_rows(log: Log, topic: str, partition: int) -> dict[bytes, bytes]:
    """The last value of every key in one partition whose last record is not a tombstone."""
    live: dict[bytes, bytes] = {}
    for rec in log.iter_partition(topic, partition):
        k = rec.key
        if k is None or k == TRUNCATE_KEY:
            continue
        if rec.value is None:
            live.pop(k, None)
        else:
            live[k] = rec.value
    return live


def _envelope(value: bytes) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(payload, the whole message when it carries an embedded schema) of a change event value."""
    obj = orjson.loads(value)
    if type(obj) is dict and "payload" in obj and "schema" in obj and type(obj["payload"]) is dict:
        return obj["payload"], obj
    if type(obj) is not dict:
        raise ValueError("not a JSON object")
    return obj, None


def truncate_records(marker: bytes, live: dict[bytes, bytes], marker_headers: Headers,
                     delete_headers: Headers, tombstone_headers: Headers) -> list[Record]:
    """One partition's records for a truncate (see the module docstring).

    `marker` is the truncate event's value (its ``source`` and ``transaction`` are reused by
    every delete); `live` maps the partition's keys to their last values (``live_rows``). A key
    whose last value holds no row (a delete without its tombstone, as Debezium writes with
    ``tombstones.on.delete=false``) only gets its tombstone.
    """
    head, wrapped = _envelope(marker)
    out: list[Record] = [TrustedRecord(TRUNCATE_KEY, marker, marker_headers)]
    for key in sorted(live):
        row = unavailable = None
        try:
            last, _ = _envelope(live[key])
            row = last.get("after")
            unavailable = last.get("kf_unavailable")
        except (ValueError, orjson.JSONDecodeError):
            row = None  # not a change event (it was dead-lettered downstream): nothing to delete
        if type(row) is dict:
            payload: dict[str, Any] = {**head, "before": row, "after": None, "op": "d", "kf_truncate": True}
            if unavailable:
                payload["kf_unavailable"] = unavailable
            else:
                payload.pop("kf_unavailable", None)
            msg: Any = payload if wrapped is None else {"schema": wrapped["schema"], "payload": payload}
            out.append(TrustedRecord(key, orjson.dumps(msg), delete_headers))
        out.append(TrustedRecord(key, None, tombstone_headers))
    return out

