"""Projections for the many-projections runtime tests (``kappaflow follow tests.projections.many_defs``):
three read one topic (a grouped, a latest-row and a custom fold), one reads another topic."""

from __future__ import annotations

from typing import Any

from kappaflow.projections import Count, Event, Max, Projection, Sum

TOPIC_A = "many.public.orders"
TOPIC_B = "manyb.public.orders"


class ManyTotals(Projection):
    name = "many_totals"
    sources = [TOPIC_A]
    key = ["customer_id"]
    where = "status <> 'cancelled'"
    aggregates = {"n": Count(), "total": Sum("amount"), "last": Max("created_at")}


class ManyLatest(Projection):
    name = "many_latest"
    sources = [TOPIC_A]
    key = ["id"]
    derive = {"cents": "cast(amount * 100 as bigint)"}


class ManyChanges(Projection):
    """Counts the changes of each order: a batch applied twice would count them twice."""

    name = "many_changes"
    sources = [TOPIC_A]
    key = ["id"]
    schema = "id bigint, customer_id bigint, changes bigint, last_op string"

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        if event.op == "d":
            return None
        return {"customer_id": event.after["customer_id"], "changes": (row["changes"] if row else 0) + 1,
                "last_op": event.op}


class ManyTotalsB(Projection):
    name = "many_totals_b"
    sources = [TOPIC_B]
    key = ["customer_id"]
    aggregates = {"n": Count(), "total": Sum("amount")}
