"""Mirrors: the search/Redis views of a grouped projection are copies of its PostgreSQL view.

A grouped fold (``aggregates``) retracts a source row's old contribution when the row
changes group or is deleted; that needs the per-source-key state and a recompute of the
touched groups in one transaction, which only a sink with ``GroupedStateStore`` has (PostgreSQL,
``apply_grouped``). So a grouped projection may name "search"/"redis" only together with
"postgres", and those sinks MIRROR the PostgreSQL view instead of folding the log themselves.
Which sink mirrors which is the fold's mirror policy (``FoldStrategy.mirror_source``); the
copy reads the source sink through its ``GroupedStateStore`` (``read_for_mirror``), never by kind:

- **replay** (``copy`` into a new shadow): after the PostgreSQL view is built (or from the
  live one), read all its rows with their ``_kf_version`` and the positions stored with
  them in ONE snapshot, write them into the shadow, store those positions, swap;
- **follow** (``sync``, one call per poll of a mirror follower): P = PostgreSQL's positions,
  M = the mirror's. When P is ahead of M, read in ONE snapshot the positions and the rows
  of every group recomputed at a version above watermark(M) (``apply_grouped`` records each
  affected group, deleted ones included, in a group change table), write them with their
  versions (the sink's guard: never older over newer), delete the changed groups that are
  gone with version watermark(P), then store M := P (the positions read WITH the rows).
  M therefore never runs ahead of PostgreSQL; re-running after a crash rewrites the same
  versions (no effect); a lagging PostgreSQL follower just makes the mirror wait. Reading
  the group change table instead of the log also covers deletes and moves whose
  before-image carries only the source key (``REPLICA IDENTITY DEFAULT``).
- **verify**: the PostgreSQL view is copied into a scratch target of the mirror's sink and
  compared there, at equal positions.
PostgreSQL positions behind the mirror's (the PostgreSQL view was dropped and re-created),
or a PostgreSQL view rebuilt after the mirror's position (e.g. by its own follower after the
view was lost: the new change table starts at the rebuild, so the groups changed or gone in
between are not in it), raise ``SinkStateLostError``: the follower then rebuilds the mirror
from the view.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from kappaflow.errors import ConfigError
from kappaflow.projections.api import ProjectionSpec
from kappaflow.projections.engine import BatchResult, _dead_letter, sink_rejections, watermark
from kappaflow.projections.folds import strategy_for
from kappaflow.projections.plan import Plan
from kappaflow.projections.sinks.base import (
    DELETED,
    VERSION,
    GroupedStateStore,
    Sink,
    Target,
    TopicPartition,
    batch_from_rows,
)
from kappaflow.projections.sinks.errors import SinkStateLostError
from kappaflow.projections.sinks.keys import key_str


def mirror_source(spec: ProjectionSpec, sink: str) -> str | None:
    """The sink whose view the projection's sink `sink` copies (None: `sink` folds the log itself)."""
    return strategy_for(spec).mirror_source(spec, sink)


def is_mirror(spec: ProjectionSpec, sink: str) -> bool:
    """True when the projection's sink `sink` keeps a copy of another sink's view (grouped folds)."""
    return mirror_source(spec, sink) is not None


def open_source(spec: ProjectionSpec, rt: Any, sink: str) -> Sink:
    """A new connection to the sink the mirror `sink` copies (the caller closes it)."""
    name = mirror_source(spec, sink)
    if name is None:
        raise ConfigError(f"projection {spec.name!r}: its {sink} view is not a mirror")
    return rt.sink_for(spec.name, name).config().open()


def _state(plan: Plan, src: Sink) -> GroupedStateStore:
    keeper = src.grouped_state()
    if keeper is None:
        raise ConfigError(f"projection {plan.spec.name!r}: the {src.kind} sink keeps no grouped view to mirror")
    return keeper


def _pg_live(plan: Plan, pg: Sink) -> Target:
    live = pg.live(plan.view)
    if live is None:
        raise ConfigError(
            f"projection {plan.spec.name!r}: its search/Redis views mirror the {pg.kind} view "
            f"{plan.view.name!r}, which does not exist yet; replay the projection with its {pg.kind} sink first"
        )
    return live


