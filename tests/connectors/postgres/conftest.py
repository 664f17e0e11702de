"""Fixtures for the PostgreSQL connector tests (helpers live in pg_helpers.py)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest


@pytest.fixture
def source_name() -> str:
    """Unique per test: slots are cluster-wide and the Kafka broker is shared by the session."""
    return f"s{uuid.uuid4().hex[:10]}"


@pytest.fixture
def sql(pg_dsn: str) -> Iterator[Callable[..., Any]]:
    """Run SQL on the test database (autocommit); returns fetched rows when there are any."""
    conn = psycopg.connect(pg_dsn, autocommit=True)

    def run(query: str, params: Any = None) -> Any:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else None

    try:
        yield run
    finally:
        conn.close()
