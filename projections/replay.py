"""Replay: rebuild a view from the start of the log without taking the old one offline.

A projection's view lives in every sink it names (``Projection.sinks``); a replay rebuilds
all of them, or the ones selected (``sinks=["redis"]``, CLI ``--sink redis``). Steps
(each is tested):

1. take the projection's build lock and its lock in every selected sink (one replay or follow
   per projection and sink at a time: PostgreSQL advisory lock, search/Redis lease); a sink
   whose lock a follower holds is not waited for: the replay builds its shadow (steps 2-4)
   without that lock and hands it over to the follower, which catches it up and swaps it in
   between two batches (``handover.py``);
2. note the log's end offsets E and create an empty shadow beside each live view
   (a leftover shadow from an interrupted replay is dropped first: a replay killed with
   -9 never leaves a half view live, and the next replay restarts cleanly);
3. fold the log [0, E) into each shadow in Spark (executors load their partitions);
   rows a sink refuses go to the dead-letter topic;
4. store E as each shadow's positions, then catch up: fold (E, E'] with the follow code
   path into every shadow until the log's end stops moving (bounded rounds);
5. swap each sink in turn: the shadow becomes the live view and its positions the live
   positions atomically within that sink (rename in one transaction / alias swap /
   pointer switch); readers see the old view until then and the new one after;
   the search/Redis views of a grouped projection are not folded from the log: they mirror
   the PostgreSQL view and are copied from it after its swap (``mirror.py``), so a replay
   of such a projection's postgres sink replays its mirrors too;
6. record the projection (new generation) in the registry.
On any failure before 5 every shadow is dropped and every live view is untouched.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kappaflow.projections.api import Projection, ProjectionSpec
from kappaflow.projections.engine import (
    ProjectionBusy,
    apply_range,
    build,
    drop_state,
    flatten,
    nest,
    prepare,
    swap_in,
)
from kappaflow.projections.handover import SHADOW_LABEL, HandoverFailed, Handovers, await_handover, build_lock_name
from kappaflow.projections.mirror import copy as copy_mirror
from kappaflow.projections.mirror import is_mirror, mirror_source, open_source
from kappaflow.projections.plan import Plan
from kappaflow.projections.runtime import Offsets, Runtime
from kappaflow.projections.sinks.base import Sink, Target

log = logging.getLogger("kappaflow.projections")


@dataclass
class SinkReplay:
    """What a replay did in one sink."""

    sink: str
    rows: int = 0
    dead_letters: int = 0
    build_seconds: float = 0.0
    handed_over: bool = False
    """The follower holding the projection's lock took the rebuilt view and swapped it in (``handover.py``)."""


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
    sinks: dict[str, SinkReplay] = field(default_factory=dict)
    """Per sink; ``rows`` above is the first sink's (PostgreSQL when it is one of them)."""

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


def lock_sinks(
    spec: ProjectionSpec, sinks: dict[str, Sink], wait_lock_s: float = 0.0, *, handover: bool = False
) -> list[str]:
    """Take the projection's build lock and its lock in every sink, or none of them (ProjectionBusy
    naming the sink). With `handover` (the registry is there to offer a shadow through,
    ``handover.py``), a sink whose lock a follower holds is not waited for: its name is returned and
    only its build lock is held, the replay then hands its shadow over to that follower."""
    deadline = time.monotonic() + wait_lock_s
    taken: list[Sink] = []
    followed: list[str] = []
    try:
        for name, sink in sinks.items():
            while not sink.try_lock(build_lock_name(spec.name)):
                if time.monotonic() >= deadline:
                    raise ProjectionBusy(f"projection {spec.name!r} is being replayed in the {name} sink by another "
                                         "process; wait for it to finish (or pass --wait)")
                time.sleep(0.2)
            taken.append(sink)
            can_hand_over = handover and not is_mirror(spec, name)
            while not sink.try_lock(spec.name):
                if can_hand_over:
                    followed.append(name)
                    break
                if time.monotonic() >= deadline:
                    lease = getattr(getattr(sink, "options", None), "lock_ttl_s", None)
                    hint = (f"; if its holder died (kill -9), its lease runs out within {lease:g} s: "
                            "retry then, or pass --wait" if lease else "")
                    why = ("its view mirrors the PostgreSQL view, and a mirror's follower takes no rebuilt view"
                           if handover else "without a views database there is no registry to hand a rebuilt "
                           "view over through")
                    raise ProjectionBusy(
                        f"projection {spec.name!r} is being followed or replayed in the {name} sink by another "
                        f"process; stop it first ({why})" + hint
                    )
                time.sleep(0.2)
    except BaseException:
        unlock_sinks(spec, taken)
        raise
    return followed


