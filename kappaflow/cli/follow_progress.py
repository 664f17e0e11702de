"""What ``kappaflow follow`` tells its user while it runs, one timestamped line at a time.

``start()`` of a follower returns as soon as Spark accepted the streaming query; under load
the first trigger came 18-55 s later, so "following ..." printed at start said nothing about
whether the view was moving. Lines, per follower (projection/sink):

- ``running: position P of log end E (lag L records)`` once its query has run its first
  trigger (and again after each restart);
- ``caught up: position E = log end (lag 0)`` when its stored positions reach the log end
  (again after each time it fell behind and caught up);
- ``batch N: ... events, ... upserts, ... deletes; lag L`` for each batch that changed the view;
- failures are logged by the follower itself (one line each, see ``projections/follow.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kappaflow.follow")


class FollowProgress:
    """Watches a ``FollowerGroup`` from its own thread (``start``/``stop``) and logs the lines above."""

    def __init__(self, group: Any, interval: float = 0.5) -> None:
        self.group = group
        self.interval = interval
        self._state: dict[str, str] = {}
        self._restarts: dict[str, int] = {}
        self._batches: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kappaflow-follow-progress", daemon=True)
        for f in group.followers.values():
            f.on_batch = self._on_batch(f)

    def _label(self, f: Any) -> str:
        return str(f.name)  # projection/sink, as the follower's own lines

    def _on_batch(self, f: Any) -> Callable[[Any, Any], None]:
        def report(stats: Any, res: Any) -> None:
            if not (res.events or res.dead_letters):
                return
            lag = ""
            try:  # from the batch's own positions and the log: no store round trip in the batch
                ends = f.rt.end_offsets(f.spec.topics)
                behind = sum(max(0, e - res.positions.get((t, p), 0)) for t, parts in ends.items()
                             for p, e in parts.items())
                lag = f"; lag {behind:,}"
            except Exception:  # the log is unreachable: the next batch will say
                pass
            log.info(
                "follower %s batch %d: %s events, %s upserts, %s deletes%s%s", self._label(f), stats.batches,
                f"{res.events:,}", f"{res.upserted:,}", f"{res.deleted:,}",
                f", {res.dead_letters} dead letters" if res.dead_letters else "", lag,
            )

        return report

    def start(self) -> FollowProgress:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for f in list(self.group.followers.values()):
                try:
                    self._tick(f)
                except Exception as exc:  # a store or the log is down: the follower reports it
                    log.debug("follow progress of %s: %s", f.name, exc)

    def _tick(self, f: Any) -> None:
        name = f.name
        if f.failed is not None:
            return
        if self._restarts.get(name, 0) != f.restarts:
            self._restarts[name] = f.restarts
            self._state[name] = "starting"
        state = self._state.setdefault(name, "starting")
        if state == "starting":
            if not f.running:
                return
            at, end = f.lag()
            log.info("follower %s running: position %s of log end %s (lag %s records)", self._label(f),
                     f"{at:,}", f"{end:,}", f"{end - at:,}")
            state = "behind"
        batches = f.stats.batches
        if state == "caught_up" and self._batches.get(name) == batches:
            return  # nothing happened since it caught up
        self._batches[name] = batches
        at, end = f.lag()
        if at >= end and state != "caught_up":
            log.info("follower %s caught up: position %s = log end (lag 0)", self._label(f), f"{at:,}")
            state = "caught_up"
        elif at < end:
            state = "behind"
        self._state[name] = state


__all__ = ["FollowProgress"]
