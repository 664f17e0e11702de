"""``kappaflow_follow_*``: what a follow process exports, from its followers' own figures.

Counters come from each follower's ``FollowStats`` (updated once per batch by the follower);
the batch duration histogram is observed by a hook chained onto ``Follower.on_batch``; lag per
topic partition is read at scrape time from the sink's stored positions and the log's end
offsets, in records and in seconds (``lag_seconds``), as ``kappaflow status`` reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import Metric

from kappaflow.metrics.core import Families
from kappaflow.metrics.names import metric

__all__ = ["BATCH_BUCKETS", "FollowCollector", "lag_seconds"]

BATCH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def lag_seconds(log: Any, topic: str, partition: int, position: int, end: int, now: float | None = None) -> float:
    """How long the oldest record the view has not applied (the one at ``position``) has been in the
    log: 0 when caught up. One read of one record; a record compaction removed is skipped over."""
    if position >= end:
        return 0.0
    recs = log.read(topic, partition, position, 1)
    if not recs or not recs[0].timestamp_ms:
        return 0.0
    now = time.time() if now is None else now
    return max(0.0, now - recs[0].timestamp_ms / 1000)


class FollowCollector:
    """Collector of a ``FollowerGroup`` (or any object with ``followers: dict[sink, Follower]``)."""

    def __init__(self, group: Any, registry: CollectorRegistry) -> None:
        self.group = group
        d = metric("kappaflow_follow_batch_duration_seconds")
        self.durations = Histogram(d.name, d.help, list(d.labels), buckets=BATCH_BUCKETS, registry=registry)
        for f in group.followers.values():
            f.on_batch = self._hook(f, f.on_batch)

    def _hook(self, f: Any, previous: Callable[[Any, Any], None] | None) -> Callable[[Any, Any], None]:
        child = self.durations.labels(f.spec.name, f.sink_name)

        def on_batch(stats: Any, res: Any) -> None:
            child.observe(stats.last_batch_s)  # once per batch, never per record
            if previous is not None:
                previous(stats, res)

        return on_batch

    def read(self) -> dict[str, int]:
        """Offsets the followers' batches moved past, per topic (for ``LogCollector``)."""
        out: dict[str, int] = {}
        for f in self.group.followers.values():
            for topic, n in dict(f.stats.read).items():
                out[topic] = out.get(topic, 0) + n
        return out

    def collect(self) -> Iterable[Metric]:
        fams = Families()
        for f in list(self.group.followers.values()):
            labels = (f.spec.name, f.sink_name)
            s = f.stats
            fams.add("kappaflow_follow_events", labels, s.events)
            fams.add("kappaflow_follow_batches", labels, s.batches)
            fams.add("kappaflow_follow_rows_written", (*labels, "upsert"), s.upserted)
            fams.add("kappaflow_follow_rows_written", (*labels, "delete"), s.deleted)
            fams.add("kappaflow_follow_dead_letters", labels, s.dead_letters)
            fams.add("kappaflow_follow_restarts", labels, f.restarts + f.rebuilds)
            fams.add("kappaflow_follow_running", labels, 1 if f.healthy else 0)
            if s.last_batch_at:
                fams.add("kappaflow_follow_last_batch_timestamp_seconds", labels, s.last_batch_at)
            if f.target is None or f._lock_sink is None:
                continue  # not started, or stopped
            try:
                parts = f.partition_lag()
            except Exception:  # the store or the log is down: lag unknown this scrape
                continue
            log = f.rt.reader()
            now = time.time()
            for (topic, p), (at, end) in sorted(parts.items()):
                fams.add("kappaflow_follow_lag_records", (*labels, topic, p), max(0, end - at))
                try:
                    fams.add("kappaflow_follow_lag_seconds", (*labels, topic, p),
                             lag_seconds(log, topic, p, at, end, now))
                except Exception:
                    pass
        return list(fams)


def follow_registry(group: Any, settings: Any) -> CollectorRegistry:
    """The follow process's registry: its followers and the log offsets their batches read."""
    from kappaflow.metrics.core import new_registry, register
    from kappaflow.metrics.log import LogCollector, embedded_dir

    registry = new_registry()
    collector = FollowCollector(group, registry)
    register(registry, collector)
    register(registry, LogCollector(read=collector.read, log_dir=embedded_dir(settings)))
    return registry
