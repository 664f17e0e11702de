"""A view column keeps its source column's type in every fold kind (issue 13 item 11).

Regression: a custom fold's ``timestamp`` became ``timestamptz`` in the view (Spark reads
``timestamp`` in DDL as ``timestamp_ltz``) while a grouped ``Max`` of the same source column
stayed ``timestamp``. The rule now: ``timestamp`` in a declared ``schema`` is a timestamp
without time zone, as the source's and PostgreSQL's ``timestamp``; ``timestamp_ltz`` is one with
time zone (``timestamptz``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from kappaflow.errors import ConfigError
from kappaflow.events import Column, FieldType, TableSchema
from kappaflow.projections import Event, Max, Projection
from kappaflow.projections.engine import prepare
from kappaflow.projections.replay import as_spec, replay
from kappaflow.projections.simulate import TableWriter

pytestmark = pytest.mark.integration

SCHEMA = TableSchema(
    "vt.public.visits",
    (
        Column("id", FieldType.INT64, optional=False),
        Column("page", FieldType.STRING),
        Column("at", FieldType.TIMESTAMP),  # PostgreSQL timestamp (without time zone): naive values
        Column("at_tz", FieldType.TIMESTAMPTZ),  # timestamptz: aware values
    ),
    ("id",),
)


class Latest(Projection):
    name = "vt_latest"
    sources = ["vt.public.visits"]
    key = ["id"]


class LastVisit(Projection):
    name = "vt_grouped"
    sources = ["vt.public.visits"]
    key = ["page"]
    aggregates = {"last_at": Max("at"), "last_at_tz": Max("at_tz")}


class LastVisitByHand(Projection):
    name = "vt_custom"
    sources = ["vt.public.visits"]
    key = ["page"]
    schema = "page string, last_at timestamp, last_at_tz timestamp_ltz"

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        r = event.after or {}
        last, last_tz = (row["last_at"], row["last_at_tz"]) if row else (None, None)
        return {
            "last_at": max(x for x in (last, r["at"]) if x is not None),
            "last_at_tz": max(x for x in (last_tz, r["at_tz"]) if x is not None),
        }


def _types(dsn: str, table: str) -> dict[str, str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = %s", (table,)
        ).fetchall()
    return {name: t for name, t in rows}


def _rows(dsn: str, table: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f'SELECT page, last_at, last_at_tz FROM public."{table}" ORDER BY page').fetchall()


def test_a_timestamp_column_is_timestamp_in_every_fold_kind(rt: Any, embedded_log: Any, pg_dsn: str) -> None:
    w = TableWriter(embedded_log, SCHEMA, partitions=2)
    t0 = datetime(2024, 3, 1, 12, 0, 0)
    for i in range(1, 21):
        at = t0 + timedelta(minutes=7 * i)
        w.insert({"id": i, "page": f"/p{i % 3}", "at": at, "at_tz": at.replace(tzinfo=UTC) + timedelta(hours=1)})
    w.flush()
    for p in (Latest, LastVisit, LastVisitByHand):
        replay(p, rt)
    naive, aware = "timestamp without time zone", "timestamp with time zone"
    assert {k: v for k, v in _types(pg_dsn, "vt_latest").items() if k.startswith("at")} == {"at": naive,
                                                                                           "at_tz": aware}
    for view in ("vt_grouped", "vt_custom"):
        types = _types(pg_dsn, view)
        assert (types["last_at"], types["last_at_tz"]) == (naive, aware), (view, types)
    assert _rows(pg_dsn, "vt_custom") == _rows(pg_dsn, "vt_grouped")
    assert _rows(pg_dsn, "vt_custom")[0][1] == max(r["at"] for r in w.rows.values() if r["page"] == "/p0")


def test_a_declared_schema_reads_timestamp_without_time_zone(rt: Any, embedded_log: Any) -> None:
    """A declarative projection may declare its schema; ``timestamp`` there matches a Max of a
    ``timestamp`` column (it was refused as 'declared timestamp, computed timestamp_ntz')."""
    TableWriter(embedded_log, SCHEMA, partitions=1).flush()

    class Declared(LastVisit):
        name = "vt_declared"
        schema = "page string, last_at timestamp, last_at_tz timestamp_ltz"

    plan = prepare(as_spec(Declared), rt)
    assert [c.type.simpleString() for c in plan.view.columns] == ["string", "timestamp_ntz", "timestamp"]

    class Tz(LastVisitByHand):
        name = "vt_tz"
        schema = "page string, last_at timestamptz, last_at_tz timestamp_ltz"

    with pytest.raises(ConfigError, match="timestamp_ltz for a timestamp with time zone"):
        prepare(as_spec(Tz), rt)
