"""An as-of view over a table captured with `keep_history` (README "As-of enrichment"): after the
embedded log compacts every compact-policy topic, a replay still finds every version of the table
and rebuilds the view the follower made. Real PostgreSQL capture, embedded log, Spark local."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kappaflow.config import PostgresSourceConfig
from kappaflow.connectors.postgres.connector import PostgresConnector
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections import AsOf, Event, Projection
from kappaflow.projections.engine import prepare
from kappaflow.projections.follow import Follower
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.sinks.postgres import PostgresSink

pytestmark = pytest.mark.integration


def test_asof_replay_after_compaction_with_keep_history(spark: Any, pg_dsn: str, tmp_path: Path) -> None:
    source = "kh" + uuid.uuid4().hex[:8]
    accounts, payments = f"public.{source}_accounts", f"public.{source}_payments"
    db = psycopg.connect(pg_dsn, autocommit=True)
    db.execute(f"CREATE TABLE {accounts} (id int PRIMARY KEY, holder text)")
    db.execute(f"CREATE TABLE {payments} (id int PRIMARY KEY, account_id int, amount bigint)")
    cfg = PostgresSourceConfig(
        name=source, dsn=pg_dsn, tables=[accounts, payments], keep_history=[accounts], heartbeat_interval_s=0.5
    )
    log_dir = tmp_path / "log"
    log = EmbeddedLog(log_dir)
    rt = Runtime(spark, str(log_dir), PostgresSink(pg_dsn), dsn=pg_dsn, checkpoint_dir=tmp_path / "ckpt")
    want: dict[int, tuple[int, int, str | None]] = {}
    holders: dict[int, str | None] = {}
    pid = 0

    def step(rnd: int) -> None:  # renames between payments, one statement (transaction) at a time
        nonlocal pid
        for i in range(12):
            a = 1 + (i * 7 + rnd) % 3
            if i % 3 == 0:
                name = f"h{a}-{rnd}-{i}"
                db.execute(
                    f"INSERT INTO {accounts} VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET holder = EXCLUDED.holder",
                    (a, name),
                )
                holders[a] = name
            else:
                pid += 1
                db.execute(f"INSERT INTO {payments} VALUES (%s, %s, %s)", (pid, a, pid * 10))
                want[pid] = (a, pid * 10, holders.get(a))
        PostgresConnector(cfg, log, partitions=2, progress=False).run(until_caught_up=True)

    class Payments(Projection):
        name = "kh_" + uuid.uuid4().hex[:8]
        sources = [f"{source}.{payments}"]
        key = ["id"]
        schema = "id bigint, account_id int, amount bigint, acct_holder string"
        as_of = [AsOf("account", f"{source}.{accounts}", on={"account_id": "id"}, columns=["holder"], prefix="acct_")]

        def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
            return None if event.after is None else {k: event.after[k] for k in ("account_id", "amount", "acct_holder")}

    def view() -> dict[int, tuple[Any, ...]]:
        live = rt.sink.live(prepare(as_spec(Payments), rt).view)
        assert live is not None
        return {r["id"]: (r["account_id"], r["amount"], r["acct_holder"]) for r in rt.sink.scan(live)}

    try:
        step(0)
        f = Follower(Payments, rt, trigger="0.2s").start()  # builds the view from the log's start
        try:
            for rnd in (1, 2):
                step(rnd)
                assert f.wait_for(lambda s: f.caught_up() and len(view()) == len(want), 120), (
                    f"follower did not catch up within 120 s (round {rnd})"
                )
        finally:
            f.stop()
        followed = view()
        assert followed == want
        stats = log.compact_all(now_ms=2**62)  # every compact-policy topic, nothing younger than "now"
        assert f"{source}.{accounts}" not in stats and f"{source}.{payments}" in stats
        replay(Payments, rt, wait_lock_s=60)  # not refused: the accounts' topic kept every version
        assert view() == followed
    finally:
        rt.close()
        log.close()
        db.close()
