"""The shop's projections (see the package docstring)."""

from __future__ import annotations

from typing import Any

from kappaflow.projections import Count, Event, Max, Projection, Sum


class CustomerTotals(Projection):
    """Per customer: number of orders, total amount, last order time (cancelled orders excluded).

    Retraction-aware: an order moved to another customer moves its amount, a cancelled or
    deleted order stops counting.
    """

    name = "customer_totals"
    sources = ["shop.public.orders"]
    key = ["customer_id"]
    where = "status <> 'cancelled'"
    aggregates = {
        "orders": Count(),
        "total_amount": Sum("amount"),
        "last_order_at": Max("created_at"),
    }


class Customers(Projection):
    """The current row of every customer, with the e-mail domain derived."""

    name = "customers_view"
    sources = ["shop.public.customers"]
    key = ["id"]
    columns = ["id", "name", "email", "city"]
    derive = {"email_domain": "lower(substring_index(email, '@', -1))"}


class CustomerActivity(Projection):
    """A custom fold: how many changes each order went through and its last status."""

    name = "order_activity"
    sources = ["shop.public.orders"]
    key = ["id"]
    schema = "id bigint, customer_id bigint, changes bigint, last_status string"

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        if event.op == "d":
            return None
        after = event.after or {}
        changes = (row["changes"] if row else 0) + 1
        return {"customer_id": after.get("customer_id"), "changes": changes, "last_status": after.get("status")}
