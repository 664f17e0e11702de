"""Shared parts of the kill -9 tests of the capture process (PostgreSQL and ledger sources).

Importable from every test folder as ``tests._kill`` (pytest puts the repository root on
``sys.path``): a bounded polling wait, the source offset the capture stored in the log,
a background writer thread, and the trial loop that starts the capture and SIGKILLs it
during the snapshot and while streaming.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from kappaflow.connectors.offsets import OFFSETS_TOPIC, find_last
from kappaflow.log import Log, open_log


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `cond` until it returns a true value (returned); AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def open_for_check(log_url: str, kafka: bool) -> Log:
    """The log as a checker opens it while (or after) a capture process writes it."""
    return open_log(log_url) if kafka else open_log(log_url, read_only=True)


def stored_offset(log_url: str, name: str, kafka: bool) -> dict[str, Any] | None:
    """The last source offset the capture `name` stored in the log, or None (nothing stored yet)."""
    try:
        log = open_for_check(log_url, kafka)
    except Exception:
        return None  # not created yet
    try:
        if OFFSETS_TOPIC not in log.list_topics():
            return None
        key = orjson.dumps({"source": name})
        rec = find_last(log, OFFSETS_TOPIC, 0, lambda r: r.key == key)
        return None if rec is None or rec.value is None else orjson.loads(rec.value)["offset"]
    finally:
        log.close()


class BackgroundWriter(threading.Thread):
    """Calls `write_one` until `stop()`, counting commits; an exception ends the thread and is
    kept in `error` for the test to report (a daemon thread cannot fail the test itself)."""

    def __init__(self, seed: int) -> None:
        super().__init__(daemon=True)
        self.rng = random.Random(seed)
        self.stop_flag = threading.Event()
        self.commits = 0
        self.error: BaseException | None = None

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """What `write_one` gets for the thread's lifetime (e.g. a connection)."""
        return contextlib.nullcontext()

    def write_one(self, session: Any) -> None:
        raise NotImplementedError

    def run(self) -> None:
        try:
            with self.session() as session:
                while not self.stop_flag.is_set():
                    self.write_one(session)
                    self.commits += 1
        except BaseException as exc:  # reported by the test
            self.error = exc

    def stop(self) -> None:
        self.stop_flag.set()
        self.join()


def kill_trials(cmd: Sequence[str], cwd: Path, log_url: str, name: str, *, kafka: bool, kills: int,
                snapshot_kills: int, rng: random.Random, streaming_pause: tuple[float, float]) -> list[Any]:
    """Start the capture `kills` times and SIGKILL it: the first `snapshot_kills` times as soon
    as its stored offset moved in that run (during the snapshot), the others once it streams,
    each after a seeded random pause. Returns the phase stored just before each kill."""
    phases = []
    for trial in range(kills):
        before = stored_offset(log_url, name, kafka)
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=str(cwd))

        def progressed(proc: subprocess.Popen[bytes] = proc, before: dict[str, Any] | None = before) -> bool:
            off = stored_offset(log_url, name, kafka)
            return (off is not None and off != before) or proc.poll() is not None

        def streaming(proc: subprocess.Popen[bytes] = proc) -> bool:
            off = stored_offset(log_url, name, kafka)
            return (off is not None and off["phase"] == "streaming") or proc.poll() is not None

        try:
            if trial < snapshot_kills:
                wait_for(progressed, 60, "snapshot progress")
                time.sleep(rng.uniform(0, 0.05))
            else:
                wait_for(streaming, 60, "streaming")
                time.sleep(rng.uniform(*streaming_pause))
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            phases.append((stored_offset(log_url, name, kafka) or {}).get("phase"))
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait()
    return phases


def run_until_caught_up(cmd: Sequence[str], cwd: Path) -> None:
    """One clean capture run with ``--until-caught-up``; its output is the failure message."""
    done = subprocess.run([*cmd, "--until-caught-up"], capture_output=True, timeout=120, cwd=str(cwd))
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
