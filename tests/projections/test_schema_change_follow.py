"""``ALTER TABLE ... ADD COLUMN`` while capture and follow run (issue 13, item 20).

A followed latest-row view ignored the new column without a word: its follower went on writing
rows without it while ``status`` said following, lag 0. A change a view does not take in place
(``on_schema_change = "rebuild"``, or a custom fold, which receives whole rows) stops its follower
with a clear message, before it writes anything of the new shape, and ``kappaflow status``
reports the projection as "needs rebuild" until a replay; views that can take it (an explicit
column list, a grouped view) keep following. (The ``evolve`` policy, the default of a view of
every column, and the others: ``test_schema_evolution.py``.)

Real PostgreSQL source, ``kappaflow capture`` running in its own process, followers in this one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from typer.testing import CliRunner

from kappaflow.cli.app import app
from kappaflow.config import LogConfig, PostgresSourceConfig, Settings, SparkConfig, ViewsConfig
from kappaflow.projections import Count, Event, Projection, Sum
from kappaflow.projections.follow import Follower
from kappaflow.projections.replay import replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.schema_watch import NeedsRebuild
from kappaflow.projections.sinks.base import ViewSchemaMismatch
from kappaflow.projections.status import projection_status
from tests._kill import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _projections(source: str, tag: str) -> dict[str, type[Projection]]:
    topic = f"{source}.public.orders"

    def activity(self: Any, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        return None if event.op == "d" else {"changes": (row["changes"] if row else 0) + 1}

    def make(kind: str, attrs: dict[str, Any]) -> type[Projection]:
        return type(kind.title(), (Projection,), {"name": f"sc_{kind}_{tag}", "sources": [topic], **attrs})

    return {
        # every column, evolved in place by default: the "rebuild" policy stops it instead
        "latest": make("latest", {"key": ["id"], "on_schema_change": "rebuild"}),
        "custom": make("custom", {"key": ["id"], "schema": "id bigint, changes bigint", "apply": activity}),
        "columns": make("columns", {"key": ["id"], "columns": ["id", "amount"]}),  # takes it
        "grouped": make("grouped", {"key": ["customer_id"], "aggregates": {"n": Count(), "total": Sum("amount")}}),
    }


@pytest.fixture
def world(pg_server: Any, spark: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    tag = uuid.uuid4().hex[:8]
    src_db, views_db = f"sc_src_{tag}", f"sc_views_{tag}"
    src = pg_server.create_database(src_db)
    views = pg_server.create_database(views_db)
    source = f"sc{tag}"
    slot = f"kf_sc_{tag}"
    settings = Settings(
        log=LogConfig(url=str(tmp_path / "log")),
        views=ViewsConfig(postgres_dsn=views),
        sources={source: PostgresSourceConfig(name=source, dsn=src, tables=["public.orders"], slot=slot,
                                              publication=slot, heartbeat_interval_s=0.5)},
        spark=SparkConfig(checkpoint_dir=str(tmp_path / "ckpt")),
        base_dir=tmp_path,
    )
    cfg = tmp_path / "kappaflow.toml"
    settings.save(cfg)
    with psycopg.connect(src, autocommit=True) as c:
        c.execute("CREATE TABLE public.orders (id bigint PRIMARY KEY, customer_id int NOT NULL, amount numeric(10,2))")
        c.execute("INSERT INTO public.orders SELECT g, g % 3, g FROM generate_series(1, 20) g")
    capture = subprocess.Popen([sys.executable, "-m", "kappaflow.cli.capture", source, "--config", str(cfg)],
                               cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rt = Runtime.from_settings(settings, spark=spark)
    try:
        yield {"src": src, "views": views, "rt": rt, "cfg": cfg, "capture": capture,
               "projections": _projections(source, tag), "topic": f"{source}.public.orders"}
    finally:
        rt.close()
        capture.terminate()
        try:
            capture.wait(30)
        except subprocess.TimeoutExpired:
            capture.kill()
            capture.wait(10)
        with psycopg.connect(src, autocommit=True) as c:
            c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                      (slot,))
        pg_server.drop_database(src_db)
        pg_server.drop_database(views_db)


def _sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn) as conn:
        for s in statements:
            conn.execute(s)


def _rows(dsn: str, view: str, columns: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return sorted(conn.execute(f'SELECT {columns} FROM public."{view}"').fetchall())  # test constants


def test_a_column_the_view_cannot_take_stops_its_follower_and_status_says_needs_rebuild(world: dict[str, Any]) -> None:
    src, views, rt, projections = world["src"], world["views"], world["rt"], world["projections"]
    capture = world["capture"]

    def captured(n: int) -> bool:
        assert capture.poll() is None, capture.stdout.read().decode()[-2000:] if capture.stdout else ""
        try:
            return sum(rt.end_offsets([world["topic"]])[world["topic"]].values()) >= n
        except Exception:
            return False

    wait_for(lambda: captured(20), 120, "the capture's snapshot of 20 rows")
    followers = {k: Follower(p, rt, trigger="0.3s").start() for k, p in projections.items()}
    try:
        wait_for(lambda: all(f.caught_up() for f in followers.values()), 240, "the followers to catch up")
        assert _rows(views, projections["latest"].name, "id, amount") == _rows(src, "orders", "id, amount")

        _sql(src, "ALTER TABLE public.orders ADD COLUMN note text")
        _sql(src, "INSERT INTO public.orders VALUES (100, 1, 5.00, 'after the alter')",
             "UPDATE public.orders SET amount = amount + 1, note = 'changed' WHERE id = 1")
        wait_for(lambda: captured(22), 120, "the capture of the changes after the ALTER")
        stopped = wait_for(lambda: followers["latest"].failed and followers["custom"].failed, 120,
                           "the latest-row and custom followers to stop on the new column")
        assert stopped
        latest_err, custom_err = followers["latest"].failed, followers["custom"].failed
        assert isinstance(latest_err, NeedsRebuild) and isinstance(custom_err, NeedsRebuild)
        assert "note" in str(latest_err) and "gain" in str(latest_err) and "kappaflow replay" in str(latest_err)
        assert "note" in str(custom_err) and "whole rows" in str(custom_err)
        # they stopped before writing anything of the new shape
        assert (100,) not in {r[:1] for r in _rows(views, projections["latest"].name, "id")}
        assert _rows(views, projections["latest"].name, "id, amount")[0] == (1, Decimal("1.00"))
        # the views that can take the new column kept following it
        wait_for(lambda: followers["columns"].caught_up() and followers["grouped"].caught_up(), 120,
                 "the explicit-columns and grouped followers to catch up")
        assert followers["columns"].failed is None and followers["grouped"].failed is None
        assert _rows(views, projections["columns"].name, "id, amount") == _rows(src, "orders", "id, amount")
        with psycopg.connect(src) as conn:
            totals = sorted(conn.execute("SELECT customer_id, count(*), sum(amount) FROM public.orders "
                                         "GROUP BY customer_id").fetchall())
        assert _rows(views, projections["grouped"].name, "customer_id, n, total") == totals

        state = {s.name: s for s in projection_status(rt)}
        for k in ("latest", "custom"):
            s = state[projections[k].name]
            assert s.state == "needs rebuild" and "note" in (s.needs_rebuild or ""), s
        for k in ("columns", "grouped"):
            assert state[projections[k].name].state == "following"
        out = CliRunner().invoke(app, ["--config", str(world["cfg"]), "status", projections["latest"].name, "--json"])
        assert out.exit_code == 0, out.output
        assert json.loads(out.output)[0]["state"] == "needs rebuild", out.output
        out = CliRunner().invoke(app, ["--config", str(world["cfg"]), "status", projections["latest"].name])
        assert "NEEDS REBUILD" in out.output and "note" in out.output, out.output

        # following again is refused until a replay
        for k in ("latest", "custom"):
            followers.pop(k).stop()
            with pytest.raises((NeedsRebuild, ViewSchemaMismatch)):
                Follower(projections[k], rt, trigger="0.3s").start()
            assert {s.name: s for s in projection_status(rt)}[projections[k].name].state == "needs rebuild"
            replay(projections[k], rt)
            assert {s.name: s for s in projection_status(rt)}[projections[k].name].needs_rebuild is None
        assert _rows(views, projections["latest"].name, "id, amount, note") == _rows(src, "orders",
                                                                                    "id, amount, note")
        again = Follower(projections["latest"], rt, trigger="0.3s").start()
        followers["latest"] = again
        _sql(src, "UPDATE public.orders SET note = 'followed' WHERE id = 2")
        wait_for(lambda: _rows(views, projections["latest"].name, "id, note")[1] == (2, "followed"), 120,
                 "the rebuilt view to follow the new column")
        assert again.failed is None
    finally:
        for f in followers.values():
            f.stop()


def test_which_source_changes_a_view_can_take(spark: Any) -> None:
    """``rebuild_reason`` per fold kind, policy and change (the follower stops when it is not None), and
    ``assess``'s verdict (follow on, evolve in place, rebuild)."""
    from dataclasses import replace as dc_replace

    from kappaflow.events import Column, FieldType
    from kappaflow.projections.api import ProjectionSpec
    from kappaflow.projections.plan import Plan
    from kappaflow.projections.schema_watch import assess, rebuild_reason
    from tests.projections.pj_helpers import orders_schema

    old = orders_schema("rc")
    topic = old.name
    added = dc_replace(old, columns=(*old.columns, Column("note", FieldType.STRING)))
    retyped = dc_replace(old, columns=tuple(Column("status", FieldType.INT32) if c.name == "status" else c
                                            for c in old.columns))
    dropped = dc_replace(old, columns=tuple(c for c in old.columns if c.name != "amount"))
    rekeyed = dc_replace(old, key=("id", "customer_id"))

    widened = dc_replace(old, columns=tuple(Column("amount", FieldType.DECIMAL, scale=2, precision=16)
                                            if c.name == "amount" else c for c in old.columns))
    narrowed = dc_replace(old, columns=tuple(Column("customer_id", FieldType.INT32) if c.name == "customer_id"
                                             else c for c in old.columns))

    def plan_of(attrs: dict[str, Any]) -> Any:
        cls = type("P", (Projection,), {"name": "rc", "sources": [topic], **attrs})
        return Plan.build(spark, ProjectionSpec.from_class(cls), {topic: old})

    def reason(attrs: dict[str, Any], new: Any) -> str | None:
        return rebuild_reason(plan_of(attrs), spark, {topic: new})

    def action(attrs: dict[str, Any], new: Any) -> str | None:
        change = assess(plan_of(attrs), spark, {topic: new})
        return None if change is None else change.action

    every = {"key": ["id"]}  # on_schema_change defaults to "evolve"
    rebuilt = {**every, "on_schema_change": "rebuild"}
    some = {"key": ["id"], "columns": ["id", "amount"]}  # defaults to "rebuild"
    grouped = {"key": ["customer_id"], "aggregates": {"n": Count(), "total": Sum("amount")}}
    custom = {"key": ["id"], "schema": "id bigint, n bigint", "apply": lambda self, row, ev: {"n": 1}}
    assert reason(every, old) is None and action(every, old) is None
    assert action(every, added) == "evolve" and reason(every, added) is None
    assert "gain column(s) ['note']" in (reason(rebuilt, added) or "")
    assert action(some, added) == "follow" and action(grouped, added) == "follow"
    assert "whole rows" in (reason(custom, added) or "")
    assert action({**custom, "on_schema_change": "evolve"}, added) == "follow"  # the declared view keeps its shape
    text = reason(some, retyped) or ""  # even where the view shows no status
    assert "type changed 'status' string -> int32" in text and "incompatible" in text, text
    assert "no longer compiles" in (reason(grouped, dropped) or "")  # Sum('amount') of a dropped column
    assert "lose column(s) ['amount']" in (reason(every, dropped) or "")
    assert "key changed" in (reason(grouped, rekeyed) or "")
    # widening: numeric(12,2) -> numeric(16,2) widens a view of it in place under "evolve" only
    assert action(every, widened) == "evolve"
    assert "widen column(s) 'amount' decimal(12,2) -> decimal(16,2)" in (reason(some, widened) or "")
    assert "keeps source columns in its state" in (reason(grouped, widened) or "")
    assert "'customer_id' int64 -> int32" in (reason(every, narrowed) or "")  # narrowing: a rebuild
    assert action({**every, "on_schema_change": "fail"}, added) == "fail"
