"""The capture contract suite, shipped with the package so every source runs the same kill -9 trials.

A capture source promises exactly-once in the log across crashes: after a kill -9 at any moment
and a restart, every change committed at the source is in the log once, in commit order per key.
This module proves it the same way for every connector (like ``kappaflow.log.testing`` for the
log backends and ``kappaflow.projections.sinks.testing`` for the sinks).

Usage (one small class per source, in its connector tests)::

    from kappaflow.connectors.testing import KafkaCaptureContract, SourceDriver

    class MySourceDriver(SourceDriver):
        ...                                  # make changes, read them back independently

    class TestMySourceCapture(KafkaCaptureContract):   # CaptureContract: the embedded log only
        kills = 6                            # captures started and killed (snapshot_kills of them
        snapshot_kills = 2                   # mid-snapshot); kafka_kills per Kafka client

        @pytest.fixture
        def driver(self, ...):
            yield MySourceDriver(...)

        @pytest.fixture
        def kafka_bootstrap(self, kafka_broker):
            return kafka_broker.bootstrap

Each trial run (``run_kill_trials``): the driver fills the source; a writer thread commits random
changes the whole time; ``python -m kappaflow.cli.capture`` is started again and again and killed
with SIGKILL -- the first ``snapshot_kills`` runs by themselves at a seeded writer step of a seeded
snapshot batch (the writer's fault hook), the others from outside at a seeded moment while they
stream; then, with the writer stopped, one clean ``--until-caught-up`` run. Checked:

* per key, the streamed changes in the log (``driver.logged``) are exactly the changes the source
  committed after the capture's start point (``driver.expected``, read independently of the
  connector: a second replication slot, the binlog, the ledger table), each once, in commit order;
* whatever else the driver checks (``driver.check_log``: e.g. the compacted log equals the tables).

**The fault hook a new source needs**: its connector must accept the capture writer's fault hook
(``fault=``, passed to its ``CaptureWriter``; see ``connectors/writer.py``) and its source kind must
say so with ``fault_hook=True`` in ``connectors/<package>/kind.py``; the suite finds it through the
source registry (``SourceKind.open(..., fault=...)``), never by connector class. The connector's
``live_summary().phase`` tells the hook whether it is in the snapshot.
"""

from __future__ import annotations

import abc
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest

from kappaflow.connectors.offsets import OFFSETS_TOPIC, find_last
from kappaflow.log import Log, open_log

__all__ = [
    "CAPTURE_MODULE",
    "FAULT_STEPS",
    "SNAPSHOT_TOO_SHORT",
    "BackgroundWriter",
    "CaptureContract",
    "KafkaCaptureContract",
    "SourceDriver",
    "check_exactly_once",
    "install_snapshot_kill",
    "kill_trials",
    "open_for_check",
    "run_kill_trials",
    "run_until_caught_up",
    "stored_offset",
    "wait_for",
]

FAULT_STEPS = ("before_records", "after_records", "after_offset")
"""The capture writer's fault hook steps (``connectors/writer.py``)."""
CAPTURE_MODULE = ["-m", "kappaflow.cli.capture"]
SNAPSHOT_TOO_SHORT = 86
"""Exit status of a capture whose snapshot ended before the batch it was to be killed at."""


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


