"""Embedded-backend specific tests: crashes (kill -9), damaged files, the single-writer
lock, readers in other processes, background compaction and the batch codec."""

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
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kappaflow.errors import (
    ConfigError,
    CorruptLogError,
    LogError,
    LogUnavailableError,
    UnknownTopicError,
    ValidationError,
)
from kappaflow.log import open_log
from kappaflow.log.base import CleanupPolicy, LogRecord, Record, TopicConfig
from kappaflow.log.embedded import EmbeddedLog, RecordColumns
from kappaflow.log.embedded.codec import decode_headers
from kappaflow.log.partitioner import murmur2, murmur2_many, partition_for, partitions_for
from kappaflow.log.testing import KAFKA_MURMUR2_VECTORS, read_all

COMPACT = CleanupPolicy.COMPACT


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def _topic_file(log_dir: Path, topic: str) -> Path:
    (path,) = (log_dir / "topics").glob(f"{topic}.*.db")
    return path


# --- opening, the writer lock, readers ------------------------------------------------------
def test_open_log_returns_embedded(tmp_path: Path) -> None:
    with open_log(str(tmp_path / "a")) as log:
        assert isinstance(log, EmbeddedLog)
    with open_log(f"file:{tmp_path / 'b'}") as log:
        assert isinstance(log, EmbeddedLog) and log.path == tmp_path / "b"


def test_bad_paths(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="expected a directory"):
        EmbeddedLog(tmp_path / "file")
    with pytest.raises(LogUnavailableError, match="no embedded log"):
        EmbeddedLog(tmp_path / "missing", read_only=True)
    with pytest.raises(ConfigError, match="synchronous"):
        EmbeddedLog(tmp_path / "x", synchronous="sometimes")  # type: ignore[arg-type]


def test_second_writer_is_refused_with_the_path(tmp_path: Path) -> None:
    path = tmp_path / "log"
    first = EmbeddedLog(path)
    try:
        with pytest.raises(LogUnavailableError) as info:
            EmbeddedLog(path)
        assert str(path) in str(info.value) and str(os.getpid()) in str(info.value)
        assert info.value.transient
        script = "import sys; from kappaflow.log.embedded import EmbeddedLog; EmbeddedLog(sys.argv[1])"
        out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0
        assert "already open for writing" in out.stderr and str(path) in out.stderr
        with EmbeddedLog(path, read_only=True) as reader:  # readers are always welcome
            assert reader.list_topics() == {}
    finally:
        first.close()
    EmbeddedLog(path).close()  # the lock goes with the writer


def test_reader_cannot_write_but_can_commit(tmp_path: Path) -> None:
    with EmbeddedLog(tmp_path) as writer:
        writer.create_topic("t", TopicConfig(partitions=2))
        writer.append("t", [Record(b"k", b"v")])
        with EmbeddedLog(tmp_path, read_only=True) as reader:
            for call in (lambda: reader.append("t", [Record(b"k", b"v")]), lambda: reader.create_topic("u"),
                         lambda: reader.delete_topic("t"), lambda: reader.compact("t")):
                with pytest.raises(LogError, match="read-only"):
                    call()
            reader.commit("consumer", {("t", 1): 1})
            assert writer.committed("consumer", "t") == {1: 1}
            assert reader.end_offsets("t") == writer.end_offsets("t")


def test_reader_follows_topic_changes(tmp_path: Path) -> None:
    with EmbeddedLog(tmp_path) as writer, EmbeddedLog(tmp_path, read_only=True) as reader:
        writer.create_topic("t")
        writer.append("t", [Record(b"k", b"old")])
        assert [r.value for r in reader.read("t", 0, 0)] == [b"old"]
        writer.delete_topic("t")
        with pytest.raises(UnknownTopicError):
            reader.read("t", 0, 0)
        writer.create_topic("t", TopicConfig(partitions=2))
        assert reader.read("t", 0, 0) == [] and reader.partitions("t") == 2
        writer.append("t", [Record(b"k", b"new")], partition=1)
        assert [r.value for r in reader.read("t", 1, 0)] == [b"new"]


