"""Joined latest-row views in search (osmem) and Redis: the join state lives in the views database,
one per build of the store, and commits before the store's rows and positions.

* batches of seeded random changes on both sides (fan-out renames, moved rows, deletes and
  re-inserts, late dimensions, NULL foreign keys), folded by the follow code path
  (``engine.apply_range``, what each follower micro-batch runs), equal the plain-Python reference
  and a fresh replay; a replay leaves one join state per view (the old build's goes with it);
* a crash between the state's commit and the store's write (before any row, after half of them,
  after all rows but before the positions) converges when the batch is read again, also when
  the re-run stops before where the crashed batch ended (the state is then ahead of the batch);
* a join state behind the store's positions (a restored backup) is refused as lost state, so a
  follower rebuilds the view instead of writing stale joined rows.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kappaflow.errors import Retry, SinkError
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections.engine import apply_range, flatten, nest, prepare
from kappaflow.projections.follow import FollowerGroup
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.sinks.base import Sink
from kappaflow.projections.sinks.errors import SinkStateLostError
from kappaflow.projections.sinks.postgres import PostgresSink
from kappaflow.projections.sinks.redis import RedisSink
from kappaflow.projections.sinks.search import SearchSink
from tests.projections.join_helpers import DOC_COLS, order_docs, ref_docs
from tests.projections.test_joins import Shop, _diff, _random_batch, _seed, _view, _want

pytestmark = pytest.mark.integration

DOC_SINKS = ("search", "redis")


@pytest.fixture
def drt(spark: Any, pg_dsn: str, search_server: Any, redis_server: Any, tmp_path: Path) -> Iterator[Any]:
    log_dir = tmp_path / "log"
    log = EmbeddedLog(log_dir)
    pg = PostgresSink(pg_dsn)
    rt = Runtime(spark, str(log_dir), pg, dsn=pg_dsn, checkpoint_dir=tmp_path / "ckpt",
                 sinks={"postgres": pg, "search": SearchSink(search_server.url), "redis": RedisSink(redis_server.url)})
    try:
        yield rt, log
    finally:
        rt.close()
        log.close()


def _follow_to_end(rt: Runtime, plan: Any, sink: Sink, end: dict[str, dict[int, int]] | None = None) -> None:
    """One follow batch from the view's stored positions to `end` (default: the log's end)."""
    spec = plan.spec
    live = sink.live(plan.view)
    assert live is not None
    parts = {t: rt.reader().partitions(t) for t in spec.topics}
    start = nest(sink.read_positions(live), spec.topics, parts)
    apply_range(plan, rt, live, start, end or rt.end_offsets(spec.topics), sink=sink)


def _catalog(dsn: str, view: str) -> list[tuple[str, str, Any]]:
    with psycopg.connect(dsn) as conn:
        return [tuple(r) for r in conn.execute(
            "SELECT sink, build, positions FROM kappaflow.join_builds WHERE view = %s ORDER BY sink, build",
            (view,)).fetchall()]


@pytest.mark.timeout(1200)
def test_search_and_redis_joined_views_equal_reference_and_fresh_replay(drt: Any) -> None:
    rt, log = drt
    source = "d" + uuid.uuid4().hex[:7]
    shop = Shop(log, source)
    _seed(shop)
    docs = order_docs(source, sinks=DOC_SINKS)
    spec = as_spec(docs)
    res = replay(docs, rt)
    assert sorted(res.sinks) == sorted(DOC_SINKS)
    plan = prepare(spec, rt)
    for s in DOC_SINKS:
        assert _view(rt, docs, DOC_COLS, s) == _want(ref_docs(shop.rows), DOC_COLS), s
    w = shop.w
    steps = [
        lambda: w["customers"].update((1,), {"name": "renamed"}),  # fan-out
        lambda: w["categories"].update((2,), {"name": "cat2b"}),  # fan-out through the chain
        lambda: (w["orders"].insert({"id": 9, "customer_id": 7, "product_id": 9, "amount": None, "status": "new"}),
                 w["customers"].delete((2,))),  # a row whose customer and product come later; a deleted customer
        lambda: (w["customers"].insert({"id": 7, "name": "late", "city": "Bern"}),
                 w["products"].insert({"id": 9, "title": "late product", "category_id": 2, "added": None})),
    ]
    rnd = random.Random(1129)
    history: list[str] = []
    for step in range(1, len(steps) + 4):
        if step <= len(steps):
            steps[step - 1]()
            shop.flush()
            history.append(f"step {step}")
        else:  # several random changes on every table folded in one batch
            history += [_random_batch(shop, rnd, 10 * step + i) for i in range(3)]
        for s in DOC_SINKS:
            _follow_to_end(rt, plan, rt.sinks[s])
        want = _want(ref_docs(shop.rows), DOC_COLS)
        for s in DOC_SINKS:
            got = _view(rt, docs, DOC_COLS, s)
            assert got == want, f"{s} after {history}: {_diff(got, want)}"
    # a follower takes over from the stored positions
    group = FollowerGroup(docs, rt, trigger="0.2s").start()
    try:
        w["customers"].update(min(shop.rows["customers"]), {"name": "again"})
        w["orders"].delete(min(shop.rows["orders"]))
        shop.flush()
        assert group.wait_for(lambda g: g.caught_up(), 180), "the followers did not catch up"
    finally:
        group.stop()
    followed = {s: _view(rt, docs, DOC_COLS, s) for s in DOC_SINKS}
    for s, rows in followed.items():
        assert rows == _want(ref_docs(shop.rows), DOC_COLS), s
    old = {(k, b) for k, b, _ in _catalog(rt.dsn, plan.view.name)}
    replay(docs, rt)
    for s, rows in followed.items():
        assert _view(rt, docs, DOC_COLS, s) == rows, f"{s}: a fresh replay differs from the followed view"
    entries = _catalog(rt.dsn, plan.view.name)
    assert sorted(k for k, _, _ in entries) == sorted(DOC_SINKS), entries  # one state per view: the live build's
    assert not old & {(k, b) for k, b, _ in entries}, "the swapped-out builds kept their join state"
    for s in DOC_SINKS:
        live = rt.sinks[s].live(plan.view)
        assert live is not None
        assert rt.sinks[s].build_of(live) in {b for k, b, _ in entries if k == s}


def _crashing(base: type[Sink], url: str, where: str) -> Sink:
    """A real store's sink that dies at `where` in a batch: ``rows`` before writing any row, ``half``
    after half of them, ``positions`` after every row but before the positions."""

    class Crashing(base):  # type: ignore[valid-type, misc]
        def write(self, target: Any, batch: Any, positions: Any = None) -> Any:
            if where == "rows":
                raise SinkError("injected crash before the rows", retry=Retry.TERMINAL)
            if where == "half":
                super().write(target, batch.slice(0, batch.num_rows // 2), positions)
                raise SinkError("injected crash after half the rows", retry=Retry.TERMINAL)
            return super().write(target, batch, positions)

        def store_positions(self, target: Any, positions: Any) -> None:
            raise SinkError("injected crash before the positions", retry=Retry.TERMINAL)

    return Crashing(url)


@pytest.mark.timeout(1200)
def test_crash_between_state_commit_and_store_write_converges(
    drt: Any, search_server: Any, redis_server: Any
) -> None:
    rt, log = drt
    source = "c" + uuid.uuid4().hex[:7]
    shop = Shop(log, source)
    _seed(shop)
    for o in range(20, 60):
        shop.w["orders"].insert({"id": o, "customer_id": 1, "product_id": 1, "amount": None, "status": "new"})
    shop.flush()
    docs = order_docs(source, sinks=DOC_SINKS)
    spec = as_spec(docs)
    replay(docs, rt)
    plan = prepare(spec, rt)
    urls = {"search": (SearchSink, search_server.url), "redis": (RedisSink, redis_server.url)}
    w = shop.w
    trials = [("search", "half"), ("redis", "half"), ("search", "positions"), ("redis", "rows")]
    for trial, (s, where) in enumerate(trials):
        w["customers"].update((1,), {"name": f"hub{trial}"})  # 40+ documents to rewrite
        w["orders"].update((20 + trial,), {"customer_id": 2})  # a moved order
        shop.flush()
        mid = rt.end_offsets(spec.topics)  # where the re-run's first batch stops
        w["products"].update((1,), {"title": f"t{trial}"})  # fan-out again
        w["customers"].delete((3,) if trial == 0 else (7 + trial,))  # a seeded one, then last trial's late one
        w["orders"].insert({"id": 100 + trial, "customer_id": 8 + trial, "product_id": 1, "amount": None,
                            "status": "new"})
        w["customers"].insert({"id": 8 + trial, "name": "late", "city": None})
        shop.flush()
        want = _want(ref_docs(shop.rows), DOC_COLS)
        sink = rt.sinks[s]
        live = sink.live(plan.view)
        assert live is not None
        stored = sink.read_positions(live)
        klass, url = urls[s]
        crashing = _crashing(klass, url, where)
        try:
            with pytest.raises(SinkError, match="injected crash"):
                _follow_to_end(rt, plan, crashing)
        finally:
            crashing.close()
        assert sink.read_positions(live) == stored, f"{s}/{where}: positions moved"
        (state_pos,) = [p for k, b, p in _catalog(rt.dsn, plan.view.name) if k == s]
        folded = {(t, int(p)): int(o) for t, p, o in state_pos}
        assert sum(folded.values()) > sum(stored.values()), f"{s}/{where}: the state did not commit first"
        _follow_to_end(rt, plan, sink, mid)  # the state is ahead of this batch
        _follow_to_end(rt, plan, sink)
        got = _view(rt, docs, DOC_COLS, s)
        assert got == want, f"{s} after a crash at {where}: {_diff(got, want)}"
    # a join state behind the store's positions is lost state: the view is rebuilt, never written from it
    with psycopg.connect(rt.dsn, autocommit=True) as conn:
        conn.execute("UPDATE kappaflow.join_builds SET positions = '[]' WHERE view = %s AND sink = 'search'",
                     (plan.view.name,))
    w["customers"].update((1,), {"name": "after the restore"})
    shop.flush()
    with pytest.raises(SinkStateLostError, match="behind the view's positions"):
        _follow_to_end(rt, plan, rt.sinks["search"])
    _follow_to_end(rt, plan, rt.sinks["redis"])
    replay(docs, rt)
    want = _want(ref_docs(shop.rows), DOC_COLS)
    for s in DOC_SINKS:
        assert _view(rt, docs, DOC_COLS, s) == want, s
    assert flatten(rt.end_offsets(spec.topics)) == rt.sinks["search"].read_positions(
        rt.sinks["search"].live(plan.view))  # type: ignore[arg-type]
