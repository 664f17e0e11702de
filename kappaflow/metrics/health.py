"""``kappaflow status --check``: the ``[health]`` thresholds against a ``Report``, one exit code per reason.

For a load balancer's health check or a cron alert: exit 0 when nothing crosses a threshold,
otherwise the code of the most severe reason found (every reason is printed, one line each):

====  =================  ===========================================================================
code  reason             when
====  =================  ===========================================================================
4     stopped_follower   a projection named in ``[health] followers`` ("*": all) is not followed in
                         a sink that holds its view (no process holds its lock there)
5     lag                a sink's view is more than ``max_lag_seconds`` behind the log
6     retained_wal       a source's replication slot retains more than ``max_retained_wal_bytes``
7     dead_letters       a projection's dead-letter topic holds more than ``max_dead_letters``
8     unknown            a part could not be read (views database, a store or a source down)
====  =================  ===========================================================================

(1 is left to crashes, 2 to kappaflow's own errors, 3 to ``verify``'s "behind".)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kappaflow.metrics.report import Report

__all__ = ["CODES", "Problem", "check"]

CODES = {"stopped_follower": 4, "lag": 5, "retained_wal": 6, "dead_letters": 7, "unknown": 8}


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str

    @property
    def code(self) -> int:
        return CODES[self.reason]


def _watched(name: str, followers: list[str]) -> bool:
    return "*" in followers or name in followers


def check(report: Report, health: Any) -> list[Problem]:
    """Every threshold crossed, most severe first (the first one's code is the exit code)."""
    out: list[Problem] = []
    registered = {p.name for p in report.projections}
    for name in health.followers:
        if name != "*" and name not in registered and not report.errors:
            out.append(Problem("stopped_follower", f"projection {name}: no live view (replay it, then follow it)"))
    for p in report.projections:
        for s in p.sinks:
            where = f"projection {p.name} in {s.sink}"
            if s.error:
                out.append(Problem("unknown", f"{where}: cannot read its positions: {s.error}"))
                continue
            if _watched(p.name, health.followers) and not s.following:
                out.append(Problem("stopped_follower", f"{where}: not followed (no process holds its lock); "
                                                       f"{s.lag_records:,} records behind"))
            if s.lag_seconds > health.max_lag_seconds:
                out.append(Problem("lag", f"{where}: {s.lag_seconds:,.0f}s behind the log "
                                          f"({s.lag_records:,} records; threshold {health.max_lag_seconds:,.0f}s)"))
        if p.dead_letters > health.max_dead_letters:
            out.append(Problem("dead_letters", f"projection {p.name}: {p.dead_letters:,} dead letters in "
                                               f"kf.dead_letter.projection.{p.name} "
                                               f"(threshold {health.max_dead_letters:,})"))
    for src in report.sources:
        r = src.reading
        if src.error:
            out.append(Problem("unknown", f"source {src.name}: {src.error}"))
        if r is not None and r.retained_wal_bytes is not None and r.retained_wal_bytes > health.max_retained_wal_bytes:
            out.append(Problem("retained_wal", f"source {src.name}: slot {r.slot} retains {r.retained_wal_bytes:,} "
                                               f"bytes of WAL (threshold {health.max_retained_wal_bytes:,})"))
    out.extend(Problem("unknown", e) for e in report.errors)
    return sorted(out, key=lambda p: p.code)
