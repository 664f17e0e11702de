"""Lost source positions and ``kappaflow capture --resnapshot``, for every log-based connector.

A capture resumes from a position in the source's own log: a PostgreSQL replication slot, a
MySQL/MariaDB binlog file/position or GTID set. The source can lose it: the slot is invalidated
(``wal_status = lost`` once ``max_slot_wal_keep_size`` is exceeded) or dropped, the binlog files
or GTIDs are purged. The changes after the position are then gone from the source, and no
streaming can bring the log back in line. The connectors stop with an error that says so
(:func:`lost_position`) and name the recovery: ``kappaflow capture SOURCE --resnapshot``.

A re-snapshot takes a **new position** (a new slot / the current binlog position), reads every
captured table again **through the log** (``op=r`` records positioned after everything the log
already holds), and then, per table topic, writes a **delete** (``op=d`` whose ``before`` is the
row as the log last held it, like a TRUNCATE's deletes in ``connectors/truncate.py``) and a
**tombstone** for every key whose latest record in the log is a live row older than the
re-snapshot: those rows were deleted while the position was lost, and no other record will ever
say so. The keys come from the log itself (:func:`stale_keys`), not from memory, so the step is
idempotent: after a crash the same scan finds only the keys not yet resolved, and a re-run writes
nothing twice.

Why this converges a projection with no doubled effect: every re-read row replaces the key's row
in a latest-row or grouped view (an ``op=r`` is an upsert of the key, never an increment), the
deletes retract exactly the rows the views still hold, and positions only grow, so the log-to-view
guard (``kappaflow.projections``) applies each record once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from kappaflow.connectors.base import OP_HEADER, record_position
from kappaflow.connectors.truncate import TRUNCATE_KEY, _envelope
from kappaflow.errors import Retry, SourceError
from kappaflow.events import Position
from kappaflow.log.base import Log, LogRecord

__all__ = [
    "ResnapshotRequest",
    "delete_value",
    "last_values",
    "lost_position",
    "resnapshot_hint",
    "stale_keys",
    "vanished_rows",
]

_KF_POS = b'"kf_pos":{'


def resnapshot_hint(source: str) -> str:
    """The one command that recovers a lost position (every lost-position error ends with it)."""
    return f"kappaflow capture {source} --resnapshot"


def lost_position(source: str, detail: str, where: str = "") -> SourceError:
    """A terminal error for a position the source no longer has: what was lost, why it matters, the fix."""
    at = f" [{where}]" if where else ""
    return SourceError(
        f"source {source!r}: {detail}: the changes after the captured position are gone from the source, so "
        f"streaming cannot continue without missing some. Recover with `{resnapshot_hint(source)}` (a new "
        f"position, a full snapshot through the log, and deletes for the rows removed meanwhile; README "
        f"'Lost positions'){at}",
        retry=Retry.TERMINAL,
    )


@dataclass
class ResnapshotRequest:
    """``capture --resnapshot [--force]`` handed to a connector, shared by the CLI's retries.

    ``started``: this command already began (or finished) the re-snapshot, so a retry after a
    transient failure resumes it instead of refusing because the position is healthy again.
    ``said``: what the connector decided, for the CLI to print.
    """

    force: bool = False
    started: bool = False
    said: list[str] = field(default_factory=list)

    def say(self, message: str) -> None:
        self.said.append(message)


def _position(rec: LogRecord) -> Position | None:
    """A record's position, reading only the ``kf_pos`` object of a change event (fast path)."""
    v = rec.value
    if v is not None:
        i = v.rfind(_KF_POS)
        if i >= 0:
            j = v.find(b"}", i)
            try:
                return Position.from_dict(orjson.loads(v[i + len(_KF_POS) - 1:j + 1]))
            except Exception:  # anything odd: the full parse below decides
                pass
    return record_position(rec)


def _older(pos: Position | None, start: Position) -> bool:
    if pos is None:
        return True
    try:
        return pos.sort_key() < start.sort_key() if type(pos) is type(start) else True
    except TypeError:
        return True


def stale_keys(log: Log, topic: str, partition: int, start: Position) -> dict[bytes, int]:
    """Keys of one partition whose latest record is a live row positioned before ``start``.

    -> key: offset of that record. A key whose latest record is a tombstone or a delete is gone
    already; one with any record at or after ``start`` (the re-snapshot read it, the stream changed
    it, or an earlier run of this step deleted it) is current. Holds only keys, not rows.
    """
    live: dict[bytes, int] = {}
    for rec in log.iter_partition(topic, partition):
        k = rec.key
        if k is None or k == TRUNCATE_KEY:
            continue
        if rec.value is None or not _older(_position(rec), start):
            live.pop(k, None)
            continue
        op = next((v for n, v in rec.headers if n == OP_HEADER), None)
        if op == b"d":
            live.pop(k, None)
        else:
            live[k] = rec.offset
    return live


def vanished_rows(log: Log, topic: str, partition: int,
                  stale: dict[bytes, int]) -> Iterator[tuple[bytes, dict[str, Any] | None, list[str] | None]]:
    """(key, the row as the log last held it, its ``kf_unavailable`` columns) per stale key, in key
    order; the row is None when the last record holds none (not a change event)."""
    for key in sorted(stale):
        recs = log.read(topic, partition, stale[key], 1)
        row: Any = None
        unavailable: Any = None
        if recs and recs[0].key == key and recs[0].value is not None:
            try:
                last, _ = _envelope(recs[0].value)
                row = last.get("after")
                unavailable = last.get("kf_unavailable")
            except (ValueError, orjson.JSONDecodeError):
                row = None
        yield key, row if type(row) is dict else None, unavailable if type(unavailable) is list else None


def last_values(log: Log, topic: str, partition: int, stale: dict[bytes, int]) -> Iterator[tuple[bytes, bytes | None]]:
    """(key, the value of its last record) per stale key, in key order."""
    for key in sorted(stale):
        recs = log.read(topic, partition, stale[key], 1)
        yield key, recs[0].value if recs and recs[0].key == key else None


def delete_value(last: bytes | None, position: Position, ts_ms: int, source: Mapping[str, Any]) -> bytes | None:
    """The ``op=d`` event for a vanished key from its last change event: ``before`` is that event's
    ``after``; its source block gets ``source``, the new position and ``snapshot = "true"``. None when
    the last value holds no row (only the tombstone is written then)."""
    if last is None:
        return None
    try:
        head, wrapped = _envelope(last)
    except (ValueError, orjson.JSONDecodeError):
        return None
    row = head.get("after")
    if type(row) is not dict:
        return None
    src = dict(head.get("source") or {})
    src.update(source)
    src.update({"snapshot": "true", "ts_ms": ts_ms, "kf_pos": position.to_dict()})
    payload: dict[str, Any] = {**head, "before": row, "after": None, "source": src, "transaction": None, "op": "d",
                               "ts_ms": ts_ms, "kf_resnapshot": True}
    for unit, scale in (("ts_us", 1000), ("ts_ns", 1_000_000)):
        if unit in payload:
            payload[unit] = ts_ms * scale
    msg: Any = payload if wrapped is None else {"schema": wrapped["schema"], "payload": payload}
    return orjson.dumps(msg)
