"""Ledger test fixtures: a database with the ledger installed, cloned from a template per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql


@pytest.fixture(scope="session")
def ledger_template(pg_server: Any) -> Iterator[str]:
    """A database with the ledger migrations applied, used as CREATE DATABASE ... TEMPLATE."""
    from kappaflow.ledger import install

    name = f"ledger_tpl_{uuid.uuid4().hex[:8]}"
    dsn = pg_server.create_database(name)
    install(dsn)
    try:
        yield name
    finally:
        pg_server.drop_database(name)


@pytest.fixture
def ledger_dsn(pg_server: Any, ledger_template: str) -> Iterator[str]:
    """A fresh database with the ledger installed (schema kappaflow_ledger)."""
    name = f"t_ledger_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(ledger_template)))
    try:
        yield pg_server.dsn(name)
    finally:
        pg_server.drop_database(name)


@pytest.fixture
def ledger(ledger_dsn: str) -> Iterator[Any]:
    from kappaflow.ledger import Ledger

    with Ledger(ledger_dsn) as led:
        yield led

