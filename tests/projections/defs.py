"""Projection classes used by the tests (a module, so Spark workers can import them)."""

from __future__ import annotations

from typing import Any

from kappaflow.projections import CollectSet, Count, Event, Max, Projection, Sum


def totals(source: str, name: str = "totals") -> type[Projection]:
    class Totals(Projection):
        sources = [f"{source}.public.orders"]
        key = ["customer_id"]
        where = "status <> 'cancelled'"
        aggregates = {"n": Count(), "total": Sum("amount"), "last": Max("created_at"), "statuses": CollectSet("status")}

    Totals.name = name
    return Totals


def accounts(topic: str, name: str = "accounts_view", consistency: str = "transactions",
             sinks: tuple[str, ...] = ("postgres",), sink_options: dict[str, Any] | None = None) -> type[Projection]:
    """The latest row of every account of a bank's accounts table (test_consistent_views.py)."""

    class Accounts(Projection):
        sources = [topic]
        key = ["id"]

    Accounts.name = name
    Accounts.consistency = consistency
    Accounts.sinks = sinks
    Accounts.sink_options = sink_options or {}
    return Accounts


def latest(source: str, name: str = "orders_latest") -> type[Projection]:
    class Latest(Projection):
        sources = [f"{source}.public.orders"]
        key = ["id"]
        derive = {"cents": "cast(amount * 100 as bigint)"}

    Latest.name = name
    return Latest


def custom(source: str, name: str = "order_changes", fail_on: int | None = None) -> type[Projection]:
    class Changes(Projection):
        sources = [f"{source}.public.orders"]
        key = ["id"]
        schema = "id bigint, customer_id bigint, changes bigint, last_op string"

        def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
            if fail_on is not None and event.row is not None and event.row["id"] == fail_on and event.op == "c":
                raise ValueError(f"cannot fold order {fail_on}")
            if event.op == "d":
                return None
            return {
                "customer_id": event.after["customer_id"],
                "changes": (row["changes"] if row else 0) + 1,
                "last_op": event.op,
            }

    Changes.name = name
    return Changes
