"""TRUNCATE reaches every fold kind, in replay and in follow (issue 13, item 1).

pgbench truncates ``pgbench_history`` (no primary key) before every run. A custom ``apply`` fold
over it kept counting every row ever inserted, because a truncate reached the log only as
tombstones, which carry no row and were never delivered to custom folds.

Real PostgreSQL source, real capture (pgoutput): a pgbench_history-like keyless table with declared
key columns (REPLICA IDENTITY FULL, as capture requires) and a keyed table, each read by a
latest-row, a grouped and a custom projection (the custom ones: keyed by a non-key column whose
value only the removed row carries, and keyed by the table's key, folded in place). Replayed,
followed through ``TRUNCATE history, accounts`` followed by inserts in the same transaction (what
pgbench does), and replayed again: every view equals what SQL says about the source tables.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kappaflow.config import PostgresSourceConfig
from kappaflow.connectors.base import StopSignal
from kappaflow.connectors.postgres import PostgresConnector
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections import Count, Event, Projection, Source, Sum
from kappaflow.projections.follow import FollowerGroup
from kappaflow.projections.replay import replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.sinks.postgres import PostgresSink

pytestmark = pytest.mark.integration


def _projections(src: str, tag: str) -> dict[str, type[Projection]]:
    history, accounts = f"{src}.public.history", f"{src}.public.accounts"

    def per_branch(self: Any, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        """Transactions per branch: `bid` is no key column, so only the row says which branch. A
        branch a truncate emptied keeps its row (n = 0) with the number of rows truncated."""
        r = event.row
        assert r is not None and r.get("bid") is not None, event  # a delete must carry the removed row
        n = (row["n"] if row else 0) + (-1 if event.op == "d" else 1)
        truncated = (row["truncated"] if row else 0) + (1 if event.truncate else 0)
        return {"n": n, "truncated": truncated} if n or truncated else None

    def per_account(self: Any, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        """Keyed by the table's key: folded in place, one log partition at a time."""
        if event.op == "d":
            return None
        return {"balance": event.after["balance"], "changes": (row["changes"] if row else 0) + 1}

    def cls(name: str, attrs: dict[str, Any]) -> type[Projection]:
        return type(name, (Projection,), {"name": f"{name.lower()}_{tag}", **attrs})

    return {
        "history_latest": cls("HistoryLatest", {"sources": [history], "key": ["tid", "aid", "mtime"]}),
        "history_by_teller": cls("HistoryByTeller", {
            "sources": [history], "key": ["tid"], "aggregates": {"n": Count(), "total": Sum("delta")}}),
        "history_by_branch": cls("HistoryByBranch", {
            "sources": [Source(history, key={"bid": "bid"})], "key": ["bid"],
            "schema": "bid int, n bigint, truncated bigint", "apply": per_branch}),
        "accounts_latest": cls("AccountsLatest", {"sources": [accounts], "key": ["id"]}),
        "accounts_by_branch": cls("AccountsByBranch", {
            "sources": [accounts], "key": ["branch"], "aggregates": {"n": Count(), "total": Sum("balance")}}),
        "accounts_changes": cls("AccountsChanges", {
            "sources": [accounts], "key": ["id"], "schema": "id bigint, balance bigint, changes bigint",
            "apply": per_account}),
    }


# what each view must hold, from the source tables (the custom folds' in columns SQL can check)
EXPECTED = {
    "history_latest": ("SELECT tid, aid, mtime, bid, delta FROM public.history", "tid, aid, mtime, bid, delta"),
    "history_by_teller": ("SELECT tid, count(*), sum(delta) FROM public.history GROUP BY tid", "tid, n, total"),
    "history_by_branch": ("SELECT bid, count(*) FROM public.history GROUP BY bid", "bid, n WHERE n > 0"),
    "accounts_latest": ("SELECT id, branch, balance FROM public.accounts", "id, branch, balance"),
    "accounts_by_branch": ("SELECT branch, count(*), sum(balance) FROM public.accounts GROUP BY branch",
                           "branch, n, total"),
    "accounts_changes": ("SELECT id, balance FROM public.accounts", "id, balance"),
}


