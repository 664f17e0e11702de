"""Helpers for the MySQL/MariaDB connector tests (private MariaDB from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from kappaflow.log.base import Log

TRUNCATE_KEY = b"{}"


def dsn(server: Any, db: str, user: str = "root") -> str:
    return f"mysql://{user}@{server.host}:{server.port}/{db}"


def connector(server: Any, db: str, log: Log, tables: list[str], **kw: Any) -> Any:
    from kappaflow.connectors.mysql.connector import MySQLConnector

    kw.setdefault("partitions", 2)
    kw.setdefault("flush_interval_s", 0.05)
    return MySQLConnector(name=kw.pop("name", "src"), log=log, dsn=dsn(server, db), tables=tables, **kw)


def values(log: Log, topic: str) -> Iterator[Any]:
    """Every record of a topic, partition by partition."""
    for p in range(log.partitions(topic)):
        yield from log.iter_partition(topic, p)


def compacted(log: Log, topic: str) -> dict[bytes, dict[str, Any]]:
    """What compaction would keep: the latest row image per key (tombstones and truncates applied)."""
    out: dict[bytes, dict[str, Any]] = {}
    for rec in values(log, topic):
        if rec.key == TRUNCATE_KEY:
            continue
        if rec.value is None:
            out.pop(rec.key, None)
            continue
        doc = orjson.loads(rec.value)
        if doc["op"] == "d":
            out.pop(rec.key, None)
        else:
            out[rec.key] = doc["after"]
    return out


def events(log: Log, topic: str) -> list[dict[str, Any]]:
    """Value documents (no tombstones), ordered by position."""
    docs = [orjson.loads(r.value) for r in values(log, topic) if r.value is not None]
    return sorted(docs, key=lambda d: _pos_key(d["source"]["kf_pos"]))


def _pos_key(p: dict[str, Any]) -> tuple[int, int, int, int]:
    return (int(p["file"].rsplit(".", 1)[1]), p["pos"], 0 if p["snapshot"] else 1, p["row"])


def table_rows(server: Any, db: str, table: str) -> list[dict[str, Any]]:
    import pymysql.cursors

    conn = pymysql.connect(host=server.host, port=server.port, user="root", password="", database=db,
                           cursorclass=pymysql.cursors.DictCursor)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT * FROM `{table}`")
            return list(cur.fetchall())
    finally:
        conn.close()


class Helpers:
    dsn = staticmethod(dsn)
    connector = staticmethod(connector)
    values = staticmethod(values)
    compacted = staticmethod(compacted)
    events = staticmethod(events)
    table_rows = staticmethod(table_rows)


@pytest.fixture
def mh() -> type[Helpers]:
    """The helpers above, for the tests of this folder."""
    return Helpers

