"""What a source's server says about a capture: retained WAL, unconfirmed WAL, binlog behind.

One reading per source kind, each kind's probe in its connector package (``connectors/<kind>/probe.py``,
found through the source registry; kinds without one -- a Debezium source, whose lag is its Kafka
consumer group's -- have none). The capture's progress lines, its
``/metrics``, ``kappaflow metrics``, ``status --check`` and the status page all read these same
figures, each probe on a connection of its own (never the capture's), so a slow or failing
probe never stops a capture: callers turn an exception into "unknown".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["CachedProbe", "SourceProbe", "SourceReading", "open_probe", "position_number"]


@dataclass
class SourceReading:
    """One probe's figures (None: not applicable to this kind, or not known)."""

    slot: str | None = None
    retained_wal_bytes: int | None = None  # PostgreSQL: current LSN - restart_lsn of the slot
    unconfirmed_wal_bytes: int | None = None  # PostgreSQL: current LSN - confirmed_flush_lsn
    confirmed_position: int | None = None  # see position_number
    binlog_files_behind: int | None = None  # MySQL/MariaDB
    binlog_bytes_behind: int | None = None
    slot_missing: bool = False
    slot_active: bool | None = None


_LSN = re.compile(r"^([0-9A-Fa-f]+)/([0-9A-Fa-f]+)$")
_BINLOG = re.compile(r"^(.*)\.(\d+):(\d+)")


def position_number(text: str | None) -> int | None:
    """A source position as one increasing number: an LSN ``X/Y`` -> its WAL byte offset; a binlog
    ``name.000003:4567`` -> 3 * 2^32 + 4567 (the sequence number orders the files). None otherwise."""
    if not text:
        return None
    m = _LSN.match(text.strip())
    if m:
        return (int(m.group(1), 16) << 32) + int(m.group(2), 16)
    b = _BINLOG.match(text.strip())
    if b:
        return (int(b.group(2)) << 32) + int(b.group(3))
    return None


class SourceProbe:
    """Reads a source's figures on its own connection (reconnecting after a failure)."""

    def read(self, position: str | None) -> SourceReading:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


def open_probe(source: Any) -> SourceProbe | None:
    """The probe for a source config (its kind's, from the source registry), or None for kinds without one."""
    from kappaflow.connectors.registry import source_kind

    return source_kind(source).probe(source)


class CachedProbe(SourceProbe):
    """A probe read at most once per ``min_interval_s``, shared by threads (progress lines and scrapes).

    Why: Prometheus may scrape every second and the progress line asks every 10 s; the source's server
    should see one small query per interval whatever reads the figures. A failed read is remembered
    for the interval too (raised again to each caller) so a down server is not hammered either.
    """

    def __init__(self, probe: SourceProbe, min_interval_s: float = 5.0) -> None:
        import threading

        self.probe = probe
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._at = float("-inf")
        self._reading: SourceReading | None = None
        self._error: Exception | None = None

    def read(self, position: str | None) -> SourceReading:
        import time

        with self._lock:
            now = time.monotonic()
            stale = self._reading is not None and self._reading.slot_missing  # not created yet: ask again
            if stale or now - self._at >= self.min_interval_s:
                self._at = now
                try:
                    self._reading, self._error = self.probe.read(position), None
                except Exception as exc:
                    self._reading, self._error = None, exc
            if self._error is not None:
                raise self._error
            assert self._reading is not None
            return self._reading

    def close(self) -> None:
        self.probe.close()
