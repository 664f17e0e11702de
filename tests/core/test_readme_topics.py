"""The README's topic names are the names capture writes (issue 13 item 25: MySQL's were written nowhere)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kappaflow.config import PostgresSourceConfig
from tests._kill import wait_for

pytestmark = pytest.mark.integration

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _row(kind: str) -> str:
    # the "Topics and keys" table names each source kind with its CLI flag: "| PostgreSQL (`--postgres`) |"
    rows = [ln for ln in README.splitlines() if ln.startswith(f"| {kind} (`--")]
    assert len(rows) == 1, f"README: one 'Topics and keys' row for {kind}, found {rows}"
    return rows[0]


def test_mysql_topic_is_source_database_table(mariadb_server: Any, mariadb_db: str, embedded_log: Any) -> None:
    from kappaflow.connectors.mysql.connector import MySQLConnector

    assert "`<source>.<database>.<table>`" in _row("MySQL/MariaDB")
    mariadb_server.execute("CREATE TABLE orders (id INT PRIMARY KEY)", "INSERT INTO orders VALUES (1)", db=mariadb_db)
    MySQLConnector(name="shop", log=embedded_log, dsn=mariadb_server.dsn(mariadb_db), tables=[f"{mariadb_db}.orders"],
                   partitions=1).run(until_caught_up=True)
    assert f"shop.{mariadb_db}.orders" in embedded_log.list_topics()


def test_postgres_topic_is_source_schema_table(pg_dsn: str, embedded_log: Any) -> None:
    from kappaflow.connectors.postgres.connector import PostgresConnector

    assert "`<source>.<schema>.<table>`" in _row("PostgreSQL")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
    name = "t" + re.sub(r"\W", "", pg_dsn.rsplit("/", 1)[1])[-12:]
    src = PostgresSourceConfig(name=name, dsn=pg_dsn, tables=["public.orders"])
    try:
        PostgresConnector(src, embedded_log, partitions=1, progress=False).run(until_caught_up=True)
        assert f"{name}.public.orders" in embedded_log.list_topics()
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            wait_for(lambda: not conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
                                              (src.slot_name,)).fetchone(), 60, "the capture to release its slot")
            conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                         (src.slot_name,))
