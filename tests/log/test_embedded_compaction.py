"""Embedded log compaction as a long-running writer needs it (issue 13, item 22).

* the freed space goes back to the file system (file sizes measured before and after);
* a log created before incremental auto-vacuum is rewritten once when asked explicitly;
* ``min_compaction_lag_ms`` keeps the head of the log (Kafka's uncleanable head);
* background compaction leaves appends going between its chunks;
* kill -9 in the middle of a compaction: the log reopens with nothing lost, nothing twice;
* another process asks the running writer to compact (``control.db``) and gets its report.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kappaflow.errors import LogError, LogUnavailableError
from kappaflow.log.base import CleanupPolicy, Record, TopicConfig
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.log.embedded.control import compact_embedded, writer_pid
from kappaflow.log.embedded.space import file_bytes
from kappaflow.log.testing import read_all

COMPACT = CleanupPolicy.COMPACT
VALUE = b"x" * 2000


def _wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def _topic_file(log_dir: Path, topic: str) -> Path:
    (path,) = (log_dir / "topics").glob(f"{topic}.*.db")
    return path


def _fill(log: EmbeddedLog, topic: str, keys: int, rounds: int, partitions: int = 2) -> dict[bytes, bytes]:
    """`rounds` versions of `keys` keys (2 KB values); returns the latest value per key."""
    log.create_topic(topic, TopicConfig(partitions=partitions, cleanup_policy=COMPACT))
    latest = {}
    for r in range(rounds):
        recs = [Record(b"k%d" % i, b"%d-%d-" % (r, i) + VALUE) for i in range(keys)]
        log.append(topic, recs)
        latest.update((rec.key, rec.value) for rec in recs)
    return latest  # type: ignore[return-value]


def _stored(log: EmbeddedLog, topic: str) -> dict[bytes | None, bytes | None]:
    recs = [r for rs in read_all(log, topic).values() for r in rs]
    out = {r.key: r.value for r in recs}
    assert len(out) == len(recs), "a key is stored twice after compaction"
    return out


# --- disk space ---------------------------------------------------------------------------------
def test_compaction_gives_the_disk_space_back(tmp_path: Path) -> None:
    with EmbeddedLog(tmp_path) as log:
        latest = _fill(log, "t", keys=500, rounds=20)
        before = file_bytes(_topic_file(tmp_path, "t"))
        assert before > 15_000_000
        stats = log.compact("t")
        after = file_bytes(_topic_file(tmp_path, "t"))
        assert stats.removed == 500 * 19 and stats.kept == 500
        assert _stored(log, "t") == latest
    # 1/20 of the records stay (database file + WAL, which the writer checkpointed and truncated)
    assert after < before * 0.15, f"topic file {after} bytes after compaction, {before} before"
    assert stats.bytes_before == before and stats.bytes_after == after


def test_a_file_without_auto_vacuum_is_rewritten_when_asked(tmp_path: Path) -> None:
    with EmbeddedLog(tmp_path) as log:
        log.create_topic("t", TopicConfig(partitions=1, cleanup_policy=COMPACT))
    path = _topic_file(tmp_path, "t")
    conn = sqlite3.connect(path)  # what topic files of logs created before this change look like
    conn.execute("PRAGMA auto_vacuum=0")
    conn.execute("VACUUM")
    assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    conn.close()
    with EmbeddedLog(tmp_path) as log:
        log.append("t", [Record(b"k%d" % (i % 300), b"%d-" % i + VALUE) for i in range(6000)])
        before = file_bytes(path)
        stats = log.compact("t")
        assert stats.kept == 300 and not stats.full_vacuum
        assert file_bytes(path) >= before * 0.9, "no auto-vacuum: the background pass never rewrites the file"
        (stats,) = log.compact_all("t", full_vacuum=True).values()
        assert stats.full_vacuum
        assert len(log.read("t", 0, 0)) == 300
        after = file_bytes(path)
        assert stats.bytes_after == after
        (again,) = log.compact_all("t", full_vacuum=True).values()
        assert not again.full_vacuum, "once incremental, the file is never rewritten whole again"
    assert after < before * 0.2, f"{after} bytes after the full vacuum, {before} before"
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2, "switched to incremental auto-vacuum"


# --- what readers need: the head stays ------------------------------------------------------------
def test_min_compaction_lag_keeps_the_head(tmp_path: Path) -> None:
    with EmbeddedLog(tmp_path, min_compaction_lag_ms=60_000) as log:
        log.create_topic("t", TopicConfig(cleanup_policy=COMPACT, delete_retention_ms=0))
        log.append("t", [Record(b"a", b"1", timestamp_ms=1_000), Record(b"b", b"1", timestamp_ms=1_000)])
        log.append("t", [Record(b"a", b"2", timestamp_ms=50_000), Record(b"b", None, timestamp_ms=50_000)])
        log.append("t", [Record(b"a", b"3", timestamp_ms=100_000)])
        stats = log.compact("t", now_ms=100_000)  # horizon: 40_000 -> only offsets 0, 1 are old enough
        assert stats.removed == 0, "old records are superseded only by records old enough themselves"
        stats = log.compact("t", now_ms=110_000)  # horizon 50_000: offsets 0..3
        assert [(r.offset, r.key, r.value) for r in log.read("t", 0, 0)] == [(2, b"a", b"2"), (4, b"a", b"3")]
        assert stats.tombstones_removed == 1
        log.compact("t", now_ms=160_000)
        assert [(r.offset, r.value) for r in log.read("t", 0, 0)] == [(4, b"3")]


# --- bounded cost: appends go on ------------------------------------------------------------------
def test_background_compaction_lets_appends_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kappaflow.log.embedded.compaction as embedded

    monkeypatch.setattr(embedded, "_COMPACT_CHUNK_RECORDS", 400)  # many chunks
    chunks: list[float] = []
    appends: list[float] = []
    step = embedded.Pacer.step

    def counting_step(self: embedded.Pacer) -> None:
        chunks.append(time.monotonic())
        step(self)

    monkeypatch.setattr(embedded.Pacer, "step", counting_step)
    with EmbeddedLog(tmp_path, batch_records=100) as log:
        latest = _fill(log, "t", keys=400, rounds=15)
        stop = threading.Event()

        def appender() -> None:
            i = 0
            while not stop.is_set():
                log.append("t", [Record(b"new%d" % i, b"v")])
                appends.append(time.monotonic())
                latest[b"new%d" % i] = b"v"
                i += 1

        worker = threading.Thread(target=appender)
        worker.start()
        try:
            log._background_pass()  # what the maintenance thread runs every compact_interval_s
        finally:
            stop.set()
            worker.join(60)
        assert not log.background_errors
        assert len(chunks) > 10
        during = [a for a in appends if chunks[0] < a < chunks[-1]]
        assert during, "appends waited for the whole compaction"
        assert _stored(log, "t") == latest


# --- kill -9 mid-compaction -------------------------------------------------------------------------
_COMPACTOR = """
import sys
import kappaflow.log.embedded.compaction as embedded
from kappaflow.log.embedded import EmbeddedLog

