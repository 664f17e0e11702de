"""Progress lines for a capture that runs without a terminal (a service, `nohup`, a container log).

Why: without a terminal there is no progress bar, and a capture that streams for days printed
nothing until it ended. Every `interval_s` one timestamped line says the phase, the changes
written and their rate since the last line, the last durable source position and the lag the
source itself reports (the slot's unconfirmed WAL, the binlog bytes not yet read)::

    2026-11-25T09:48:19Z shop: streaming, 1,204,331 changes (41,210/s), position 0/3A2B1C8, lag 1.2 MB

The lag is read on a connection of its own, never the capture's; a lag that cannot be read is
shown as "?" and never stops the capture.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from rich.filesize import decimal

from kappaflow.metrics.probes import SourceProbe, SourceReading, open_probe

__all__ = ["ProgressLog", "lag_text", "stamp"]


def stamp(line: str) -> str:
    """``line`` prefixed with the UTC time to the second (every line a capture logs carries one)."""
    return f"{datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')} {line}"



def lag_text(reading: SourceReading) -> str | None:
    """The lag a progress line shows: the slot's unconfirmed WAL, or the binlog bytes not read yet
    (files behind when the capture is not in the server's current file)."""
    if reading.unconfirmed_wal_bytes is not None:
        return decimal(reading.unconfirmed_wal_bytes)
    if reading.binlog_files_behind:
        return f"{reading.binlog_files_behind} binlog file(s) behind"
    if reading.binlog_bytes_behind is not None:
        return decimal(reading.binlog_bytes_behind)
    return None


class ProgressLog:
    """A daemon thread handing ``write`` one progress line per interval for the connector ``current()`` returns.

    ``write`` adds the time stamp (the CLI stamps every line it logs, these included).
    """

    def __init__(self, source: Any, current: Callable[[], Any], write: Callable[[str], None], *,
                 interval_s: float = 10.0, probe: SourceProbe | None = None) -> None:
        self.source = source
        self.current = current
        self.write = write
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"progress-{source.name}", daemon=True)
        # a probe shared with the metrics endpoint is closed by its owner
        self._owns_probe = probe is None
        self._lag: SourceProbe | None = open_probe(source) if probe is None else probe
        self._last: tuple[float, int] | None = None

    def __enter__(self) -> ProgressLog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._lag is not None and self._owns_probe:
            try:
                self._lag.close()
            except Exception:
                pass

    def line(self) -> str | None:
        """The progress line now (None before the connector has started)."""
        connector = self.current()
        summary = connector.live_summary() if connector is not None else None
        if summary is None:
            return None
        now = time.monotonic()
        events = summary.events
        rate = ""
        if self._last is not None and now > self._last[0]:
            rate = f" ({(events - self._last[1]) / (now - self._last[0]):,.0f}/s)"
        self._last = (now, events)
        parts = [f"{self.source.name}: {summary.phase}, {events:,} changes{rate}"]
        if summary.phase == "snapshot":
            parts.append(f"{summary.snapshot_rows:,} snapshot rows")
        od = getattr(summary, "ondemand", None) or {}
        if od.get("state") in ("running", "paused"):  # an on-demand snapshot (kappaflow snapshot)
            od_rate, eta = od.get("rows_per_s"), od.get("eta_s")
            extra = [] if od_rate is None else [f"{od_rate:,.0f}/s"] + ([] if eta is None else [f"ETA {eta:,.0f} s"])
            parts.append(f"on-demand snapshot {od['state']}: {od.get('rows', 0):,} rows"
                         + (f" ({', '.join(extra)})" if extra else ""))
        parts.append(f"position {summary.position or '-'}")
        if self._lag is not None:
            try:
                lag = lag_text(self._lag.read(summary.position))
            except Exception:  # a figure for a log line: never worth stopping the capture for
                lag = "?"
            parts.append(f"lag {lag if lag is not None else '-'}")
        return ", ".join(parts)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            text = self.line()
            if text is not None:
                self.write(text)
