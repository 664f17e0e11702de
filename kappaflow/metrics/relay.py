"""``kappaflow_relay_*``: the ledger relay's figures (``LedgerRelay`` counts per append of a run)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import Metric

from kappaflow.metrics.core import Families

__all__ = ["RelayCollector"]


class RelayCollector:
    """Collector of the relays this process ran for ``source`` (``relays()``: every one, current last)."""

    def __init__(self, source: str, relays: Callable[[], list[Any]]) -> None:
        self.source = source
        self.relays = relays
        self._lock = threading.Lock()
        self.errors = {"transient": 0, "terminal": 0}
        self.restarts = 0

    def error(self, exc: BaseException) -> None:
        with self._lock:
            self.errors["transient" if getattr(exc, "transient", False) else "terminal"] += 1

    def restart(self) -> None:
        with self._lock:
            self.restarts += 1

    def appended(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in list(self.relays()):
            for topic, n in dict(r.per_topic).items():
                out[topic] = out.get(topic, 0) + n
        return out

    def collect(self) -> Iterable[Metric]:
        fams = Families()
        relays = list(self.relays())
        fams.add("kappaflow_relay_events", (self.source,), sum(r.relayed for r in relays))
        fams.add("kappaflow_relay_position", (self.source,), max((r.position for r in relays), default=0))
        with self._lock:
            for kind, n in self.errors.items():
                fams.add("kappaflow_relay_errors", (self.source, kind), n)
            fams.add("kappaflow_relay_restarts", (self.source,), self.restarts)
        return list(fams)