embedded._COMPACT_CHUNK_RECORDS = 300  # many chunk transactions
wanted, chunks = int(sys.argv[2]), 0
step = embedded.Pacer.step
def announce(self):
    global chunks
    if sys._getframe(1).f_code.co_name == "commit_chunk":  # a chunk of rewritten batches committed
        chunks += 1
        if chunks == wanted:
            print("chunk", flush=True)
            sys.stdin.readline()  # killed here, or told to go on and killed a moment later
    step(self)
embedded.Pacer.step = announce
with EmbeddedLog(sys.argv[1], batch_records=64) as log:
    log.compact("t")
print("done", flush=True)
"""


def test_kill_9_mid_compaction_loses_nothing_and_shows_nothing_twice(tmp_path: Path) -> None:
    rnd = random.Random(20261201)
    path = tmp_path / "log"
    original: dict[tuple[int, int], tuple[bytes | None, bytes | None]] = {}
    with EmbeddedLog(path, batch_records=64) as log:
        log.create_topic("t", TopicConfig(partitions=2, cleanup_policy=COMPACT, delete_retention_ms=0))
        for r in range(12):
            recs = [Record(b"k%d" % i, None if (r == 11 and i % 10 == 0) else b"%d-%d" % (r, i))
                    for i in range(600)]
            for rec, a in zip(recs, log.append("t", recs), strict=True):
                original[(a.partition, a.offset)] = (rec.key, rec.value)
        ends = log.end_offsets("t")
    # the latest record of each key in the original (what every state must hold)
    latest: dict[bytes, tuple[int, int]] = {}
    for pos in sorted(original):
        key = original[pos][0]
        assert key is not None
        if key not in latest or latest[key] < pos:
            latest[key] = pos
    partial = 0
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, "-c", _COMPACTOR, str(path), str(rnd.randint(1, 3))],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline().strip()
        if line == "chunk" and trial % 2:  # odd trials: let it go on, kill it inside the next chunks
            proc.stdin.write("go\n")
            proc.stdin.flush()
            time.sleep(rnd.uniform(0.0, 0.02))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
        err = proc.stderr.read()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()
        assert line in ("chunk", "done"), f"trial {trial}: the compactor failed: {line!r} {err}"
        with EmbeddedLog(path) as log:  # reopens as the writer: the lock died with the process
            assert log.end_offsets("t") == ends, f"trial {trial}: end offsets moved"
            recs = read_all(log, "t")
            count = 0
            for p, rs in recs.items():
                offsets = [r.offset for r in rs]
                assert offsets == sorted(set(offsets)), f"trial {trial}: partition {p} shows an offset twice"
                for r in rs:
                    assert (r.key, r.value) == original[(p, r.offset)], f"trial {trial}: record {p}@{r.offset} changed"
                count += len(rs)
            present = {(p, r.offset) for p, rs in recs.items() for r in rs}
            for key, pos in latest.items():
                if original[pos][1] is not None:
                    assert pos in present, f"trial {trial}: the latest record of {key!r} ({pos}) was lost"
            partial += 540 < count < len(original)  # 540: fully compacted (60 keys deleted)
    assert partial, "no trial stopped a compaction half-way"
    with EmbeddedLog(path) as log:  # and compaction finishes afterwards
        log.compact("t")
        assert _stored(log, "t") == {k: original[pos][1] for k, pos in latest.items() if original[pos][1] is not None}


# --- asking the running writer ------------------------------------------------------------------------
_WRITER = """
import sys, time
from kappaflow.log.embedded import EmbeddedLog

