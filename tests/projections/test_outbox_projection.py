"""An outbox topic is an event topic: a custom fold folds it into a PostgreSQL view.

The outbox rows are captured from a real PostgreSQL (inserted and deleted in the same
transaction, the usual outbox pattern), routed to ``outbox.event.order`` like Debezium's outbox
event router does, and folded by ``Source(topic, events=True)``. The README's "Outbox tables"
example (its SQL and its projection) runs here as written.
"""

from __future__ import annotations

import re
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from kappaflow.config import PostgresSourceConfig
from kappaflow.connectors.postgres.connector import PostgresConnector
from kappaflow.projections import Event, Projection, Source
from kappaflow.projections.replay import replay
from tests.projections.pj_helpers import view_rows

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "tests/projections/test_outbox_projection.py"


def readme_block(lang: str) -> str:
    blocks = [b for b in re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), re.S | re.M)
              if MARK in b.splitlines()[0]]
    assert len(blocks) == 1, f"README.md: expected one ```{lang} block marked {MARK!r}, found {len(blocks)}"
    return blocks[0]


class OrderStatus(Projection):
    name = "outbox_order_status"
    sources = [Source("outbox.event.order", events=True, key={"order_id": "order_id"})]
    key = ["order_id"]
    schema = "order_id bigint, status string, events bigint, total bigint"

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        e = event.after or {}
        if e.get("status") == "DELETED":
            return None
        row = dict(row or {"events": 0, "total": 0})
        row["status"] = e["status"]
        row["events"] += 1
        row["total"] += e.get("amount", 0)
        return row


def test_a_custom_fold_folds_an_outbox_topic_into_a_view(rt: Any, embedded_log: Any, pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE outbox (id uuid PRIMARY KEY, aggregatetype text NOT NULL, "
                     "aggregateid text NOT NULL, type text NOT NULL, payload jsonb)")
    name = f"s{uuid.uuid4().hex[:8]}"
    cfg = PostgresSourceConfig(name=name, dsn=pg_dsn, tables=["public.outbox"], heartbeat_interval_s=0.5,
                               outbox={"tables": ["public.outbox"]})
    PostgresConnector(cfg, embedded_log, partitions=3, progress=False).run(until_caught_up=True)
    script = [(1, "CREATED", 10), (2, "CREATED", 5), (1, "PAID", 0), (3, "CREATED", 7), (2, "SHIPPED", 1),
              (3, "DELETED", 0), (1, "SHIPPED", 2)]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for order_id, status, amount in script:
            eid = str(uuid.uuid4())
            with conn.transaction():
                conn.execute("INSERT INTO outbox VALUES (%s, 'order', %s, %s, %s)",
                             (eid, str(order_id), f"Order{status.title()}",
                              orjson.dumps({"order_id": order_id, "status": status, "amount": amount}).decode()))
                conn.execute("DELETE FROM outbox WHERE id = %s", (eid,))
    PostgresConnector(cfg, embedded_log, partitions=3, progress=False).run(until_caught_up=True)
    replay(OrderStatus, rt)
    assert view_rows(pg_dsn, "outbox_order_status", "order_id, status, events, total") == [
        (1, "SHIPPED", 3, 12), (2, "SHIPPED", 2, 6)]


def test_the_readmes_outbox_example(rt: Any, embedded_log: Any, pg_dsn: str) -> None:
    sql = readme_block("sql")
    create, _, writes = sql.partition(";\n")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(create)
    name = f"s{uuid.uuid4().hex[:8]}"
    cfg = PostgresSourceConfig(name=name, dsn=pg_dsn, tables=["public.outbox"], heartbeat_interval_s=0.5,
                               outbox={"tables": ["public.outbox"]})
    PostgresConnector(cfg, embedded_log, partitions=3, progress=False).run(until_caught_up=True)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(writes)
    PostgresConnector(cfg, embedded_log, partitions=3, progress=False).run(until_caught_up=True)
    module = types.ModuleType(f"readme_outbox_{uuid.uuid4().hex[:8]}")
    sys.modules[module.__name__] = module
    try:
        exec(compile(readme_block("python"), "README.md", "exec"), module.__dict__)  # the README's own code
        replay(module.OrderStatus, rt)
    finally:
        sys.modules.pop(module.__name__, None)
    assert view_rows(pg_dsn, "order_status", "order_id, status, events, total") == [
        (1, "PAID", 2, 10), (2, "CREATED", 1, 5)]
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (1,)  # order 2's row was kept
