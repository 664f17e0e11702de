"""The bank's statement lines with the holder's name as of each event (as-of enrichment, two real captures).

The ledger (account events) and the CRM table ``account_holders`` (the holder's name) live in
PostgreSQL; the ledger connector captures the events into ``bank.account``, the PostgreSQL
connector the CRM table into ``crm.public.account_holders``. Alice is renamed between her
events: her earlier lines keep "Alice", the later ones show "Alice Smith", in the replay and in
a replay after the rename's row changed again (the enrichment never changes afterwards).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from examples.bank.bank import Bank
from examples.bank.events import registry
from examples.bank.projections import AccountStatement
from kappaflow.config import PostgresSourceConfig
from kappaflow.connectors.postgres import PostgresConnector
from kappaflow.ledger import Ledger
from tests.ledger.test_bank_projections import capture, source_config, view_rows

pytestmark = pytest.mark.integration


@pytest.fixture
def rt(spark: Any, embedded_log: Any, ledger_dsn: str, tmp_path: Path) -> Iterator[Any]:
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink

    runtime = Runtime(spark, str(embedded_log.path), PostgresSink(ledger_dsn), checkpoint_dir=tmp_path / "ckpt")
    yield runtime
    runtime.close()


def test_statement_lines_carry_the_holders_name_as_of_each_event(ledger_dsn: str, embedded_log: Any, rt: Any) -> None:
    from kappaflow.projections.replay import replay

    with psycopg.connect(ledger_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE account_holders (stream_id text PRIMARY KEY, name text NOT NULL)")
    crm_cfg = PostgresSourceConfig(
        name="crm",
        dsn=ledger_dsn,
        tables=["public.account_holders"],
        slot=f"kf_{uuid.uuid4().hex[:12]}",
        heartbeat_interval_s=0.5,
    )

    def capture_crm() -> None:
        PostgresConnector(crm_cfg, embedded_log, partitions=2, progress=False).run(until_caught_up=True)

    capture_crm()  # the CRM's history starts here (an empty snapshot); every change below is streamed

    def crm(sql: str, *args: Any) -> None:
        with psycopg.connect(ledger_dsn, autocommit=True) as conn:
            conn.execute(sql, args)

    with Ledger(ledger_dsn, registry=registry) as ledger:
        bank = Bank(ledger)
        crm("INSERT INTO account_holders VALUES ('account-alice', 'Alice'), ('account-bob', 'Bob')")
        bank.open_account("alice", "Alice")
        bank.open_account("bob", "Bob")
        bank.deposit("alice", 1_000)
        bank.transfer("alice", "bob", 200, transfer_id="t-1")
        crm("UPDATE account_holders SET name = 'Alice Smith' WHERE stream_id = 'account-alice'")
        bank.deposit("alice", 300)
        bank.transfer("bob", "alice", 50, transfer_id="t-2")
        last = bank.withdraw("alice", 100)
        # the CRM moves on after the last event (any change, e.g. a heartbeat row): its capture has then
        # passed every event, so none waits
        crm("INSERT INTO account_holders VALUES ('account-carol', 'Carol')")
    capture(source_config(ledger_dsn), embedded_log)
    capture_crm()

    replay(AccountStatement, rt)
    lines = sorted(view_rows(ledger_dsn, "account_statement"), key=lambda r: r["position"])
    assert [r["position"] for r in lines] == list(range(1, last.position + 1))
    alice = [(r["event_type"], r["holder_name"]) for r in lines if r["account"] == "alice"]
    assert alice == [
        ("AccountOpened", "Alice"),
        ("Deposited", "Alice"),
        ("TransferSent", "Alice"),
        ("Deposited", "Alice Smith"),
        ("TransferReceived", "Alice Smith"),
        ("Withdrawn", "Alice Smith"),
    ]
    assert {r["holder_name"] for r in lines if r["account"] == "bob"} == {"Bob"}
    assert sum(r["delta"] for r in lines if r["account"] == "alice") == 1_000 - 200 + 300 + 50 - 100

    # the holders' rows change again (Alice renamed back, Bob deleted): the lines already written keep
    # the names they had, in a replay as well
    crm("UPDATE account_holders SET name = 'Alice' WHERE stream_id = 'account-alice'")
    crm("DELETE FROM account_holders WHERE stream_id = 'account-bob'")
    capture_crm()
    replay(AccountStatement, rt)
    again = sorted(view_rows(ledger_dsn, "account_statement"), key=lambda r: r["position"])
    assert [(r["position"], r["holder_name"]) for r in again] == [(r["position"], r["holder_name"]) for r in lines]