@dataclass
class World:
    source_dsn: str
    views_dsn: str
    log_dir: Path
    slot: str
    source: str
    rt: Runtime
    projections: dict[str, type[Projection]] = field(default_factory=dict)

    def sql(self, *statements: str) -> None:
        with psycopg.connect(self.source_dsn) as conn:  # one transaction
            for s in statements:
                conn.execute(s)

    def capture(self) -> None:
        cfg = PostgresSourceConfig(name=self.source, dsn=self.source_dsn, tables=["public.history", "public.accounts"],
                                   key_columns={"public.history": ["tid", "aid", "mtime"]}, slot=self.slot,
                                   publication=self.slot)
        with EmbeddedLog(self.log_dir) as log:
            PostgresConnector(cfg, log, partitions=2, progress=False).run(StopSignal(), until_caught_up=True)

    def check(self, when: str) -> None:
        with psycopg.connect(self.source_dsn) as src, psycopg.connect(self.views_dsn) as views:
            for name, (query, columns) in EXPECTED.items():
                want = sorted(src.execute(query).fetchall())
                view = self.projections[name].name
                cols, _, cond = columns.partition(" WHERE ")
                where = f" WHERE {cond}" if cond else ""
                got = sorted(views.execute(f'SELECT {cols} FROM public."{view}"{where}').fetchall())  # test constants
                assert got == want, f"{when}: view {name} differs from the source ({len(got)} vs {len(want)} rows)"

    def truncated_counts(self) -> dict[int, int]:
        with psycopg.connect(self.views_dsn) as views:
            view = self.projections["history_by_branch"].name
            return dict(views.execute(f'SELECT bid, truncated FROM public."{view}"').fetchall())


@pytest.fixture
def world(pg_server: Any, spark: Any, tmp_path: Path) -> Iterator[World]:
    tag = uuid.uuid4().hex[:8]
    src_db, views_db = f"trunc_src_{tag}", f"trunc_views_{tag}"
    source_dsn = pg_server.create_database(src_db)
    views_dsn = pg_server.create_database(views_db)
    rt = Runtime(spark, str(tmp_path / "log"), PostgresSink(views_dsn), checkpoint_dir=tmp_path / "ckpt")
    w = World(source_dsn, views_dsn, tmp_path / "log", f"kf_trunc_{tag}", f"tr{tag}", rt)
    w.projections = _projections(w.source, tag)
    try:
        # pgbench's schema, trimmed: pgbench_history has no primary key
        w.sql("CREATE TABLE public.history (tid int NOT NULL, bid int NOT NULL, aid int NOT NULL, delta int, "
              "mtime timestamp NOT NULL, filler char(22))",
              "ALTER TABLE public.history REPLICA IDENTITY FULL",
              "CREATE TABLE public.accounts (id bigint PRIMARY KEY, branch int NOT NULL, balance bigint NOT NULL)",
              "ALTER TABLE public.accounts REPLICA IDENTITY FULL")
        yield w
    finally:
        rt.close()
        with psycopg.connect(source_dsn, autocommit=True) as c:
            c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                      (w.slot,))
        pg_server.drop_database(src_db)
        pg_server.drop_database(views_db)


def _history_rows(start: int, n: int) -> str:
    return ("INSERT INTO public.history (tid, bid, aid, delta, mtime) SELECT 1 + g % 7, 1 + g % 3, g, g % 11 - 5, "
            f"timestamp '2024-01-01' + g * interval '1 second' FROM generate_series({start}, {start + n - 1}) g")


def test_truncate_reaches_latest_grouped_and_custom_views_in_replay_and_follow(world: World) -> None:
    w = world
    w.sql(_history_rows(1, 120),
          "INSERT INTO public.accounts SELECT g, 1 + g % 4, 100 * g FROM generate_series(1, 40) g")
    w.capture()
    w.sql(_history_rows(121, 30),
          "UPDATE public.accounts SET balance = balance + 1 WHERE id % 5 = 0",
          "DELETE FROM public.accounts WHERE id = 3",
          "DELETE FROM public.history WHERE aid = 7")
    w.capture()
    for p in w.projections.values():
        replay(p, w.rt)
    w.check("after the first replay")

    # pgbench: truncate, then the new run's rows, in one transaction; a second truncate later
    group = [FollowerGroup(p, w.rt, trigger="0.3s").start() for p in w.projections.values()]
    try:
        w.sql("TRUNCATE public.history, public.accounts",
              _history_rows(1000, 25),
              "INSERT INTO public.accounts SELECT g, 1 + g % 4, 7 * g FROM generate_series(30, 50) g")
        w.sql("UPDATE public.accounts SET balance = 0 WHERE id = 31")
        w.capture()
        for g in group:
            assert g.wait_for(lambda g: g.caught_up(), timeout=240), "a follower did not catch up"
        w.check("followed through a TRUNCATE")
        # the truncate's deletes were delivered with the removed rows: 150 - 1 history rows at the truncate
        assert sum(w.truncated_counts().values()) == 149, w.truncated_counts()

        w.sql("TRUNCATE public.history", _history_rows(2000, 10))
        w.capture()
        for g in group:
            assert g.wait_for(lambda g: g.caught_up(), timeout=240), "a follower did not catch up"
        w.check("followed through a second TRUNCATE")
    finally:
        for g in group:
            g.stop()

    for p in w.projections.values():
        replay(p, w.rt)
    w.check("replayed after the truncates")
    assert sum(w.truncated_counts().values()) == 149 + 25, w.truncated_counts()
