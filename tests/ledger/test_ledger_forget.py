"""Erasure of personal data (crypto-shredding): sealed at rest, in the log and its copies; readable
until the subject is forgotten; unreadable everywhere afterwards -- the ledger, the log, a
replayed view -- while the events, the hash chain and `verify` stay as they were."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

import orjson
import psycopg
import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from kappaflow.config import LedgerSourceConfig
from kappaflow.connectors.ledger import LedgerConnector
from kappaflow.ledger import (
    FORGOTTEN,
    EventRegistry,
    ExpectedVersion,
    Fold,
    InvalidAppendError,
    Ledger,
    LedgerRelay,
    NewEvent,
    Query,
    SubjectForgottenError,
)
from kappaflow.projections import Event, Projection, Source

pytestmark = pytest.mark.integration

E = '"kappaflow_ledger".events'


class CustomerRegistered(BaseModel):
    customer_id: str
    name: str
    email: str
    plan: str


class CustomerMoved(BaseModel):
    customer_id: str
    address: str


def registry() -> EventRegistry:
    reg = EventRegistry(strict=False)
    reg.register(CustomerRegistered, personal=("name", "email"), subject="customer_id",
                 tags={"customer": "customer_id"})
    reg.register(CustomerMoved, personal=["address"], subject="customer_id")
    return reg


def customers(ledger: Ledger) -> None:
    ledger.append("customer-c1", [CustomerRegistered(customer_id="c1", name="Ann Smith", email="ann@example.org",
                                                     plan="gold"), CustomerMoved(customer_id="c1", address="1 Elm St")])
    ledger.append("customer-c2", [CustomerRegistered(customer_id="c2", name="Bob Jones", email="bob@example.org",
                                                     plan="basic")])


PLAINTEXT = (b"Ann Smith", b"ann@example.org", b"Elm St", b"Bob Jones", b"bob@example.org")


def stored_payloads(dsn: str) -> bytes:
    with psycopg.connect(dsn) as conn:
        return b"\n".join(r[0].encode() for r in conn.execute(f"select payload::text from {E} order by position"))


def test_personal_fields_are_sealed_at_rest_and_read_in_clear(ledger_dsn: str) -> None:
    with Ledger(ledger_dsn, registry=registry()) as ledger:
        customers(ledger)
        raw = stored_payloads(ledger_dsn)
        assert not any(p in raw for p in PLAINTEXT) and b'"kf.enc"' in raw and b'"plan": "gold"' in raw
        events = ledger.read_stream("customer-c1")
        assert events[0].event == CustomerRegistered(customer_id="c1", name="Ann Smith", email="ann@example.org",
                                                     plan="gold")
        assert events[1].data == {"customer_id": "c1", "address": "1 Elm St"}
        sealed = ledger.read_stream("customer-c1", decode=False, reveal=False)[0].data
        assert set(sealed["name"]) == {"kf.enc", "kf.subject"} and sealed["name"]["kf.subject"] == "c1"
        assert ledger.verify().ok
        # sealing is deterministic: a retried append with its idempotency key is the same request
        ev = CustomerMoved(customer_id="c2", address="2 Oak Rd")
        first = ledger.append("customer-c2", [ev], 1, idempotency_key="move-1")
        again = ledger.append("customer-c2", [ev], 1, idempotency_key="move-1")
        assert again.duplicate and again.position == first.position


def test_forget_makes_the_data_unreadable_and_keeps_the_chain(ledger_dsn: str) -> None:
    fold = Fold("customer", 1, dict, lambda s: {}, lambda st, v, e: {**st, **e.model_dump()})
    with Ledger(ledger_dsn, registry=registry(), snapshot_every={"customer": 1}) as ledger:
        customers(ledger)
        assert ledger.load("customer-c1", fold).state["name"] == "Ann Smith"  # a snapshot with decrypted state
        head, report = ledger.head(), ledger.verify()
        result = ledger.forget("c1")
        assert not result.already and result.snapshots_dropped >= 1

        c1 = ledger.read_stream("customer-c1")
        assert c1[0].event == CustomerRegistered(customer_id="c1", name=FORGOTTEN, email=FORGOTTEN, plan="gold")
        assert c1[1].event.address == FORGOTTEN
        assert ledger.read_stream("customer-c2")[0].event.name == "Bob Jones"  # others untouched
        assert [e.data["name"] for e in ledger.read_query(Query.where(tags=["customer:c1"])).events] == [FORGOTTEN]
        assert ledger.load_events("customer-c1")[1][1].address == FORGOTTEN
        assert ledger.load("customer-c1", fold).state["name"] == FORGOTTEN  # the snapshot went with the key
        with psycopg.connect(ledger_dsn) as conn:
            assert conn.execute('select count(*) from "kappaflow_ledger".snapshots where state like %s',
                                ("%Ann Smith%",)).fetchone() == (0,)
        # the events and their chain are exactly as before
        assert ledger.head() == head and ledger.verify() == report and report.ok

        assert ledger.forget("c1").already  # twice: harmless
        with pytest.raises(SubjectForgottenError) as err:
            ledger.append("customer-c1", [CustomerMoved(customer_id="c1", address="3 Pine Ave")], 2)
        assert err.value.field == "events" and "subject 'c1' was forgotten" in str(err.value)
        ledger.append("customer-c1", [NewEvent("Closed", {"customer_id": "c1"})], 2)  # nothing personal: fine
        assert ledger.verify().ok


def test_a_forget_racing_appends_for_the_same_subject(ledger_dsn: str) -> None:
    """Appends committed before the forget read as forgotten; appends after it are refused; no
    append slips through with a readable value."""
    with Ledger(ledger_dsn, registry=registry(), pool_size=6) as ledger:
        ledger.append("customer-r", [CustomerMoved(customer_id="r", address="0 Start")])
        stop = threading.Event()
        outcomes: list[str] = []
        errors: list[BaseException] = []

        def mover(w: int) -> None:
            i = 0
            try:
                while not stop.is_set():
                    i += 1
                    try:
                        ledger.append("customer-r", [CustomerMoved(customer_id="r", address=f"{w}-{i} Race St")])
                        outcomes.append("ok")
                    except SubjectForgottenError:
                        outcomes.append("refused")
                        return
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=mover, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        give_up = time.monotonic() + 60
        while outcomes.count("ok") < 20 and not errors:  # the forget lands while appends are in flight
            assert time.monotonic() < give_up, f"the writers made no progress: {outcomes[-5:]}"
            time.sleep(0.01)
        ledger.forget("r")
        for t in threads:
            t.join(60)
        stop.set()
        assert not errors, errors[0]
        assert outcomes.count("refused") == 4 and outcomes.count("ok") >= 20
        events = ledger.read_stream("customer-r")
        assert len(events) == outcomes.count("ok") + 1
        assert {e.event.address for e in events} == {FORGOTTEN}
        assert b"Race St" not in stored_payloads(ledger_dsn)
        assert ledger.verify().ok


def test_cli_forget(ledger_dsn: str) -> None:
    from kappaflow.cli.ledger import app as ledger_cli

    with Ledger(ledger_dsn, registry=registry()) as ledger:
        customers(ledger)
    runner = CliRunner()
    res = runner.invoke(ledger_cli, ["forget", "c2", "--dsn", ledger_dsn])
    assert res.exit_code == 0, res.output
    assert "forgot subject 'c2'" in res.output
    res = runner.invoke(ledger_cli, ["forget", "c2", "--dsn", ledger_dsn, "--json"])
    assert orjson.loads(res.output)["already"] is True
    res = runner.invoke(ledger_cli, ["read", "customer-c2", "--dsn", ledger_dsn])
    line = orjson.loads(res.output.splitlines()[0])
    assert line["data"]["name"] == FORGOTTEN and line["data"]["plan"] == "basic"
    assert runner.invoke(ledger_cli, ["verify", "--dsn", ledger_dsn]).exit_code == 0


class CustomerView(Projection):
    name = "crm_customers"
    sources: ClassVar[Any] = [Source("crm.customer", events=True, key={"customer_id": "stream_id"})]
    key: ClassVar[Any] = ["customer_id"]
    schema = "customer_id string, name string, email string, plan string, address string"

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        e = event.after or {}
        data = e.get("data") or {}
        out = dict(row or {"customer_id": e["stream_id"], "name": None, "email": None, "plan": None,
                           "address": None})
        for k in ("name", "email", "plan", "address"):
            if k in data:
                out[k] = data[k]
        return out


def test_the_log_and_a_replayed_view_after_a_forget(ledger_dsn: str, embedded_log: Any, spark: Any,
                                                    tmp_path: Path) -> None:
    """Through the real ledger source and a real replay: the log only ever holds envelopes (or the
    marker); a replay before the forget shows the data, one after it does not."""
    from kappaflow.projections.replay import replay
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink

    cfg = LedgerSourceConfig(name="crm", dsn=ledger_dsn, slot=f"kf_{uuid.uuid4().hex[:12]}", heartbeat_interval_s=0.5)
    with Ledger(ledger_dsn, registry=registry()) as ledger:
        customers(ledger)
        LedgerConnector(cfg, embedded_log, partitions=2, progress=False).run(until_caught_up=True)
        log_bytes = b"".join(r.value or b"" for p in range(2) for r in embedded_log.iter_partition("crm.customer", p))
        assert b'"kf.enc"' in log_bytes and not any(p in log_bytes for p in PLAINTEXT)

        rt = Runtime(spark, str(embedded_log.path), PostgresSink(ledger_dsn), checkpoint_dir=tmp_path / "ckpt",
                     ledger_keys={"crm.": {"name": "crm", "dsn": ledger_dsn, "schema": "kappaflow_ledger"}})
        try:
            replay(CustomerView, rt)
            view = {r["customer_id"]: r for r in view_rows(ledger_dsn)}
            assert (view["customer-c1"]["name"], view["customer-c1"]["address"]) == ("Ann Smith", "1 Elm St")

            # events appended before the forget but captured after it: the source writes the marker
            ledger.append("customer-c1", [CustomerMoved(customer_id="c1", address="9 Late Ln")], 2)
            ledger.forget("c1")
            LedgerConnector(cfg, embedded_log, partitions=2, progress=False).run(until_caught_up=True)
            recs = [orjson.loads(r.value or b"")
                    for p in range(2) for r in embedded_log.iter_partition("crm.customer", p)]
            late = next(r for r in recs if r["stream_version"] == 3)
            assert late["data"]["address"] == FORGOTTEN
            log_bytes = b"".join(orjson.dumps(r) for r in recs)
            assert b"Late Ln" not in log_bytes and not any(p in log_bytes for p in PLAINTEXT)

            assert view_rows(ledger_dsn)  # the old view still holds its copy until it is replayed (documented)
            replay(CustomerView, rt)
            view = {r["customer_id"]: r for r in view_rows(ledger_dsn)}
            assert (view["customer-c1"]["name"], view["customer-c1"]["email"], view["customer-c1"]["address"]) == \
                (FORGOTTEN, FORGOTTEN, FORGOTTEN)
            assert view["customer-c1"]["plan"] == "gold"
            assert (view["customer-c2"]["name"], view["customer-c2"]["email"]) == ("Bob Jones", "bob@example.org")
        finally:
            rt.close()
        assert ledger.verify().ok


def test_the_relay_writes_what_the_source_writes(ledger_dsn: str, embedded_log: Any) -> None:
    with Ledger(ledger_dsn, registry=registry()) as ledger:
        customers(ledger)
        ledger.forget("c2")
        relay = LedgerRelay(ledger, embedded_log, "crm", partitions=1)
        while relay.run_once():
            pass
    recs = [orjson.loads(r.value or b"") for r in embedded_log.iter_partition("crm.customer", 0)]
    assert [r["data"]["name"] for r in recs if r["stream_id"] == "customer-c2"] == [FORGOTTEN]
    c1 = next(r for r in recs if r["stream_id"] == "customer-c1")
    assert set(c1["data"]["name"]) == {"kf.enc", "kf.subject"}


def view_rows(dsn: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return list(cur.execute('SELECT * FROM public."crm_customers"'))


class Aged(BaseModel):
    customer_id: str
    age: int


def test_bad_personal_declarations_and_events(ledger: Ledger) -> None:
    reg = EventRegistry()
    with pytest.raises(InvalidAppendError) as err:
        reg.register(CustomerMoved, personal=["address"])
    assert err.value.field == "subject" and "declares personal fields ['address'] but no subject" in str(err.value)
    with pytest.raises(InvalidAppendError, match="the subject field 'customer_id' cannot be personal"):
        reg.register(CustomerMoved, personal=["customer_id"], subject="customer_id")
    with pytest.raises(InvalidAppendError) as err:
        reg.register(Aged, personal=["age"], subject="customer_id")
    assert err.value.field == "personal.age" and f"must accept the forgotten marker {FORGOTTEN!r}" in str(err.value)
    with pytest.raises(InvalidAppendError, match="has no field 'adress'"):
        reg.register(CustomerMoved, personal=["adress"], subject="customer_id")
    reg.register(CustomerMoved, personal=["address"], subject="customer_id")
    with Ledger(ledger.dsn, registry=reg) as led:
        with pytest.raises(InvalidAppendError) as err:
            led.append("customer-x", [NewEvent("CustomerMoved", {"address": "1 Elm St"})], ExpectedVersion.ANY)
        assert err.value.field == "events[0].data.customer_id"
        assert "expected the subject of the personal fields ['address']" in str(err.value)
        assert led.head().position == 0
