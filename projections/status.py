"""Status of projections: where each view is, its positions and lag per log partition."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kappaflow.errors import ConfigError, UnknownTopicError
from kappaflow.projections.runtime import Runtime


@dataclass
class PartitionLag:
    topic: str
    partition: int
    position: int  # next offset the view will read
    end: int  # log end offset now

    @property
    def lag(self) -> int:
        return max(0, self.end - self.position)


@dataclass
class ProjectionStatus:
    name: str
    kind: str
    view: str
    rows: int | None
    generation: int
    class_path: str | None
    replayed_at: Any
    updated_at: Any
    partitions: list[PartitionLag] = field(default_factory=list)
    following: bool = False

    @property
    def lag(self) -> int:
        return sum(p.lag for p in self.partitions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "view": self.view,
            "rows": self.rows,
            "generation": self.generation,
            "class_path": self.class_path,
            "replayed_at": str(self.replayed_at) if self.replayed_at else None,
            "updated_at": str(self.updated_at) if self.updated_at else None,
            "following": self.following,
            "lag": self.lag,
            "partitions": [
                {"topic": p.topic, "partition": p.partition, "position": p.position, "end": p.end, "lag": p.lag}
                for p in self.partitions
            ],
        }


def projection_status(rt: Runtime, name: str | None = None) -> list[ProjectionStatus]:
    """Every registered projection (or one), with per-partition positions and lag."""
    from kappaflow.projections.sinks.base import Target

    out = []
    with rt.registry() as reg:
        entries = reg.list() if name is None else [e for e in [reg.by_view(name)] if e is not None]
        if name is not None and not entries:
            known = ", ".join(e.name for e in reg.list()) or "none yet"
            raise ConfigError(f"unknown projection or view {name!r} (registered: {known})")
        for e in entries:
            view = e.view
            live = Target(view, view.name)
            try:
                rows = rt.sink.count(live)
            except Exception:
                rows = None
            positions = rt.sink.read_positions(live)
            parts = []
            log = rt.reader()
            for t in e.topics:
                try:
                    ends = log.end_offsets(t)
                except UnknownTopicError:
                    ends = {}
                for p, end in sorted(ends.items()):
                    parts.append(PartitionLag(t, p, positions.get((t, p), 0), end))
            following = _is_locked(rt, e.name)
            out.append(
                ProjectionStatus(
                    e.name,
                    e.kind,
                    f"{e.view_schema}.{e.view_table}",
                    rows,
                    e.generation,
                    e.class_path,
                    e.replayed_at,
                    e.updated_at,
                    parts,
                    following,
                )
            )
    return out


def _is_locked(rt: Runtime, name: str) -> bool:
    """True when a follower or replay holds the projection's lock (checked without taking it)."""
    if not rt.dsn:
        return False
    import psycopg

    with psycopg.connect(rt.dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
            "((classid::bigint << 32) | objid::bigint) = hashtextextended(%s, 7270604)",
            ("kappaflow.projection:" + name,),
        ).fetchone()
    return bool(row and row[0])


__all__ = ["PartitionLag", "ProjectionStatus", "projection_status"]
