"""kill -9 the ledger capture process at seeded random moments while appends go on.

The capture runs as a real process (``python -m kappaflow.cli.capture NAME --config ...``,
source kind ``ledger``). The first trials kill it during the snapshot, the others while
streaming; each time it is started again. At the end, with the writer stopped and one
clean ``--until-caught-up`` run, every ledger event is in the log exactly once, as the
very record `to_log_record` defines (same topic, partition, key, value, headers).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from kappaflow.connectors.offsets import OFFSETS_TOPIC, find_last
from kappaflow.ledger import Ledger, NewEvent, StreamAppend
from kappaflow.ledger.logmap import to_log_record
from kappaflow.ledger.relay import record_position
from kappaflow.log import open_log
from kappaflow.log.partitioner import partition_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARTITIONS = 3


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def stored_offset(log_url: str, name: str, kafka: bool) -> dict[str, Any] | None:
    try:
        log = open_log(log_url) if kafka else open_log(log_url, read_only=True)
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


class Appender(threading.Thread):
    """Atomic two-stream appends (an account and an audit stream) until stopped."""

    def __init__(self, ledger: Ledger, seed: int) -> None:
        super().__init__(daemon=True)
        self.ledger = ledger
        self.rng = random.Random(seed)
        self.stop_flag = threading.Event()
        self.commits = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_flag.is_set():
                i = self.rng.randint(0, 40)
                self.ledger.append_many([StreamAppend(f"account-{i}", [NewEvent("Moved", {"i": self.commits})]),
                                         StreamAppend(f"audit-{i % 3}", [NewEvent("Seen", {"i": i})])])
                self.commits += 1
                time.sleep(0.002)
        except BaseException as exc:  # reported by the test
            self.error = exc


def trials(tmp_path: Path, ledger: Ledger, dsn: str, name: str, log_url: str, *, kafka: bool, kills: int,
           seed: int) -> None:
    rng = random.Random(seed)
    for b in range(12):  # 12,000 events before the first start: a snapshot of many chunks
        ledger.append(f"account-{b}", [NewEvent("Opened", {"n": k}) for k in range(1000)])
    config = tmp_path / "kappaflow.toml"
    config.write_text(f'[log]\nurl = "{log_url}"\npartitions = {PARTITIONS}\n\n'
                      f'[sources.{name}]\nkind = "ledger"\ndsn = "{dsn}"\n'
                      "snapshot_chunk_rows = 150\nheartbeat_interval_s = 0.5\n")
    cmd = [sys.executable, "-m", "kappaflow.cli.capture", name, "--config", str(config), "--no-progress"]
    writer = Appender(ledger, seed)
    writer.start()
    phases = []
    try:
        for trial in range(kills):
            before = stored_offset(log_url, name, kafka)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=str(tmp_path))
            def progressed(proc: subprocess.Popen[bytes] = proc, before: dict[str, Any] | None = before) -> bool:
                off = stored_offset(log_url, name, kafka)
                return (off is not None and off != before) or proc.poll() is not None

            def streaming(proc: subprocess.Popen[bytes] = proc) -> bool:
                off = stored_offset(log_url, name, kafka)
                return (off is not None and off["phase"] == "streaming") or proc.poll() is not None

            try:
                if trial < 2:  # during the snapshot, once it made progress in this run
                    wait_for(progressed, 60, "snapshot progress")
                    time.sleep(rng.uniform(0, 0.05))
                else:  # while streaming
                    wait_for(streaming, 60, "streaming")
                    time.sleep(rng.uniform(0.05, 0.5))
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                phases.append((stored_offset(log_url, name, kafka) or {}).get("phase"))
                os.kill(proc.pid, signal.SIGKILL)
            finally:
                proc.wait()
    finally:
        writer.stop_flag.set()
        writer.join()
    assert writer.error is None, writer.error
    assert writer.commits > 20
    assert "snapshot" in phases and "streaming" in phases, phases
    done = subprocess.run([*cmd, "--until-caught-up"], capture_output=True, timeout=120, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()

    want = {}
    for e in ledger.iter_all(decode=False):
        topic, rec = to_log_record(name, e)
        want[e.position] = (topic, partition_for(rec.key, PARTITIONS), rec.key, rec.value, rec.headers,
                            rec.timestamp_ms)
    log = open_log(log_url) if kafka else open_log(log_url, read_only=True)
    try:
        got: dict[int, tuple[Any, ...]] = {}
        seen: Counter[int] = Counter()
        for topic, cfg in log.list_topics().items():
            if not topic.startswith(name + "."):
                continue
            for p in range(cfg.partitions):
                last = 0
                for r in log.iter_partition(topic, p):
                    pos = record_position(r)
                    assert pos is not None and pos > last, f"{topic}[{p}] offset {r.offset}: out of order"
                    last = pos
                    seen[pos] += 1
                    got[pos] = (topic, p, r.key, r.value, r.headers, r.timestamp_ms)
        twice = [p for p, n in seen.items() if n > 1]
        assert not twice, f"written twice: {twice[:10]}"
        missing = sorted(set(want) - set(got))
        assert not missing, f"{len(missing)} events missing from the log, first {missing[:10]}"
        assert got == want
    finally:
        log.close()


def test_kill_9_ledger_capture_embedded(tmp_path: Path, ledger: Ledger, ledger_dsn: str) -> None:
    trials(tmp_path, ledger, ledger_dsn, "lk" + os.urandom(4).hex(), str(tmp_path / "log"), kafka=False,
           kills=5, seed=2024)


def test_kill_9_ledger_capture_kafka(tmp_path: Path, ledger: Ledger, ledger_dsn: str, kafka_broker: Any) -> None:
    trials(tmp_path, ledger, ledger_dsn, "lk" + os.urandom(4).hex(), f"kafka://{kafka_broker.bootstrap}",
           kafka=True, kills=3, seed=77)
