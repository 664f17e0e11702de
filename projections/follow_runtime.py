"""Many projections in one Spark application: ``kappaflow follow A B ...`` / ``follow module`` / ``--all``.

Why one runtime: every ``kappaflow follow`` used to be its own Spark driver (a JVM of 0.7-0.8 GB
and 5-50 s of start-up); an application with twenty views needed twenty of them. A
``FollowRuntime`` runs one ``Follower`` per (projection, sink) in ONE SparkSession: each is its
own streaming query with its own lock, stored positions, checkpoint and backoff, so

- a failing query (its store is down, a batch fails) backs off and restarts alone, on the same
  JVM; the other queries keep running;
- a follower whose store is down when the runtime starts retries its start in the background
  (``Follower.start(retry_start=True)``) instead of keeping the others from starting;
- an error no retry can fix (a view that needs a rebuild, another process following it) stops
  that follower only; the runtime ends when every follower gave up (``run_forever``).

Why separate reads of a topic several projections share (the issue asked for one read per
micro-batch feeding every fold, or a measured reason not to): a shared read couples the
projections' positions -- one query would commit one checkpoint for all of them, so a
projection whose store is down would hold back (or be skipped by) the others, which is what
per-projection queries exist to avoid. What the separate reads cost is measured by
``bench/follow_many.py`` (``read_once_s`` against the catch-up time; README "Following many
projections"): reading the log is a small share of a follow batch, the fold and the sink
transaction are the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kappaflow.errors import ConfigError
from kappaflow.projections.api import Projection, ProjectionSpec, load_projections
from kappaflow.projections.follow import Follower, FollowerGroup, _run_forever
from kappaflow.projections.replay import as_spec

log = logging.getLogger("kappaflow.projections")


def resolve_projections(targets: Sequence[str], *, all_: bool = False,
                        configured: Sequence[str] = ()) -> list[ProjectionSpec]:
    """The projections ``kappaflow follow`` runs: each target is ``module:Class`` or a module
    (every projection class it offers); ``all_`` takes the ``[follow] projections`` list instead.

    Refused with a ConfigError (before Spark starts): no target, targets together with ``--all``,
    ``--all`` with an empty list, an unknown module or class, and the same projection (by its
    ``name``, which names its view, lock and positions) listed twice."""
    if all_ and targets:
        raise ConfigError("follow: give projections (module:Class or module) or --all, not both")
    if all_:
        if not configured:
            raise ConfigError(
                "follow --all: [follow] projections is empty; list them in kappaflow.toml, e.g. "
                '[follow] projections = ["examples.shop"] (or KAPPAFLOW_FOLLOW__PROJECTIONS=a.b:C,d.e)'
            )
        targets, origin = list(configured), "[follow] projections"
    else:
        origin = "arguments"
    if not targets:
        raise ConfigError("follow: expected at least one projection (module:Class or module), or --all")
    specs: list[ProjectionSpec] = []
    where: dict[str, str] = {}
    for target in targets:
        for spec in load_projections(target):
            path = spec.class_path or spec.name
            if spec.name in where:
                raise ConfigError(
                    f"follow: projection {spec.name!r} is listed twice in the {origin} ({where[spec.name]} and "
                    f"{path}); each projection runs once per runtime"
                )
            where[spec.name] = path
            specs.append(spec)
    return specs


class FollowRuntime:
    """Followers of several projections in one Spark application, started and stopped together.

    ``followers`` maps ``projection/sink`` to its ``Follower`` (what the metrics and progress lines
    read); ``groups`` maps each projection to its ``FollowerGroup``. `sinks` limits every
    projection to those of its sinks named (a projection writing to none of them is an error);
    `checkpoint` is a folder holding one sub-folder per projection. Other keyword arguments go
    to every ``Follower`` (trigger, batch size, backoff)."""

    def __init__(
        self,
        projections: Iterable[ProjectionSpec | type[Projection] | Projection],
        rt: Any,
        *,
        sinks: Sequence[str] | None = None,
        checkpoint: str | None = None,
        **kwargs: Any,
    ) -> None:
        specs = [as_spec(p) for p in projections]
        if not specs:
            raise ConfigError("FollowRuntime: expected at least one projection")
        names = [s.name for s in specs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"FollowRuntime: projection(s) {twice} given more than once")
        self.rt = rt
        self.groups: dict[str, FollowerGroup] = {}
        for spec in specs:
            selected = [n for n in spec.sinks if n in sinks] if sinks else None
            if sinks and not selected:
                raise ConfigError(
                    f"--sink {','.join(sinks)}: projection {spec.name!r} writes to none of them "
                    f"(its sinks: {list(spec.sinks)})"
                )
            ckpt = str(Path(checkpoint) / spec.name) if checkpoint and len(specs) > 1 else checkpoint
            self.groups[spec.name] = FollowerGroup(spec, rt, sinks=selected, checkpoint=ckpt, **kwargs)
        self.followers: dict[str, Follower] = {
            f.name: f for g in self.groups.values() for f in g.followers.values()
        }

    @property
    def specs(self) -> list[ProjectionSpec]:
        return [g.spec for g in self.groups.values()]

    def start(self, *, stagger_s: float = 30.0) -> FollowRuntime:
        """Start every follower. A start that fails for a reason a retry can fix goes on in the
        background; one that cannot (busy, needs a rebuild, bad configuration) stops that follower
        only, logged, unless every follower failed that way: then the first error is raised.

        One query at a time: each waits (at most `stagger_s`) until the one before ran its first
        trigger. Why: a streaming query's start spawns a fresh Python interpreter for the log data
        source's planning side, which must connect back to the JVM within Spark's fixed 10 s; ten
        of them spawned at once on a busy 2-core machine missed it ("Python worker failed to
        connect back") and each query then went through restarts with backoff."""
        for f in self.followers.values():
            try:
                f.start(retry_start=True)
            except Exception as exc:
                if len(self.followers) == 1:
                    raise
                f._give_up(exc, "it could not start")
                continue
            deadline = time.monotonic() + stagger_s
            while time.monotonic() < deadline and f.healthy and not f.running:
                time.sleep(0.05)
        self.check()
        return self

    def stop(self) -> None:
        errors = []
        for f in self.followers.values():
            try:
                f.stop()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def caught_up(self) -> bool:
        """Every follower's stored positions reach the log's current end."""
        return all(f.caught_up() for f in self.followers.values())

    def check(self) -> None:
        """Raise when every follower gave up (one failing query alone does not stop the rest)."""
        failed = [f.failed for f in self.followers.values() if f.failed is not None]
        if failed and len(failed) == len(self.followers):
            raise failed[0]

    def wait_for(self, condition: Callable[[FollowRuntime], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if condition(self):
                    return True
            except Exception as exc:  # a store is down: its follower retries, keep waiting
                log.debug("wait_for: %s", exc)
            self.check()
            time.sleep(0.05)
        return condition(self)

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """Run until SIGINT/SIGTERM (or `stop`), or until every follower gave up (raises then)."""
        _run_forever(list(self.followers.values()), stop)


__all__ = ["FollowRuntime", "resolve_projections"]
