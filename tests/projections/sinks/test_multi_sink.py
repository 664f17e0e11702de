"""One projection, several sinks: PostgreSQL, search and Redis views of the same log.

* replay then follow into each sink gives the same rows as the PostgreSQL view;
* each sink keeps its own positions: a failing sink neither blocks nor corrupts the
  others, and catches up from its own positions once it recovers.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from _sink_helpers import wait_for

from kappaflow.errors import KappaflowError
from kappaflow.events import Column, FieldType, TableSchema
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections.api import Projection
from kappaflow.projections.engine import apply_range, flatten, nest, prepare
from kappaflow.projections.follow import Follower
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.sinks.base import Sink, Target
from kappaflow.projections.sinks.postgres import PostgresSink
from kappaflow.projections.sinks.redis import RedisSink
from kappaflow.projections.sinks.search import SearchSink

pytestmark = pytest.mark.integration

TOPIC = "shop.public.customers"
SCHEMA = TableSchema(TOPIC, (
    Column("id", FieldType.INT64, optional=False), Column("name", FieldType.STRING),
    Column("total", FieldType.DECIMAL, scale=2, precision=12), Column("vip", FieldType.BOOLEAN),
    Column("since", FieldType.DATE), Column("seen_at", FieldType.TIMESTAMPTZ),
), ("id",))


class Customers(Projection):
    name = "mcustomers"
    sources = [TOPIC]
    key = ["id"]


def _projections() -> tuple[type[Projection], dict[str, type[Projection]]]:
    """The projection under a view name of its own (the Redis and search servers are shared by the
    session), and once per sink: own name (lock, registry, checkpoint), the same view name."""
    view = "mcustomers_" + uuid.uuid4().hex[:8]
    base = type("CustomersT", (Customers,), {"name": view, "view": view})
    return base, {k: type(f"Customers_{k}", (Customers,), {"name": f"{view}_{k}", "view": view, "sinks": (k,)})
                  for k in ("postgres", "search", "redis")}


def _row(i: int, gen: int) -> dict[str, Any]:
    return {"id": i, "name": f"customer {i} g{gen}", "total": Decimal(f"{i}.{gen % 100:02d}"), "vip": i % 5 == 0,
            "since": dt.date(2020, 1, 1) + dt.timedelta(days=i),
            "seen_at": dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.UTC) + dt.timedelta(minutes=i * gen)}


def _history(w: TableWriter, keys: range, gen: int) -> None:
    for i in keys:
        if (i,) in w.rows:
            if i % 11 == 0:
                w.delete((i,))
            else:
                w.update((i,), {k: v for k, v in _row(i, gen).items() if k != "id"})
        else:
            w.insert(_row(i, gen))
    w.flush()


def _rows(sink: Sink, target: Target) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in sink.scan(target)}


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "log"


def test_replay_then_follow_equals_the_postgresql_view(spark: Any, pg_dsn: str, search_server: Any,
                                                        redis_server: Any, log_dir: Path, tmp_path: Path) -> None:
    _, per_sink = _projections()
    log = EmbeddedLog(log_dir)
    try:
        w = TableWriter(log, SCHEMA, partitions=2)
        _history(w, range(120), 1)
        _history(w, range(0, 120, 2), 2)
        sinks: dict[str, Sink] = {"postgres": PostgresSink(pg_dsn), "search": SearchSink(search_server.url),
                                  "redis": RedisSink(redis_server.url)}
        runtimes = {k: Runtime(spark, str(log_dir), s, dsn=pg_dsn, checkpoint_dir=tmp_path / f"ckpt-{k}")
                    for k, s in sinks.items()}
        for k in sinks:
            res = replay(per_sink[k], runtimes[k])
            assert res.rows == len(w.rows), (k, res)
        views = {k: prepare(as_spec(per_sink[k]), rt).view for k, rt in runtimes.items()}
        live = {k: s.live(views[k]) for k, s in sinks.items()}
        assert all(live.values())
        reference = _rows(sinks["postgres"], live["postgres"])
        assert len(reference) == len(w.rows)
        for k in ("search", "redis"):
            assert _rows(sinks[k], live[k]) == reference, k
            assert sinks[k].count(live[k]) == len(reference)

        # follow: more changes (updates, deletes, new keys); the three followers run side by side
        _history(w, range(60, 160), 3)
        followers = {k: Follower(per_sink[k], rt, trigger="0.2s", checkpoint=str(tmp_path / f"ckpt-{k}" / "follow"))
                     for k, rt in runtimes.items()}
        try:
            for f in followers.values():
                f.start()
            for k, f in followers.items():
                assert f.wait_for(lambda _s, f=f: f.caught_up(), timeout=90), f"{k} follower did not catch up"
        finally:
            for f in followers.values():
                f.stop()
        reference = _rows(sinks["postgres"], live["postgres"])
        assert {k[0] for k in w.rows} == set(reference)
        end = flatten(runtimes["postgres"].end_offsets([TOPIC]))
        fresh = PostgresSink(pg_dsn)
        try:
            assert fresh.read_positions(live["postgres"]) == end, (
                "PostgreSQL positions", fresh.read_positions(live["postgres"]), end)
        finally:
            fresh.close()
        for k in ("search", "redis"):
            assert _rows(sinks[k], live[k]) == reference, k
            assert sinks[k].read_positions(live[k]) == end, k
        for s in sinks.values():
            s.close()
    finally:
        log.close()


def test_a_failing_sink_neither_blocks_nor_corrupts_the_others(spark: Any, pg_dsn: str, redis_server: Any,
                                                               log_dir: Path) -> None:
    """The search server freezes (SIGSTOP): its writes time out and fail; PostgreSQL and Redis keep
    applying batches and advancing their own positions. After SIGCONT the search sink catches up from
    its own, older positions to the same rows."""
    from kappaflow.testing.servers.osmem import OsmemServer

    projection, _ = _projections()
    osmem = OsmemServer().start()
    log = EmbeddedLog(log_dir)
    try:
        w = TableWriter(log, SCHEMA, partitions=2)
        _history(w, range(80), 1)
        sinks: dict[str, Sink] = {
            "postgres": PostgresSink(pg_dsn),
            "redis": RedisSink(redis_server.url),
            "search": SearchSink(osmem.url),
        }
        rts = {k: Runtime(spark, str(log_dir), s, dsn=pg_dsn) for k, s in sinks.items()}
        plan = prepare(as_spec(projection), rts["postgres"])
        targets = {k: s.ensure(plan.view) for k, s in sinks.items()}

        def round_(names: list[str]) -> dict[str, BaseException | float]:
            """One pass of a fan-out runner: every sink in turn, each from its OWN positions; a sink
            that fails is reported and skipped (retried next round), the others go on."""
            out: dict[str, BaseException | float] = {}
            end = rts["postgres"].end_offsets([TOPIC])
            for k in names:
                t0 = time.monotonic()
                try:
                    start = nest(sinks[k].read_positions(targets[k]), [TOPIC], {TOPIC: 2})
                    apply_range(plan, rts[k], targets[k], start, end)
                    out[k] = time.monotonic() - t0
                except KappaflowError as exc:
                    out[k] = exc
            return out

        first = round_(list(sinks))
        assert all(isinstance(v, float) for v in first.values()), first
        pos_before = sinks["search"].read_positions(targets["search"])

        os.kill(osmem.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        # the search sink as a runner would configure it for quick failure (short timeout, no retries)
        healthy = sinks["search"]
        sinks["search"] = SearchSink(osmem.url, client_options={"timeout": 1.0},
                                     options={"max_retries": 0, "backoff_initial_s": 0.01})
        rts["search"] = Runtime(spark, str(log_dir), sinks["search"], dsn=pg_dsn)
        try:
            _history(w, range(40, 120), 2)
            out = round_(["search", "postgres", "redis"])  # the failing sink first: it must not block the rest
            assert isinstance(out["search"], KappaflowError) and out["search"].transient, out
            assert isinstance(out["postgres"], float) and isinstance(out["redis"], float), out
            end = flatten(rts["postgres"].end_offsets([TOPIC]))
            for k in ("postgres", "redis"):  # advanced, with the right rows
                assert sinks[k].read_positions(targets[k]) == end
                assert {r["id"] for r in sinks[k].scan(targets[k])} == {k_[0] for k_ in w.rows}
            reference = _rows(sinks["postgres"], targets["postgres"])
            assert _rows(sinks["redis"], targets["redis"]) == reference
        finally:
            os.kill(osmem.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
            sinks["search"].close()
            sinks["search"] = healthy
            rts["search"] = Runtime(spark, str(log_dir), healthy, dsn=pg_dsn)

        wait_for(lambda: _alive(sinks["search"], targets["search"]), timeout=30, what="osmem to answer again")
        assert sinks["search"].read_positions(targets["search"]) == pos_before  # not moved while failing
        out = round_(["search"])
        assert isinstance(out["search"], float), out
        assert sinks["search"].read_positions(targets["search"]) == end
        assert _rows(sinks["search"], targets["search"]) == reference
        for s in sinks.values():
            s.close()
    finally:
        log.close()
        osmem.stop()


def _alive(sink: Sink, target: Target) -> bool:
    try:
        sink.count(target)
        return True
    except KappaflowError:
        return False