def test_closed_log_refuses_calls(tmp_path: Path) -> None:
    log = EmbeddedLog(tmp_path)
    log.create_topic("t")
    log.close()
    log.close()  # idempotent
    with pytest.raises(LogError, match="closed"):
        log.read("t", 0, 0)


def test_orphan_topic_files_are_removed_on_open(tmp_path: Path) -> None:
    with EmbeddedLog(tmp_path) as log:
        log.create_topic("t")
    orphan = tmp_path / "topics" / "gone.0123456789ab.db"
    orphan.write_bytes(b"left by a crash inside create_topic")
    with EmbeddedLog(tmp_path) as log:
        assert list(log.list_topics()) == ["t"]
    assert not orphan.exists()


# --- input validation -------------------------------------------------------------------------
def test_bad_headers_and_timestamps(tmp_path: Path) -> None:
    with EmbeddedLog(tmp_path) as log:
        log.create_topic("t")
        with pytest.raises(ValidationError, match=r"record 1: header 'h' value"):
            log.append("t", [Record(b"k", b"v"), Record(b"k", b"v", headers=(("h", "text"),))])  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match="record 0: headers"):
            log.append("t", [Record(b"k", b"v", headers=("nonsense",))])  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match="record 2: timestamp_ms"):
            log.append("t", [Record(b"k", b"v")] * 2 + [Record(b"k", b"v", timestamp_ms=1.5)])  # type: ignore[arg-type]
        assert log.end_offset("t", 0) == 0


# --- kill -9 ----------------------------------------------------------------------------------
_WRITER = """
import sys
from kappaflow.log.base import Record
from kappaflow.log.embedded import EmbeddedLog

log = EmbeddedLog(sys.argv[1])
i = int(sys.argv[2])
print("ready", flush=True)
while True:
    size = 1 + (i * 7919) % 2500
    log.append("t", [Record(b"k%d" % (j % 97), b"a%d-r%d" % (i, j)) for j in range(size)])
    print(i, flush=True)
    i += 1
"""


def _size(i: int) -> int:
    return 1 + (i * 7919) % 2500


def _kill_trials(path: Path, seed: int, trials: int) -> None:
    rnd = random.Random(seed)
    with EmbeddedLog(path) as log:
        log.create_topic("t", TopicConfig(partitions=3))
    next_id = 0
    for trial in range(trials):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(next_id)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line == "ready", f"writer did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"
        time.sleep(rnd.uniform(0.0, 0.4))  # a seeded random moment, very likely mid-append
        os.kill(proc.pid, signal.SIGKILL)
        # read through the text wrapper: `readline` above may have buffered the first acks
        # already (communicate() would read past them from the raw pipe)
        out = proc.stdout.read()
        proc.wait(timeout=60)
        if proc.stderr is not None:
            proc.stderr.close()
        proc.stdout.close()
        acked = [int(x) for x in out.split()]
        with EmbeddedLog(path) as log:  # the lock died with the writer
            seen: dict[int, list[int]] = {}
            positions = set()
            for recs in read_all(log, "t").values():
                for r in recs:
                    assert r.value is not None
                    a, j = r.value.decode().split("-")
                    seen.setdefault(int(a[1:]), []).append(int(j[1:]))
                    positions.add((r.partition, r.offset))
            ids = sorted(seen)
            assert ids == list(range(len(ids))), f"trial {trial}: appends missing in the middle: {ids[-5:]}"
            for i in ids:
                assert sorted(seen[i]) == list(range(_size(i))), f"trial {trial}: append {i} partly visible"
            assert set(acked) <= set(ids), f"trial {trial}: an acknowledged append was lost"
            assert len(ids) <= next_id + len(acked) + 1, "more appends than were made"
            for p, end in log.end_offsets("t").items():
                assert end == sum(1 for q, _ in positions if q == p)
            next_id = len(ids)
    with EmbeddedLog(path) as log:  # and appending goes on where it stopped
        ends = log.end_offsets("t")
        more = log.append("t", [Record(b"after", b"x")])
        assert more[0].offset == ends[more[0].partition]


def test_kill_9_mid_append_is_all_or_nothing(tmp_path: Path) -> None:
    _kill_trials(tmp_path / "log", seed=20261122, trials=4)


