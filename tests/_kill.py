"""The capture kill -9 harness for the tests, importable as ``tests._kill`` from every test folder.

The harness itself ships with the package, as the capture contract suite
``kappaflow.connectors.testing`` (the kill trials, the source driver, the exactly-once check);
this module re-exports what other tests use from it (a bounded polling wait, the stored offset).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from kappaflow.connectors.testing import (
    BackgroundWriter,
    kill_trials,
    open_for_check,
    run_until_caught_up,
    stored_offset,
    wait_for,
)

__all__ = ["BackgroundWriter", "KilledProcess", "kill_trials", "live_offsets", "open_for_check", "run_until_caught_up",
           "stored_offset", "thorough_kills", "trial_count", "wait_for"]


def trial_count(quick: int, thorough: int) -> int:
    """How many kill -9 trials a follower kill test runs: `quick` by default, `thorough` with
    ``KF_THOROUGH_KILLS=1`` in the environment.

    Why two numbers: every trial kills a follower process and starts a new one with its own Spark
    driver (~20 s on the 2-core machine), so these tests were the top of ``--durations`` and the suite's
    time budget (~20 min) cannot hold the larger counts. Each kill lands at a seeded random moment, so
    more trials reach more moments; run the thorough counts after changing a commit protocol.
    """
    return thorough if thorough_kills() else quick


def thorough_kills() -> bool:
    """``KF_THOROUGH_KILLS=1``: the kill tests run their larger trial counts (see `trial_count`)."""
    return os.environ.get("KF_THOROUGH_KILLS", "") not in ("", "0")


def live_offsets(dsn: str, projection: str) -> int:
    """The sum of the live view's stored next offsets: it grows with every batch a follower commits."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT coalesce(sum(next_offset), 0) FROM kappaflow.projection_positions "
                           "WHERE projection = %s AND target = 'live'", (projection,)).fetchone()
    return int(row[0]) if row else 0


class KilledProcess:
    """A child process (a follower or capture runner) that a test kills with -9 and starts again.

    It runs in its own process group (the kill takes its Spark JVM and Python workers with it); its
    output accumulates in `out`, and a wait that times out quotes the end of it, so a failure says what
    the child was doing.
    """

    def __init__(self, argv: list[str], out: Path, what: str) -> None:
        self.argv, self.out, self.what = argv, out, what
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        with self.out.open("ab") as sink:
            return subprocess.Popen(self.argv, env={**os.environ, "PYSPARK_PYTHON": sys.executable}, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self) -> str:
        return self.out.read_bytes()[-3000:].decode(errors="replace") if self.out.exists() else ""

    def alive(self) -> bool:
        assert self.proc.poll() is None, f"{self.what} ended: {self.tail()}"
        return True

    def wait(self, cond: Callable[[], Any], timeout: float, what: str) -> None:
        """Poll `cond` (bounded); on timeout fail naming `what`, with the end of the child's output."""
        try:
            wait_for(cond, timeout, what, interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {self.what} output:\n{self.tail()}") from None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def kill_after_progress(self, progress: Callable[[], int], more: Callable[[int], None], trials: int,
                            rnd: random.Random, pause: float, timeout: float = 300) -> None:
        """`trials` times: `more(trial)` writes new input, wait until `progress()` moved (the child committed
        work of it), let it run on for a seeded moment (not a synchronisation: the kill lands at a random
        point of a batch), kill -9 and start it again."""
        for trial in range(trials):
            before = progress()
            more(trial)
            self.wait(lambda b=before: progress() > b, timeout, f"trial {trial}: progress")
            time.sleep(rnd.uniform(0.0, pause))
            self.kill()
            self.proc = self._start()
