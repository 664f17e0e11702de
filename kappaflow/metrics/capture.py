"""``kappaflow_capture_*``: what a capture process exports, read from the figures it keeps anyway.

The connector's live summary (changes, transactions, snapshot progress per table, phase, the
source lag the writer measured per durable batch or the heartbeat round trip when idle, the
acknowledged position) and the source probe (retained WAL, binlog behind) -- the same figures as
the progress lines. A capture that restarts after a transient failure runs a new connector with
a new summary, so counters add up every connector this process ran: they never go back.

Hooks at the call sites (``kappaflow/cli/capture.py``): ``error(exc)`` when a run fails and
``restart()`` when the retry loop starts another one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client.core import Metric

from kappaflow.metrics.core import Families
from kappaflow.metrics.probes import SourceProbe, position_number

__all__ = ["PHASES", "CaptureCollector"]

PHASES = ("starting", "snapshot", "streaming", "stopped")
ONDEMAND_STATES = ("idle", "running", "paused", "stopped", "done")


class CaptureCollector:
    """Collector of one source's capture in this process; ``connectors()`` returns every connector run
    so far (the current one last)."""

    def __init__(self, source: Any, connectors: Callable[[], Sequence[Any]], *,
                 probe: SourceProbe | None = None) -> None:
        self.source = source
        self.connectors = connectors
        self.probe = probe
        self._lock = threading.Lock()
        self.errors = {"transient": 0, "terminal": 0}
        self.restarts = 0

    # -- hooks -------------------------------------------------------------------------------
    def error(self, exc: BaseException) -> None:
        kind = "transient" if getattr(exc, "transient", False) else "terminal"
        with self._lock:
            self.errors[kind] += 1

    def restart(self) -> None:
        with self._lock:
            self.restarts += 1

    def appended(self) -> dict[str, int]:
        """Records appended per topic by every connector of this process (for ``LogCollector``)."""
        out: dict[str, int] = {}
        for s in self._summaries():
            for topic, n in dict(s.per_topic).items():
                out[topic] = out.get(topic, 0) + n
        return out

    # -- scrape --------------------------------------------------------------------------------
    def _summaries(self) -> list[Any]:
        out = []
        for c in list(self.connectors()):
            s = c.live_summary()
            if s is not None:
                out.append(s)
        return out

    def collect(self) -> Iterable[Metric]:
        name = self.source.name
        fams = Families()
        summaries = self._summaries()
        fams.add("kappaflow_capture_changes", (name,), sum(s.events for s in summaries))
        fams.add("kappaflow_capture_transactions", (name,), sum(s.transactions for s in summaries))
        tables: dict[str, list[int]] = {}
        for s in summaries:  # a later run's figures for a table replace an earlier one's
            tables.update({t: list(v) for t, v in dict(s.snapshot_tables).items()})
        fams.declare("kappaflow_capture_snapshot_rows")
        for table, (rows, total, done) in sorted(tables.items()):
            fams.add("kappaflow_capture_snapshot_rows", (name, table), rows)
            ratio = 1.0 if done else (min(1.0, rows / total) if total > 0 else 0.0)
            fams.add("kappaflow_capture_snapshot_progress_ratio", (name, table), ratio)
        current = summaries[-1] if summaries else None
        ondemand = dict(getattr(current, "ondemand", None) or {}) if current is not None else {}
        fams.add("kappaflow_capture_ondemand_rows", (name,), ondemand.get("rows", 0))
        fams.add("kappaflow_capture_ondemand_rows_per_second", (name,), ondemand.get("rows_per_s"))
        fams.add("kappaflow_capture_ondemand_eta_seconds", (name,), ondemand.get("eta_s"))
        od_state = ondemand.get("state", "idle")
        for st in ONDEMAND_STATES:
            fams.add("kappaflow_capture_ondemand_state", (name, st), 1 if st == od_state else 0)
        phase = current.phase if current is not None else "starting"
        for p in PHASES:
            fams.add("kappaflow_capture_phase", (name, p), 1 if p == phase else 0)
        lag = next((s.source_lag_ms for s in reversed(summaries) if s.source_lag_ms is not None), None)
        fams.add("kappaflow_capture_source_lag_seconds", (name,), None if lag is None else lag / 1000)
        acked = next((s.acknowledged for s in reversed(summaries) if s.acknowledged), None)
        confirmed = position_number(acked)
        reading = None
        if self.probe is not None:
            try:
                reading = self.probe.read(current.position if current is not None else None)
            except Exception:  # the source is down: its figures are unknown, the rest still counts
                reading = None
        if reading is not None:
            if confirmed is None:
                confirmed = reading.confirmed_position
            if reading.slot is not None:
                fams.add("kappaflow_capture_retained_wal_bytes", (name, reading.slot), reading.retained_wal_bytes)
                fams.add("kappaflow_capture_unconfirmed_wal_bytes", (name, reading.slot),
                         reading.unconfirmed_wal_bytes)
            fams.add("kappaflow_capture_binlog_files_behind", (name,), reading.binlog_files_behind)
            fams.add("kappaflow_capture_binlog_bytes_behind", (name,), reading.binlog_bytes_behind)
        fams.add("kappaflow_capture_confirmed_position", (name,), confirmed)
        with self._lock:
            for kind, n in self.errors.items():
                fams.add("kappaflow_capture_errors", (name, kind), n)
            fams.add("kappaflow_capture_restarts", (name,), self.restarts)
        return list(fams)