@pytest.mark.slow
def test_kill_9_many_trials(tmp_path: Path) -> None:
    _kill_trials(tmp_path / "log", seed=7, trials=15)


# --- damaged files ----------------------------------------------------------------------------
def _write_markers(path: Path, count: int, **options: int) -> None:
    with EmbeddedLog(path, **options) as log:  # type: ignore[arg-type]
        log.create_topic("t")
        for start in range(0, count, 1000):
            log.append("t", [Record(b"k%d" % i, b"VALUE-%08d-" % i + b"x" * 150)
                             for i in range(start, min(count, start + 1000))])


def test_bit_flip_in_a_value_is_named_and_earlier_records_stay_readable(tmp_path: Path) -> None:
    path = tmp_path / "log"
    _write_markers(path, 3000)
    file = _topic_file(path, "t")
    blob = bytearray(file.read_bytes())
    at = blob.index(b"VALUE-00001234-") + 20
    blob[at] ^= 0x01
    file.write_bytes(bytes(blob))
    with EmbeddedLog(path, read_only=True) as log:
        good = log.read("t", 0, 0, max_records=5000)
        assert [r.offset for r in good] == list(range(1234)), "records before the damage are returned first"
        with pytest.raises(CorruptLogError) as info:
            log.read("t", 0, 1234)
        err = info.value
        assert (err.path, err.topic, err.partition, err.offset) == (str(file), "t", 0, 1234)
        assert str(file) in str(err) and "offset 1234" in str(err)
        assert [r.offset for r in log.read("t", 0, 1235, 3)] == [1235, 1236, 1237]


