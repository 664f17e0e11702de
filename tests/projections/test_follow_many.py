"""Many projections in one runtime (``FollowRuntime``, ``kappaflow follow A B`` / ``module`` / ``--all``).

* four projections over two topics (three share one) in the session's Spark, plus one whose Redis
  is down when the runtime starts: the others start, follow and catch up while it retries with
  backoff; once Redis is up it starts and catches up; every PostgreSQL view equals a fresh replay;
* argument resolution (module:Class, a module, ``--all`` from ``[follow] projections``) and its
  errors, refused before Spark starts;
* kill -9 of a ``kappaflow follow tests.projections.many_defs`` process mid-batch, restarted:
  every view equals a fresh replay (slow).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kappaflow.config import FollowConfig, LogConfig, Settings, SparkConfig, ViewsConfig
from kappaflow.errors import ConfigError
from kappaflow.projections.api import Projection
from kappaflow.projections.follow_runtime import FollowRuntime, resolve_projections
from kappaflow.projections.replay import replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.sinks.postgres import PostgresSink
from kappaflow.projections.sinks.redis import RedisSink, get
from tests.projections import many_defs
from tests.projections.pj_helpers import orders_schema, view_rows
from tests.projections.test_follow import more_changes, wait
from tests.projections.test_replay import random_history

ROOT = Path(__file__).resolve().parents[2]
MANY = [many_defs.ManyTotals, many_defs.ManyLatest, many_defs.ManyChanges, many_defs.ManyTotalsB]
# what a replay and a follow must agree on: grouped/custom versions are write watermarks (the last column)
COLUMNS = {"many_totals": ("customer_id, n, total, last", None), "many_latest": ("*", None),
           "many_changes": ("*", -1), "many_totals_b": ("*", -1)}


def _writers(log: Any) -> tuple[TableWriter, TableWriter]:
    return (TableWriter(log, orders_schema("many"), partitions=2),
            TableWriter(log, orders_schema("manyb"), partitions=2))


def _view(dsn: str, name: str) -> list[tuple[Any, ...]]:
    cols, cut = COLUMNS[name]
    rows = view_rows(dsn, name, cols)
    return [r[:cut] for r in rows] if cut else rows


def _views(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    return {name: _view(dsn, name) for name in COLUMNS}


def _assert_equal_to_fresh_replays(rt: Any, dsn: str) -> None:
    followed = _views(dsn)
    assert all(followed.values()), {k: len(v) for k, v in followed.items()}
    for p in MANY:
        replay(p, rt)
    assert _views(dsn) == followed


@pytest.mark.integration
@pytest.mark.timeout(1200)  # five streaming queries in the session's Spark; slow when the machine is busy
def test_many_projections_in_one_runtime_and_one_sink_down(spark: Any, embedded_log: Any, pg_dsn: str,
                                                          tmp_path: Path) -> None:
    from kappaflow.testing.servers.redis import PrivateRedis

    redis = PrivateRedis(workdir=tmp_path / "redis").start()
    redis.stop()  # down when the runtime starts: its port is known and closed
    cache = type("ManyCache", (Projection,), {"name": "many_cache", "sources": [many_defs.TOPIC_B], "key": ["id"],
                                               "sinks": ("redis",)})
    pg = PostgresSink(pg_dsn)
    sinks = {"postgres": pg, "redis": RedisSink(redis.url, options={"max_retries": 1, "backoff_initial_s": 0.05,
                                                                     "backoff_max_s": 0.2})}
    rt = Runtime(spark, str(embedded_log.path), pg, dsn=pg_dsn, checkpoint_dir=tmp_path / "ckpt", sinks=sinks)
    wa, wb = _writers(embedded_log)
    random_history(wa, seed=5, n=120)
    random_history(wb, seed=6, n=60)
    runtime = FollowRuntime([*MANY, cache], rt, trigger="0.2s", backoff_s=0.2, max_backoff_s=1.0,
                            max_restarts=10_000)
    others = [f for f in runtime.followers.values() if f.spec.name != "many_cache"]
    cache_f = runtime.followers["many_cache/redis"]
    try:
        runtime.start()
        rnd = random.Random(3)
        for step in range(2):
            wait(lambda: all(f.caught_up() for f in others), 480, f"step {step}: the PostgreSQL views to catch up")
            assert cache_f.failed is None and not cache_f.healthy and cache_f.error is not None
            more_changes(wa, rnd, 40, 500 + step)
            more_changes(wb, rnd, 20, 600 + step)
        redis.start()  # the store is back: the cache's follower starts and catches up
        wait(lambda: runtime.caught_up(), 480, "every follower, the Redis one included, to catch up")
        assert cache_f.healthy and cache_f.restarts == 0 and all(f.failed is None for f in others)
        import redis as redis_py

        client = redis_py.Redis.from_url(redis.url)
        cached = {k[0]: get(client, "many_cache", k[0]) for k in wb.rows}
        assert {i: (r or {}).get("customer_id") for i, r in cached.items()} == {
            k[0]: r["customer_id"] for k, r in wb.rows.items()}
    finally:
        runtime.stop()
    try:
        _assert_equal_to_fresh_replays(rt, pg_dsn)
    finally:
        rt.close()
        redis.stop()


def test_arguments_resolve_to_projections_and_bad_ones_are_refused() -> None:
    mod = "tests.projections.many_defs"
    names = [s.name for s in resolve_projections([mod])]
    assert names == ["many_totals", "many_latest", "many_changes", "many_totals_b"]
    specs = resolve_projections([f"{mod}:ManyLatest", f"{mod}:ManyTotalsB"])
    assert [(s.name, s.class_path) for s in specs] == [("many_latest", f"{mod}:ManyLatest"),
                                                       ("many_totals_b", f"{mod}:ManyTotalsB")]
    assert [s.name for s in resolve_projections([], all_=True, configured=[f"{mod}:ManyTotals"])] == ["many_totals"]
    # a package offers the classes of its submodules it exposes
    assert "customer_totals" in [s.name for s in resolve_projections(["examples.shop"])]

    def refused(*args: Any, **kw: Any) -> str:
        with pytest.raises(ConfigError) as err:
            resolve_projections(*args, **kw)
        return str(err.value)

    msg = refused([mod, f"{mod}:ManyLatest"])
    assert "'many_latest' is listed twice" in msg and f"{mod}:ManyLatest" in msg
    assert "no 'Nope'" in refused([f"{mod}:Nope"])
    assert "cannot import module 'tests.projections.nosuch'" in refused(["tests.projections.nosuch"])
    assert "defines no Projection class" in refused(["tests.projections.pj_helpers"])
    assert "not both" in refused([mod], all_=True, configured=[mod])
    assert "[follow] projections is empty" in refused([], all_=True, configured=[])
    assert "at least one projection" in refused([])
    assert "expected module:Class or a module" in refused(["not a module"])


def test_cli_follow_refuses_bad_arguments_before_spark_starts(pg_dsn: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from kappaflow.cli import projections as pcli

    cfg = tmp_path / "kappaflow.toml"
    Settings(log=LogConfig(url=str(tmp_path / "log")), base_dir=tmp_path, views=ViewsConfig(postgres_dsn=pg_dsn),
             follow=FollowConfig(projections=["tests.projections.many_defs", "tests.projections.many_defs:ManyTotals"]),
             ).save(cfg)
    assert Settings.load(cfg).follow.projections[1] == "tests.projections.many_defs:ManyTotals"
    app = typer.Typer()

    @app.callback()
    def root(ctx: typer.Context) -> None:
        ctx.obj = {"config": cfg, "profile": None}

    app.command("follow")(pcli.follow)

    def no_spark(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("Spark was started for arguments that must be refused")

    monkeypatch.setattr("kappaflow.projections.runtime.spark_session", no_spark)
    runner = CliRunner()
    cases = {
        ("--all",): "'many_totals' is listed twice in the [follow] projections",
        ("tests.projections.many_defs", "--all"): "not both",
        ("tests.projections.many_defs:ManyLatest", "tests.projections.many_defs:ManyLatest"): "listed twice",
        ("tests.projections.many_defs", "--sink", "redis"): "writes to none of them",
        (): "at least one projection",
    }
    for args, expected in cases.items():
        out = runner.invoke(app, ["follow", *args])
        assert out.exit_code != 0, (args, out.output)
        assert expected in str(out.exception), (args, out.exception)
    monkeypatch.setenv("KAPPAFLOW_FOLLOW__PROJECTIONS", "tests.projections.many_defs:ManyLatest,x.y:Z")
    assert Settings.load(cfg).follow.projections == ["tests.projections.many_defs:ManyLatest", "x.y:Z"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1200)  # the runtime starts its own Spark twice; on a busy machine that takes minutes
def test_kill_9_of_a_many_projection_runtime_mid_batch_then_restart(spark: Any, embedded_log: Any, pg_dsn: str,
                                                                   tmp_path: Path) -> None:
    """``kappaflow follow --all`` (``[follow] projections = ["tests.projections.many_defs"]``: 4
    projections, 2 topics) killed with -9 at a seeded random moment while it applies small batches;
    after the restart every view equals a fresh replay (the custom fold counts changes: a batch
    applied twice would show)."""
    from kappaflow.projections.sinks.postgres import ensure_migrated
    from tests.projections.test_follow import positions

    ensure_migrated(pg_dsn)
    cfg = tmp_path / "kappaflow.toml"
    Settings(log=LogConfig(url=str(embedded_log.path)), base_dir=tmp_path, views=ViewsConfig(postgres_dsn=pg_dsn),
             spark=SparkConfig(master="local[2]", conf={"spark.ui.enabled": "false",
                                                        "spark.sql.shuffle.partitions": "2"}),
             follow=FollowConfig(projections=["tests.projections.many_defs"])).save(cfg)
    wa, wb = _writers(embedded_log)
    random_history(wa, seed=11, n=100)
    random_history(wb, seed=12, n=60)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    errlog = tmp_path / "follow.log"

    def start() -> subprocess.Popen[bytes]:
        with errlog.open("ab") as err:
            return subprocess.Popen(
                [sys.executable, "-m", "kappaflow.cli", "--config", str(cfg), "follow", "--all", "--trigger", "0.2s",
                 "--max-records", "60"],
                cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)

    def total() -> int:
        return sum(sum(positions(pg_dsn, p.name).values()) for p in MANY)

    def caught_up() -> bool:
        ends = {t: embedded_log.end_offsets(t) for t in (many_defs.TOPIC_A, many_defs.TOPIC_B)}
        for p in MANY:
            pos = positions(pg_dsn, p.name)
            topic = p.sources[0]
            if any(pos.get((topic, part), 0) < e for part, e in ends[topic].items()):
                return False
        return True

    rnd = random.Random(77)
    proc = start()
    try:
        for trial in range(1):
            before = total()
            more_changes(wa, rnd, 50, 3000 + trial)
            more_changes(wb, rnd, 25, 3100 + trial)
            wait(lambda b=before: total() > b, 480, f"trial {trial}: a batch of the new changes "
                 f"(log: {errlog})")
            import time

            time.sleep(rnd.uniform(0.0, 0.8))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            proc = start()
        wait(caught_up, 480, f"the restarted runtime to catch up (log: {errlog})")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
    rt = Runtime(spark, str(embedded_log.path), PostgresSink(pg_dsn), dsn=pg_dsn, checkpoint_dir=tmp_path / "other")
    try:
        _assert_equal_to_fresh_replays(rt, pg_dsn)
    finally:
        rt.close()


@pytest.mark.integration
def test_a_batch_spark_reruns_after_a_restart_is_skipped_when_the_view_has_it(
        rt: Any, embedded_log: Any, pg_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """Spark re-runs the last batch it had not recorded as committed (a crash between the sink's
    commit and Spark's): the follower sees from Spark's offset log that the view has every record of
    it and skips it -- no Spark job, no sink transaction -- and the next batch applies normally."""
    import logging

    from kappaflow.projections.follow import Follower

    wa, _ = _writers(embedded_log)
    random_history(wa, seed=41, n=80)
    f = Follower(many_defs.ManyChanges, rt, trigger="0.2s").start()
    try:
        wait(lambda: f.caught_up(), 180, "the follower to catch up")
    finally:
        f.stop()
    assert f._ckpt is not None
    ckpt = Path(f._ckpt)
    last = max(int(p.name) for p in (ckpt / "offsets").iterdir() if p.name.isdigit())
    for p in (ckpt / "commits").iterdir():  # as if the process died before Spark recorded the batch
        if p.name in (str(last), f".{last}.crc"):
            p.unlink()
    before = _view(pg_dsn, "many_changes")
    caplog.set_level(logging.DEBUG, logger="kappaflow.projections")
    again = Follower(many_defs.ManyChanges, rt, trigger="0.2s").start()
    try:
        wait(lambda: (ckpt / "commits" / str(last)).exists(), 180, f"Spark to re-run batch {last}")
        assert again.stats.batches == 0 and again.stats.events == 0
        assert f"follower many_changes/postgres: batch {last} is already in the view, skipped" in caplog.messages
        assert _view(pg_dsn, "many_changes") == before
        more_changes(wa, random.Random(2), 30, 900)
        wait(lambda: again.stats.batches >= 1 and again.caught_up(), 180, "the next batch to apply")
    finally:
        again.stop()
    followed = _view(pg_dsn, "many_changes")
    replay(many_defs.ManyChanges, rt)
    assert _view(pg_dsn, "many_changes") == followed  # no change counted twice