# --- the snapshot-phase kill -------------------------------------------------------------------
def install_snapshot_kill(batch: int, step: str) -> None:
    """In this process, every connector the source registry opens SIGKILLs the process at `step`
    (a ``FAULT_STEPS`` name) of the `batch`-th batch it writes during its snapshot; if the snapshot
    ends before that batch, the process exits with ``SNAPSHOT_TOO_SHORT`` and says so.

    Test code only (the capture subprocess of `kill_trials` calls it before running the CLI): the
    hook reaches the connector through its registered ``fault_hook`` (``SourceKind.open``).
    """
    from kappaflow.connectors.registry import SourceKind

    open_connector = SourceKind.open

    def open_with_fault(self: SourceKind, config: Any, log: Log, **kwargs: Any) -> Any:
        opened: list[Any] = []
        written = [0]

        def fault(at: str) -> None:
            summary = opened[0].live_summary() if opened else None
            phase = summary.phase if summary is not None else "starting"
            if phase == "snapshot":
                if at == "before_records":
                    written[0] += 1
                if written[0] == batch and at == step:
                    print(f"kill test: SIGKILL at {at} of snapshot batch {batch}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            elif phase == "streaming" and written[0] < batch:
                print(f"kill test: the snapshot ended after {written[0]} batches, before batch {batch}", flush=True)
                os._exit(SNAPSHOT_TOO_SHORT)

        connector = open_connector(self, config, log, **kwargs, fault=fault)
        opened.append(connector)
        return connector

    SourceKind.open = open_with_fault  # type: ignore[method-assign]


# Runs ``kappaflow.cli.capture`` (argv as for ``python -m kappaflow.cli.capture``) with the snapshot
# kill of ``KF_TEST_KILL_AT`` = "BATCH:STEP" installed.
_KILL_AT_SNAPSHOT_BATCH = """
import os, runpy, sys
from kappaflow.connectors.testing import install_snapshot_kill

batch, step = os.environ["KF_TEST_KILL_AT"].split(":")
install_snapshot_kill(int(batch), step)
sys.argv[0] = "kappaflow.cli.capture"
runpy.run_module("kappaflow.cli.capture", run_name="__main__", alter_sys=True)
"""


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
                assert off is not None and off["phase"] == "snapshot", (
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


# --- the source driver and the exactly-once check ----------------------------------------------
Changes = Mapping[Hashable, Sequence[Hashable]]
"""Per key (e.g. ``(table, primary key)``), the changes to it in order (e.g. ``(commit position, op)``)."""


class SourceDriver(abc.ABC):
    """What the suite needs from a source: make changes on it and read them back independently.

    ``name`` is the capture's source name; ``snapshot_batches`` the range of snapshot batches the
    snapshot-phase kills pick from (``prepare`` must leave more batches than its upper end, twice:
    each snapshot kill resumes the snapshot).
    """

    name: str
    snapshot_batches: tuple[int, int] = (2, 20)
    min_commits: int = 20
    """The writer must have committed at least this many transactions for a trial to count."""

    @abc.abstractmethod
    def source_config(self) -> str:
        """The body of the source's ``[sources.<name>]`` table in ``kappaflow.toml`` (TOML lines)."""

    @abc.abstractmethod
    def prepare(self) -> None:
        """Create and fill what the source captures, before the capture first starts."""

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """What `write_one` gets for the writer thread's lifetime (e.g. a connection)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def write_one(self, session: Any, rng: random.Random) -> None:
        """Commit one source transaction of seeded random changes (the writer thread's step)."""

    @abc.abstractmethod
    def expected(self, offset: Mapping[str, Any]) -> Changes:
        """Every change the source committed after the capture's start point, per key in commit
        order, read without the connector; ``offset``: the capture's last stored offset."""

    @abc.abstractmethod
    def logged(self, log: Log) -> Changes:
        """The changes the log holds for the same keys, per key in log order (the same change
        identities as `expected`; snapshot reads left out where `expected` leaves them out)."""

    def check_log(self, log: Log) -> None:  # noqa: B027 - optional
        """More checks of the caught-up log (e.g. the compacted log equals the source tables)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release what `prepare` made that outlives the test's own cleanup (slots, databases)."""


def check_exactly_once(logged: Changes, expected: Changes, *, show: int = 5) -> None:
    """Every expected change in the log once, in commit order per key; AssertionError naming the
    first keys that miss a change, hold one twice (or one never committed), or hold them out of order."""
    assert expected, "the trial made no changes after the capture's start point: nothing was checked"
    problems: list[str] = []
    for key in sorted(set(expected) | set(logged), key=repr):
        want, got = list(expected.get(key, ())), list(logged.get(key, ()))
        if want == got:
            continue
        missing = Counter(want) - Counter(got)
        extra = Counter(got) - Counter(want)
        if missing:
            problems.append(f"key {key!r}: committed but missing from the log: {sorted(missing, key=repr)[:show]}")
        if extra:
            twice = [c for c in extra if c in want]
            what = "written twice" if twice else "in the log but never committed"
            problems.append(f"key {key!r}: {what}: {sorted(extra, key=repr)[:show]}")
        if not missing and not extra:
            problems.append(f"key {key!r}: out of commit order: log {got[:show * 2]}, committed {want[:show * 2]}")
    assert not problems, (f"{len(problems)} key(s) not exactly-once in commit order (of {len(expected)} changed):\n"
                          + "\n".join(problems[:show]))


class _DriverWriter(BackgroundWriter):
    def __init__(self, driver: SourceDriver, seed: int) -> None:
        super().__init__(seed)
        self.driver = driver

    def session(self) -> contextlib.AbstractContextManager[Any]:
        return self.driver.session()

    def write_one(self, session: Any) -> None:
        self.driver.write_one(session, self.rng)


def run_kill_trials(driver: SourceDriver, cwd: Path, log_url: str, *, kills: int, snapshot_kills: int, seed: int,
                    kafka_client: str | None = None, partitions: int = 3,
                    streaming_pause: tuple[float, float] = (0.05, 0.5)) -> None:
    """One seeded run of the kill -9 trials against `driver` (see the module docstring)."""
    kafka = kafka_client is not None
    rng = random.Random(seed)
    driver.prepare()
    config = cwd / "kappaflow.toml"
    # every streamed event is checked: the capture's background compaction stays off
    config.write_text(f'[log]\nurl = "{log_url}"\npartitions = {partitions}\ncompact_interval_s = 0\n\n'
                      f"[sources.{driver.name}]\n{driver.source_config().strip()}\n"
                      + (f'\n[log.kafka]\nclient = "{kafka_client}"\n' if kafka else ""))
    cmd = [sys.executable, *CAPTURE_MODULE, driver.name, "--config", str(config), "--no-progress"]
    writer = _DriverWriter(driver, seed)
    writer.start()
    try:
        phases = kill_trials(cmd, cwd, log_url, driver.name, kafka=kafka, kills=kills, snapshot_kills=snapshot_kills,
                             rng=rng, streaming_pause=streaming_pause, snapshot_batches=driver.snapshot_batches)
    finally:
        writer.stop()
    assert writer.error is None, f"the source writer failed: {writer.error!r}"
    assert writer.commits >= driver.min_commits, (
        f"the writer committed {writer.commits} transactions during the trials, fewer than {driver.min_commits}")
    if snapshot_kills:
        assert "snapshot" in phases, f"no kill landed in the snapshot: {phases}"
    if kills > snapshot_kills:
        assert "streaming" in phases, f"no kill landed while streaming: {phases}"
    run_until_caught_up(cmd, cwd)
    final = stored_offset(log_url, driver.name, kafka)
    assert final is not None and final["phase"] == "streaming", f"after catching up, the stored offset is {final}"
    log = open_for_check(log_url, kafka)
    try:
        check_exactly_once(driver.logged(log), driver.expected(final))
        driver.check_log(log)
    finally:
        log.close()


class CaptureContract:
    """The kill -9 trials every capture source runs, on the embedded log. Subclass with a `driver`
    fixture; see the module docstring."""

    kills: ClassVar[int] = 6
    """Captures started and killed; the first ``snapshot_kills`` mid-snapshot."""
    snapshot_kills: ClassVar[int] = 2
    seed: ClassVar[int] = 20261129
    streaming_pause: ClassVar[tuple[float, float]] = (0.05, 0.5)

    @pytest.fixture
    def driver(self) -> Iterator[SourceDriver]:
        raise NotImplementedError("a CaptureContract subclass provides the `driver` fixture")

    @pytest.mark.slow
    def test_kill_9_exactly_once(self, driver: SourceDriver, tmp_path: Path) -> None:
        run_kill_trials(driver, tmp_path, str(tmp_path / "log"), kills=self.kills, snapshot_kills=self.snapshot_kills,
                        seed=self.seed, streaming_pause=self.streaming_pause)


class KafkaCaptureContract(CaptureContract):
    """`CaptureContract`, and the same trials with the log on Kafka, once per Kafka client. Subclass
    with a `driver` and a `kafka_bootstrap` fixture (the broker's ``host:port``)."""

    kafka_kills: ClassVar[int] = 3
    """Captures started and killed per Kafka client; the first ``kafka_snapshot_kills`` mid-snapshot."""
    kafka_snapshot_kills: ClassVar[int] = 2

    @pytest.fixture
    def kafka_bootstrap(self) -> str:
        raise NotImplementedError("a KafkaCaptureContract subclass provides the `kafka_bootstrap` fixture")

    @pytest.mark.slow
    @pytest.mark.parametrize("client", ["confluent", "kafka-python"])  # capture with each Kafka client
    def test_kill_9_exactly_once_kafka(self, driver: SourceDriver, kafka_bootstrap: str, tmp_path: Path,
                                       client: str) -> None:
        run_kill_trials(driver, tmp_path, f"kafka://{kafka_bootstrap}", kills=self.kafka_kills,
                        snapshot_kills=self.kafka_snapshot_kills, seed=self.seed + 1, kafka_client=client,
                        streaming_pause=self.streaming_pause)
