"""Concurrent writers: no lost update, a conflict exactly when expected, idempotency under
concurrent retries, and gap-free tailing while commits race."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kappaflow.ledger import ExpectedVersion, Ledger, NewEvent, StreamAppend, TailReader, WrongExpectedVersionError

pytestmark = pytest.mark.integration


def run_threads(targets: list[Callable[[], None]], timeout: float = 60.0) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a writer thread hung"
    if errors:
        raise errors[0]


@dataclass
class Outcome:
    thread: int
    stream: str
    count: int
    expected: int | None  # None = ANY
    ok: bool
    first_position: int = 0
    actual: int | None = None


OPS = st.tuples(st.sampled_from(["shared-0", "shared-1", "own"]), st.integers(1, 3), st.sampled_from(["exact", "any"]))


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(plan=st.lists(st.lists(OPS, min_size=1, max_size=10), min_size=2, max_size=6))
def test_no_lost_update_and_conflict_exactly_when_expected(ledger_dsn: str, plan: list[list[Any]]) -> None:
    prefix = uuid.uuid4().hex[:8]
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(plan))
    with Ledger(ledger_dsn, pool_size=len(plan)) as ledger:
        def worker(t: int, ops: list[Any]) -> Callable[[], None]:
            def run() -> None:
                barrier.wait()
                for target, count, mode in ops:
                    stream = f"{prefix}{target}-{t}" if target == "own" else f"{prefix}{target}"
                    events = [NewEvent("Tick", {"thread": t, "i": i}) for i in range(count)]
                    expected = ledger.stream_version(stream) if mode == "exact" else None
                    try:
                        r = ledger.append(stream, events, ExpectedVersion.ANY if expected is None else expected)
                        o = Outcome(t, stream, count, expected, True, r.first_position)
                        assert r.versions[stream] >= count
                    except WrongExpectedVersionError as exc:
                        assert exc.stream_id == stream and exc.expected == expected
                        o = Outcome(t, stream, count, expected, False, actual=exc.actual)
                    with lock:
                        outcomes.append(o)
            return run

        run_threads([worker(t, ops) for t, ops in enumerate(plan)])

        by_stream: dict[str, list[Outcome]] = defaultdict(list)
        for o in outcomes:
            by_stream[o.stream].append(o)
        for stream, outs in by_stream.items():
            events = ledger.read_stream(stream)
            ok = [o for o in outs if o.ok]
            # no lost update: every successful append is there, versions are 1..n
            assert [e.stream_version for e in events] == list(range(1, len(events) + 1))
            assert len(events) == sum(o.count for o in ok) == ledger.stream_version(stream)
            at = {e.position: e for e in events}
            for o in ok:
                written = [at[p] for p in range(o.first_position, o.first_position + o.count)]
                assert all(e.stream_id == stream and e.data["thread"] == o.thread for e in written)
                if o.expected is not None:  # applied exactly on top of the version it expected
                    assert [e.stream_version for e in written] == list(range(o.expected + 1, o.expected + 1 + o.count))
            writers = {o.thread for o in ok}
            for o in outs:
                if o.ok:
                    continue
                # a conflict only when someone else moved the stream past the expected version
                assert o.expected is not None and o.actual is not None and o.actual > o.expected
                assert writers - {o.thread}, f"conflict on {stream} without another writer"
                assert any(e.stream_version == o.expected + 1 and e.data["thread"] != o.thread for e in events)
            if stream.endswith(tuple(f"own-{t}" for t in range(len(plan)))):
                assert all(o.ok for o in outs), "a single writer never conflicts"
        assert ledger.verify(from_position=max(1, ledger.head().position - 500)).ok


def test_transfers_between_shared_streams_never_deadlock(ledger: Ledger) -> None:
    """Multi-stream appends lock streams in id order: opposite-direction transfers interleave safely."""
    accounts = [f"acct-{i}" for i in range(4)]
    for a in accounts:
        ledger.append(a, [NewEvent("Opened", {})])

    def writer(seed: int) -> Callable[[], None]:
        def run() -> None:
            rnd = random.Random(seed)
            for _ in range(40):
                a, b = rnd.sample(accounts, 2)
                ledger.append_many([StreamAppend(a, [NewEvent("Sent", {"to": b})]),
                                    StreamAppend(b, [NewEvent("Received", {"from": a})])])
        return run

    run_threads([writer(s) for s in range(6)])
    assert sum(ledger.stream_version(a) for a in accounts) == 4 + 6 * 40 * 2
    assert ledger.verify().ok


def test_idempotency_under_concurrent_retries(ledger_dsn: str) -> None:
    n = 8
    with Ledger(ledger_dsn, pool_size=n) as ledger:
        for round_ in range(8):
            key = f"transfer-{round_}"
            # odd rounds: exact expected versions, as a client that read the streams first
            exp_a = ledger.stream_version("acct-a") if round_ % 2 else ExpectedVersion.ANY
            parts = [StreamAppend("acct-a", [NewEvent("Sent", {"n": round_})], exp_a),
                     StreamAppend("acct-b", [NewEvent("Received", {"n": round_})])]
            results: list[Any] = []
            lock = threading.Lock()
            barrier = threading.Barrier(n)

            def retry(parts: list[StreamAppend] = parts, key: str = key, results: list[Any] = results,
                      lock: threading.Lock = lock, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                r = ledger.append_many(parts, idempotency_key=key)
                with lock:
                    results.append(r)

            head = ledger.head().position
            run_threads([retry] * n)
            assert sum(not r.duplicate for r in results) == 1
            assert {(r.first_position, r.position, tuple(sorted(r.versions.items()))) for r in results} == {
                (head + 1, head + 2, (("acct-a", round_ + 1), ("acct-b", round_ + 1)))}
            assert ledger.head().position == head + 2
        assert ledger.verify().ok


# --- gap-safe order -----------------------------------------------------------

def naive_tail(dsn: str, table: str, stop: threading.Event, seen: list[int]) -> Callable[[], None]:
    """A reader that trusts `position > last`: it skips any event that commits after a later one."""
    def run() -> None:
        last = 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            while True:
                done = stop.is_set()
                rows = conn.execute(f"select position from {table} where position > %s order by position",
                                    (last,)).fetchall()
                for (p,) in rows:
                    seen.append(p)
                    last = p
                if done:
                    return
    return run


def wait_for_lock_wait(dsn: str, app: str, timeout: float = 10.0) -> None:
    """Bounded wait until the session named `app` is blocked on a lock."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute("select count(*) from pg_stat_activity where application_name = %s "
                               "and wait_event_type = 'Lock'", (app,)).fetchone()
            if row and row[0]:
                return
            time.sleep(0.01)
    raise AssertionError(f"session {app} never blocked on a lock")