def test_compaction_refuses_to_rewrite_damaged_batches(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with EmbeddedLog(path) as log:
        log.create_topic("t", TopicConfig(cleanup_policy=COMPACT))
        log.append("t", [Record(b"k%d" % (i % 10), b"VALUE-%08d-" % i + b"y" * 50) for i in range(100)])
    file = _topic_file(path, "t")
    blob = bytearray(file.read_bytes())
    blob[blob.index(b"VALUE-00000042-") + 3] ^= 0x40
    file.write_bytes(bytes(blob))
    with EmbeddedLog(path) as log:
        with pytest.raises(CorruptLogError, match="offset 42"):
            log.compact("t")
        assert len(log.read("t", 0, 0, 42)) == 42  # nothing was rewritten


def test_damaged_batch_index_is_detected(tmp_path: Path) -> None:
    import struct

    path = tmp_path / "log"
    _write_markers(path, 3000, batch_records=500)
    file = _topic_file(path, "t")
    blob = bytearray(file.read_bytes())
    at = blob.index(struct.pack("<Bqq", 1, 1000, 1499))  # the index header of the batch at 1000
    blob[at + 40] ^= 0xFF  # inside its offset deltas
    file.write_bytes(bytes(blob))
    with EmbeddedLog(path, read_only=True) as log:
        assert len(log.read("t", 0, 0, 5000)) == 1000
        with pytest.raises(CorruptLogError, match="index CRC32") as info:
            log.read("t", 0, 1000)
        assert info.value.offset == 1000
        assert log.read("t", 0, 1500, 1)[0].offset == 1500


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "log"
    _write_markers(path, 20_000)
    file = _topic_file(path, "t")
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size // 2)
    with EmbeddedLog(path, read_only=True) as log:
        got: list[LogRecord] = []
        with pytest.raises(CorruptLogError) as info:
            while True:
                recs = log.read("t", 0, len(got), 2000)
                assert recs, "a truncated file must not look like a shorter, healthy log"
                assert recs[0].offset == len(got)
                got += recs
        assert 0 < len(got) < 20_000, "records before the damage stay readable"
        assert info.value.path == str(file) and info.value.offset == len(got)
        assert str(file) in str(info.value)
    # the writer refuses to append after the damage
    with pytest.raises(CorruptLogError) as info2, EmbeddedLog(path) as log:
        log.append("t", [Record(b"k", b"v")])
    assert info2.value.path == str(file)


def test_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "log"
    _write_markers(path, 10)
    file = _topic_file(path, "t")
    file.write_bytes(b"this is not an SQLite file" * 200)
    with EmbeddedLog(path, read_only=True) as log, pytest.raises(CorruptLogError) as info:
        log.read("t", 0, 0)
    assert info.value.path == str(file) and str(file) in str(info.value)


def test_missing_topic_file(tmp_path: Path) -> None:
    path = tmp_path / "log"
    _write_markers(path, 10)
    _topic_file(path, "t").unlink()
    with EmbeddedLog(path, read_only=True) as log, pytest.raises(CorruptLogError, match="missing"):
        log.read("t", 0, 0)


# --- compaction -------------------------------------------------------------------------------
def test_background_compaction(tmp_path: Path) -> None:
    with EmbeddedLog(tmp_path, compact_interval_s=0.05) as log:
        log.create_topic("t", TopicConfig(partitions=2, cleanup_policy=COMPACT))
        for round_no in range(5):
            log.append("t", [Record(b"k%d" % i, b"v%d" % round_no) for i in range(50)])

        def compacted() -> bool:
            recs = [r for rs in read_all(log, "t").values() for r in rs]
            # the bookkeeping follows the last chunk's commit (background compaction is paced)
            return len(recs) == 50 and {r.value for r in recs} == {b"v4"} and "t" in log.last_compaction

        _wait_for(compacted, 30, "the background thread to compact topic t")
        assert not log.background_errors
        assert log.last_compaction["t"].kept == 50


def test_compaction_while_appending(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kappaflow.log.embedded.compaction as embedded

    monkeypatch.setattr(embedded, "_COMPACT_CHUNK_RECORDS", 500)  # many small compaction transactions
    with EmbeddedLog(tmp_path, batch_records=64) as log:
        log.create_topic("t", TopicConfig(partitions=2, cleanup_policy=COMPACT))
        latest: dict[bytes, bytes] = {}
        for r in range(20):
            recs = [Record(b"k%d" % i, b"%d-%d" % (r, i)) for i in range(300)]
            log.append("t", recs)
        errors: list[BaseException] = []

        def compact() -> None:
            try:
                for _ in range(3):
                    log.compact("t")
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=compact)
        worker.start()
        for r in range(20, 40):  # appends interleave with compaction chunks
            log.append("t", [Record(b"k%d" % i, b"%d-%d" % (r, i)) for i in range(0, 300, 3)])
        worker.join(60)
        assert not worker.is_alive() and not errors
        for i in range(300):
            latest[b"k%d" % i] = b"%d-%d" % (39 if i % 3 == 0 else 19, i)
        log.compact("t")
        stored = [r for rs in read_all(log, "t").values() for r in rs]
        assert {r.key: r.value for r in stored} == latest and len(stored) == 300
        for p, rs in read_all(log, "t").items():
            assert [r.offset for r in rs] == sorted(r.offset for r in rs)
            assert log.end_offset("t", p) > rs[-1].offset
        batches = sum(sqlite3.connect(_topic_file(tmp_path, "t")).execute(f"SELECT count(*) FROM p{p}").fetchone()[0]
                      for p in range(2))
        assert batches <= 10, f"small batches are merged by compaction, {batches} left"


def test_compaction_survives_reopen_with_tombstone_clock(tmp_path: Path) -> None:
    with EmbeddedLog(tmp_path) as log:
        log.create_topic("t", TopicConfig(cleanup_policy=COMPACT, delete_retention_ms=100))
        log.append("t", [Record(b"a", b"1"), Record(b"a", None)])
        log.compact("t", now_ms=1_000)
    with EmbeddedLog(tmp_path) as log:  # the first-seen time was stored
        log.compact("t", now_ms=1_099)
        assert [r.offset for r in log.read("t", 0, 0)] == [1]
        log.compact("t", now_ms=1_100)
        assert log.read("t", 0, 0) == []
        assert log.end_offset("t", 0) == 2


# --- codec ------------------------------------------------------------------------------------
def test_vectorised_murmur2_matches_kafka_vectors() -> None:
    assert murmur2_many(list(KAFKA_MURMUR2_VECTORS)) == list(KAFKA_MURMUR2_VECTORS.values())


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.one_of(st.none(), st.binary(max_size=40)), min_size=0, max_size=300),
       partitions=st.integers(1, 50))