def _write(plan: Plan, sink: Sink, target: Target, rows: list[dict[str, Any]], refused: list[Any]) -> int:
    batch = batch_from_rows(plan.view, [{c: r.get(c) for c in (*plan.view.column_names, VERSION)} for r in rows])
    w = sink.write(target, batch)
    refused += [(key_str(k), next((int(r[VERSION]) for r in rows if _key(plan, r) == tuple(k)), None), why)
                for k, why in w.rejected]
    return w.upserted


def _key(plan: Plan, row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row[k] for k in plan.view.key)


def copy(
    plan: Plan, rt: Any, pg: Sink, sink: Sink, target: Target, *, dead_letters: bool = True
) -> tuple[int, dict[TopicPartition, int], int]:
    """Write every row of the PostgreSQL view into `target` (a fresh shadow) and store the
    positions read with them: (rows written, positions, rows refused)."""
    refused: list[Any] = []
    written = 0

    def consume(rows: list[dict[str, Any]]) -> None:
        nonlocal written
        written += _write(plan, sink, target, rows, refused)

    positions, _ = _state(plan, pg).read_for_mirror(_pg_live(plan, pg), None, consume)
    dead = _refused(plan, rt, sink, refused, dead_letters)
    if positions:
        sink.store_positions(target, positions)
    return written, positions, dead


def _refused(plan: Plan, rt: Any, sink: Sink, refused: list[Any], dead_letters: bool) -> int:
    if not refused:
        return 0
    if not dead_letters:
        return len(refused)
    return _dead_letter(rt, plan, sink_rejections(plan, sink.kind, refused, None))


def ahead(p: dict[TopicPartition, int], m: dict[TopicPartition, int]) -> bool:
    """PostgreSQL's positions `p` are past the mirror's `m` somewhere."""
    return any(o > m.get(tp, 0) for tp, o in p.items())


def sync(plan: Plan, rt: Any, pg: Sink, sink: Sink, target: Target) -> BatchResult | None:
    """Bring the live mirror `target` up to the PostgreSQL view (see the module docstring);
    None when PostgreSQL has nothing new."""
    pg_live = _pg_live(plan, pg)
    m = sink.read_positions(target)
    p = pg.read_positions(pg_live)
    behind = sorted(tp for tp, o in m.items() if o > p.get(tp, 0))
    if behind:
        raise SinkStateLostError(
            f"projection {plan.spec.name!r}: the PostgreSQL view {plan.view.name!r} is behind its "
            f"{sink.kind} mirror at {behind[:5]} (it was dropped or re-created); the mirror is rebuilt from it"
        )
    if m and not ahead(p, m):
        return None
    refused: list[Any] = []
    res = BatchResult()

    def consume(rows: list[dict[str, Any]]) -> None:
        res.upserted += _write(plan, sink, target, rows, refused)

    # No positions yet (a new mirror): copy every row, guarded like any follow write.
    p, gone = _state(plan, pg).read_for_mirror(pg_live, watermark(m) if m else None, consume)
    if gone:
        view = plan.view
        version = watermark(p)
        schema = view.arrow_schema()
        cols: dict[str, list[Any]] = {f.name: [] for f in schema}
        for k in gone:
            for f in schema:
                cols[f.name].append(
                    k[view.key.index(f.name)] if f.name in view.key else version if f.name == VERSION
                    else True if f.name == DELETED else None
                )
        w = sink.write(target, pa.Table.from_pydict(cols, schema=schema))
        res.deleted = w.deleted
        refused += [(key_str(k), version, why) for k, why in w.rejected]
    res.dead_letters = _refused(plan, rt, sink, refused, True)
    if p:
        sink.store_positions(target, p)  # after the rows and dead letters: a crash re-runs the sync
    res.events = sum(o - m.get(tp, 0) for tp, o in p.items())
    res.positions = dict(p)
    return res


__all__ = ["ahead", "copy", "is_mirror", "mirror_source", "open_source", "sync"]
