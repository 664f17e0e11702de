"""The MySQL/MariaDB streaming source: the binlog into the log until stopped or caught up.

The reading itself is ``binlog.py``; the writing and checkpoints are the engine's (``engine.py``).
"""

from __future__ import annotations

from typing import Any

from kappaflow.connectors.base import (
    StopSignal,
    StreamingSource,
)
from kappaflow.connectors.mysql.engine import CaptureEngine
from kappaflow.connectors.mysql.offset import MySQLOffset
from kappaflow.connectors.mysql.server import (
    master_status,
)

__all__ = ["MySQLStreamingSource"]


class MySQLStreamingSource(StreamingSource):
    """Streams the binlog into the log until stopped (or caught up with the server)."""

    def __init__(self, engine: CaptureEngine) -> None:
        self.engine = engine
        self.ondemand: Any = None  # the on-demand snapshot driver (ondemand.py), ticked after every item

    def execute(self, offset: Any, stop: StopSignal, *, until_caught_up: bool = False) -> MySQLOffset:
        eng = self.engine
        target: tuple[str, int] | None = None
        if until_caught_up:
            with eng.ctl.cursor() as cur:
                target = master_status(cur)
        ondemand = self.ondemand
        while not stop.is_set():
            if target is not None and eng.reached(*target) and eng._txn is None:
                break
            eng.process(eng.next_item())
            if ondemand is not None:
                ondemand.tick(stop)
        eng.checkpoint(force_save=True, drain=True)
        return eng.offset
