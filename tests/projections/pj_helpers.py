"""Helpers shared by the projection tests (plain functions, no fixtures)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from kappaflow.events import Column, FieldType, TableSchema


def orders_schema(source: str = "shop") -> TableSchema:
    return TableSchema(
        f"{source}.public.orders",
        (
            Column("id", FieldType.INT64, optional=False),
            Column("customer_id", FieldType.INT64),
            Column("amount", FieldType.DECIMAL, scale=2, precision=12),
            Column("status", FieldType.STRING),
            Column("created_at", FieldType.TIMESTAMPTZ),
        ),
        ("id",),
    )


def log_url(log: Any, kafka_broker: Any = None) -> str:
    path = getattr(log, "path", None)
    if path is not None:
        return str(path)
    return f"kafka://{kafka_broker.bootstrap}"


def view_rows(dsn: str, view: str, columns: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        return conn.execute(f'SELECT {columns} FROM public."{view}" ORDER BY 1').fetchall()


def totals_reference(rows: dict[tuple[Any, ...], dict[str, Any]]) -> list[tuple[Any, ...]]:
    """CustomerTotals computed in plain Python from the table's current rows."""
    acc: dict[int, list[Any]] = {}
    for r in rows.values():
        if r["status"] == "cancelled" or r["customer_id"] is None:
            continue
        a = acc.setdefault(r["customer_id"], [0, Decimal("0"), None, set()])
        a[0] += 1
        a[1] += r["amount"]
        a[2] = r["created_at"] if a[2] is None else max(a[2], r["created_at"])
        a[3].add(r["status"])
    return [(k, v[0], v[1], v[2], sorted(v[3])) for k, v in sorted(acc.items())]
