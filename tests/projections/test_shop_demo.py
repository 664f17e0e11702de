"""The README's main job: the shop example end to end (capture with the PostgreSQL connector)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def test_run_demo_captures_replays_and_moves_totals(pg_server: Any, spark: Any, tmp_path: Path) -> None:
    from examples.shop import run_demo

    lines: list[Any] = []
    res = run_demo(dsn=pg_server.dsn(), workdir=tmp_path, spark=spark, customers=5, orders=30, out=lines.append)
    assert (tmp_path / "kappaflow.toml").exists()
    assert res.captured >= 35 + 2
    assert sum(r["orders"] for r in res.totals) == 30  # the seed has no cancelled orders
    before = {r["customer_id"]: r for r in res.totals}
    after = {r["customer_id"]: r for r in res.totals_after}
    # order 1 moved to another customer and order 2 was cancelled: one order fewer in total
    assert sum(r["orders"] for r in after.values()) == 29
    moved = [c for c in after if after[c]["orders"] != before.get(c, {}).get("orders")]
    assert moved, "no customer total changed"
    assert all(r["name"] for r in res.totals_after)  # joined with the customers view
