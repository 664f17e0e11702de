"""Status of projections: where each view is, its positions and lag per log partition, per sink.

Every configured sink that holds a live copy of a registered view reports its own rows,
positions and lag (each sink follows from its own positions); the top-level fields of a
``ProjectionStatus`` are those of its first sink (PostgreSQL when it has the view)."""

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
class SinkStatus:
    sink: str
    rows: int | None
    partitions: list[PartitionLag] = field(default_factory=list)
    following: bool = False
    error: str | None = None  # the store could not be read (down?)
    details: dict[str, Any] = field(default_factory=dict)  # the fold's own (``FoldStrategy.status_details``)

    @property
    def lag(self) -> int:
        return sum(p.lag for p in self.partitions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sink": self.sink,
            "rows": self.rows,
            "following": self.following,
            "lag": self.lag,
            "error": self.error,
            **({"details": self.details} if self.details else {}),
            "partitions": [
                {"topic": p.topic, "partition": p.partition, "position": p.position, "end": p.end, "lag": p.lag}
                for p in self.partitions
            ],
        }


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
    sinks: list[SinkStatus] = field(default_factory=list)
    needs_rebuild: str | None = None  # why the view must be rebuilt (a follower stopped on it)

    @property
    def lag(self) -> int:
        return sum(p.lag for p in self.partitions)

    @property
    def state(self) -> str:
        """"needs rebuild" (never healthy, whatever the positions say), "following" or "stopped"."""
        if self.needs_rebuild:
            return "needs rebuild"
        return "following" if self.following else "stopped"

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
            "state": self.state,
            "needs_rebuild": self.needs_rebuild,
            "lag": self.lag,
            "partitions": [
                {"topic": p.topic, "partition": p.partition, "position": p.position, "end": p.end, "lag": p.lag}
                for p in self.partitions
            ],
            "sinks": [x.to_dict() for x in self.sinks],
        }


def projection_status(rt: Runtime, name: str | None = None) -> list[ProjectionStatus]:
    """Every registered projection (or one), with per-partition positions and lag per sink."""
    out = []
    with rt.registry() as reg:
        entries = reg.list() if name is None else [e for e in [reg.by_view(name)] if e is not None]
        if name is not None and not entries:
            known = ", ".join(e.name for e in reg.list()) or "none yet"
            raise ConfigError(f"unknown projection or view {name!r} (registered: {known})")
        for e in entries:
            view = e.view
            log = rt.reader()
            ends: dict[tuple[str, int], int] = {}
            for t in e.topics:
                try:
                    for p, end in log.end_offsets(t).items():
                        ends[(t, p)] = end
                except UnknownTopicError:
                    pass
            per_sink = [
                st for kind, sink in rt.sinks.items()
                if (st := _sink_status(rt, kind, sink, e.name, view, ends, e.kind))
            ]
            first = per_sink[0] if per_sink else SinkStatus("postgres", None)
            out.append(
                ProjectionStatus(
                    e.name,
                    e.kind,
                    f"{e.view_schema}.{e.view_table}",
                    first.rows,
                    e.generation,
                    e.class_path,
                    e.replayed_at,
                    e.updated_at,
                    first.partitions,
                    first.following,
                    per_sink,
                    e.needs_rebuild,
                )
            )
    return out


def _sink_status(
    rt: Runtime, kind: str, sink: Any, name: str, view: Any, ends: dict[tuple[str, int], int], fold_kind: str = ""
) -> SinkStatus | None:
    """The view's status in one sink; None when the sink does not hold the view."""
    from kappaflow.errors import KappaflowError

    try:
        live = sink.live(view)
        if live is None:
            return None
        positions = sink.read_positions(live)
        try:
            rows = sink.count(live)
        except Exception:
            rows = None
        following = sink.is_locked(name)
    except KappaflowError as exc:
        return SinkStatus(kind, None, [PartitionLag(t, p, 0, end) for (t, p), end in sorted(ends.items())],
                          error=str(exc))
    parts = [PartitionLag(t, p, positions.get((t, p), 0), end) for (t, p), end in sorted(ends.items())]
    from kappaflow.projections.folds import strategy_of_kind

    details: dict[str, Any] = {}
    strategy = strategy_of_kind(fold_kind)
    if strategy is not None:
        try:
            details = strategy.status_details(sink, live)
        except Exception as exc:  # the fold's own figures are extra: positions and lag still show
            details = {"error": str(exc)[:200]}
    return SinkStatus(kind, rows, parts, following, details=details)


__all__ = ["PartitionLag", "ProjectionStatus", "SinkStatus", "projection_status"]
