"""Tables, projections and a plain-Python reference for the join tests (no fixtures)."""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

from kappaflow.events import Column, FieldType, TableSchema
from kappaflow.projections import Count, Lookup, Projection, Sum


def schemas(source: str) -> dict[str, TableSchema]:
    t = f"{source}.public."
    return {
        "customers": TableSchema(t + "customers", (
            Column("id", FieldType.INT64, optional=False), Column("name", FieldType.STRING),
            Column("city", FieldType.STRING)), ("id",)),
        "categories": TableSchema(t + "categories", (
            Column("id", FieldType.INT32, optional=False), Column("name", FieldType.STRING)), ("id",)),
        "products": TableSchema(t + "products", (
            Column("id", FieldType.INT64, optional=False), Column("title", FieldType.STRING),
            Column("category_id", FieldType.INT64), Column("added", FieldType.TIMESTAMPTZ)), ("id",)),
        "orders": TableSchema(t + "orders", (
            Column("id", FieldType.INT64, optional=False), Column("customer_id", FieldType.INT64),
            Column("product_id", FieldType.INT32), Column("amount", FieldType.DECIMAL, scale=2, precision=12),
            Column("status", FieldType.STRING)), ("id",)),
    }


def order_docs(source: str, how: str = "left", name: str | None = None,
               sinks: tuple[str, ...] = ("postgres",)) -> type[Projection]:
    """Orders + customer name/city + product title + the product's category name (a chain)."""
    t = f"{source}.public."
    return type("OrderDocs", (Projection,), {
        "name": name or "jd_" + uuid.uuid4().hex[:8], "sources": [t + "orders"], "key": ["id"], "sinks": sinks,
        "derive": {"label": "concat_ws(' / ', customer_name, product_title)"},
        "lookups": [
            Lookup("customer", t + "customers", on={"customer_id": "id"}, columns=["name", "city"], how=how),
            Lookup("product", t + "products", on={"product_id": "id"}, columns=["title", "added"]),
            Lookup("category", t + "categories", on={"category_id": "id"}, via="product", columns=["name"],
                   prefix="cat_"),
        ],
    })


def category_revenue(source: str) -> type[Projection]:
    """Revenue per category over orders joined with products (grouped over a join)."""
    t = f"{source}.public."
    return type("CategoryRevenue", (Projection,), {
        "name": "jr_" + uuid.uuid4().hex[:8], "sources": [t + "orders"], "key": ["product_category_id"],
        "where": "status <> 'cancelled'",
        "lookups": [Lookup("product", t + "products", on={"product_id": "id"}, columns=["category_id"])],
        "aggregates": {"orders": Count(), "revenue": Sum("amount")},
    })


DOC_COLS = ("id", "customer_id", "product_id", "amount", "status", "customer_name", "customer_city",
            "product_title", "product_added", "cat_name", "label")
REV_COLS = ("product_category_id", "orders", "revenue")


def ref_docs(rows: dict[str, dict[tuple[Any, ...], dict[str, Any]]], how: str = "left") -> dict[Any, Any]:
    """The OrderDocs view computed from the tables' current rows."""
    out = {}
    for (oid,), o in rows["orders"].items():
        c = rows["customers"].get((o["customer_id"],)) if o["customer_id"] is not None else None
        p = rows["products"].get((o["product_id"],)) if o["product_id"] is not None else None
        cat = rows["categories"].get((p["category_id"],)) if p and p["category_id"] is not None else None
        if how == "inner" and c is None:
            continue
        name = c["name"] if c else None
        title = p["title"] if p else None
        out[(oid,)] = {
            **{k: o[k] for k in ("id", "customer_id", "product_id", "amount", "status")},
            "customer_name": name, "customer_city": c["city"] if c else None,
            "product_title": title, "product_added": p["added"] if p else None,
            "cat_name": cat["name"] if cat else None,
            "label": " / ".join(v for v in (name, title) if v is not None),
        }
    return out


def ref_revenue(rows: dict[str, dict[tuple[Any, ...], dict[str, Any]]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for o in rows["orders"].values():
        if o["status"] == "cancelled":
            continue
        p = rows["products"].get((o["product_id"],)) if o["product_id"] is not None else None
        cat = p["category_id"] if p else None
        if cat is None:
            continue
        g = out.setdefault((cat,), {"product_category_id": cat, "orders": 0, "revenue": None})
        g["orders"] += 1
        if o["amount"] is not None:
            g["revenue"] = (g["revenue"] or Decimal(0)) + o["amount"]
    return out
