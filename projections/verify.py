"""Verify: rebuild the view into a scratch target and report rows that drifted.

The scratch is built from the log up to the live view's own positions, then compared
with the live view in one snapshot that also reads those positions; if a follower moved
the positions meanwhile, the scratch catches up (the follow code path) and the
comparison is repeated. Drift means something changed the view behind kappaflow's back
(or a projection is not deterministic); ``kappaflow verify`` exits 1 on drift. The
search/Redis views of a grouped projection mirror its PostgreSQL view and are compared
with it (``mirror.py``).

A comparison only covers the log up to the view's positions, so the result also says how
far that is: the log end when verify started, the positions compared at, and how many rows
were compared. A view whose positions are below that log end is *behind* (``lag``), never
"ok" — a view 720k records behind once compared "ok (0 rows)" because the empty prefix it
had consumed matched. ``wait_s`` first waits (bounded) for a follower to bring the view to
that log end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kappaflow.errors import ConfigError
from kappaflow.projections.api import Projection, ProjectionSpec
from kappaflow.projections.engine import apply_range, build, drop_state, flatten, nest, prepare
from kappaflow.projections.mirror import copy as copy_mirror
from kappaflow.projections.mirror import is_mirror, open_source
from kappaflow.projections.plan import Plan
from kappaflow.projections.replay import as_spec
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.sinks.base import Drift, Sink, Target


@dataclass
class VerifyResult:
    """``rows``: rows in the live view; ``rows_compared``: rows of the fresh replay it was compared
    with (at ``positions``); ``log_end``: the log's end offsets when verify started."""

    projection: str
    view: str
    rows: int
    drift_count: int
    drift: list[Drift] = field(default_factory=list)
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    seconds: float = 0.0
    attempts: int = 1
    sink: str = "postgres"
    rows_compared: int = 0
    log_end: dict[tuple[str, int], int] = field(default_factory=dict)

    @property
    def lag(self) -> int:
        """Records between the positions compared at and the log end (0: the whole log was compared)."""
        return sum(max(0, e - self.positions.get(tp, 0)) for tp, e in self.log_end.items())

    @property
    def position(self) -> int:
        """The positions compared at, summed over the log partitions (capped at the log end)."""
        return sum(min(self.positions.get(tp, 0), e) for tp, e in self.log_end.items())

    @property
    def log_end_total(self) -> int:
        return sum(self.log_end.values())

    @property
    def matches(self) -> bool:
        """The view equals a fresh replay up to its own positions (it may still be behind)."""
        return self.drift_count == 0 and not (self.rows and not self.rows_compared)

    @property
    def ok(self) -> bool:
        """Matches a fresh replay of the whole log (as of when verify started)."""
        return self.matches and self.lag == 0


def verify(
    projection: ProjectionSpec | type[Projection] | Projection,
    rt: Runtime,
    *,
    limit: int = 100,
    attempts: int = 5,
    plan: Plan | None = None,
    sink: str | None = None,
    wait_s: float = 0.0,
) -> VerifyResult:
    """Verify the view in `sink` (default: the projection's first sink). `wait_s`: wait up to that
    long for the view's positions to reach the log end first (a follower catching up)."""
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
    log_end = flatten(rt.end_offsets(spec.topics))
    if wait_s > 0:
        _wait_caught_up(sink_, live, log_end, wait_s)
    if is_mirror(spec, name):
        res = _verify_mirror(plan, rt, store, live, name, limit, attempts, t0)
        res.log_end = log_end
        return res
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
                    name, rows_compared=sink_.count(scratch), log_end=log_end,
                )
            new_end = nest(now_pos, spec.topics, partitions)  # a follower moved on: catch the scratch up
            apply_range(plan, rt, scratch, end, new_end, sink=sink_)
            end = new_end
        raise AssertionError("unreachable")
    finally:
        drop_state(plan, rt, sink_, scratch)
        sink_.drop(scratch)


def _verify_mirror(
    plan: Plan, rt: Runtime, store: Sink, live: Target, name: str, limit: int, attempts: int, t0: float
) -> VerifyResult:
    """A mirror (search/Redis view of a grouped projection) is compared with its PostgreSQL view:
    the view is copied into a scratch target of the mirror's sink (same value encoding) and
    diffed there when the mirror's positions equal the copied ones (its follower may be one
    poll behind: retried up to `attempts` times)."""
    pg = open_source(plan.spec, rt, name)
    try:
        for attempt in range(1, attempts + 1):
            scratch = store.begin_shadow(plan.view, label="verify")
            try:
                _, positions, _ = copy_mirror(plan, rt, pg, store, scratch, dead_letters=False)
                now_pos, count, drift = store.diff(live, scratch, limit)
                compared = store.count(scratch)
            finally:
                store.drop(scratch)
            if now_pos == positions or attempt == attempts:
                return VerifyResult(
                    plan.spec.name, plan.view.name, store.count(live), count, drift, now_pos,
                    time.monotonic() - t0, attempt, name, rows_compared=compared,
                )
            time.sleep(0.5)
        raise AssertionError("unreachable")
    finally:
        pg.close()


def _wait_caught_up(sink: Sink, live: Target, log_end: dict[tuple[str, int], int], wait_s: float) -> bool:
    """Poll the view's stored positions until they reach `log_end` or `wait_s` passes (bounded)."""
    deadline = time.monotonic() + wait_s
    while True:
        pos = sink.read_positions(live)
        if all(pos.get(tp, 0) >= e for tp, e in log_end.items()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


__all__ = ["VerifyResult", "verify"]