def test_vectorised_partitioning_matches_scalar(keys: list[bytes | None], partitions: int) -> None:
    keys = keys * (1 + 64 // max(1, len(keys)))  # past the vectorisation threshold
    assert partitions_for(keys, partitions) == [partition_for(k, partitions) for k in keys]
    present = [k for k in keys if k is not None]
    assert murmur2_many(present) == [murmur2(k) for k in present]


def test_large_records_span_batches(tmp_path: Path) -> None:
    with EmbeddedLog(tmp_path, batch_bytes=4096) as log:
        log.create_topic("t", TopicConfig(max_record_bytes=100_000))
        recs = [Record(b"k%d" % i, bytes([i]) * (i * 500)) for i in range(40)]
        log.append("t", recs)
        assert [(r.key, r.value) for r in log.read("t", 0, 0)] == [(r.key, r.value) for r in recs]


def test_bulk_built_results_equal_constructed_ones() -> None:
    from dataclasses import dataclass

    from kappaflow.log.base import Appended
    from kappaflow.log.embedded.codec import build

    assert build(Appended, 3, [0, 1, 2], [7, 8, 9]) == [Appended(0, 7), Appended(1, 8), Appended(2, 9)]
    rec = build(LogRecord, 1, ["t"], [1], [5], [b"k"], [None], [(("h", b"v"),)], [42])[0]
    assert rec == LogRecord("t", 1, 5, b"k", None, (("h", b"v"),), 42)
    assert hash(rec) == hash(LogRecord("t", 1, 5, b"k", None, (("h", b"v"),), 42)) and "offset=5" in repr(rec)

    @dataclass(frozen=True, slots=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            if self.x < 0:
                raise ValueError("x")

    with pytest.raises(ValueError):  # classes with validation are built through __init__
        build(Checked, 1, [-1])


@pytest.mark.parametrize("name", ["meta.db", "groups.db"])
def test_damaged_meta_or_groups_file_is_named(tmp_path: Path, name: str) -> None:
    with EmbeddedLog(tmp_path) as log:
        log.create_topic("t")
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"{name}{suffix}").unlink(missing_ok=True)
    (tmp_path / name).write_bytes(b"garbage, not SQLite" * 500)
    with pytest.raises(CorruptLogError) as info:
        EmbeddedLog(tmp_path)
    assert info.value.path == str(tmp_path / name) and name in str(info.value)


def test_bit_flip_in_a_one_record_batch(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with EmbeddedLog(path) as log:
        log.create_topic("t")
        for i in range(10):  # small appends: one record per stored batch (the fast read path)
            log.append("t", [Record(b"k", b"VALUE-%08d-" % i, headers=(("i", b"%d" % i),))])
    file = _topic_file(path, "t")
    blob = bytearray(file.read_bytes())
    blob[blob.index(b"VALUE-00000005-") + 7] ^= 0x04
    file.write_bytes(bytes(blob))
    with EmbeddedLog(path, read_only=True) as log:
        good = log.read("t", 0, 0)
        assert [r.headers for r in good] == [(("i", b"%d" % i),) for i in range(5)]
        with pytest.raises(CorruptLogError, match="offset 5") as info:
            log.read("t", 0, 5)
        assert info.value.offset == 5
        assert [r.offset for r in log.read("t", 0, 6)] == [6, 7, 8, 9]


# --- columnar reads ---------------------------------------------------------------------------
def _as_columns(recs: list[LogRecord]) -> tuple[list[Any], ...]:
    return ([r.offset for r in recs], [r.key for r in recs], [r.value for r in recs],
            [r.timestamp_ms for r in recs], [r.headers for r in recs])


def _joined(chunks: list[RecordColumns]) -> tuple[list[Any], ...]:
    out: tuple[list[Any], ...] = ([], [], [], [], [])
    for c in chunks:
        assert len({len(c.offsets), len(c.keys), len(c.values), len(c.timestamps_ms), len(c.headers)}) == 1
        for col, part in zip(out, (c.offsets, c.keys, c.values, c.timestamps_ms,
                                   [decode_headers(h) for h in c.headers]), strict=True):
            col.extend(part)
    return out


def test_read_columns_equals_read_across_compaction_gaps(tmp_path: Path) -> None:
    with EmbeddedLog(tmp_path / "log", batch_records=50) as log:
        log.create_topic("t", TopicConfig(partitions=2, cleanup_policy=COMPACT, delete_retention_ms=0))
        log.create_topic("plain")  # keyless records are allowed here
        rng = random.Random(7)
        for i in range(40):
            for topic in ("t", "plain"):
                log.append(topic, [Record(b"k%d" % rng.randrange(30) if topic == "t" or j % 7 else None,
                                          None if j % 11 == 0 else b"v%d-%d" % (i, j),
                                          headers=(("kf.op", b"u"), ("n", b"%d" % j)) if j % 3 else (),
                                          timestamp_ms=1_700_000_000_000 + i * 100 + j)
                                   for j in range(rng.randrange(1, 120))])
        log.compact("t", now_ms=time.time_ns() // 1_000_000 + 10_000)
        for topic, p in [("t", 0), ("t", 1), ("plain", 0)]:
            end = log.end_offset(topic, p)
            full = log.read(topic, p, 0, max_records=100_000)
            assert topic == "plain" or len(full) < end, "compaction left gaps to read across"
            assert _joined(list(log.read_columns(topic, p))) == _as_columns(full)
            for start, stop, fetch in [(0, end, 1), (3, end // 2, 1), (end // 3, end // 3 + 17, 2),
                                       (end - 1, end, 16), (5, 5, 1), (end, end + 10, 4)]:
                want = [r for r in full if start <= r.offset < stop]
                got = list(log.read_columns(topic, p, start, stop, batches_per_fetch=fetch))
                assert _joined(got) == _as_columns(want), (topic, p, start, stop, fetch)


def test_read_columns_from_inside_a_compaction_gap_one_batch_per_fetch(tmp_path: Path) -> None:
    with EmbeddedLog(tmp_path / "log", batch_records=50) as log:
        log.create_topic("t", TopicConfig(cleanup_policy=COMPACT))
        log.append("t", [Record(b"k%d" % i, b"first") for i in range(50)])  # one batch, offsets 0-49
        log.append("t", [Record(b"k%d" % i, b"second") for i in range(40, 50)])  # supersede 40-49
        log.compact("t")
        assert [r.offset for r in log.read("t", 0, 0)] == [*range(40), *range(50, 60)]
        chunks = list(log.read_columns("t", 0, 45, batches_per_fetch=1))
        assert _joined(chunks)[0] == list(range(50, 60)), "records after the gap are not skipped"


def test_read_columns_yields_records_before_damage_then_names_it(tmp_path: Path) -> None:
    path = tmp_path / "log"
    _write_markers(path, 3000)
    file = _topic_file(path, "t")
    blob = bytearray(file.read_bytes())
    blob[blob.index(b"VALUE-00001234-") + 20] ^= 0x01
    file.write_bytes(bytes(blob))
    with EmbeddedLog(path, read_only=True) as log:
        got: list[RecordColumns] = []
        with pytest.raises(CorruptLogError) as info:
            for chunk in log.read_columns("t", 0, 1000):
                got.append(chunk)
        assert _joined(got)[0] == list(range(1000, 1234)), "the records before the damage come first"
        assert (info.value.path, info.value.topic, info.value.partition, info.value.offset) == (str(file), "t", 0, 1234)
        assert _joined(list(log.read_columns("t", 0, 1235, 1240)))[0] == list(range(1235, 1240))


@pytest.mark.parametrize("args, kwargs, what", [
    (("t", 1), {}, "partition"),
    (("t", 0, -1), {}, "start"),
    (("t", 0, 0, "9"), {}, "end"),
    (("t", 0), {"batches_per_fetch": 0}, "batches_per_fetch"),
])
def test_read_columns_refuses_bad_arguments(tmp_path: Path, args: tuple[Any, ...], kwargs: dict[str, Any],
                                            what: str) -> None:
    with EmbeddedLog(tmp_path / "log") as log:
        log.create_topic("t")
        with pytest.raises(ValidationError, match=what):
            list(log.read_columns(*args, **kwargs))
        with pytest.raises(UnknownTopicError):
            list(log.read_columns("nope", 0))
