"""Replay and follow report the log records they read, not the offsets they passed (issue 13, item 24).

After compaction a topic's offsets have gaps: one trial reported 1,993,263 events for a topic
holding 699,402 records, inflating events/s. Here a compacted log is replayed by each fold path
(latest row and grouped: ``latestPerKey`` reads; custom folds: the direct in-place read and the
sorted read), and followed from the start, and each reports exactly the records the log holds.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from kappaflow.projections import Count, Event, Projection, Source, Sum
from kappaflow.projections.follow import Follower
from kappaflow.projections.replay import replay
from kappaflow.projections.simulate import TableWriter
from tests.projections.pj_helpers import orders_schema

pytestmark = pytest.mark.integration


def _records(log: Any, topic: str) -> int:
    return sum(1 for p in range(log.partitions(topic)) for _ in log.iter_partition(topic, p))


def _projections(topic: str) -> list[type[Projection]]:
    tag = uuid.uuid4().hex[:8]

    def count_orders(self: Any, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        n = (row["n"] if row else 0) + (-1 if event.op == "d" else 1 if event.op in ("c", "r") else 0)
        return {"n": n} if n else None

    def changes(self: Any, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        return None if event.op == "d" else {"changes": (row["changes"] if row else 0) + 1}

    return [
        type("Latest", (Projection,), {"name": f"cnt_latest_{tag}", "sources": [topic], "key": ["id"]}),
        type("Grouped", (Projection,), {"name": f"cnt_grouped_{tag}", "sources": [topic], "key": ["customer_id"],
                                        "aggregates": {"n": Count(), "total": Sum("amount")}}),
        type("InPlace", (Projection,), {"name": f"cnt_inplace_{tag}", "sources": [topic], "key": ["id"],
                                        "schema": "id bigint, changes bigint", "apply": changes}),
        type("Sorted", (Projection,), {"name": f"cnt_sorted_{tag}", "key": ["customer_id"],
                                       "sources": [Source(topic, key={"customer_id": "customer_id"})],
                                       "schema": "customer_id bigint, n bigint", "apply": count_orders}),
    ]


def test_replay_and_follow_count_records_read_after_compaction(rt: Any, embedded_log: Any) -> None:
    from decimal import Decimal

    w = TableWriter(embedded_log, orders_schema("cnt"), partitions=2)
    for i in range(120):
        w.insert({"id": i, "customer_id": i % 7, "amount": Decimal("1.00"), "status": "new", "created_at": None})
    for r in range(4):
        for i in range(120):
            w.update((i,), {"amount": Decimal(f"{r + 2}.00")})
    for i in range(10):
        w.delete((i,))
    w.flush()
    topic = w.topic
    span = sum(embedded_log.end_offsets(topic).values())
    embedded_log.compact(topic)
    held = _records(embedded_log, topic)
    assert held < span / 3, (held, span)  # the test is only meaningful with large gaps

    projections = _projections(topic)
    for proj in projections:
        res = replay(proj, rt)
        assert res.events == held, f"{proj.__name__}: reported {res.events} events, the log holds {held} (span {span})"

    # a follower of a view never built reads the compacted log from the start, then new changes
    fresh = type("Followed", (Projection,), {"name": f"cnt_follow_{uuid.uuid4().hex[:8]}", "sources": [topic],
                                             "key": ["id"]})
    for i in range(120, 125):
        w.insert({"id": i, "customer_id": 1, "amount": Decimal("1.00"), "status": "new", "created_at": None})
    w.flush()
    f = Follower(fresh, rt, trigger="0.2s").start()
    try:
        assert f.wait_for(lambda s: f.caught_up(), timeout=120), "the follower did not catch up"
        assert f.stats.events == held + 5, (f.stats.events, held + 5, span)
    finally:
        f.stop()