def unlock_sinks(spec: ProjectionSpec, sinks: Sequence[Sink]) -> None:
    """Release the projection's lock and its build lock (either may not be held)."""
    for sink in sinks:
        for name in (spec.name, build_lock_name(spec.name)):
            try:
                sink.unlock(name)
            except Exception:  # a lost lease or connection: the store releases it on its own
                pass


def rebuild(
    plan: Plan,
    rt: Runtime,
    sinks: dict[str, Sink],
    *,
    catch_up_rounds: int = 3,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, SinkReplay], int, float, dict[tuple[str, int], int], int]:
    """Steps 2-5 for `sinks` (locks held by the caller): (per sink, events, build seconds of the first
    sink, positions, catch-up rounds)."""
    spec = plan.spec
    mirrors = {n: s for n, s in sinks.items() if is_mirror(spec, n)}
    sinks = {n: s for n, s in sinks.items() if n not in mirrors}
    if not sinks:
        out, positions = _copy_mirrors(plan, rt, mirrors)
        return out, 0, 0.0, positions, 0
    shadows, out, events, first_build, end, rounds = _build_shadows(
        plan, rt, sinks, catch_up_rounds=catch_up_rounds, progress=progress)
    for name, sink in sinks.items():
        swap_in(plan, rt, sink, shadows[name])
        live = sink.live(plan.view)
        out[name].rows = sink.count(live) if live is not None else 0
    if mirrors:
        out.update(_copy_mirrors(plan, rt, mirrors)[0])
    return out, events, first_build, end, rounds


def _build_shadows(
    plan: Plan,
    rt: Runtime,
    sinks: dict[str, Sink],
    *,
    label: str = "shadow",
    catch_up_rounds: int = 3,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, Target], dict[str, SinkReplay], int, float, dict[tuple[str, int], int], int]:
    """Steps 2-4: a shadow per sink, built to the log's end and caught up, its positions stored with it;
    (shadows, per sink, events, build seconds of the first sink, positions, catch-up rounds). On any
    failure every shadow is dropped."""
    spec = plan.spec
    end: Offsets = rt.read_end(spec.topics, spec.consistency)  # a consistent cut (issue 17)
    shadows: dict[str, Target] = {}
    out: dict[str, SinkReplay] = {}
    events = 0
    first_build = 0.0
    rounds = 0
    try:
        for name, sink in sinks.items():
            shadows[name] = sink.begin_shadow(plan.view, label)
        total = sum(sum(p.values()) for p in end.values())
        for name, sink in sinks.items():
            if progress is not None:
                with _Progress(rt, total, progress):
                    built = build(plan, rt, shadows[name], end, sink=sink)
            else:
                built = build(plan, rt, shadows[name], end, sink=sink)
            sink.store_positions(shadows[name], flatten(end))
            out[name] = SinkReplay(name, dead_letters=built.dead_letters, build_seconds=built.seconds)
            events = built.events
            first_build = first_build or built.seconds
        for _ in range(catch_up_rounds):
            new_end = rt.read_end(spec.topics, spec.consistency)
            if new_end == end:
                break
            for i, (name, sink) in enumerate(sinks.items()):
                batch = apply_range(plan, rt, shadows[name], end, new_end, sink=sink)
                out[name].dead_letters += batch.dead_letters
                if i == 0:
                    events += batch.events
            end = new_end
            rounds += 1
    except BaseException:
        for name, shadow in shadows.items():
            try:
                drop_state(plan, rt, sinks[name], shadow)
                sinks[name].drop(shadow)
            except Exception:
                pass
        raise
    return shadows, out, events, first_build, flatten(end), rounds


