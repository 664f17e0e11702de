"""Transactionally consistent views over PostgreSQL and MariaDB sources (issue 17).

Transfers are one source transaction each: two UPDATEs of two account rows (usually two log
partitions), run at full rate from two sessions while the source's connector captures and a
follower keeps the latest-row view of the accounts current in PostgreSQL. A reader polls the view
inside its own transactions: the total of the balances never changes at the source, so every read
must show it. Follow micro-batches end at the newest consistent cut of the source.

Also here: a transaction larger than a micro-batch's record limit (and than the MySQL capture's
batch, so the capture writes it in parts without a cut) is read whole -- the batch grows to the
next cut; an idle source keeps recording its cut with every heartbeat, at the log's end.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from psycopg import sql

from kappaflow.config import PostgresSourceConfig
from kappaflow.connectors.base import StopSignal
from kappaflow.connectors.postgres.connector import PostgresConnector
from tests._consistency import InvariantReader, wait_until
from tests._kill import KilledProcess, trial_count
from tests.projections import defs

pytestmark = pytest.mark.integration

ACCOUNTS = 12
OPENING = 1_000
TOTAL = OPENING * ACCOUNTS
VIEW = "accounts_view"


def transfer(rnd: random.Random) -> tuple[int, int, int]:
    """Two accounts in id order (no deadlocks between the writers) and a signed amount."""
    a, b = sorted(rnd.sample(range(1, ACCOUNTS + 1), 2))
    return a, b, rnd.randint(1, 50) * rnd.choice((1, -1))


def rotation(rnd: random.Random) -> list[tuple[int, int]]:
    """(id, delta) for every account, deltas summing to 0: one transaction over all of them."""
    deltas = [rnd.randint(-30, 30) for _ in range(ACCOUNTS - 1)]
    deltas.append(-sum(deltas))
    return list(zip(range(1, ACCOUNTS + 1), deltas, strict=True))


@dataclass
class Bank:
    """One source database holding the accounts table, as each source kind reaches it."""

    source: str
    topic: str
    connector: Callable[..., Any]  # (log, **capture options) -> a connector with run(stop, until_caught_up=)
    session: Callable[[], Any]  # a context manager yielding `run(statements)`: one source transaction
    rows: Callable[[], dict[int, int]]

    def transfers(self, seed: int, stop: threading.Event, errors: list[BaseException], pause: float = 0.0) -> None:
        """Transfers until `stop`: at full rate, or with `pause` seconds between two (a bounded backlog)."""
        rnd = random.Random(seed)
        try:
            with self.session() as run:
                while not stop.is_set():
                    a, b, amount = transfer(rnd)
                    run([(-amount, a), (amount, b)])
                    if pause:
                        stop.wait(pause)
        except BaseException as exc:
            errors.append(exc)


@pytest.fixture
def pg_bank(pg_dsn: str) -> Bank:
    source = f"c{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        conn.execute("INSERT INTO accounts SELECT g, %s FROM generate_series(1, %s) g", (OPENING, ACCOUNTS))
    cfg = PostgresSourceConfig(name=source, dsn=pg_dsn, tables=["public.accounts"], heartbeat_interval_s=0.5,
                               slot=f"kf_{source}", publication=f"kf_{source}")

    def connector(log: Any, **kw: Any) -> Any:
        return PostgresConnector(cfg, log, partitions=3, progress=False, linger_s=kw.pop("linger_s", 0.005), **kw)

    @contextmanager
    def session() -> Iterator[Callable[[list[tuple[int, int]]], None]]:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            def run(changes: list[tuple[int, int]]) -> None:
                with conn.transaction():
                    for delta, account in changes:
                        conn.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (delta, account))
            yield run

    def rows() -> dict[int, int]:
        with psycopg.connect(pg_dsn) as conn:
            return dict(conn.execute("SELECT id, balance FROM accounts").fetchall())

    return Bank(source, f"{source}.public.accounts", connector, session, rows)


@pytest.fixture
def mariadb_bank(mariadb_server: Any, mariadb_db: str) -> Bank:
    import pymysql

    from kappaflow.connectors.mysql.connector import MySQLConnector

    db, source = mariadb_db, f"m{uuid.uuid4().hex[:8]}"
    mariadb_server.execute("CREATE TABLE accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL) ENGINE=InnoDB",
                           *(f"INSERT INTO accounts VALUES ({i}, {OPENING})" for i in range(1, ACCOUNTS + 1)), db=db)

    def connector(log: Any, **kw: Any) -> Any:
        kw.setdefault("flush_interval_s", 0.05)
        return MySQLConnector(name=source, log=log, dsn=mariadb_server.dsn(db), tables=[f"{db}.accounts"],
                              partitions=3, heartbeat_interval_s=0.5, **kw)

    @contextmanager
    def session() -> Iterator[Callable[[list[tuple[int, int]]], None]]:
        conn = pymysql.connect(autocommit=False, **mariadb_server.connect_args(db))
        try:
            def run(changes: list[tuple[int, int]]) -> None:
                with conn.cursor() as cur:  # one InnoDB transaction: one XID event in the binlog
                    for delta, account in changes:
                        cur.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (delta, account))
                conn.commit()
            yield run
        finally:
            conn.close()

    def rows() -> dict[int, int]:
        return {int(i): int(b) for i, b in mariadb_server.execute("SELECT id, balance FROM accounts", db=db)}

    return Bank(source, f"{source}.{db}.accounts", connector, session, rows)


class Run:
    """Capture (a thread) + follower + invariant reader over one bank; `finish()` stops them all."""

    def __init__(self, bank: Bank, log: Any, url: str, spark: Any, pg_server: Any, tmp_path: Path, *,
                 capture: dict[str, Any] | None = None, follow: dict[str, Any] | None = None,
                 follower: bool = True, capturing: bool = True) -> None:
        """`follower=False` / `capturing=False`: the test runs the follower / capture itself (a process it
        kills)."""
        from kappaflow.projections.follow import Follower
        from kappaflow.projections.runtime import Runtime
        from kappaflow.projections.sinks.postgres import PostgresSink

        self.bank, self.pg_server = bank, pg_server
        bank.connector(log).run(until_caught_up=True)  # snapshot, topics
        self.errors: list[BaseException] = []
        self.stop_capture = StopSignal()
        options = capture or {}

        def run_capture() -> None:
            try:
                bank.connector(log, **options).run(self.stop_capture)
            except BaseException as exc:
                self.errors.append(exc)

        self.views_db = f"v_{bank.source}"
        self.views_dsn = pg_server.create_database(self.views_db)
        self.rt = Runtime(spark, url, PostgresSink(self.views_dsn), checkpoint_dir=tmp_path / "ckpt")
        self.capturing = threading.Thread(target=run_capture, daemon=True)
        if capturing:
            self.capturing.start()
        self.batch_events: list[int] = []
        self.follower: Any = None
        if follower:
            self.follower = Follower(defs.accounts(bank.topic, VIEW), self.rt, trigger="0.05s",
                                     on_batch=lambda stats, res: self.batch_events.append(res.events),
                                     **(follow or {})).start()
        query = sql.SQL("SELECT sum(balance), count(*) FROM {}").format(sql.Identifier("public", VIEW))
        self.reader = InvariantReader(
            self.views_dsn, query,
            check=lambda r: None if (r[0], r[1]) == (TOTAL, ACCOUNTS) else f"sum(balance) {r[0]} over {r[1]} rows",
            state=lambda r: None).start()

    def view(self) -> dict[int, int]:
        with psycopg.connect(self.views_dsn) as conn:
            return dict(conn.execute(sql.SQL("SELECT id, balance FROM {}").format(
                sql.Identifier("public", VIEW))).fetchall())

    def healthy(self) -> bool:
        assert not self.errors, self.errors
        assert self.follower is None or self.follower.failed is None, self.follower.failed
        return True

    def caught_up(self, timeout: float = 120) -> None:
        """The view equals the source table (bounded wait)."""
        want = self.bank.rows()
        wait_until(lambda: self.healthy() and self.view() == want, timeout, "the view to equal the source table")

    def finish(self) -> Any:
        self.stop_capture.set("test")
        try:
            result = self.reader.stop()
        finally:
            if self.follower is not None:
                self.follower.stop()
            if self.capturing.is_alive():
                self.capturing.join(timeout=60)
            self.rt.close()
            self.pg_server.drop_database(self.views_db)
        assert not self.errors, self.errors
        assert not result.bad, (f"{len(result.bad)} of {result.reads} reads of the accounts view showed part "
                                f"of a source transaction; first: {result.bad[0]}")
        return result


def log_and_url(backend: str, request: pytest.FixtureRequest) -> tuple[Any, str]:
    log = request.getfixturevalue(f"{backend}_log")
    url = str(log.path) if backend == "embedded" else f"kafka://{request.getfixturevalue('kafka_broker').bootstrap}"
    return log, url


@pytest.mark.parametrize(("kind", "backend", "batches"),
                         [("pg", "embedded", 12), ("pg", "kafka", 12), ("mariadb", "embedded", 6),
                          ("mariadb", "kafka", 6)])
def test_no_half_transfer_is_ever_visible(kind: str, backend: str, batches: int, pg_server: Any, spark: Any,
                                          tmp_path: Path, request: pytest.FixtureRequest) -> None:
    bank: Bank = request.getfixturevalue(f"{kind}_bank")
    log, url = log_and_url(backend, request)
    run = Run(bank, log, url, spark, pg_server, tmp_path)
    stop_writers = threading.Event()
    writers = [threading.Thread(target=bank.transfers, args=(s, stop_writers, run.errors), daemon=True)
               for s in (1, 2)]
    try:
        for w in writers:
            w.start()
        wait_until(lambda: run.healthy() and run.follower.stats.batches >= batches, 300,
                   f"{batches} follow micro-batches")
        stop_writers.set()
        for w in writers:
            w.join(timeout=60)
        run.caught_up()
    finally:
        stop_writers.set()
        result = run.finish()
    assert result.reads > 0, result


def test_a_transaction_larger_than_the_batch_limit_is_read_whole(mariadb_bank: Bank, embedded_log: Any,
                                                                 pg_server: Any, spark: Any,
                                                                 tmp_path: Path) -> None:
    """Transactions over all 12 accounts, between two-row transfers, with a micro-batch limit of 5 records
    and a MySQL capture that hands batches of 5 rows to the log (so it writes the big transactions in
    parts, recording no cut until their XID): no read shows part of one, and micro-batches grew past the
    limit to the next cut rather than splitting a transaction."""
    run = Run(mariadb_bank, embedded_log, str(embedded_log.path), spark, pg_server, tmp_path,
              capture={"batch_records": 5}, follow={"max_records_per_batch": 5})
    rnd = random.Random(3)
    try:
        with mariadb_bank.session() as transact:
            for _ in range(6):
                a, b, amount = transfer(rnd)
                transact([(-amount, a), (amount, b)])
                transact([(d, i) for i, d in rotation(rnd)])
        run.caught_up()
    finally:
        result = run.finish()
    assert result.reads > 0
    assert max(run.batch_events) >= ACCOUNTS, (
        f"every micro-batch read at most {max(run.batch_events)} records: none held a whole "
        f"{ACCOUNTS}-row transaction (batches: {run.batch_events})")


def test_an_idle_source_keeps_its_cut_at_the_log_end(pg_bank: Bank, embedded_log: Any) -> None:
    """After the last transaction the source goes idle: the newest cut reaches the end of its topics (a
    reader stops at the log's end, nothing is held back), and every heartbeat's offsets record carries
    it again."""
    from kappaflow.connectors.cuts import CutIndex, consistent_ends, cut_from_json
    from kappaflow.connectors.offsets import OFFSETS_TOPIC

    log, topic = embedded_log, pg_bank.topic
    pg_bank.connector(log).run(until_caught_up=True)
    stop, errors = StopSignal(), []

    def capture() -> None:
        try:
            pg_bank.connector(log).run(stop)
        except BaseException as exc:
            errors.append(exc)

    capturing = threading.Thread(target=capture, daemon=True)
    capturing.start()
    rnd = random.Random(5)
    try:
        with pg_bank.session() as transact:
            for _ in range(20):
                a, b, amount = transfer(rnd)
                transact([(-amount, a), (amount, b)])
        index = CutIndex(log)

        def at_end() -> bool:
            assert not errors, errors
            index.refresh()
            ends = dict(log.end_offsets(topic))
            return sum(ends.values()) >= ACCOUNTS + 40 and (index.cut(pg_bank.source) or {}).get(topic) == ends

        wait_until(at_end, 60, "the source's cut to reach the end of its topic")
        ends = {topic: dict(log.end_offsets(topic))}
        assert consistent_ends(index, [topic], {}, ends) == ends
        seen = log.end_offset(OFFSETS_TOPIC, 0)
        wait_until(lambda: log.end_offset(OFFSETS_TOPIC, 0) >= seen + 3, 30,
                   "three more offsets records (heartbeats) from the idle source")
        heartbeats = [orjson.loads(r.value) for r in log.read(OFFSETS_TOPIC, 0, seen, 100)]
        assert heartbeats and all(doc["source"] == pg_bank.source for doc in heartbeats)
        assert [cut_from_json(doc.get("cut")) for doc in heartbeats] == [index.cut(pg_bank.source)] * len(heartbeats)
        assert {topic: dict(log.end_offsets(topic))} == ends, "the idle source wrote records"
    finally:
        stop.set("test")
        capturing.join(timeout=60)
    assert not errors, errors


def test_redis_view_never_shows_half_a_transfer(pg_bank: Bank, embedded_log: Any, redis_server: Any, spark: Any,
                                                tmp_path: Path) -> None:
    """The accounts as a Redis view, written in script calls of 2 keys (a micro-batch takes several):
    a reader that reads every account in one atomic call (get_many: one script) never sees half a
    transfer -- the micro-batch ends at a cut and the sink applies it in one MULTI/EXEC."""
    import redis

    from kappaflow.projections.follow import Follower
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.redis import RedisSink, get_many

    log = embedded_log
    pg_bank.connector(log).run(until_caught_up=True)
    stop_capture, errors = StopSignal(), []

    def capture() -> None:
        try:
            pg_bank.connector(log).run(stop_capture)
        except BaseException as exc:
            errors.append(exc)

    view = f"accounts_{pg_bank.source}"  # the Redis server is shared by the session
    proj = defs.accounts(pg_bank.topic, view, sinks=("redis",), sink_options={"redis": {"batch_keys": 2}})
    rt = Runtime(spark, str(log.path), RedisSink(redis_server.url), checkpoint_dir=tmp_path / "ckpt")
    ids = list(range(1, ACCOUNTS + 1))
    reads, bad, stop_reader = [0], [], threading.Event()

    def reader() -> None:
        client = redis.Redis.from_url(redis_server.url)
        try:
            while not stop_reader.is_set():
                rows = get_many(client, view, ids)
                if all(r is None for r in rows):
                    stop_reader.wait(0.05)  # the view does not exist yet (the follower creates it)
                    continue
                reads[0] += 1
                got = [int(r["balance"]) for r in rows if r is not None]
                if (sum(got), len(got)) != (TOTAL, ACCOUNTS):
                    bad.append(f"sum(balance) {sum(got)} over {len(got)} keys")
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    def redis_view() -> dict[int, int]:
        client = redis.Redis.from_url(redis_server.url)
        try:
            return {i: int(r["balance"]) for i, r in zip(ids, get_many(client, view, ids), strict=True) if r}
        finally:
            client.close()

    capturing = threading.Thread(target=capture, daemon=True)
    reading = threading.Thread(target=reader, daemon=True)
    stop_writers = threading.Event()
    writers = [threading.Thread(target=pg_bank.transfers, args=(s, stop_writers, errors), daemon=True)
               for s in (1, 2)]
    follower = Follower(proj, rt, trigger="0.05s")
    try:
        capturing.start()
        follower.start()
        reading.start()
        for w in writers:
            w.start()
        wait_until(lambda: not errors and (follower.stats.batches >= 8 or follower.failed), 300,
                   "8 follow micro-batches")
        assert follower.failed is None, follower.failed
        stop_writers.set()
        for w in writers:
            w.join(timeout=60)
        want = pg_bank.rows()
        wait_until(lambda: not errors and redis_view() == want, 120, "the Redis view to equal the source table")
    finally:
        stop_writers.set()
        stop_reader.set()
        stop_capture.set("test")
        follower.stop()
        reading.join(timeout=60)
        capturing.join(timeout=60)
        rt.close()
    assert not errors, errors
    assert reads[0] > 0
    assert not bad, f"{len(bad)} of {reads[0]} reads of the Redis view showed half a transfer; first: {bad[0]}"


RUNNER = Path(__file__).with_name("follow_runner.py")
CAPTURE_RUNNER = Path(__file__).with_name("bank_capture_runner.py")


class Killed(KilledProcess):
    """The follower or capture of a running bank, killed with -9 at seeded moments and restarted."""

    def trials(self, run: Run, progress: Callable[[], int], n: int, rnd: random.Random, pause: float,
               timeout: float, moved: str) -> None:
        """`n` times: wait until `progress()` moved (the process did work), let the run go on for a seeded
        moment (not a synchronisation), kill -9, restart; then wait for progress once more."""
        for trial in range(n + 1):
            before = progress()
            wait_until(lambda b=before: run.healthy() and self.alive() and progress() > b, timeout,
                       f"trial {trial}: {moved}")
            if trial == n:
                return
            time.sleep(rnd.uniform(0.0, pause))
            self.kill()
            self.proc = self._start()


def _transfers_across_kills(run: Run, bank: Bank, start: Callable[[], Killed], progress: Callable[[], int],
                            *, trials: int, pause: float, gap: float, moved: str) -> None:
    """Transfers from two writers (`gap` seconds between two) while the process is killed and restarted
    `trials` times; then the view must equal the source and no read may have shown half a transfer."""
    rnd = random.Random(1717 + trials)
    stop_writers = threading.Event()
    writers = [threading.Thread(target=bank.transfers, args=(s, stop_writers, run.errors, gap), daemon=True)
               for s in (1, 2)]
    proc = start()
    try:
        for w in writers:
            w.start()
        proc.trials(run, progress, trials, rnd, pause, 300, moved)
        stop_writers.set()
        for w in writers:
            w.join(timeout=60)
        run.caught_up(timeout=300)
    finally:
        stop_writers.set()
        proc.kill()
        result = run.finish()
    assert result.reads > 0, result


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the follower process starts its own Spark after every kill
def test_no_half_transfer_across_follower_kills(pg_bank: Bank, embedded_log: Any, pg_server: Any, spark: Any,
                                                tmp_path: Path) -> None:
    """The follower as a process, SIGKILLed once (twice with KF_THOROUGH_KILLS=1) at seeded moments after
    it committed a batch, and restarted, while transfers run: no read shows half a transfer (a batch and
    its positions commit in one transaction, the restart resumes at the stored positions and at a cut),
    nothing is lost (the view ends equal to the source table)."""
    run = Run(pg_bank, embedded_log, str(embedded_log.path), spark, pg_server, tmp_path, follower=False)

    def stored() -> int:
        with psycopg.connect(run.views_dsn) as conn:
            try:
                row = conn.execute("SELECT coalesce(sum(next_offset), 0) FROM kappaflow.projection_positions "
                                   "WHERE projection = %s", (VIEW,)).fetchone()
            except psycopg.errors.UndefinedTable:
                return 0
        return int(row[0]) if row else 0

    # a few hundred transfers a second: the backlog a restarted follower (its own Spark) reads stays small
    _transfers_across_kills(
        run, pg_bank,
        lambda: Killed([sys.executable, str(RUNNER), str(embedded_log.path), run.views_dsn, str(tmp_path / "proc_ckpt"),
                        pg_bank.topic, "accounts", "0"], tmp_path / "follower.out", "the follower"),
        stored, trials=trial_count(1, 2), pause=1.5, gap=0.005, moved="a committed batch")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_no_half_transfer_across_capture_kills(pg_bank: Bank, pg_dsn: str, pg_server: Any, spark: Any,
                                               tmp_path: Path) -> None:
    """PostgreSQL capture as a process, SIGKILLed three times at seeded moments after it appended
    records, and restarted, while transfers run and the follower follows: no read of the view shows
    half a transfer (a cut is recorded only once the records it covers are durable; a restarted capture
    resumes at its stored position and never leaves a transaction half in the log below a cut), and
    nothing is lost or doubled (the view ends equal to the source table, balances included)."""
    from kappaflow.log.embedded import EmbeddedLog

    writer = EmbeddedLog(tmp_path / "log")  # the initial snapshot in this process, then the log's one writer
    run = Run(pg_bank, writer, str(writer.path), spark, pg_server, tmp_path, capturing=False)
    writer.close()
    reader = EmbeddedLog(tmp_path / "log", read_only=True)
    try:
        _transfers_across_kills(
            run, pg_bank,
            lambda: Killed([sys.executable, str(CAPTURE_RUNNER), str(reader.path), pg_dsn, pg_bank.source],
                           tmp_path / "capture.out", "capture"),
            lambda: sum(reader.end_offsets(pg_bank.topic).values()), trials=3, pause=0.5, gap=0.002,
            moved="capture appended records")
    finally:
        reader.close()
