"""The log contract test suite, shipped with the package so every backend runs the same tests.

Usage (one small module per backend)::

    from kappaflow.log.testing import LogContract

    class TestMyLogContract(LogContract):
        @pytest.fixture
        def log(self, tmp_path):
            log = MyLog(...)
            yield log
            log.close()

        def reopen(self, log):             # a writer restart: close, open the same log again
            log.close()
            return MyLog(...)

        def reader_factory(self, log):     # picklable; opens a reader in another process
            return functools.partial(MyLog, ..., read_only=True)

Backends whose compaction cannot be forced synchronously (a Kafka broker compacts on
its own schedule) set ``compacts_on_demand = False``; the compaction tests then skip.
Every test makes its own uniquely named topics (`new_topic`), so a shared server works.
``close()`` must be idempotent: tests close reopened logs and the fixture closes again.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kappaflow.errors import (
    ConfigError,
    RecordTooLargeError,
    UnknownTopicError,
    ValidationError,
)
from kappaflow.log.base import Log, LogRecord, Record, TopicConfig
from kappaflow.log.partitioner import murmur2

__all__ = ["KAFKA_MURMUR2_VECTORS", "LogContract", "read_all"]

#: Kafka's own test vectors for `Utils.murmur2` (clients/src/test/.../UtilsTest.java).
KAFKA_MURMUR2_VECTORS: dict[bytes, int] = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


def read_all(log: Log, topic: str) -> dict[int, list[LogRecord]]:
    """Every record of every partition, up to the end offsets at the call."""
    return {p: list(log.iter_partition(topic, p)) for p in range(log.partitions(topic))}


def _kafka_partition(key: bytes, partitions: int) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def _reader_process(factory: Callable[[], Log], topic: str, partitions: int, expected: int,
                    first: int, timeout_s: float, out: Any) -> None:
    """Runs in another process: follow `topic` until `expected` records were read.

    Reports ("progress", n) once `first` records were seen, then ("done", records) or
    ("timeout", n). Polls with a short pause between empty reads, bounded by `timeout_s`.
    """
    log = factory()
    try:
        nxt = dict.fromkeys(range(partitions), 0)
        got: list[tuple[int, int, bytes | None, bytes | None]] = []
        told = False
        deadline = time.monotonic() + timeout_s
        while len(got) < expected:
            progressed = False
            for p in range(partitions):
                recs = log.read(topic, p, nxt[p], 5000)
                if recs:
                    progressed = True
                    got += [(r.partition, r.offset, r.key, r.value) for r in recs]
                    nxt[p] = recs[-1].offset + 1
            if not told and len(got) >= first:
                out.put(("progress", len(got)))
                told = True
            if time.monotonic() > deadline:
                out.put(("timeout", len(got)))
                return
            if not progressed:
                time.sleep(0.01)  # polling interval of a follower, not a synchronisation
        out.put(("done", got))
    except BaseException as exc:  # report, so the parent fails with the reason
        out.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        log.close()


class LogContract:
    """Tests every `Log` backend must pass. Subclass with a `log` fixture (see module doc)."""

    #: False for backends that cannot compact synchronously on `compact(topic, now_ms=...)`.
    compacts_on_demand: ClassVar[bool] = True
    #: Bound for waits on another process (spawn start-up, broker latency).
    cross_process_timeout_s: ClassVar[float] = 60.0
    #: Records in the large-batch test (the issue asks for >= 100k).
    large_batch: ClassVar[int] = 100_000
    #: False for backends that cannot store a record timestamp of 0 (librdkafka reads 0 as "now"):
    #: they must refuse such an append with a ValidationError naming the record, writing nothing.
    writes_zero_timestamp: ClassVar[bool] = True

    # --- what a subclass provides -----------------------------------------------------
    @pytest.fixture
    def log(self) -> Iterator[Log]:
        raise NotImplementedError("a LogContract subclass provides the `log` fixture")

    def reopen(self, log: Log) -> Log:
        """Close `log` and open the same log again as the writer (a writer restart)."""
        raise NotImplementedError

    def reader_factory(self, log: Log) -> Callable[[], Log]:
        """A picklable callable that opens the same log (as a reader) in another process."""
        raise NotImplementedError

    # --- helpers ----------------------------------------------------------------------
    def new_topic(self, log: Log, partitions: int = 1, **config: Any) -> str:
        name = f"contract-{uuid.uuid4().hex[:16]}"
        log.create_topic(name, TopicConfig(partitions=partitions, **config))
        return name

    @contextlib.contextmanager
    def reopened(self, log: Log) -> Iterator[Log]:
        again = self.reopen(log)
        try:
            yield again
        finally:
            again.close()

    def _need_compaction(self) -> None:
        if not self.compacts_on_demand:
            pytest.skip("this backend cannot compact synchronously on demand")

    # --- partitioning -----------------------------------------------------------------
    def test_murmur2_matches_kafka_test_vectors(self) -> None:
        for key, expected in KAFKA_MURMUR2_VECTORS.items():
            assert murmur2(key) == expected, key

    def test_partition_is_murmur2_mod_partitions(self, log: Log) -> None:
        topic = self.new_topic(log, partitions=5)
        keys = [*KAFKA_MURMUR2_VECTORS, *(b"k%d" % i for i in range(300)), b""]
        appended = log.append(topic, [Record(k, b"v") for k in keys])
        assert [a.partition for a in appended] == [_kafka_partition(k, 5) for k in keys]
        stored = read_all(log, topic)
        for p, recs in stored.items():
            assert [r.key for r in recs] == [k for k in keys if _kafka_partition(k, 5) == p]
            assert all(r.partition == p and r.topic == topic for r in recs)

    def test_explicit_partition_and_keyless_records(self, log: Log) -> None:
        topic = self.new_topic(log, partitions=3)
        a = log.append(topic, [Record(b"x", b"1"), Record(b"y", b"2")], partition=2)
        assert [(x.partition, x.offset) for x in a] == [(2, 0), (2, 1)]
        b = log.append(topic, [Record(None, b"keyless")])
        assert [(x.partition, x.offset) for x in b] == [(0, 0)]
        assert [r.key for r in log.read(topic, 0, 0)] == [None]

    # --- order, offsets, restarts -----------------------------------------------------
    def test_offsets_are_dense_in_append_order(self, log: Log) -> None:
        topic = self.new_topic(log, partitions=2)
        first = log.append(topic, [Record(b"a", b"%d" % i) for i in range(5)])
        second = log.append(topic, [Record(b"a", b"%d" % i) for i in range(5, 8)])
        p = first[0].partition
        assert [x.offset for x in first + second] == list(range(8))
        assert {x.partition for x in first + second} == {p}
        assert log.end_offset(topic, p) == 8
        assert log.end_offsets(topic) == {p: 8, 1 - p: 0}
        assert [r.value for r in log.read(topic, p, 3, max_records=2)] == [b"3", b"4"]

    def test_append_quiet_places_records_like_append(self, log: Log) -> None:
        topic = self.new_topic(log, partitions=3)
        h = (("kf.op", b"c"),)
        recs = [Record(b"k%d" % (i % 9), b"v%d" % i, h if i % 2 else ()) for i in range(30)]
        log.append_quiet(topic, recs)
        log.append_quiet(topic, [Record(None, b"keyless")], partition=2)
        got = read_all(log, topic)
        want: dict[int, list[bytes | None]] = {}
        for r in recs:
            want.setdefault(_kafka_partition(r.key or b"", 3), []).append(r.value)
        want.setdefault(2, []).append(b"keyless")
        assert {p: [r.value for r in rs] for p, rs in got.items() if rs} == want
        assert all(tuple(r.headers) == (h if int(r.value[1:]) % 2 else ())  # type: ignore[index]
                   for rs in got.values() for r in rs if r.key is not None)

    def test_per_key_order(self, log: Log) -> None:
        topic = self.new_topic(log, partitions=3)
        keys = [b"key-%d" % i for i in range(40)]
        for round_no in range(5):
            log.append(topic, [Record(k, b"%s:%d" % (k, round_no * 10 + j)) for j in range(10) for k in keys])
        per_key: dict[bytes | None, list[bytes | None]] = {}
        for recs in read_all(log, topic).values():
            for r in recs:
                per_key.setdefault(r.key, []).append(r.value)
        assert set(per_key) == set(keys)
        for k in keys:
            assert per_key[k] == [b"%s:%d" % (k, i) for i in range(50)]

    def test_no_loss_no_duplicates_across_writer_restarts(self, log: Log) -> None:
        topic = self.new_topic(log, partitions=3)
        expected: dict[tuple[int, int], tuple[bytes, bytes]] = {}

        def put(lg: Log, start: int, count: int) -> None:
            recs = [Record(b"k%d" % (i % 17), b"v%d" % i) for i in range(start, start + count)]
            for a, r in zip(lg.append(topic, recs), recs, strict=True):
                assert (a.partition, a.offset) not in expected
                expected[(a.partition, a.offset)] = (r.key, r.value)  # type: ignore[assignment]

        put(log, 0, 200)
        with self.reopened(log) as again:
            put(again, 200, 150)
            with self.reopened(again) as third:
                put(third, 350, 1)
                stored = read_all(third, topic)
                got = {(r.partition, r.offset): (r.key, r.value) for recs in stored.values() for r in recs}
                assert got == expected
                for p, recs in stored.items():
                    assert [r.offset for r in recs] == list(range(len(recs)))
                    assert third.end_offset(topic, p) == len(recs)

    def test_reader_in_another_process_while_writer_appends(self, log: Log) -> None:
        topic = self.new_topic(log, partitions=3)
        chunk = 2000
        sent: dict[tuple[int, int], tuple[bytes, bytes]] = {}

        def put(i: int) -> None:
            recs = [Record(b"key-%d" % (j % 101), b"value-%d-%d" % (i, j)) for j in range(chunk)]
            for a, r in zip(log.append(topic, recs), recs, strict=True):
                sent[(a.partition, a.offset)] = (r.key, r.value)  # type: ignore[assignment]

        put(0)
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        proc = ctx.Process(
            target=_reader_process,
            args=(self.reader_factory(log), topic, 3, 4 * chunk, chunk, self.cross_process_timeout_s, results),
            daemon=True,
        )
        proc.start()
        try:
            kind, payload = self._next_message(proc, results)
            assert kind == "progress", (kind, payload)
            for i in range(1, 4):  # appended while the other process is reading
                put(i)
            kind, payload = self._next_message(proc, results)
            assert kind == "done", (kind, payload)
            got = {(p, o): (k, v) for p, o, k, v in payload}
            assert len(payload) == len(got) == 4 * chunk, "the reader saw duplicates"
            assert got == sent
        finally:
            proc.join(self.cross_process_timeout_s)
            if proc.is_alive():
                proc.kill()
        assert proc.exitcode == 0

    def _next_message(self, proc: Any, results: Any) -> tuple[str, Any]:
        deadline = time.monotonic() + self.cross_process_timeout_s
        while time.monotonic() < deadline:
            try:
                msg: tuple[str, Any] = results.get(timeout=0.5)
                return msg
            except queue.Empty:
                if not proc.is_alive() and results.empty():
                    pytest.fail(f"reader process exited (code {proc.exitcode}) without a result")
        pytest.fail(f"no word from the reader process within {self.cross_process_timeout_s} s")

    def test_large_batch(self, log: Log) -> None:
        topic = self.new_topic(log, partitions=4)
        n = self.large_batch
        recs = [Record(b"key-%d" % (i % 10_007), b"value-%d" % i) for i in range(n)]
        appended = log.append(topic, recs)
        assert len(appended) == n
        counts: dict[int, int] = {}
        for a in appended:
            assert a.offset == counts.get(a.partition, 0)
            counts[a.partition] = a.offset + 1
        assert log.end_offsets(topic) == {p: counts.get(p, 0) for p in range(4)}
        stored = read_all(log, topic)
        assert sum(len(v) for v in stored.values()) == n
        by_pos = {(a.partition, a.offset): r for a, r in zip(appended, recs, strict=True)}
        for p, got in stored.items():
            for r in got:
                want = by_pos[(p, r.offset)]
                assert (r.key, r.value) == (want.key, want.value)

    # differing_executors: by design, every backend's subclass runs this same test method.
    @settings(max_examples=30, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors])
    @given(batch=st.lists(st.tuples(st.binary(max_size=64), st.one_of(st.none(), st.binary(max_size=300))),
                          min_size=1, max_size=20))
    def test_arbitrary_bytes_roundtrip(self, log: Log, batch: list[tuple[bytes, bytes | None]]) -> None:
        topics: dict[int, str] = self.__dict__.setdefault("_bytes_topics", {})
        topic = topics.get(id(log)) or topics.setdefault(id(log), self.new_topic(log, partitions=3))
        appended = log.append(topic, [Record(k, v) for k, v in batch])
        for a, (k, v) in zip(appended, batch, strict=True):
            assert a.partition == _kafka_partition(k, 3)
            got = log.read(topic, a.partition, a.offset, 1)
            assert len(got) == 1
            assert (got[0].offset, got[0].key, got[0].value) == (a.offset, k, v)

    def test_headers_and_timestamps_round_trip(self, log: Log) -> None:
        topic = self.new_topic(log, partitions=1)
        headers = (("source", b"pg"), ("lsn", b"\x00\x01\xff"), ("empty", b""), ("source", b"again"))
        earliest = 0 if self.writes_zero_timestamp else 1
        if not self.writes_zero_timestamp:
            with pytest.raises(ValidationError, match=r"record 1: timestamp_ms 0"):
                log.append(topic, [Record(b"x", b"1"), Record(b"x", b"2", timestamp_ms=0)])
            assert log.end_offset(topic, 0) == 0, "a refused append writes nothing"
        before = time.time_ns() // 1_000_000
        log.append(topic, [
            Record(b"a", b"1", headers=headers, timestamp_ms=1_600_000_000_123),
            Record(b"b", b"2"),
            Record(b"c", None, headers=(("why", b"deleted"),), timestamp_ms=earliest),
        ])
        after = time.time_ns() // 1_000_000
        a, b, c = log.read(topic, 0, 0)
        assert a.headers == headers and a.timestamp_ms == 1_600_000_000_123
        assert b.headers == () and before - 5_000 <= b.timestamp_ms <= after + 5_000
        assert (c.value, c.headers, c.timestamp_ms) == (None, (("why", b"deleted"),), earliest)

    # --- edges ------------------------------------------------------------------------
    def test_empty_topic(self, log: Log) -> None:
        topic = self.new_topic(log, partitions=3)
        assert log.end_offsets(topic) == {0: 0, 1: 0, 2: 0}
        assert log.read(topic, 1, 0) == []
        assert list(log.iter_partition(topic, 2)) == []
        assert log.committed("g", topic) == {}
        assert log.append(topic, []) == []

    def test_reading_past_the_end(self, log: Log) -> None:
        topic = self.new_topic(log)
        log.append(topic, [Record(b"k", b"v")] * 3)
        assert log.read(topic, 0, 3) == []
        assert log.read(topic, 0, 1_000_000) == []
        assert [r.offset for r in log.read(topic, 0, 2)] == [2]
        assert [r.offset for r in log.iter_partition(topic, 0, start=1, end=2)] == [1]

    def test_unknown_topic(self, log: Log) -> None:
        name = f"missing-{uuid.uuid4().hex[:12]}"
        calls: list[Callable[[], object]] = [
            lambda: log.read(name, 0, 0),
            lambda: log.append(name, [Record(b"k", b"v")]),
            lambda: log.end_offset(name, 0),
            lambda: log.end_offsets(name),
            lambda: log.topic_config(name),
            lambda: log.delete_topic(name),
            lambda: log.commit("g", {(name, 0): 1}),
            lambda: log.committed("g", name),
        ]
        if self.compacts_on_demand:
            calls.append(lambda: log.compact(name))
        for call in calls:
            with pytest.raises(UnknownTopicError) as info:
                call()
            assert name in str(info.value)

    def test_topics_create_list_delete(self, log: Log) -> None:
        config = TopicConfig(partitions=2, cleanup_policy="compact", delete_retention_ms=1234)  # type: ignore[arg-type]
        topic = self.new_topic(log, partitions=2, cleanup_policy="compact", delete_retention_ms=1234)
        assert log.list_topics()[topic] == config
        assert log.topic_config(topic) == config and log.partitions(topic) == 2
        assert log.create_topic(topic) == config  # exist_ok: the existing config
        assert log.create_topic(topic, config) == config
        with pytest.raises(ConfigError, match="already exists"):
            log.create_topic(topic, TopicConfig(partitions=3))
        with pytest.raises(ConfigError, match="already exists"):
            log.create_topic(topic, config, exist_ok=False)
        log.append(topic, [Record(b"k", b"v")])
        log.commit("g", {(topic, 0): 1})
        log.delete_topic(topic)
        assert topic not in log.list_topics()
        with pytest.raises(UnknownTopicError):
            log.read(topic, 0, 0)
        log.create_topic(topic, config)  # a new topic with the old name starts empty
        assert log.end_offsets(topic) == {0: 0, 1: 0}
        assert log.committed("g", topic) == {}

    def test_bad_topic_names_and_configs(self, log: Log) -> None:
        for bad in ("", "has space", "x" * 250, ".", "..", "slash/y"):
            with pytest.raises(ConfigError):
                log.create_topic(bad)
        with pytest.raises(ConfigError, match="partitions"):
            TopicConfig(partitions=0)
        with pytest.raises(ConfigError, match=r"cleanup\.policy"):
            TopicConfig(cleanup_policy="sometimes")  # type: ignore[arg-type]

    def test_record_too_large(self, log: Log) -> None:
        topic = self.new_topic(log, max_record_bytes=1000)
        log.append(topic, [Record(b"k", b"x" * 990)])
        with pytest.raises(RecordTooLargeError) as info:
            log.append(topic, [Record(b"k", b"ok"), Record(b"k", b"x" * 1200)])
        message = str(info.value)
        assert topic in message
        assert any(int(n) >= 1201 for n in re.findall(r"\d+", message)), f"size not named: {message}"
        assert log.end_offset(topic, 0) == 1, "a rejected append must write nothing"

    def test_bad_records_and_arguments(self, log: Log) -> None:
        topic = self.new_topic(log, partitions=2)
        with pytest.raises(ValidationError, match="key"):
            Record("text key", b"v")  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match="value"):
            Record(b"k", "text value")  # type: ignore[arg-type]
        with pytest.raises(ValidationError):
            log.append(topic, [("k", "v")])  # type: ignore[list-item]
        with pytest.raises(ValidationError, match="partition"):
            log.append(topic, [Record(b"k", b"v")], partition=2)
        with pytest.raises(ValidationError, match="partition"):
            log.read(topic, 5, 0)
        with pytest.raises(ValidationError, match="partition"):
            log.end_offset(topic, -1)
        with pytest.raises(ValidationError, match="offset"):
            log.read(topic, 0, -1)
        with pytest.raises(ValidationError):
            log.commit("g", {(topic, 0): -5})
        assert log.end_offsets(topic) == {0: 0, 1: 0}

    def test_compacted_topic_needs_keys(self, log: Log) -> None:
        topic = self.new_topic(log, cleanup_policy="compact")
        with pytest.raises(ValidationError, match="key"):
            log.append(topic, [Record(b"k", b"v"), Record(None, b"v")])
        assert log.end_offset(topic, 0) == 0

    # --- consumer groups ----------------------------------------------------------------
    def test_committed_offsets(self, log: Log) -> None:
        t1 = self.new_topic(log, partitions=3)
        t2 = self.new_topic(log, partitions=1)
        log.append(t1, [Record(b"k%d" % i, b"v") for i in range(30)])
        assert log.committed("g1", t1) == {}
        log.commit("g1", {(t1, 0): 5, (t1, 2): 7, (t2, 0): 1})
        assert log.committed("g1", t1) == {0: 5, 2: 7}
        assert log.committed("g1", t2) == {0: 1}
        assert log.committed("g2", t1) == {}
        log.commit("g1", {(t1, 0): 9})
        assert log.committed("g1", t1) == {0: 9, 2: 7}
        log.commit("g2", {(t1, 1): 3})
        assert log.committed("g2", t1) == {1: 3}
        assert log.committed("g1", t1) == {0: 9, 2: 7}
        with self.reopened(log) as again:
            assert again.committed("g1", t1) == {0: 9, 2: 7}

    # --- compaction -------------------------------------------------------------------------
    def test_compaction_keeps_latest_per_key_and_offsets(self, log: Log) -> None:
        self._need_compaction()
        topic = self.new_topic(log, partitions=2, cleanup_policy="compact")
        keys = [b"k%d" % i for i in range(25)]
        appended = []
        for round_no in range(4):
            appended += log.append(topic, [Record(k, b"%s-v%d" % (k, round_no)) for k in keys])
        latest = {}
        for a, k in zip(appended, keys * 4, strict=True):
            latest[k] = a
        ends = log.end_offsets(topic)
        stats = log.compact(topic, now_ms=1_000)
        assert stats.removed == 75 and stats.kept == 25
        assert log.end_offsets(topic) == ends, "compaction must not move end offsets"
        for recs in read_all(log, topic).values():
            for r in recs:
                assert r.key is not None
                assert (r.partition, r.offset) == (latest[r.key].partition, latest[r.key].offset)
                assert r.value == r.key + b"-v3"
            assert len({r.key for r in recs}) == len(recs)
        assert sum(len(v) for v in read_all(log, topic).values()) == 25
        more = log.append(topic, [Record(keys[0], b"after")])
        assert more[0].offset == ends[more[0].partition], "offsets continue after compaction"
        again = log.compact(topic, now_ms=2_000)
        assert again.removed == 1

    def test_tombstone_removed_only_after_retention(self, log: Log) -> None:
        self._need_compaction()
        topic = self.new_topic(log, cleanup_policy="compact", delete_retention_ms=5_000)
        log.append(topic, [Record(b"gone", b"1"), Record(b"stay", b"2"), Record(b"gone", b"3")])
        log.append(topic, [Record(b"gone", None)])  # offset 3, the last record
        log.compact(topic, now_ms=10_000)  # first seen: retention runs until 15_000
        assert [(r.offset, r.key, r.value) for r in log.read(topic, 0, 0)] == [(1, b"stay", b"2"), (3, b"gone", None)]
        log.compact(topic, now_ms=14_999)
        assert [r.offset for r in log.read(topic, 0, 0)] == [1, 3]
        stats = log.compact(topic, now_ms=15_000)
        assert stats.tombstones_removed == 1
        assert [(r.offset, r.key) for r in log.read(topic, 0, 0)] == [(1, b"stay")]
        assert log.end_offset(topic, 0) == 4, "removing the last record must not reuse its offset"
        assert log.append(topic, [Record(b"gone", b"back")])[0].offset == 4

    def test_tombstone_superseded_before_retention(self, log: Log) -> None:
        self._need_compaction()
        topic = self.new_topic(log, cleanup_policy="compact", delete_retention_ms=0)
        log.append(topic, [Record(b"a", b"1"), Record(b"a", None), Record(b"b", b"x")])
        stats = log.compact(topic, now_ms=5)  # retention 0: the tombstone goes in this pass
        assert stats.tombstones_removed == 1
        assert [(r.offset, r.key) for r in log.read(topic, 0, 0)] == [(2, b"b")]
        assert log.read(topic, 0, 1)[0].offset == 2, "reading from a gap returns the next record"

    def test_compaction_is_a_noop_for_delete_policy(self, log: Log) -> None:
        self._need_compaction()
        topic = self.new_topic(log, cleanup_policy="delete")
        log.append(topic, [Record(b"k", b"%d" % i) for i in range(10)])
        stats = log.compact(topic, now_ms=10**12)
        assert stats.removed == 0
        assert len(log.read(topic, 0, 0)) == 10
