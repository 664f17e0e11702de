"""Replay: rebuild a view from the start of the log without taking the old one offline.

Steps (each is tested):

1. take the projection's lock (one replay or follow per projection at a time);
2. note the log's end offsets E and create an empty shadow beside the live view
   (a leftover shadow from an interrupted replay is dropped first: a replay killed with
   -9 never leaves a half view live, and the next replay restarts cleanly);
3. fold the log [0, E) into the shadow in Spark (executors COPY their partitions);
4. store E as the shadow's positions, then catch up: fold (E, E'] with the follow code
   path until the log's end stops moving (bounded rounds);
5. swap: the shadow becomes the live view and its positions the live positions, in one
   transaction; readers see the old view until that commit and the new one after;
6. record the projection (new generation) in the registry.
On any failure before 5 the shadow is dropped and the live view is untouched.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kappaflow.projections.api import Projection, ProjectionSpec
from kappaflow.projections.engine import ProjectionBusy, apply_range, build, flatten, prepare
from kappaflow.projections.plan import Plan
from kappaflow.projections.runtime import Offsets, Runtime


@dataclass
class ReplayResult:
    projection: str
    view: str
    events: int
    rows: int
    dead_letters: int
    seconds: float
    build_seconds: float
    positions: dict[tuple[str, int], int]
    catch_up_rounds: int = 0

    @property
    def events_per_s(self) -> float:
        return self.events / self.build_seconds if self.build_seconds > 0 else 0.0


def as_spec(projection: ProjectionSpec | type[Projection] | Projection) -> ProjectionSpec:
    if isinstance(projection, ProjectionSpec):
        return projection
    return ProjectionSpec.from_class(projection)


class _Progress:
    """Polls Spark's status tracker while a build runs and reports events read (by tasks done)."""

    def __init__(self, rt: Runtime, total: int, report: Callable[[int, int], None]) -> None:
        self.rt, self.total, self.report = rt, total, report
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kappaflow-replay-progress", daemon=True)

    def _run(self) -> None:
        tracker = self.rt.spark.sparkContext.statusTracker()
        best = 0
        while not self.stop.wait(0.5):
            try:
                for sid in tracker.getActiveStageIds():
                    info = tracker.getStageInfo(sid)
                    if info is not None and info.numTasks and info.stageId == min(tracker.getActiveStageIds()):
                        done = int(self.total * info.numCompletedTasks / info.numTasks)
                        best = max(best, done)
                self.report(best, self.total)
            except Exception:
                pass

    def __enter__(self) -> _Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=2)
        self.report(self.total, self.total)


def replay(
    projection: ProjectionSpec | type[Projection] | Projection,
    rt: Runtime,
    *,
    catch_up_rounds: int = 3,
    progress: Callable[[int, int], None] | None = None,
    plan: Plan | None = None,
    wait_lock_s: float = 0.0,
) -> ReplayResult:
    """Rebuild `projection`'s view from the log (see the module docstring)."""
    t0 = time.monotonic()
    spec = as_spec(projection)
    plan = plan or prepare(spec, rt)
    sink = rt.sink
    deadline = time.monotonic() + wait_lock_s
    while not sink.try_lock(spec.name):
        if time.monotonic() >= deadline:
            raise ProjectionBusy(
                f"projection {spec.name!r} is being followed or replayed by another process; stop it first "
                "(a replay swaps the view under the follower's feet otherwise)"
            )
        time.sleep(0.2)
    try:
        end: Offsets = rt.end_offsets(spec.topics)
        shadow = sink.begin_shadow(plan.view)
        try:
            total = sum(sum(p.values()) for p in end.values())
            if progress is not None:
                with _Progress(rt, total, progress):
                    built = build(plan, rt, shadow, end)
            else:
                built = build(plan, rt, shadow, end)
            sink.store_positions(shadow, flatten(end))
            rounds = 0
            events = built.events
            dead = built.dead_letters
            for _ in range(catch_up_rounds):
                new_end = rt.end_offsets(spec.topics)
                if new_end == end:
                    break
                batch = apply_range(plan, rt, shadow, end, new_end)
                events += batch.events
                dead += batch.dead_letters
                end = new_end
                rounds += 1
            sink.swap(shadow)
        except BaseException:
            try:
                sink.drop(shadow)
            except Exception:
                pass
            raise
        _record(rt, plan, new_generation=True, replayed=True)
        rows = sink.count(sink.live(plan.view))
        return ReplayResult(
            projection=spec.name,
            view=plan.view.name,
            events=events,
            rows=rows,
            dead_letters=dead,
            seconds=time.monotonic() - t0,
            build_seconds=built.seconds,
            positions=flatten(end),
            catch_up_rounds=rounds,
        )
    finally:
        sink.unlock(spec.name)


def _record(rt: Runtime, plan: Plan, *, new_generation: bool, replayed: bool) -> int:
    if not rt.dsn:
        return 1
    spec = plan.spec
    with rt.registry() as reg:
        return int(
            reg.record(
                name=spec.name,
                kind=spec.kind,
                view=plan.view,
                schema=plan.view.namespace or getattr(rt.sink, "default_schema", "public"),
                topics=spec.topics,
                class_path=spec.class_path,
                fingerprint=spec.fingerprint(),
                new_generation=new_generation,
                replayed=replayed,
            )
        )


def replay_class(path: str, rt: Runtime, **kwargs: Any) -> ReplayResult:
    from kappaflow.projections.api import load_projection

    return replay(load_projection(path), rt, **kwargs)


__all__ = ["ReplayResult", "as_spec", "replay", "replay_class"]
