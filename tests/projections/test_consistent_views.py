"""Transactionally consistent views over a PostgreSQL source (issue 17).

Transfers are one source transaction each: two UPDATEs of two account rows (usually two log
partitions), run at full rate from two sessions while the PostgreSQL connector captures and a
follower keeps the latest-row view of the accounts current. A reader polls the view inside its
own transactions: the total of the balances never changes at the source, so every read must
show it. Follow micro-batches end at the newest consistent cut of the source (with a record
limit per micro-batch below one transaction, a batch still ends at a cut: it grows to the
next one rather than splitting a transaction; tests/connectors/test_cuts.py).
"""

from __future__ import annotations

import random
import threading
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from kappaflow.config import PostgresSourceConfig
from kappaflow.connectors.base import StopSignal
from kappaflow.connectors.postgres.connector import PostgresConnector
from kappaflow.projections import Projection
from tests._consistency import InvariantReader, wait_until

pytestmark = pytest.mark.integration

ACCOUNTS = 12
OPENING = 1_000


def accounts_view(source: str, consistency: str = "transactions") -> type[Projection]:
    class Accounts(Projection):
        name = "accounts_view"
        sources = [f"{source}.public.accounts"]
        key = ["id"]

    Accounts.consistency = consistency
    return Accounts


def transfers(dsn: str, seed: int, stop: threading.Event, errors: list[BaseException]) -> None:
    rnd = random.Random(seed)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                a, b = sorted(rnd.sample(range(1, ACCOUNTS + 1), 2))  # in id order: no deadlocks
                amount = rnd.randint(1, 50) * rnd.choice((1, -1))
                with conn.transaction():
                    conn.execute("UPDATE accounts SET balance = balance - %s WHERE id = %s", (amount, a))
                    conn.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (amount, b))
    except BaseException as exc:
        errors.append(exc)


@pytest.mark.parametrize("backend", ["embedded", "kafka"])
def test_no_half_transfer_is_ever_visible(backend: str, pg_dsn: str, pg_server: Any,
                                          spark: Any, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    from kappaflow.projections.follow import Follower
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink

    log = request.getfixturevalue(f"{backend}_log")
    url = str(log.path) if backend == "embedded" else f"kafka://{request.getfixturevalue('kafka_broker').bootstrap}"
    source = f"c{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        conn.execute("INSERT INTO accounts SELECT g, %s FROM generate_series(1, %s) g", (OPENING, ACCOUNTS))
    cfg = PostgresSourceConfig(name=source, dsn=pg_dsn, tables=["public.accounts"], heartbeat_interval_s=0.5,
                               slot=f"kf_{source}", publication=f"kf_{source}")
    PostgresConnector(cfg, log, partitions=3, progress=False).run(until_caught_up=True)  # snapshot, topics
    stop_capture = StopSignal()
    errors: list[BaseException] = []

    def capture() -> None:
        try:
            PostgresConnector(cfg, log, partitions=3, progress=False, linger_s=0.005).run(stop_capture)
        except BaseException as exc:
            errors.append(exc)

    views_dsn = pg_server.create_database(f"v_{source}")
    rt = Runtime(spark, url, PostgresSink(views_dsn), checkpoint_dir=tmp_path / "ckpt")
    capturing = threading.Thread(target=capture, daemon=True)
    capturing.start()
    follower = Follower(accounts_view(source), rt, trigger="0.05s").start()
    query = sql.SQL("SELECT sum(balance), count(*) FROM {}").format(sql.Identifier("public", "accounts_view"))
    total = OPENING * ACCOUNTS
    reader = InvariantReader(
        views_dsn, query,
        check=lambda r: None if (r[0], r[1]) == (total, ACCOUNTS) else f"sum(balance) {r[0]} over {r[1]} rows",
        state=lambda r: None).start()
    stop_writers = threading.Event()
    writers = [threading.Thread(target=transfers, args=(pg_dsn, s, stop_writers, errors), daemon=True)
               for s in (1, 2)]
    for w in writers:
        w.start()
    batches = 0
    try:
        wait_until(lambda: follower.stats.batches >= 12 or errors or follower.failed, 300,
                   "12 follow micro-batches")
        batches = follower.stats.batches
        assert not errors, errors
        assert follower.failed is None, follower.failed
        stop_writers.set()
        for w in writers:
            w.join(timeout=60)
        seen = reader.result
        assert not seen.bad, (f"{len(seen.bad)} of {seen.reads} reads of the accounts view showed half a "
                              f"transfer; first: {seen.bad[0]}")
        with psycopg.connect(pg_dsn) as conn:
            want = dict(conn.execute("SELECT id, balance FROM accounts").fetchall())

        def view() -> dict[int, int]:
            with psycopg.connect(views_dsn) as conn:
                return dict(conn.execute(sql.SQL("SELECT id, balance FROM {}").format(
                    sql.Identifier("public", "accounts_view"))).fetchall())

        wait_until(lambda: view() == want, 120, "the view to equal the source table")
    finally:
        stop_writers.set()
        stop_capture.set("test")
        result = reader.stop()
        follower.stop()
        capturing.join(timeout=60)
        rt.close()
        pg_server.drop_database(f"v_{source}")
    assert not errors, errors
    assert result.reads > 0 and batches >= 12
    assert not result.bad, (f"{len(result.bad)} of {result.reads} reads of the accounts view showed half a "
                            f"transfer; first: {result.bad[0]}")
