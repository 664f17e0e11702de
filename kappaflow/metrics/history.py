"""The short history behind the status page's plots: selected samples kept in the views database.

Why in the views database: every follower already writes there, and a capture usually has it
configured too (``[views.postgres] dsn``), so the page needs no extra store, and the history
outlives the processes (the page shows the last hour even after a restart). Size is bounded by
construction: each series owns ``retention / interval + 1`` slots that are overwritten in turn
(see ``migrations/versions/metrics_0001_history.py``).

Only a few series are kept, and per-partition lag is folded to one series per (projection, sink)
(records summed, seconds the maximum), so a projection over many partitions costs no more.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger("kappaflow.metrics")

__all__ = ["HISTORY_SERIES", "HistoryStore", "HistoryWriter", "Point", "samples_of", "series_key"]

# metric (as scraped) -> labels kept, and how samples that differ only in other labels combine
HISTORY_SERIES: dict[str, tuple[tuple[str, ...], str]] = {
    "kappaflow_capture_changes_total": (("source",), "sum"),
    "kappaflow_capture_source_lag_seconds": (("source",), "max"),
    "kappaflow_capture_retained_wal_bytes": (("source",), "sum"),
    "kappaflow_relay_events_total": (("source",), "sum"),
    "kappaflow_follow_events_total": (("projection", "sink"), "sum"),
    "kappaflow_follow_lag_records": (("projection", "sink"), "sum"),
    "kappaflow_follow_lag_seconds": (("projection", "sink"), "max"),
}


def series_key(name: str, labels: dict[str, str]) -> str:
    """``name{a="x",b="y"}`` with labels in name order (the row key and what the page parses)."""
    inner = ",".join(f'{k}="{labels[k]}"' for k in sorted(labels))
    return f"{name}{{{inner}}}"


def parse_key(key: str) -> tuple[str, dict[str, str]]:
    name, _, rest = key.partition("{")
    labels: dict[str, str] = {}
    for part in rest.rstrip("}").split('",'):
        if "=" in part:
            k, _, v = part.partition("=")
            labels[k] = v.strip('"')
    return name, labels


def samples_of(metrics: Iterable[Any]) -> dict[str, float]:
    """The history's series from collected metric families (``registry.collect()``)."""
    out: dict[str, float] = {}
    for fam in metrics:
        for s in fam.samples:
            spec = HISTORY_SERIES.get(s.name)
            if spec is None or math.isnan(s.value):
                continue
            keep, how = spec
            key = series_key(s.name, {k: s.labels.get(k, "") for k in keep})
            old = out.get(key)
            out[key] = s.value if old is None else (old + s.value if how == "sum" else max(old, s.value))
    return out


@dataclass(frozen=True)
class Point:
    ts: datetime
    value: float


class HistoryStore:
    """Reads and writes ``kappaflow.metric_history`` (the table is created on first use)."""

    def __init__(self, dsn: str, *, interval_s: float = 10.0, retention_s: float = 3600.0) -> None:
        self.dsn = dsn
        self.interval_s = interval_s
        self.slots = math.ceil(retention_s / interval_s) + 1
        self._conn: Any = None
        self._migrated = False

    def _connection(self) -> Any:
        import psycopg

        if not self._migrated:
            from kappaflow.migrations import upgrade

            upgrade(self.dsn, "metrics@head")
            self._migrated = True
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
        return self._conn

    def write(self, samples: dict[str, float], now: float | None = None) -> None:
        if not samples:
            return
        now = time.time() if now is None else now
        slot = int(now // self.interval_s) % self.slots
        ts = datetime.fromtimestamp(now, UTC)
        conn = self._connection()
        try:
            # one statement (not executemany: its pipeline logs psycopg's own warning when the server
            # goes away mid-write, a line outside kappaflow's log format)
            conn.execute(
                'INSERT INTO "kappaflow"."metric_history" (series, slot, ts, value) '
                "SELECT s, %s, %s, v FROM unnest(%s::text[], %s::float8[]) AS x(s, v) "
                "ON CONFLICT (series, slot) DO UPDATE SET ts = EXCLUDED.ts, value = EXCLUDED.value",
                (slot, ts, list(samples), [float(v) for v in samples.values()]),
            )
        except Exception:
            conn.close()
            raise

    def read(self, since_s: float = 3600.0) -> dict[str, list[Point]]:
        """Every series' points of the last ``since_s`` seconds, oldest first."""
        conn = self._connection()
        try:
            rows = conn.execute(
                'SELECT series, ts, value FROM "kappaflow"."metric_history" '
                "WHERE ts >= now() - make_interval(secs => %s) ORDER BY series, ts",
                (float(since_s),),
            ).fetchall()
        except Exception:
            conn.close()
            raise
        out: dict[str, list[Point]] = {}
        for series, ts, value in rows:
            out.setdefault(series, []).append(Point(ts, value))
        return out

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class HistoryWriter:
    """A daemon thread sampling ``registry`` into ``store`` every ``store.interval_s`` seconds.

    A failing write (the views database down) is logged once as a warning and retried at the
    next interval; it never stops the process it samples."""

    def __init__(self, registry: Any, store: HistoryStore) -> None:
        self.registry = registry
        self.store = store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kappaflow-metric-history", daemon=True)
        self._failing = False

    def start(self) -> None:
        self._thread.start()

    def sample_now(self) -> None:
        self.store.write(samples_of(self.registry.collect()))

    def _run(self) -> None:
        while True:
            try:
                self.sample_now()
                if self._failing:
                    log.info("metric history: writing to the views database again")
                self._failing = False
            except Exception as exc:
                if not self._failing:
                    from kappaflow.config import redact

                    log.warning("metric history: cannot write to the views database (%s); retrying every %.0fs",
                                redact(" ".join(str(exc).split()))[:300], self.store.interval_s)
                self._failing = True
            if self._stop.wait(self.store.interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.store.close()
