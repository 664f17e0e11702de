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

__all__ = ["LAG_PROBES", "ProgressLog", "stamp"]


def stamp(line: str) -> str:
    """``line`` prefixed with the UTC time to the second (every line a capture logs carries one)."""
    return f"{datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')} {line}"



class _PostgresLag:
    """Bytes of WAL the source's slot has not confirmed yet (what `source status` calls lag_bytes)."""

    def __init__(self, src: Any) -> None:
        self.slot = src.slot_name
        self.dsn = src.connect_dsn()
        self.conn: Any = None

    def __call__(self, position: str | None) -> str | None:
        from kappaflow.connectors.postgres import slots

        if self.conn is None or self.conn.closed:
            self.conn = slots.connect(self.dsn, what="reading the slot lag")
        row = self.conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), confirmed_flush_lsn)::bigint "
                                "FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)).fetchone()
        return None if row is None or row[0] is None else decimal(max(0, int(row[0])))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class _MySQLLag:
    """Binlog bytes between the capture's position and the server's (files behind when not the same file)."""

    def __init__(self, src: Any) -> None:
        from kappaflow.connectors.mysql.server import parse_dsn

        self.args = parse_dsn(src.dsn, src.resolved_password())
        self.conn: Any = None

    def __call__(self, position: str | None) -> str | None:
        from kappaflow.connectors.mysql.server import binlog_files, connect, master_status

        if position is None or ":" not in position:
            return None
        if self.conn is None or not self.conn.open:
            self.conn = connect(self.args, what="reading the binlog lag", autocommit=True)
        with self.conn.cursor() as cur:
            file, pos = master_status(cur)
        at_file, _, at_pos = position.partition(":")
        if at_file == file:
            return decimal(max(0, pos - int(at_pos)))
        files = binlog_files(self.conn)
        behind = len(files) - files.index(at_file) - 1 if at_file in files else "?"
        return f"{behind} binlog file(s) behind"

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


# Source kind -> how to read its lag (kinds without one print none: a Debezium source's lag is its
# consumer group's, which Kafka's own tools show).
LAG_PROBES: dict[str, Callable[[Any], Any]] = {
    "postgres": _PostgresLag,
    "ledger": _PostgresLag,
    "mysql": _MySQLLag,
}


class ProgressLog:
    """A daemon thread handing ``write`` one progress line per interval for the connector ``current()`` returns.

    ``write`` adds the time stamp (the CLI stamps every line it logs, these included).
    """

    def __init__(self, source: Any, current: Callable[[], Any], write: Callable[[str], None], *,
                 interval_s: float = 10.0) -> None:
        self.source = source
        self.current = current
        self.write = write
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"progress-{source.name}", daemon=True)
        probe = LAG_PROBES.get(source.kind)
        self._lag: Any = probe(source) if probe is not None else None
        self._last: tuple[float, int] | None = None

    def __enter__(self) -> ProgressLog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._lag is not None:
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
        parts.append(f"position {summary.position or '-'}")
        if self._lag is not None:
            try:
                lag = self._lag(summary.position)
            except Exception:  # a figure for a log line: never worth stopping the capture for
                lag = "?"
            parts.append(f"lag {lag if lag is not None else '-'}")
        return ", ".join(parts)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            text = self.line()
            if text is not None:
                self.write(text)
