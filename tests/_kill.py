"""Shared parts of the kill -9 tests of the capture process (PostgreSQL and ledger sources).

Importable from every test folder as ``tests._kill`` (pytest puts the repository root on
``sys.path``): a bounded polling wait, the source offset the capture stored in the log,
a background writer thread, and the trial loop that starts the capture and SIGKILLs it
during the snapshot (at a seeded writer step, through the fault hook) and while streaming.
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


# Runs ``kappaflow.cli.capture`` (argv as for ``python -m kappaflow.cli.capture``) with the writer's fault
# hook (connectors/writer.py) set on every PostgreSQL connector (the ledger connector wraps one): at the
# step ``KF_TEST_KILL_AT`` = "BATCH:STEP" of the BATCH-th batch the snapshot writes in this run, the
# capture SIGKILLs itself, while its main thread reads the next chunk. If the snapshot ends first it
# exits with SNAPSHOT_TOO_SHORT and says so. Test code only: the product has no such switch.
SNAPSHOT_TOO_SHORT = 86
_KILL_AT_SNAPSHOT_BATCH = f"""
import os, runpy, signal, sys
from kappaflow.connectors.postgres.connector import PostgresConnector

batch, step = os.environ["KF_TEST_KILL_AT"].split(":")
batch = int(batch)
init = PostgresConnector.__init__


def with_fault(self, *args, **kwargs):
    written = [0]

    def fault(at):
        phase = self.summary.phase if self.summary is not None else "starting"
        if phase == "snapshot":
            if at == "before_records":
                written[0] += 1
            if written[0] == batch and at == step:
                print(f"kill test: SIGKILL at {{at}} of snapshot batch {{batch}}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        elif phase == "streaming" and written[0] < batch:
            print(f"kill test: the snapshot ended after {{written[0]}} batches, before batch {{batch}}", flush=True)
            os._exit({SNAPSHOT_TOO_SHORT})

    kwargs["fault"] = fault
    init(self, *args, **kwargs)


PostgresConnector.__init__ = with_fault
sys.argv[0] = "kappaflow.cli.capture"
runpy.run_module("kappaflow.cli.capture", run_name="__main__", alter_sys=True)
"""
FAULT_STEPS = ("before_records", "after_records", "after_offset")
CAPTURE_MODULE = ["-m", "kappaflow.cli.capture"]


def _tail(path: Path) -> str:
    return path.read_bytes()[-4000:].decode(errors="replace") if path.exists() else ""


def kill_trials(cmd: Sequence[str], cwd: Path, log_url: str, name: str, *, kafka: bool, kills: int,
                snapshot_kills: int, rng: random.Random, streaming_pause: tuple[float, float],
                snapshot_batches: tuple[int, int]) -> list[Any]:
    """Start the capture `kills` times and SIGKILL it; returns the phase stored at each kill.

    The first `snapshot_kills` runs kill themselves mid-snapshot, at a seeded step (writer fault
    hook step) of a seeded batch in `snapshot_batches` (inclusive; the snapshot must have that many
    batches left, or the trial fails saying so): a wall-clock moment cannot be relied on to land in a
    snapshot that a fast log client finishes in a fraction of a second. The other runs are killed
    from here once they stream, after a seeded random pause. `cmd` is
    ``python -m kappaflow.cli.capture ARGS...``.
    """
    assert list(cmd[1:3]) == CAPTURE_MODULE, f"kill_trials runs the capture module, got {cmd}"
    phases = []
    for trial in range(kills):
        out_path = cwd / f"capture-trial-{trial}.out"
        with open(out_path, "wb") as out:  # a file, not a pipe: nobody reads while it runs
            if trial < snapshot_kills:
                batch, step = rng.randint(*snapshot_batches), rng.choice(FAULT_STEPS)
                env = {**os.environ, "KF_TEST_KILL_AT": f"{batch}:{step}"}
                proc = subprocess.Popen([cmd[0], "-c", _KILL_AT_SNAPSHOT_BATCH, *cmd[3:]], stdout=out,
                                        stderr=subprocess.STDOUT, cwd=str(cwd), env=env)
                try:
                    rc = proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    raise AssertionError(f"trial {trial}: the capture did not reach {step} of snapshot batch {batch} "
                                         f"within 120s:\n{_tail(out_path)}") from None
                assert rc == -signal.SIGKILL, (f"trial {trial}: expected the capture to kill itself at {step} of "
                                               f"snapshot batch {batch}, it exited with {rc}:\n{_tail(out_path)}")
                off = stored_offset(log_url, name, kafka)
                assert off is not None and off["phase"] == "snapshot" and not off["snapshot"]["completed"], (
                    f"trial {trial}: killed at {step} of snapshot batch {batch}, but the stored offset is not "
                    f"mid-snapshot: {off}")
                phases.append(off["phase"])
                continue
            proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=str(cwd))

            def streaming(proc: subprocess.Popen[bytes] = proc) -> bool:
                off = stored_offset(log_url, name, kafka)
                return (off is not None and off["phase"] == "streaming") or proc.poll() is not None

            try:
                wait_for(streaming, 60, f"trial {trial}: the capture to stream")
                time.sleep(rng.uniform(*streaming_pause))  # a seeded moment while streaming (it streams on)
                assert proc.poll() is None, f"trial {trial}: the capture ended before the kill:\n{_tail(out_path)}"
                phases.append((stored_offset(log_url, name, kafka) or {}).get("phase"))
                os.kill(proc.pid, signal.SIGKILL)
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
    return phases


def run_until_caught_up(cmd: Sequence[str], cwd: Path) -> None:
    """One clean capture run with ``--until-caught-up``; its output is the failure message."""
    done = subprocess.run([*cmd, "--until-caught-up"], capture_output=True, timeout=120, cwd=str(cwd))
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
