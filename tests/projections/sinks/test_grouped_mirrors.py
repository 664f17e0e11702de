"""Grouped projections (``aggregates``) on search and Redis: mirrors of the PostgreSQL view.

* replay, then follow with moves between groups, deletes and groups emptied (updates without
  before-images, deletes with key-only before-images, as PostgreSQL's default replica
  identity gives): search and Redis equal the PostgreSQL view, versions included;
* with the PostgreSQL follower stopped the mirror follower waits (its positions never run
  ahead of PostgreSQL's); when PostgreSQL moves on, the mirror follows;
* Redis stopped mid-follow and restarted empty: the mirror is rebuilt from the PostgreSQL view;
* verify on a mirror compares it with the PostgreSQL view; a grouped projection without
  "postgres" is refused.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from _sink_helpers import live_positions as _positions
from _sink_helpers import redis_outage_and_empty_restart, wait_for

from kappaflow.errors import ConfigError
from kappaflow.events import Column, FieldType, TableSchema
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections.api import Count, Max, Projection, ProjectionSpec, Sum
from kappaflow.projections.engine import flatten, prepare
from kappaflow.projections.follow import FollowerGroup
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.sinks.base import Sink
from kappaflow.projections.sinks.postgres import PostgresSink
from kappaflow.projections.sinks.redis import RedisSink
from kappaflow.projections.sinks.search import SearchSink
from kappaflow.projections.verify import verify

pytestmark = pytest.mark.integration

TOPIC = "shop.public.morders"
SCHEMA = TableSchema(TOPIC, (
    Column("id", FieldType.INT64, optional=False), Column("customer_id", FieldType.INT64),
    Column("amount", FieldType.INT64), Column("status", FieldType.STRING),
), ("id",))


def _projection(sinks: tuple[str, ...] = ("postgres", "search", "redis")) -> type[Projection]:
    name = "totals_" + uuid.uuid4().hex[:8]
    return type("Totals", (Projection,), {
        "name": name, "sources": [TOPIC], "key": ["customer_id"], "where": "status <> 'cancelled'",
        "aggregates": {"orders": Count(), "total": Sum("amount"), "biggest": Max("amount")}, "sinks": sinks,
    })


def _runtime(spark: Any, log_dir: Path, pg_dsn: str, search_url: str, redis_url: str, tmp_path: Path,
             redis_options: dict[str, Any] | None = None) -> Runtime:
    sinks: dict[str, Sink] = {"postgres": PostgresSink(pg_dsn), "search": SearchSink(search_url),
                              "redis": RedisSink(redis_url, options=redis_options or {})}
    return Runtime(spark, str(log_dir), sinks["postgres"], dsn=pg_dsn, checkpoint_dir=tmp_path / "ckpt", sinks=sinks)


def _rows(sink: Sink, view: Any) -> dict[int, dict[str, Any]]:
    live = sink.live(view)
    assert live is not None, sink.kind
    return {r["customer_id"]: {k: r[k] for k in (*view.column_names, "_kf_version")} for r in sink.scan(live)}


def _expected(w: TableWriter) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for r in w.rows.values():
        if r["status"] == "cancelled" or r["customer_id"] is None:
            continue
        g = out.setdefault(r["customer_id"], {"customer_id": r["customer_id"], "orders": 0, "total": 0, "biggest": 0})
        g["orders"] += 1
        g["total"] += r["amount"]
        g["biggest"] = max(g["biggest"], r["amount"])
    return out


def _mirrors_equal_pg(rt: Runtime, view: Any, w: TableWriter, mirrors: tuple[str, ...] = ("search", "redis")) -> None:
    pg = _rows(rt.sinks["postgres"], view)
    assert {k: {c: v for c, v in r.items() if c != "_kf_version"} for k, r in pg.items()} == _expected(w)
    for m in mirrors:
        assert _rows(rt.sinks[m], view) == pg, m  # values AND versions
        assert _positions(rt.sinks[m], view) == _positions(rt.sinks["postgres"], view), m


def _orders(w: TableWriter, ids: range, gen: int) -> None:
    for i in ids:
        w.insert({"id": i + 1000 * gen, "customer_id": i % 7, "amount": i * 10 + gen, "status": "paid"})
    w.flush()


def _churn(w: TableWriter, gen: int) -> None:
    """Moves between customers, cancellations, deletes; customer 6 loses all its orders."""
    for k in sorted(w.rows):
        r = w.rows[k]
        if r["customer_id"] == 6 and k[0] % 2:
            w.delete(k)
        elif r["customer_id"] == 6:
            w.update(k, {"customer_id": 100 + gen})
        elif k[0] % 5 == 0:
            w.update(k, {"customer_id": (r["customer_id"] + 1) % 6})
        elif k[0] % 5 == 1:
            w.update(k, {"status": "cancelled"})
        elif k[0] % 5 == 2:
            w.delete(k)
        elif k[0] % 5 == 3:
            w.update(k, {"amount": r["amount"] + 1})
    w.flush()


def test_grouped_projection_needs_postgres_for_search_and_redis() -> None:
    with pytest.raises(ConfigError, match="only together with 'postgres'"):
        ProjectionSpec.from_class(_projection(("redis",)))
    assert ProjectionSpec.from_class(_projection(("postgres", "redis"))).sinks == ("postgres", "redis")


def test_replay_follow_and_a_waiting_mirror(
        spark: Any, pg_dsn: str, search_server: Any, redis_server: Any, tmp_path: Path) -> None:
    proj = _projection()
    log_dir = tmp_path / "log"
    log = EmbeddedLog(log_dir)
    rt = _runtime(spark, log_dir, pg_dsn, search_server.url, redis_server.url, tmp_path)
    try:
        w = TableWriter(log, SCHEMA, partitions=2)
        _orders(w, range(60), 1)
        res = replay(proj, rt)
        assert set(res.sinks) == {"postgres", "search", "redis"}
        view = prepare(as_spec(proj), rt).view
        _mirrors_equal_pg(rt, view, w)
        assert _positions(rt.sinks["redis"], view) == flatten(rt.end_offsets([TOPIC]))

        # only the mirrors follow: PostgreSQL does not move, so neither do they
        _churn(w, 2)
        pg_before = _positions(rt.sinks["postgres"], view)
        mirrors = FollowerGroup(proj, rt, sinks=["search", "redis"], trigger="0.1s").start()
        try:
            wait_for(lambda: all(f.stats.batches == 0 and f.healthy for f in mirrors.followers.values()),
                     timeout=10, what="the mirror followers to start", interval=0.1)
            polls = mirrors["redis"]
            for _ in range(5):  # several polls: positions and rows stay at PostgreSQL's
                assert _positions(rt.sinks["redis"], view) == pg_before
                assert polls.stats.batches == 0
                polls._stopping.wait(0.15)
            assert not mirrors["redis"].caught_up()

            pg = FollowerGroup(proj, rt, sinks=["postgres"], trigger="0.2s").start()
            try:
                assert pg.wait_for(lambda g: g.caught_up(), timeout=120), "PostgreSQL follower did not catch up"
                assert mirrors.wait_for(lambda g: g.caught_up(), timeout=60), "mirrors did not follow PostgreSQL"
                _mirrors_equal_pg(rt, view, w)
                assert 100 + 2 in _expected(w) and 6 not in _expected(w)
                assert mirrors["redis"].stats.deleted >= 1  # groups that became empty

                _churn(w, 3)
                _orders(w, range(20), 4)
                assert pg.wait_for(lambda g: g.caught_up(), timeout=120)
                assert mirrors.wait_for(lambda g: g.caught_up(), timeout=60)
                _mirrors_equal_pg(rt, view, w)
            finally:
                pg.stop()
        finally:
            mirrors.stop()
        for name in ("search", "redis"):
            v = verify(proj, rt, sink=name)
            assert v.ok and v.sink == name and v.rows == len(_expected(w)), (name, v.drift)
        # drift behind kappaflow's back is found by comparing with the PostgreSQL view
        redis_sink = rt.sinks["redis"]
        live = redis_sink.live(view)
        assert live is not None
        row = next(iter(_rows(redis_sink, view).values()))
        redis_sink.write(live, _batch(view, {**row, "total": -1, "_kf_version": row["_kf_version"] + 10**9}))
        v = verify(proj, rt, sink="redis")
        assert v.drift_count == 1 and v.drift[0].kind == "changed", v.drift

        # a replay of the postgres sink alone also rebuilds its mirrors
        res = replay(proj, rt, sinks=["postgres"])
        assert set(res.sinks) == {"postgres", "search", "redis"}
        _mirrors_equal_pg(rt, view, w)
    finally:
        rt.close()
        log.close()


def _batch(view: Any, row: dict[str, Any]) -> Any:
    from kappaflow.projections.sinks.base import batch_from_rows

    return batch_from_rows(view, [row])


def test_redis_stopped_and_restarted_empty_catches_up(
        spark: Any, pg_dsn: str, search_server: Any, tmp_path: Path) -> None:
    from kappaflow.testing.servers.redis import PrivateRedis

    server = PrivateRedis(workdir=tmp_path / "redis").start()
    proj = _projection()
    log_dir = tmp_path / "log"
    log = EmbeddedLog(log_dir)
    rt = _runtime(spark, log_dir, pg_dsn, search_server.url, server.url, tmp_path,
                  redis_options={"max_retries": 1, "backoff_initial_s": 0.05, "backoff_max_s": 0.2})
    group: FollowerGroup | None = None
    try:
        w = TableWriter(log, SCHEMA, partitions=2)
        _orders(w, range(40), 1)
        replay(proj, rt)
        view = prepare(as_spec(proj), rt).view
        group = FollowerGroup(proj, rt, trigger="0.2s", backoff_s=0.2, max_backoff_s=1.0, max_restarts=10_000).start()
        assert group.wait_for(lambda g: g.caught_up(), timeout=90)

        redis_outage_and_empty_restart(group, rt, view, server, lambda: flatten(rt.end_offsets([TOPIC])),
                                       lambda: _churn(w, 2))
        _mirrors_equal_pg(rt, view, w)
        _churn(w, 3)
        assert group.wait_for(lambda g: g.caught_up(), timeout=120)
        _mirrors_equal_pg(rt, view, w)
    finally:
        if group is not None:
            group.stop()
        rt.close()
        log.close()
        server.stop()


def test_a_mirror_behind_a_rebuilt_postgres_view_is_copied_again(
        spark: Any, pg_dsn: str, search_server: Any, redis_server: Any, tmp_path: Path) -> None:
    """Regression: the PostgreSQL view rebuilt on its own (what its follower does when the view was
    lost) while a mirror lagged. The rebuilt view's change table starts at the rebuild, so the
    mirror's incremental sync missed every group changed or emptied in between (customer 6 stayed
    in Redis) and stored PostgreSQL's positions as if caught up. Now the sync sees the rebuild and
    the mirror follower copies the view again."""
    from kappaflow.projections.mirror import sync
    from kappaflow.projections.replay import rebuild
    from kappaflow.projections.sinks.errors import SinkStateLostError

    proj = _projection(("postgres", "redis"))
    log_dir = tmp_path / "log"
    log = EmbeddedLog(log_dir)
    rt = _runtime(spark, log_dir, pg_dsn, search_server.url, redis_server.url, tmp_path)
    try:
        w = TableWriter(log, SCHEMA, partitions=2)
        _orders(w, range(30), 1)
        replay(proj, rt)
        plan = prepare(as_spec(proj), rt)
        view = plan.view
        _mirrors_equal_pg(rt, view, w, ("redis",))
        _churn(w, 2)
        pg, redis_sink = rt.sinks["postgres"], rt.sinks["redis"]
        rebuild(plan, rt, {"postgres": pg})
        live = redis_sink.live(view)
        assert live is not None
        with pytest.raises(SinkStateLostError, match="rebuilt at watermark"):
            sync(plan, rt, pg, redis_sink, live)
        assert 6 in _rows(redis_sink, view)  # nothing was written by the refused sync

        mirror = FollowerGroup(proj, rt, sinks=["redis"], trigger="0.1s", backoff_s=0.1).start()
        try:
            wait_for(lambda: mirror["redis"].rebuilds >= 1 and mirror["redis"].caught_up(), timeout=60,
                     what="the Redis mirror to be copied again from the rebuilt view", interval=0.1)
            _mirrors_equal_pg(rt, view, w, ("redis",))
            assert 6 not in _rows(redis_sink, view)
            # and from there on it follows incrementally again
            _churn(w, 3)
            pg_f = FollowerGroup(proj, rt, sinks=["postgres"], trigger="0.1s").start()
            try:
                assert pg_f.wait_for(lambda g: g.caught_up(), timeout=120)
                assert mirror.wait_for(lambda g: g.caught_up(), timeout=60)
                _mirrors_equal_pg(rt, view, w, ("redis",))
                assert mirror["redis"].rebuilds == 1
            finally:
                pg_f.stop()
        finally:
            mirror.stop()
    finally:
        rt.close()
        log.close()
