"""Verify: rebuild the view into a scratch target and report rows that drifted.

The scratch is built from the log up to the live view's own positions, then compared
with the live view in one snapshot that also reads those positions; if a follower moved
the positions meanwhile, the scratch catches up (the follow code path) and the
comparison is repeated. Drift means something changed the view behind kappaflow's back
(or a projection is not deterministic); ``kappaflow verify`` exits 1 on drift.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kappaflow.errors import ConfigError
from kappaflow.projections.api import Projection, ProjectionSpec
from kappaflow.projections.engine import apply_range, build, flatten, nest, prepare
from kappaflow.projections.plan import Plan
from kappaflow.projections.replay import as_spec
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.sinks.base import Drift


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


__all__ = ["VerifyResult", "verify"]
