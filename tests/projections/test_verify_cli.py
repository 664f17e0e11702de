"""verify detects drift; status, list and query; the CLI commands end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
import typer
from typer.testing import CliRunner

from kappaflow.projections.replay import replay
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.status import projection_status
from kappaflow.projections.verify import verify
from tests.projections import defs
from tests.projections.pj_helpers import orders_schema
from tests.projections.test_replay import random_history

pytestmark = pytest.mark.integration


def test_verify_detects_a_row_changed_behind_kappaflows_back(rt: Any, embedded_log: Any, pg_dsn: str) -> None:
    w = TableWriter(embedded_log, orders_schema("vf"), partitions=2)
    random_history(w, seed=2, n=120)
    proj = defs.totals("vf", name="vf_totals")
    replay(proj, rt)
    assert verify(proj, rt).ok
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            'UPDATE public."vf_totals" SET total = total + 1 WHERE customer_id = '
            '(SELECT min(customer_id) FROM public."vf_totals")'
        )
        conn.execute(
            'DELETE FROM public."vf_totals" WHERE customer_id = (SELECT max(customer_id) FROM public."vf_totals")'
        )
    res = verify(proj, rt)
    assert not res.ok and res.drift_count == 2
    assert sorted(d.kind for d in res.drift) == ["changed", "missing"]
    # status: registered, caught up, positions per partition
    [st] = projection_status(rt, "vf_totals")
    assert st.name == "vf_totals" and st.kind == "grouped" and st.lag == 0 and len(st.partitions) == 2
    assert not st.following


def _cli(tmp_path: Path, log_path: str, dsn: str) -> tuple[typer.Typer, Path]:
    from kappaflow.cli import projections as pcli
    from kappaflow.config import LogConfig, Settings, ViewsConfig

    cfg = tmp_path / "kappaflow.toml"
    Settings(log=LogConfig(url=log_path), views=ViewsConfig(postgres_dsn=dsn), base_dir=tmp_path).save(cfg)
    app = typer.Typer()

    @app.callback()
    def root(ctx: typer.Context) -> None:
        ctx.obj = {"config": cfg, "profile": None}

    app.command("verify")(pcli.verify)
    app.command("query")(pcli.query)
    app.add_typer(pcli.app, name="projection")
    return app, cfg


def test_cli_query_status_list_and_verify_exit_code(
    rt: Any, embedded_log: Any, pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = TableWriter(embedded_log, orders_schema("cli"), partitions=2)
    random_history(w, seed=9, n=80)
    proj = defs.latest("cli", name="cli_orders")
    replay(proj, rt)
    app, _ = _cli(tmp_path, str(embedded_log.path), pg_dsn)
    runner = CliRunner()
    some = sorted(w.rows)[0][0]
    out = runner.invoke(app, ["query", "cli_orders", str(some)])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["id"] == some
    assert runner.invoke(app, ["query", "cli_orders", "999999"]).exit_code == 1
    out = runner.invoke(app, ["projection", "status", "cli_orders", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)[0]["lag"] == 0
    out = runner.invoke(app, ["projection", "list"])
    assert out.exit_code == 0 and "cli_orders" in out.output
    # verify through the CLI: the projection class must be importable as module:Class
    monkeypatch.setattr(defs, "CliOrders", proj, raising=False)
    monkeypatch.setattr("kappaflow.projections.runtime.spark_session", lambda *a, **k: rt.spark)
    assert runner.invoke(app, ["verify", "tests.projections.defs:CliOrders"]).exit_code == 0
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("UPDATE public.\"cli_orders\" SET status = 'tampered' WHERE id = %s", (some,))
    out = runner.invoke(app, ["verify", "tests.projections.defs:CliOrders"])
    assert out.exit_code == 1 and "tampered" in out.output, out.output


def _kappaflow(tmp_path: Path, log_path: str, dsn: str) -> tuple[Any, list[str]]:
    """The real `kappaflow` command on a config for this test, and the root options that select it."""
    from kappaflow.cli.app import app
    from kappaflow.config import LogConfig, Settings, ViewsConfig

    cfg = tmp_path / "kappaflow.toml"
    Settings(log=LogConfig(url=log_path), views=ViewsConfig(postgres_dsn=dsn), base_dir=tmp_path).save(cfg)
    return app, ["--config", str(cfg)]


def test_verify_reports_a_view_behind_the_log_and_how_far_it_compared(
    rt: Any, embedded_log: Any, pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (issue 13 item 2): a view ~720k records behind was reported "ok ... matches a fresh
    replay (0 rows)": verify compared the log only up to the view's own positions and said nothing
    about the rest. It now reports how far it compared, how many rows, and 'behind' (exit 3)."""
    from kappaflow.projections.engine import prepare
    from kappaflow.projections.follow import Follower
    from kappaflow.projections.replay import as_spec
    from tests.projections.test_follow import more_changes

    w = TableWriter(embedded_log, orders_schema("vb"), partitions=2)
    random_history(w, seed=6, n=80)
    proj = defs.totals("vb", name="vb_totals")
    replay(proj, rt)

    def end() -> int:
        return sum(embedded_log.end_offsets(w.topic).values())

    res = verify(proj, rt)
    assert res.ok and res.lag == 0 and res.position == res.log_end_total == end()
    assert res.rows_compared == res.rows > 0
    at = end()
    more_changes(w, __import__("random").Random(5), 40, 900)  # nobody follows: the view falls behind
    res = verify(proj, rt)
    assert res.matches and not res.ok
    assert res.lag == end() - at > 0 and res.position == at and res.log_end_total == end()

    monkeypatch.setattr(defs, "VbTotals", proj, raising=False)
    monkeypatch.setattr("kappaflow.projections.runtime.spark_session", lambda *a, **k: rt.spark)
    app, root = _kappaflow(tmp_path, str(embedded_log.path), pg_dsn)
    runner = CliRunner()
    out = runner.invoke(app, [*root, "verify", "tests.projections.defs:VbTotals"])
    assert out.exit_code == 3, out.output
    text = " ".join(out.output.split())
    assert f"behind: view vb_totals in postgres is {end() - at:,} records behind the log end" in text, text
    assert f"{res.rows_compared:,} rows compared at position {at:,} of log end {end():,} (2 partitions)" in text
    assert "--wait" in text

    # The case: a view created by a follower that has not committed a batch yet (no rows,
    # no positions) compared equal to an empty replay.
    empty = defs.latest("vb", name="vb_empty")
    rt.sink.ensure(prepare(as_spec(empty), rt).view)
    res = verify(empty, rt)
    assert not res.ok and res.rows == res.rows_compared == 0 and res.position == 0 and res.lag == end()

    # --wait: a follower brings the view to the log end first, then it is ok
    f = Follower(proj, rt, trigger="0.2s").start()
    try:
        out = runner.invoke(app, [*root, "verify", "tests.projections.defs:VbTotals", "--wait", "180"])
    finally:
        f.stop()
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "ok: view vb_totals in postgres matches a fresh replay: " in text, text
    assert f"rows compared at position {end():,} of log end {end():,}" in text


