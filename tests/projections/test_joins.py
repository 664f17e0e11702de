"""Lookups (many-to-one joins): replay, follow with fan-out, load-time errors, a differential test.

The views are compared with a plain-Python join of the tables' current rows
(``join_helpers.ref_docs`` / ``ref_revenue``), written from the semantics in the README's
"Joins" section, and with a fresh replay.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections import Projection
from kappaflow.projections.engine import prepare
from kappaflow.projections.follow import Follower
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.runtime import Runtime
from kappaflow.projections.simulate import TableWriter
from kappaflow.projections.sinks.postgres import PostgresSink
from tests.projections.join_helpers import (
    DOC_COLS,
    REV_COLS,
    category_revenue,
    order_docs,
    ref_docs,
    ref_revenue,
    schemas,
)

pytestmark = pytest.mark.integration

T0 = datetime(2024, 1, 1, tzinfo=UTC)


@pytest.fixture
def jrt(spark: Any, pg_dsn: str, tmp_path: Path) -> Any:
    log_dir = tmp_path / "log"
    log = EmbeddedLog(log_dir)
    rt = Runtime(spark, str(log_dir), PostgresSink(pg_dsn), dsn=pg_dsn, checkpoint_dir=tmp_path / "ckpt")
    try:
        yield rt, log
    finally:
        rt.close()
        log.close()


class Shop:
    """Four tables written to the log, with their current rows for the reference."""

    def __init__(self, log: EmbeddedLog, source: str) -> None:
        self.w = {name: TableWriter(log, s, partitions=2) for name, s in schemas(source).items()}

    @property
    def rows(self) -> dict[str, dict[tuple[Any, ...], dict[str, Any]]]:
        return {n: w.rows for n, w in self.w.items()}

    def flush(self) -> int:
        return sum(w.flush() for w in self.w.values())


def _norm(v: Any) -> Any:
    if isinstance(v, datetime):
        return v.astimezone(UTC)
    return v


def _view(rt: Runtime, proj: type[Projection], cols: tuple[str, ...]) -> dict[tuple[Any, ...], Any]:
    spec = as_spec(proj)
    sink = rt.sink
    live = sink.live(prepare(spec, rt).view)
    assert live is not None, f"{spec.name}: no live view"
    return {tuple(r[k] for k in spec.key): {c: _norm(r.get(c)) for c in cols} for r in sink.scan(live)}


def _want(ref: dict[Any, Any], cols: tuple[str, ...]) -> dict[Any, Any]:
    return {k: {c: _norm(v[c]) for c in cols} for k, v in ref.items()}


def _diff(got: dict[Any, Any], want: dict[Any, Any]) -> str:
    keys = sorted(set(got) | set(want), key=repr)
    return "; ".join(f"{k}: got {got.get(k)} want {want.get(k)}" for k in keys if got.get(k) != want.get(k))


def _wait(f: Follower, timeout: float = 120) -> None:
    assert f.wait_for(lambda s: f.caught_up(), timeout), f"{f.name} did not catch up within {timeout}s"


def _seed(shop: Shop) -> None:
    w = shop.w
    for c in range(1, 4):
        w["customers"].insert({"id": c, "name": f"cust{c}", "city": "Oslo" if c % 2 else "Rome"})
    for g in range(1, 3):
        w["categories"].insert({"id": g, "name": f"cat{g}"})
    for p in range(1, 4):
        w["products"].insert({"id": p, "title": f"prod{p}", "category_id": 1 + p % 2,
                              "added": T0 + timedelta(microseconds=p * 1001)})
    for o in range(1, 7):
        w["orders"].insert({"id": o, "customer_id": 1 + o % 3, "product_id": 1 + o % 3,
                            "amount": Decimal(o * 10) / 4, "status": "new"})
    shop.flush()


def test_replay_then_follow_fan_out_deletes_and_late_rows(jrt: Any) -> None:
    rt, log = jrt
    source = "j" + uuid.uuid4().hex[:7]
    shop = Shop(log, source)
    _seed(shop)
    docs, rev = order_docs(source), category_revenue(source)
    for p in (docs, rev):
        replay(p, rt)
    assert _view(rt, docs, DOC_COLS) == _want(ref_docs(shop.rows), DOC_COLS)
    assert _view(rt, rev, REV_COLS) == _want(ref_revenue(shop.rows), REV_COLS)
    followers = [Follower(p, rt, trigger="0.2s").start() for p in (docs, rev)]
    try:
        w = shop.w
        steps = [
            lambda: w["customers"].update((1,), {"name": "renamed"}),  # fan-out to two orders
            lambda: w["categories"].update((2,), {"name": "cat2b"}),  # fan-out through the chain
            lambda: w["products"].update((2,), {"category_id": 1}),  # a product moves category
            lambda: w["orders"].update((1,), {"customer_id": 3, "product_id": 3}),  # a moved order
            lambda: w["customers"].delete((2,)),  # left: NULLs
            lambda: w["orders"].insert({"id": 9, "customer_id": 7, "product_id": 9, "amount": Decimal("1.5"),
                                        "status": "new"}),  # its customer and product come later
            lambda: w["orders"].update((2,), {"customer_id": None}),  # NULL foreign key
            lambda: (w["customers"].insert({"id": 7, "name": "late", "city": "Bern"}),
                     w["products"].insert({"id": 9, "title": "late product", "category_id": 2, "added": T0})),
            lambda: w["categories"].delete((1,)),
            lambda: w["orders"].delete((3,)),
        ]
        for i, step in enumerate(steps):
            step()
            shop.flush()
            for f in followers:
                _wait(f)
            got, want = _view(rt, docs, DOC_COLS), _want(ref_docs(shop.rows), DOC_COLS)
            assert got == want, f"step {i}: {_diff(got, want)}"
            got, want = _view(rt, rev, REV_COLS), _want(ref_revenue(shop.rows), REV_COLS)
            assert got == want, f"step {i} (revenue): {_diff(got, want)}"
    finally:
        for f in followers:
            f.stop()
    for p, cols in ((docs, DOC_COLS), (rev, REV_COLS)):
        followed = _view(rt, p, cols)
        replay(p, rt)
        assert _view(rt, p, cols) == followed
