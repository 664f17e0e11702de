"""The PostgreSQL connector's offset context (what the offsets topic stores per source).

``lsn`` is the resume point: the end LSN of the last transaction whose records
(and this offset) are durable in the log — streaming restarts there. During a
snapshot, ``snapshot`` records per-table progress (the key of the last row of
the last completed chunk), so a crash resumes from the next chunk instead of
from zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kappaflow.connectors.base import OffsetContext
from kappaflow.errors import ValidationError

__all__ = ["PgOffset", "SnapshotProgress", "TableProgress"]


@dataclass
class TableProgress:
    done: bool = False
    last_key: list[str] | None = None  # text form of the key columns of the last row written
    rows: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"done": self.done, "last_key": self.last_key, "rows": self.rows}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TableProgress:
        lk = d.get("last_key")
        return cls(bool(d.get("done", False)), list(lk) if lk is not None else None, int(d.get("rows", 0)))


@dataclass
class SnapshotProgress:
    lsn: int  # LSN stamped on snapshot positions; streaming resumes here afterwards
    next_index: int = 0
    tables: dict[str, TableProgress] = field(default_factory=dict)
    completed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"lsn": self.lsn, "next_index": self.next_index, "completed": self.completed,
                "tables": {k: v.to_dict() for k, v in self.tables.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SnapshotProgress:
        return cls(int(d["lsn"]), int(d.get("next_index", 0)),
                   {k: TableProgress.from_dict(v) for k, v in (d.get("tables") or {}).items()},
                   bool(d.get("completed", False)))


@dataclass
class PgOffset(OffsetContext):
    slot: str
    lsn: int  # resume streaming here (end LSN of the last durable transaction)
    phase: str = "streaming"  # "snapshot" | "streaming" | "done" (initial_only finished)
    last_commit_lsn: int = 0
    snapshot: SnapshotProgress | None = None
    events: int = 0  # events captured so far (for status)
    # this snapshot re-captures a log that already holds records (``kappaflow capture --resnapshot``,
    # ``connectors/resnapshot.py``): when it completes, keys it did not read get deletes
    resnapshot: bool = False
    # on-demand snapshot state (connectors/ondemand.py OnDemandState.to_dict), None when never used
    ondemand: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {
            "kind": "pg", "slot": self.slot, "lsn": self.lsn, "phase": self.phase,
            "last_commit_lsn": self.last_commit_lsn,
            "snapshot": None if self.snapshot is None else self.snapshot.to_dict(),
            "events": self.events,
            **({"ondemand": self.ondemand} if self.ondemand is not None else {}),
        }
        if self.resnapshot:
            d["resnapshot"] = True
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PgOffset:
        try:
            if d.get("kind") != "pg":
                raise ValueError(f"kind {d.get('kind')!r} is not 'pg'")
            snap = d.get("snapshot")
            return cls(
                slot=str(d["slot"]), lsn=int(d["lsn"]), phase=str(d.get("phase", "streaming")),
                last_commit_lsn=int(d.get("last_commit_lsn", 0)),
                snapshot=None if snap is None else SnapshotProgress.from_dict(snap),
                events=int(d.get("events", 0)), resnapshot=bool(d.get("resnapshot", False)),
                ondemand=dict(d["ondemand"]) if isinstance(d.get("ondemand"), dict) else None,
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ValidationError(f"postgres offset: malformed stored offset ({exc}); expected the dict written "
                                  "by PgOffset.to_dict") from None