def test_a_late_commit_is_not_skipped_sequence_control(ledger_dsn: str) -> None:
    """Control: with sequence positions, the naive reader does skip (the harness has teeth)."""
    with psycopg.connect(ledger_dsn, autocommit=True) as conn:
        conn.execute("create table seq_events (position bigserial primary key, v int)")
    with psycopg.connect(ledger_dsn) as a, psycopg.connect(ledger_dsn, autocommit=True) as b, \
            psycopg.connect(ledger_dsn, autocommit=True) as r:
        a.execute("insert into seq_events (v) values (1)")  # position 1, not committed
        b.execute("insert into seq_events (v) values (2)")  # position 2, committed
        seen = [p for (p,) in r.execute("select position from seq_events where position > 0 order by 1")]
        a.commit()
        seen += [p for (p,) in r.execute("select position from seq_events where position > %s order by 1",
                                          (seen[-1],))]
    assert seen == [2]  # position 1 was skipped for ever


def test_a_late_commit_is_not_skipped_ledger(ledger_dsn: str) -> None:
    """The same interleaving on the ledger: the second writer waits, the reader sees 1 then 2."""
    with Ledger(ledger_dsn) as ledger, psycopg.connect(ledger_dsn) as a, \
            psycopg.connect(ledger_dsn, autocommit=True, application_name="writer-b") as b:
        ledger.append("x-1", [NewEvent("A", {})], connection=a)  # position assigned, not committed
        done = threading.Event()
        result: list[int] = []

        def writer_b() -> None:
            result.append(ledger.append("x-2", [NewEvent("B", {})], connection=b).position)
            done.set()

        t = threading.Thread(target=writer_b, daemon=True)
        t.start()
        wait_for_lock_wait(ledger_dsn, "writer-b")
        assert ledger.read_all() == []  # nothing visible, nothing to skip
        a.commit()
        t.join(10)
        assert done.is_set() and result == [2]
        assert [(e.position, e.event_type) for e in ledger.read_all()] == [(1, "A"), (2, "B")]


def test_gap_free_tailing_under_concurrent_commits(ledger_dsn: str) -> None:
    writers, per_writer = 4, 25
    stop = threading.Event()
    naive_seen: list[int] = []
    tail_seen: list[int] = []
    with Ledger(ledger_dsn, pool_size=writers + 2) as ledger:
        reader = TailReader(ledger, batch=7)

        def tail() -> None:
            while True:
                done = stop.is_set()
                tail_seen.extend(e.position for e in reader.poll(timeout=0.05))
                if done and reader.next_position > writers * per_writer:
                    return

        def writer(w: int) -> Callable[[], None]:
            def run() -> None:
                rnd = random.Random(w)
                with psycopg.connect(ledger_dsn) as conn:
                    for i in range(per_writer):
                        if rnd.random() < 0.5:
                            # hold the position uncommitted for a moment, inside a caller transaction
                            ledger.append(f"w-{w}", [NewEvent("E", {"i": i})], connection=conn)
                            conn.execute("select pg_sleep(%s)", (rnd.random() * 0.01,))
                            conn.commit()
                        else:
                            ledger.append(f"w-{rnd.randrange(writers)}", [NewEvent("E", {"i": i})])
            return run

        readers = [threading.Thread(target=naive_tail(ledger_dsn, '"kappaflow_ledger".events', stop, naive_seen),
                                    daemon=True), threading.Thread(target=tail, daemon=True)]
        for t in readers:
            t.start()
        run_threads([writer(w) for w in range(writers)])
        stop.set()
        for t in readers:
            t.join(30)
            assert not t.is_alive()
    total = writers * per_writer
    assert naive_seen == list(range(1, total + 1))
    assert tail_seen == list(range(1, total + 1))