def test_replay_and_follow_of_a_locked_projection_are_refused_before_spark_starts(
    rt: Any, embedded_log: Any, pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (issue 13 item 10): `replay` of a followed projection started Spark (~10 s) before
    it found the lock taken. The locks are checked first now; Spark is never started. (A replay of a
    followed projection hands its view over to the follower now: what it still refuses at once is a
    projection another replay is building.)"""
    from kappaflow.projections.handover import build_lock_name
    from kappaflow.projections.sinks.postgres import PostgresSink

    w = TableWriter(embedded_log, orders_schema("rl"), partitions=2)
    random_history(w, seed=4, n=30)
    proj = defs.latest("rl", name="rl_orders")
    replay(proj, rt)
    monkeypatch.setattr(defs, "RlOrders", proj, raising=False)
    started: list[str] = []

    def spark_session(*args: Any, **kwargs: Any) -> Any:
        started.append("spark")
        return rt.spark

    monkeypatch.setattr("kappaflow.projections.runtime.spark_session", spark_session)
    app, root = _kappaflow(tmp_path, str(embedded_log.path), pg_dsn)
    runner = CliRunner()
    follower = PostgresSink(pg_dsn)  # another process following it: holds the projection's lock
    assert follower.try_lock(proj.name)
    builder = PostgresSink(pg_dsn)  # another replay of it: holds its build lock
    assert builder.try_lock(build_lock_name(proj.name))
    try:
        out = runner.invoke(app, [*root, "replay", "tests.projections.defs:RlOrders"])
        assert out.exit_code == 2 and "is being replayed" in " ".join(out.output.split()), out.output
        builder.close()
        out = runner.invoke(app, [*root, "follow", "tests.projections.defs:RlOrders"])
        assert out.exit_code == 2 and "already followed" in " ".join(out.output.split()), out.output
        assert started == [], "Spark was started before the lock was checked"
    finally:
        builder.close()
        follower.close()
    out = runner.invoke(app, [*root, "replay", "tests.projections.defs:RlOrders"])
    assert out.exit_code == 0, out.output
    assert started == ["spark"] and "replayed rl_orders" in out.output


def test_a_projection_locked_in_another_database_is_not_locked_here(pg_server: Any, pg_dsn: str) -> None:
    """Regression: ``is_locked`` (what status and follow check) counted an advisory lock of a
    projection of the same name in another database of the server (a local replay made a
    follower on another database refuse to start)."""
    from kappaflow.projections.sinks.postgres import PostgresSink

    other = pg_server.create_database("t_other_" + __import__("uuid").uuid4().hex[:8])
    here, there = PostgresSink(pg_dsn), PostgresSink(other)
    try:
        assert there.try_lock("same_name")
        assert there.is_locked("same_name") and not here.is_locked("same_name")
        assert here.try_lock("same_name") and here.is_locked("same_name")
    finally:
        here.close()
        there.close()
        pg_server.drop_database(other.rsplit("/", 1)[1])
