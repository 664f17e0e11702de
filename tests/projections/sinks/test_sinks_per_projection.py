"""A projection that names several sinks (``sinks = ("postgres", "search", "redis")``):

* replay then follow through the ordinary API: search and Redis hold the PostgreSQL view;
* a row the search mapping refuses goes to the dead-letter topic (sink, reason, log position),
  the rest is indexed;
* Redis stopped mid-follow: PostgreSQL and search keep advancing; Redis restarted (empty)
  and FLUSHALL: the Redis follower rebuilds its view from the log and catches up;
* ``--sink`` selects sinks on the CLI; an unconfigured sink is a clear error.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import typer
from _sink_helpers import live_positions as _positions
from _sink_helpers import redis_outage_and_empty_restart, wait_for
from typer.testing import CliRunner

from kappaflow.errors import ConfigError, KappaflowError
from kappaflow.events import Column, FieldType, TableSchema
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections.api import Projection
from kappaflow.projections.deadletter import read_dead_letters
from kappaflow.projections.engine import flatten, prepare
from kappaflow.projections.follow import FollowerGroup
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.sinks.base import Sink
from kappaflow.projections.sinks.postgres import PostgresSink
from kappaflow.projections.sinks.redis import RedisSink
from kappaflow.projections.sinks.search import SearchSink

pytestmark = pytest.mark.integration

TOPIC = "shop.public.items"
SCHEMA = TableSchema(TOPIC, (
    Column("id", FieldType.INT64, optional=False), Column("name", FieldType.STRING), Column("code", FieldType.STRING),
), ("id",))
BAD = "not-a-number"


def _projection(**extra: Any) -> type[Projection]:
    view = "items_" + uuid.uuid4().hex[:8]
    attrs = {"name": view, "sources": [TOPIC], "key": ["id"], "sinks": ("postgres", "search", "redis"),
             "sink_options": {"search": {"fields": {"code": {"type": "integer"}}}, "redis": {"format": "hash"}}}
    attrs.update(extra)
    return type("Items", (Projection,), attrs)


def _history(w: TableWriter, keys: range, gen: int, bad: frozenset[int] = frozenset()) -> None:
    for i in keys:
        row = {"name": f"item {i} g{gen}", "code": BAD if i in bad else str(i * 10 + gen)}
        if (i,) in w.rows:
            if i % 9 == 0:
                w.delete((i,))
            else:
                w.update((i,), row)
        else:
            w.insert({"id": i, **row})
    w.flush()


def _rows(sink: Sink, view: Any) -> dict[int, dict[str, Any]]:
    live = sink.live(view)
    assert live is not None, sink.kind
    return {r["id"]: {k: v for k, v in r.items() if k != "_kf_version"} for r in sink.scan(live)}


def _runtime(spark: Any, log_dir: Path, pg_dsn: str, search_url: str, redis_url: str, tmp_path: Path,
             redis_options: dict[str, Any] | None = None) -> Runtime:
    sinks: dict[str, Sink] = {"postgres": PostgresSink(pg_dsn), "search": SearchSink(search_url),
                              "redis": RedisSink(redis_url, options=redis_options or {})}
    return Runtime(spark, str(log_dir), sinks["postgres"], dsn=pg_dsn, checkpoint_dir=tmp_path / "ckpt", sinks=sinks)


def _same_views(rt: Runtime, view: Any, rejected: frozenset[int] = frozenset()) -> dict[int, dict[str, Any]]:
    reference = _rows(rt.sinks["postgres"], view)
    assert _rows(rt.sinks["redis"], view) == reference
    expected_search = {k: v for k, v in reference.items() if k not in rejected}
    assert _rows(rt.sinks["search"], view) == expected_search
    return reference


def test_replay_then_follow_in_every_sink_and_refused_rows_dead_lettered(
        spark: Any, pg_dsn: str, search_server: Any, redis_server: Any, tmp_path: Path) -> None:
    proj = _projection()
    log_dir = tmp_path / "log"
    log = EmbeddedLog(log_dir)
    rt = _runtime(spark, log_dir, pg_dsn, search_server.url, redis_server.url, tmp_path)
    try:
        w = TableWriter(log, SCHEMA, partitions=2)
        _history(w, range(60), 1, bad=frozenset({7}))
        res = replay(proj, rt)
        assert set(res.sinks) == {"postgres", "search", "redis"}
        assert res.sinks["postgres"].rows == res.sinks["redis"].rows == len(w.rows)
        assert res.sinks["search"].rows == len(w.rows) - 1 and res.sinks["search"].dead_letters == 1
        view = prepare(as_spec(proj), rt).view
        _same_views(rt, view, rejected=frozenset({7}))
        dl = [d for d in read_dead_letters(str(log_dir), None, proj.name) if d.get("sink") == "search"]
        assert len(dl) == 1 and dl[0]["row_key"] == "7", dl
        assert "mapper_parsing_exception" in dl[0]["reason"] and dl[0]["topic"] == TOPIC
        # the log position of the change that made the refused row
        assert dl[0]["partition"] in (0, 1) and isinstance(dl[0]["offset"], int)

        # follow: more changes (a fixed row, a new bad one, deletes, new keys), one follower per sink
        _history(w, range(5, 80), 2, bad=frozenset({70}))
        group = FollowerGroup(proj, rt, trigger="0.2s").start()
        try:
            # each lease store's follower writes fenced with the token its lock holds in the store
            held = {"redis": rt.sinks["redis"].client.get(f"kf:~lock:{proj.name}").decode(),  # type: ignore[attr-defined]
                    "search": rt.sinks["search"].client.get_doc_meta(  # type: ignore[attr-defined]
                        "kappaflow-positions", f"~lock:{proj.name}")[0]["token"]}
            for kind, token in held.items():
                assert group[kind].sink.config().fences == {proj.name: token}, kind
            assert group.wait_for(lambda g: g.caught_up(), timeout=120), "followers did not catch up"
        finally:
            group.stop()
        reference = _same_views(rt, view, rejected=frozenset({70}))
        assert set(reference) == {k[0] for k in w.rows}
        end = flatten(rt.end_offsets([TOPIC]))
        for k, s in rt.sinks.items():
            assert _positions(s, view) == end, k
        dl = [d for d in read_dead_letters(str(log_dir), None, proj.name) if d.get("sink") == "search"]
        assert {d["row_key"] for d in dl} == {"7", "70"}, dl
        late = next(d for d in dl if d["row_key"] == "70")
        assert late["topic"] == TOPIC and late["offset"] is not None and "mapper_parsing_exception" in late["reason"]
    finally:
        rt.close()
        log.close()


def test_redis_down_restarted_empty_and_flushed_while_following(
        spark: Any, pg_dsn: str, search_server: Any, tmp_path: Path) -> None:
    """A private Redis (the session one is shared): stopped mid-follow, restarted empty, flushed."""
    import redis as redis_py

    from kappaflow.testing.servers.redis import PrivateRedis

    server = PrivateRedis(workdir=tmp_path / "redis").start()
    proj = _projection(sink_options={})
    log_dir = tmp_path / "log"
    log = EmbeddedLog(log_dir)
    # quick failure inside a batch, so the follower's own backoff/restart is what is exercised
    rt = _runtime(spark, log_dir, pg_dsn, search_server.url, server.url, tmp_path,
                  redis_options={"max_retries": 1, "backoff_initial_s": 0.05, "backoff_max_s": 0.2})
    group: FollowerGroup | None = None
    try:
        w = TableWriter(log, SCHEMA, partitions=2)
        _history(w, range(50), 1)
        replay(proj, rt)
        view = prepare(as_spec(proj), rt).view
        group = FollowerGroup(proj, rt, trigger="0.2s", backoff_s=0.2, max_backoff_s=1.0, max_restarts=10_000).start()
        assert group.wait_for(lambda g: g.caught_up(), timeout=90)

        # PostgreSQL and search advance while Redis is down; Redis rebuilds after its empty restart
        redis_f = redis_outage_and_empty_restart(group, rt, view, server, lambda: flatten(rt.end_offsets([TOPIC])),
                                                 lambda: _history(w, range(30, 90), 2))
        end = flatten(rt.end_offsets([TOPIC]))

        def redis_caught_up() -> bool:
            try:
                return bool(redis_f.caught_up())
            except KappaflowError:
                return False

        assert redis_f.rebuilds >= 1 and redis_f.restarts >= 1
        _same_views(rt, view)
        assert _positions(rt.sinks["redis"], view) == end

        rebuilds = redis_f.rebuilds
        redis_py.Redis.from_url(server.url).flushall()
        _history(w, range(80, 110), 3)
        wait_for(lambda: redis_f.rebuilds > rebuilds and redis_f.healthy and redis_caught_up() and group.caught_up(),
                 timeout=120,
                 what="the Redis follower to rebuild after FLUSHALL", interval=0.2)
        reference = _same_views(rt, view)
        assert set(reference) == {k[0] for k in w.rows}
    finally:
        if group is not None:
            group.stop()
        rt.close()
        log.close()
        server.stop()


def test_unconfigured_and_unknown_sinks_are_clear_errors(spark: Any, pg_dsn: str, tmp_path: Path) -> None:
    proj = _projection(sink_options={})
    rt = Runtime(spark, str(tmp_path / "log"), PostgresSink(pg_dsn), dsn=pg_dsn)
    try:
        with pytest.raises(ConfigError) as err:
            replay(proj, rt)
        assert proj.name in str(err.value) and "views.search.url" in str(err.value)
        with pytest.raises(ConfigError) as err:
            replay(proj, rt, sinks=["nosuch"])
        assert "--sink" in str(err.value) and "nosuch" in str(err.value)
    finally:
        rt.close()


def test_cli_sink_selection(spark: Any, pg_dsn: str, search_server: Any, redis_server: Any, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    from kappaflow.cli import projections as pcli
    from kappaflow.config import LogConfig, Settings, ViewsConfig
    from tests.projections import defs

    proj = _projection(sink_options={})
    log_dir = tmp_path / "log"
    log = EmbeddedLog(log_dir)
    try:
        w = TableWriter(log, SCHEMA, partitions=2)
        _history(w, range(20), 1)
    finally:
        log.close()
    cfg = tmp_path / "kappaflow.toml"
    Settings(log=LogConfig(url=str(log_dir)), base_dir=tmp_path, views=ViewsConfig(
        postgres_dsn=pg_dsn, search_url=search_server.url, redis_url=redis_server.url)).save(cfg)
    app = typer.Typer()

    @app.callback()
    def root(ctx: typer.Context) -> None:
        ctx.obj = {"config": cfg, "profile": None}

    app.command("replay")(pcli.replay)
    app.command("query")(pcli.query)
    app.command("status")(pcli.status)
    monkeypatch.setattr(defs, "CliItems", proj, raising=False)
    monkeypatch.setattr("kappaflow.projections.runtime.spark_session", lambda *a, **k: spark)
    runner = CliRunner()
    out = runner.invoke(app, ["replay", "tests.projections.defs:CliItems", "--sink", "redis"])
    assert out.exit_code == 0, out.output
    assert "redis 20 rows" in out.output and "postgres" not in out.output.split("(")[1].split(")")[0]
    pg, search = PostgresSink(pg_dsn), SearchSink(search_server.url)
    try:
        view = prepare(as_spec(proj), Runtime(spark, str(log_dir), pg, dsn=pg_dsn)).view
        assert pg.live(view) is None and search.live(view) is None  # only the selected sink was built
    finally:
        pg.close()
        search.close()
    out = runner.invoke(app, ["query", proj.name, "3", "--sink", "redis"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["name"] == "item 3 g1"
    out = runner.invoke(app, ["status", proj.name, "--json"])
    assert out.exit_code == 0, out.output
    st = json.loads(out.output)[0]
    assert [s["sink"] for s in st["sinks"]] == ["redis"] and st["sinks"][0]["lag"] == 0
    out = runner.invoke(app, ["replay", "tests.projections.defs:CliItems", "--sink", "search"])
    assert out.exit_code == 0, out.output
    out = runner.invoke(app, ["query", proj.name, "4", "--sink", "search"])
    assert out.exit_code == 0 and json.loads(out.output)["code"] == "41", out.output
    out = runner.invoke(app, ["replay", "tests.projections.defs:CliItems", "--sink", "bogus"])
    assert out.exit_code != 0 and "bogus" in str(out.exception or out.output)
