"""Upgrading a ledger created by an older release: the data stays, verifies, and the new code
appends to it (the hash chain continues across the upgrade)."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from alembic import command

from kappaflow.ledger import (
    AppendCondition,
    AppendConditionFailedError,
    Ledger,
    NewEvent,
    Query,
    WrongExpectedVersionError,
    install,
)
from kappaflow.migrations import alembic_config, current

pytestmark = pytest.mark.integration

# The ledger_0001 call signature, as a client of that release sent it.
V1_APPEND = ("select * from kappaflow_ledger.append(%s::text[], %s::text[], %s::bigint[], %s::bigint[], "
             "%s::int[], %s::text[], %s::int[], %s::text[], %s::text[], %s::text, %s::bytea, false)")


def test_upgrade_from_ledger_0001_keeps_the_chain_and_the_data(pg_server: Any) -> None:
    name = f"t_upgrade_{uuid.uuid4().hex[:8]}"
    dsn = pg_server.create_database(name)
    try:
        cfg = alembic_config(dsn)
        cfg.attributes["ledger_schema"] = "kappaflow_ledger"
        command.upgrade(cfg, "ledger_0001")
        assert current(dsn) == {"ledger_0001"}
        with psycopg.connect(dsn, autocommit=True) as conn:  # events written by the old release's function
            for i in range(3):
                conn.execute(V1_APPEND, ("{acct-1}", "{acct}", "{-1}", "{1}", "{1}", "{Deposited}", "{1}",
                                         '{"{\\"amount\\": ' + str(i + 1) + '}"}', '{"{}"}', None, None))

        install(dsn)  # to head
        assert "ledger_0001" not in current(dsn)
        with Ledger(dsn) as ledger:
            assert ledger.verify().ok
            assert [e.data["amount"] for e in ledger.read_stream("acct-1")] == [1, 2, 3]
            assert all(e.tags == () for e in ledger.read_all())
            r = ledger.append("acct-1", [NewEvent("Deposited", {"amount": 4}, tags=["acct:1"])], expected_version=3)
            assert r.position == 4
            with pytest.raises(WrongExpectedVersionError):
                ledger.append("acct-1", [NewEvent("Deposited", {"amount": 5})], expected_version=3)
            with pytest.raises(AppendConditionFailedError):
                ledger.append("acct-2", [NewEvent("Opened", {})],
                              condition=AppendCondition(Query.where(tags=["acct:1"]), 3))
            report = ledger.verify()
            assert report.ok and report.checked == 4
    finally:
        pg_server.drop_database(name)