def hand_over(
    plan: Plan,
    rt: Runtime,
    sinks: dict[str, Sink],
    *,
    catch_up_rounds: int = 3,
    progress: Callable[[int, int], None] | None = None,
    timeout_s: float = 60.0,
) -> tuple[dict[str, SinkReplay], int, float, dict[tuple[str, int], int], int]:
    """Replay into `sinks` whose follower holds the lock (``handover.py``): build and catch up a shadow
    in each without that lock, offer it, and wait (at most `timeout_s` per sink) until the follower
    caught it up to its own positions and swapped it in. HandoverFailed when it did not (the live
    view is then unchanged and the shadow dropped). Returns what ``rebuild`` returns."""
    spec = plan.spec
    assert rt.dsn, "a handover goes through the registry in the views database"
    shadows, out, events, first_build, positions, rounds = _build_shadows(
        plan, rt, sinks, label=SHADOW_LABEL, catch_up_rounds=catch_up_rounds, progress=progress)
    db = Handovers(rt.dsn)
    failed: BaseException | None = None
    try:
        for name in sinks:
            db.offer(spec.name, name, shadows[name], spec.fingerprint())
        for name, sink in sinks.items():
            log.info("replay %s: the %s view is followed: handing the rebuilt view over to its follower",
                     spec.name, name)
            try:
                taken = await_handover(db, spec.name, name, sink, shadows[name], timeout_s)
            except HandoverFailed as exc:
                failed = failed or exc
                continue
            if taken is None:  # the follower went away first and the lock is ours: as a plain replay
                out[name].rows = _finish_alone(plan, rt, sink, shadows[name], catch_up_rounds)
                _record(rt, plan, new_generation=True, replayed=True)
                continue
            live = sink.live(plan.view)
            out[name].rows = sink.count(live) if live is not None else 0
            out[name].handed_over = True
    finally:
        db.close()
    if failed is not None:
        raise failed
    return out, events, first_build, positions, rounds


def _copy_mirrors(
    plan: Plan, rt: Runtime, mirrors: dict[str, Sink]
) -> tuple[dict[str, SinkReplay], dict[tuple[str, int], int]]:
    """Search/Redis views of a grouped projection: a new shadow filled from the live PostgreSQL
    view (rows and positions from one snapshot), then swapped in (see ``mirror.py``)."""
    out: dict[str, SinkReplay] = {}
    positions: dict[tuple[str, int], int] = {}
    sources: dict[str, Sink] = {}
    try:
        for name, sink in mirrors.items():
            src = str(mirror_source(plan.spec, name))
            if src not in sources:
                sources[src] = open_source(plan.spec, rt, name)
            pg = sources[src]
            t0 = time.monotonic()
            shadow = sink.begin_shadow(plan.view)
            try:
                _, positions, dead = copy_mirror(plan, rt, pg, sink, shadow)
            except BaseException:
                try:
                    sink.drop(shadow)
                except Exception:
                    pass
                raise
            sink.swap(shadow)
            live = sink.live(plan.view)
            out[name] = SinkReplay(name, rows=sink.count(live) if live is not None else 0, dead_letters=dead,
                                   build_seconds=time.monotonic() - t0)
    finally:
        for s in sources.values():
            s.close()
    return out, positions