log = EmbeddedLog(sys.argv[1])  # no background compaction: it still answers requests
print("ready", flush=True)
time.sleep(600)
"""


def test_another_process_asks_the_running_writer_to_compact(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with EmbeddedLog(path) as log:
        latest = _fill(log, "t", keys=300, rounds=20)
        log.create_topic("plain", TopicConfig(cleanup_policy=CleanupPolicy.DELETE))
    before = file_bytes(_topic_file(path, "t"))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert writer_pid(path) == proc.pid

        def open_writer() -> EmbeddedLog:
            return EmbeddedLog(path)

        with pytest.raises(LogUnavailableError):
            open_writer()  # what `log compact` used to stop at
        report = compact_embedded(path, None, open_writer=open_writer, timeout_s=120)
        assert report.writer_pid == proc.pid
        assert set(report.topics) == {"t"}, "only compact-policy topics"
        st = report.topics["t"]
        assert (st["kept"], st["removed"]) == (300, 300 * 19)
        assert not st["full_vacuum"], "a file the log created frees its pages in steps, appends going on"
        assert st["bytes_before"] == pytest.approx(before, rel=0.05)
        assert st["bytes_after"] < before * 0.2
        with pytest.raises(LogError, match="no-such-topic"):
            compact_embedded(path, "no-such-topic", open_writer=open_writer, timeout_s=120)
        with EmbeddedLog(path, read_only=True) as reader:
            assert _stored(reader, "t") == latest  # type: ignore[arg-type]
    finally:
        proc.kill()
        proc.wait(30)
    # no writer any more: the same call compacts in this process
    report = compact_embedded(path, "t", open_writer=lambda: EmbeddedLog(path), timeout_s=120)
    assert report.writer_pid is None and report.topics["t"]["removed"] == 0


def test_a_request_left_by_a_dead_writer_is_run_by_the_next_one(tmp_path: Path) -> None:
    from kappaflow.log.embedded.control import ControlChannel

    path = tmp_path / "log"
    with EmbeddedLog(path) as log:
        _fill(log, "t", keys=50, rounds=4)
    channel = ControlChannel(path)
    try:
        rid = channel.submit("t")
        channel._run("UPDATE requests SET state = 'running', writer_pid = 999999999 WHERE id = ?", (rid,))
        with EmbeddedLog(path):
            _wait_for(lambda: channel.state(rid).state == "done", 60, "the new writer to run the request")
        result = channel.state(rid).result
        assert result is not None and result["topics"]["t"]["removed"] == 150
    finally:
        channel.close()


def test_closing_the_writer_does_not_wait_for_a_background_compaction(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import kappaflow.log.embedded.compaction as embedded

    monkeypatch.setattr(embedded, "_COMPACT_CHUNK_RECORDS", 200)  # a long, paced compaction: many chunks
    with EmbeddedLog(tmp_path, batch_records=50) as log:
        latest = _fill(log, "t", keys=300, rounds=30)
    started = threading.Event()
    step = embedded.Pacer.step

    def noting_step(self: embedded.Pacer) -> None:
        started.set()
        step(self)

    monkeypatch.setattr(embedded.Pacer, "step", noting_step)
    log = EmbeddedLog(tmp_path, batch_records=50, compact_interval_s=0.01)
    try:
        _wait_for(started.is_set, 60, "the background compaction to start")
    finally:
        log.close()  # stops it between two chunks (each chunk is its own transaction)
    with EmbeddedLog(tmp_path, read_only=True) as reader:
        left = [r for rs in read_all(reader, "t").values() for r in rs]
    assert len(left) > 300, "the compaction ran to its end before close returned"
    with EmbeddedLog(tmp_path) as log:
        log.compact("t")
        assert _stored(log, "t") == latest
