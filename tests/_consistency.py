"""Shared parts of the transactional-consistency tests (issue 17): an invariant reader.

A reader polls a PostgreSQL view inside its own transactions (one REPEATABLE READ snapshot per
read) while the workload runs at full rate, and checks an invariant that holds at every
source commit point but not in the middle of a source transaction (a bank transfer's debit
without its credit). Importable as ``tests._consistency``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql


@dataclass
class Reads:
    """What the reader saw: every read, the bad ones (with what they showed), distinct states."""

    reads: int = 0
    bad: list[str] = field(default_factory=list)
    states: set[Any] = field(default_factory=set)
    error: BaseException | None = None


class InvariantReader:
    """Polls ``query`` on ``dsn`` in a loop; ``check(row)`` returns None when the invariant holds,
    else a description of the violation. ``state(row)`` names the view state (to count how many
    distinct states the reader saw, i.e. that the view moved during the run)."""

    def __init__(self, dsn: str, query: sql.Composable, check: Callable[[Any], str | None],
                 state: Callable[[Any], Any]) -> None:
        self.dsn = dsn
        self.query = query
        self.check = check
        self.state = state
        self.result = Reads()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="invariant-reader", daemon=True)

    def start(self) -> InvariantReader:
        self._thread.start()
        return self

    def _run(self) -> None:
        res = self.result
        try:
            with psycopg.connect(self.dsn) as conn:
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                while not self._stop.is_set():
                    try:
                        with conn.transaction():
                            row = conn.execute(self.query).fetchone()
                    except psycopg.errors.UndefinedTable:
                        conn.rollback()
                        time.sleep(0.05)  # the view does not exist yet (the follower creates it)
                        continue
                    if row is None or row[0] is None:
                        continue  # empty view
                    res.reads += 1
                    res.states.add(self.state(row))
                    bad = self.check(row)
                    if bad is not None:
                        res.bad.append(bad)
        except BaseException as exc:  # reported by stop()
            res.error = exc

    def stop(self) -> Reads:
        self._stop.set()
        self._thread.join(timeout=60)
        if self.result.error is not None:
            raise self.result.error
        return self.result


def wait_until(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