def _finish_alone(plan: Plan, rt: Runtime, sink: Sink, shadow: Target, catch_up_rounds: int) -> int:
    """Steps 4-5 for a handover shadow whose follower went away (the caller holds the lock now): catch
    it up from its stored positions, swap it in; the live view's row count."""
    spec = plan.spec
    log_ = rt.reader()
    partitions = {t: log_.partitions(t) for t in spec.topics}
    for _ in range(max(catch_up_rounds, 1)):
        start = nest(sink.read_positions(shadow), spec.topics, partitions)
        end = rt.read_end(spec.topics, spec.consistency)
        if all(end[t].get(p, 0) <= o for t, parts in start.items() for p, o in parts.items()):
            break
        apply_range(plan, rt, shadow, start, end, sink=sink)
    swap_in(plan, rt, sink, shadow)
    live = sink.live(plan.view)
    return sink.count(live) if live is not None else 0


def replay(
    projection: ProjectionSpec | type[Projection] | Projection,
    rt: Runtime,
    *,
    catch_up_rounds: int = 3,
    progress: Callable[[int, int], None] | None = None,
    plan: Plan | None = None,
    wait_lock_s: float = 0.0,
    sinks: Sequence[str] | None = None,
    locked: bool = False,
    followed: Sequence[str] = (),
    handover_timeout_s: float = 60.0,
) -> ReplayResult:
    """Rebuild `projection`'s view in its sinks (or the `sinks` named) from the log (see the module docstring).

    A sink whose follower holds the projection's lock gets the rebuilt view through that follower
    (``handover.py``: it keeps the live view current meanwhile, catches the shadow up and swaps it in;
    this waits at most `handover_timeout_s` for it). `locked`: the caller holds the locks of
    ``replay_sinks(spec, rt, sinks)`` already (``lock_sinks``, whose result it passes as `followed`)
    and releases them; the CLI takes them before starting Spark."""
    t0 = time.monotonic()
    spec = as_spec(projection)
    selected = replay_sinks(spec, rt, sinks)
    if not locked:
        followed = lock_sinks(spec, selected, wait_lock_s, handover=bool(rt.dsn))
    try:
        plan = plan or prepare(spec, rt)
        owned = {n: s for n, s in selected.items() if n not in followed}
        handed = {n: s for n, s in selected.items() if n in followed}
        per_sink: dict[str, SinkReplay] = {}
        events, build_s, rounds = 0, 0.0, 0
        positions: dict[tuple[str, int], int] = {}
        if handed:
            per_sink, events, build_s, positions, rounds = hand_over(
                plan, rt, handed, catch_up_rounds=catch_up_rounds, progress=progress, timeout_s=handover_timeout_s)
        if owned:
            mine, events_o, build_o, positions, rounds_o = rebuild(
                plan, rt, owned, catch_up_rounds=catch_up_rounds, progress=progress
            )
            per_sink.update(mine)
            events, build_s, rounds = events or events_o, build_s or build_o, max(rounds, rounds_o)
            _record(rt, plan, new_generation=True, replayed=True)
        per_sink = {n: per_sink[n] for n in selected if n in per_sink}
        first = next(iter(per_sink.values()))
        return ReplayResult(
            projection=spec.name,
            view=plan.view.name,
            events=events,
            rows=first.rows,
            dead_letters=sum(r.dead_letters for r in per_sink.values()),
            seconds=time.monotonic() - t0,
            build_seconds=build_s,
            positions=positions,
            catch_up_rounds=rounds,
            sinks=per_sink,
        )
    finally:
        if not locked:
            unlock_sinks(spec, list(selected.values()))


def replay_sinks(spec: ProjectionSpec, rt: Runtime, sinks: Sequence[str] | None = None) -> dict[str, Sink]:
    """The sinks a replay of `spec` writes (and locks): `sinks` (default: all of its own), plus the
    mirrors of a grouped projection when its PostgreSQL view is rebuilt (they copy that view)."""
    selected = rt.sinks_for(spec, sinks)
    mirrors = [n for n in spec.sinks if n not in selected and mirror_source(spec, n) in selected]
    if sinks and mirrors:
        selected = rt.sinks_for(spec, [*selected, *mirrors])
    return selected


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


__all__ = [
    "ReplayResult", "SinkReplay", "as_spec", "hand_over", "lock_sinks", "rebuild", "replay", "replay_class",
    "replay_sinks", "unlock_sinks",
]
