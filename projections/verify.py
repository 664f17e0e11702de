"""Verify: rebuild the view into a scratch target and report rows that drifted.

The scratch is built from the log up to the live view's own positions, then compared
with the live view in one snapshot that also reads those positions; if a follower moved
the positions meanwhile, the scratch catches up (the follow code path) and the
comparison is repeated. Drift means something changed the view behind kappaflow's back
(or a projection is not deterministic); ``kappaflow verify`` exits 1 on drift. The
search/Redis views of a grouped projection mirror its PostgreSQL view and are compared
with it (``mirror.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kappaflow.errors import ConfigError
from kappaflow.projections.api import Projection, ProjectionSpec
from kappaflow.projections.engine import apply_range, build, flatten, nest, prepare
from kappaflow.projections.mirror import copy as copy_mirror
from kappaflow.projections.mirror import is_mirror
from kappaflow.projections.plan import Plan
from kappaflow.projections.replay import as_spec
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.sinks.base import Drift, Sink, Target


@dataclass
class VerifyResult:
    projection: str
    view: str
    rows: int
    drift_count: int
    drift: list[Drift] = field(default_factory=list)
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    seconds: float = 0.0
    attempts: int = 1
    sink: str = "postgres"

    @property
    def ok(self) -> bool:
        return self.drift_count == 0


def verify(
    projection: ProjectionSpec | type[Projection] | Projection,
    rt: Runtime,
    *,
    limit: int = 100,
    attempts: int = 5,
    plan: Plan | None = None,
    sink: str | None = None,
) -> VerifyResult:
    """Verify the view in `sink` (default: the projection's first sink)."""
    t0 = time.monotonic()
    spec = as_spec(projection)
    name = sink or spec.sinks[0]
    store = rt.sinks_for(spec, [name])[name]
    plan = plan or prepare(spec, rt)
    sink_ = store
    live = sink_.live(plan.view)
    if live is None:
        raise ConfigError(
            f"projection {spec.name!r} has no live view {plan.view.name!r} in the {name} sink yet: "
            "run `kappaflow replay` first"
        )
    sink_.ensure(plan.view)  # schema check: a mismatching table is reported clearly
    if is_mirror(spec, name):
        return _verify_mirror(plan, rt, store, live, name, limit, attempts, t0)
    log_ = rt.reader()
    partitions = {t: log_.partitions(t) for t in spec.topics}
    positions = sink_.read_positions(live)
    end = nest(positions, spec.topics, partitions)
    scratch = sink_.begin_shadow(plan.view, label="verify")
    try:
        build(plan, rt, scratch, end, dead_letters=False, sink=sink_)
        for attempt in range(1, attempts + 1):
            now_pos, count, drift = sink_.diff(live, scratch, limit)
            if now_pos == flatten(end) or attempt == attempts:
                return VerifyResult(
                    spec.name, plan.view.name, sink_.count(live), count, drift, now_pos, time.monotonic() - t0, attempt,
                    name,
                )
            new_end = nest(now_pos, spec.topics, partitions)  # a follower moved on: catch the scratch up
            apply_range(plan, rt, scratch, end, new_end, sink=sink_)
            end = new_end
        raise AssertionError("unreachable")
    finally:
        sink_.drop(scratch)


def _verify_mirror(
    plan: Plan, rt: Runtime, store: Sink, live: Target, name: str, limit: int, attempts: int, t0: float
) -> VerifyResult:
    """A mirror (search/Redis view of a grouped projection) is compared with its PostgreSQL view:
    the view is copied into a scratch target of the mirror's sink (same value encoding) and
    diffed there when the mirror's positions equal the copied ones (its follower may be one
    poll behind: retried up to `attempts` times)."""
    pg = rt.sink_for(plan.spec.name, "postgres").config().open()
    try:
        for attempt in range(1, attempts + 1):
            scratch = store.begin_shadow(plan.view, label="verify")
            try:
                _, positions, _ = copy_mirror(plan, rt, pg, store, scratch, dead_letters=False)
                now_pos, count, drift = store.diff(live, scratch, limit)
            finally:
                store.drop(scratch)
            if now_pos == positions or attempt == attempts:
                return VerifyResult(
                    plan.spec.name, plan.view.name, store.count(live), count, drift, now_pos,
                    time.monotonic() - t0, attempt, name,
                )
            time.sleep(0.5)
        raise AssertionError("unreachable")
    finally:
        pg.close()


__all__ = ["VerifyResult", "verify"]
