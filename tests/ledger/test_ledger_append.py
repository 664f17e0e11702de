"""Ledger API on a real PostgreSQL: appends, expected versions, multi-stream atomicity,
idempotency, reads, typed events with upcasting, a custom schema."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import psycopg
import pytest
from pydantic import BaseModel

from kappaflow.ledger import (
    EventRegistry,
    ExpectedVersion,
    IdempotencyKeyReusedError,
    InvalidAppendError,
    Ledger,
    NewEvent,
    StreamAppend,
    StreamTypeMismatchError,
    UnknownEventTypeError,
    UpcastError,
    WrongExpectedVersionError,
    install,
)

pytestmark = pytest.mark.integration


def ev(n: int = 0, kind: str = "Noted") -> NewEvent:
    return NewEvent(kind, {"n": n})


def test_append_returns_dense_global_positions_and_versions(ledger: Ledger) -> None:
    r1 = ledger.append("order-1", [ev(1), ev(2)])
    r2 = ledger.append("order-2", [ev(3)])
    r3 = ledger.append("order-1", [ev(4)])
    assert (r1.first_position, r1.position, r1.versions) == (1, 2, {"order-1": 2})
    assert (r2.first_position, r2.position, r2.versions) == (3, 3, {"order-2": 1})
    assert (r3.position, r3.versions) == (4, {"order-1": 3})
    assert not r1.duplicate
    assert r1.recorded_at <= r2.recorded_at <= r3.recorded_at

    stream = ledger.read_stream("order-1")
    assert [(e.stream_version, e.position, e.data["n"]) for e in stream] == [(1, 1, 1), (2, 2, 2), (3, 4, 4)]
    assert stream[0].stream_type == "order" and stream[0].event_type == "Noted"
    assert [e.position for e in ledger.read_all()] == [1, 2, 3, 4]
    assert [e.position for e in ledger.read_all(from_position=3, limit=1)] == [3]
    assert [e.stream_version for e in ledger.read_stream("order-1", from_version=2, limit=1)] == [2]
    assert [e.position for e in ledger.read_all(stream_types=["nope"])] == []
    assert ledger.stream_version("order-1") == 3
    assert ledger.stream_version("order-404") == 0
    assert ledger.head().position == 4
    assert ledger.verify().ok


def test_expected_version_semantics(ledger: Ledger) -> None:
    ledger.append("s-1", [ev()], ExpectedVersion.NO_STREAM)
    with pytest.raises(WrongExpectedVersionError) as err:
        ledger.append("s-1", [ev()], ExpectedVersion.NO_STREAM)
    assert (err.value.stream_id, err.value.expected, err.value.actual) == ("s-1", ExpectedVersion.NO_STREAM, 1)
    assert "expected no stream, found version 1" in str(err.value)

    ledger.append("s-1", [ev()], ExpectedVersion.STREAM_EXISTS)
    with pytest.raises(WrongExpectedVersionError, match="expected an existing stream, found version 0"):
        ledger.append("s-2", [ev()], ExpectedVersion.STREAM_EXISTS)
    ledger.append("s-1", [ev()], 2)
    with pytest.raises(WrongExpectedVersionError) as err:
        ledger.append("s-1", [ev()], 2)
    assert (err.value.expected, err.value.actual) == (2, 3)
    ledger.append("s-1", [ev()], "any")
    ledger.append("s-3", [ev()], 0)  # 0 == no events yet
    ledger.append("s-3", [ev()], "1")
    assert ledger.stream_version("s-1") == 4
    assert ledger.stream_version("s-2") == 0  # the failed append created nothing
    assert ledger.stream_version("s-3") == 2


def test_multi_stream_append_is_all_or_nothing(ledger: Ledger) -> None:
    ledger.append("acct-a", [ev(1)])
    ledger.append("acct-b", [ev(2)])
    r = ledger.append_many([StreamAppend("acct-a", [ev(3)], 1), StreamAppend("acct-b", [ev(4), ev(5)], 1),
                            StreamAppend("acct-c", [ev(6)], ExpectedVersion.NO_STREAM)])
    assert r.versions == {"acct-a": 2, "acct-b": 3, "acct-c": 1}
    assert (r.first_position, r.position) == (3, 6)
    head = ledger.head().position
    with pytest.raises(WrongExpectedVersionError) as err:
        ledger.append_many([StreamAppend("acct-a", [ev(7)], 2), StreamAppend("acct-b", [ev(8)], 1),
                            StreamAppend("acct-d", [ev(9)])])
    assert err.value.stream_id == "acct-b"
    assert ledger.head().position == head
    assert ledger.stream_version("acct-a") == 2
    assert ledger.stream_version("acct-d") == 0
    assert ledger.verify().ok


def test_stream_type_defaults_to_category_and_must_match(ledger: Ledger) -> None:
    ledger.append("cart-9", [ev()])
    ledger.append("plain", [ev()])
    ledger.append("x-1", [ev()], stream_type="custom")
    assert ledger.read_stream("cart-9")[0].stream_type == "cart"
    assert ledger.read_stream("plain")[0].stream_type == "plain"
    with pytest.raises(StreamTypeMismatchError, match="has type 'custom'"):
        ledger.append("x-1", [ev()], stream_type="other")
    assert [e.stream_id for e in ledger.read_all(stream_types=["custom"])] == ["x-1"]


def test_idempotent_append_returns_original_and_writes_nothing(ledger: Ledger) -> None:
    parts = [StreamAppend("acct-1", [ev(1)]), StreamAppend("acct-2", [ev(2)])]
    first = ledger.append_many(parts, idempotency_key="transfer-1")
    ledger.append("acct-1", [ev(3)])
    again = ledger.append_many(parts, idempotency_key="transfer-1")
    assert again.duplicate and not first.duplicate
    assert (again.first_position, again.position, again.versions) == (first.first_position, first.position,
                                                                        first.versions)
    assert again.recorded_at == first.recorded_at
    assert ledger.head().position == 3
    assert [e.idempotency_key for e in ledger.read_all()] == ["transfer-1", "transfer-1", None]
    with pytest.raises(IdempotencyKeyReusedError) as err:
        ledger.append("acct-1", [ev(99)], idempotency_key="transfer-1")
    assert err.value.field == "idempotency_key"
    # A failed append does not consume its key.
    with pytest.raises(WrongExpectedVersionError):
        ledger.append("acct-1", [ev(4)], 0, idempotency_key="k2")
    assert not ledger.append("acct-1", [ev(4)], 2, idempotency_key="k2").duplicate
    assert ledger.verify().ok


def test_append_inside_caller_transaction(ledger: Ledger, ledger_dsn: str) -> None:
    with psycopg.connect(ledger_dsn) as conn:
        r = ledger.append("outbox-1", [ev(1)], connection=conn)
        assert ledger.read_all() == []  # not committed yet
        conn.commit()
    assert [e.position for e in ledger.read_all()] == [r.position]
    with psycopg.connect(ledger_dsn) as conn:
        ledger.append("outbox-1", [ev(2)], connection=conn)
        conn.rollback()
    assert ledger.stream_version("outbox-1") == 1
    assert ledger.verify().ok


# --- typed events -----------------------------------------------------------

class Opened(BaseModel):
    owner: str
    currency: str


@dataclasses.dataclass
class Deposited:
    amount: int
    note: str = ""


def make_registry() -> EventRegistry:
    reg = EventRegistry()
    reg.register(Opened, name="AccountOpened", version=3)
    reg.register(Deposited)

    @reg.upcaster("AccountOpened", 1)
    def v1(d: dict[str, Any]) -> dict[str, Any]:  # v1 had "name"
        return {"owner": d.pop("name"), **d}

    @reg.upcaster("AccountOpened", 2)
    def v2(d: dict[str, Any]) -> dict[str, Any]:  # v2 had no currency
        return {**d, "currency": "EUR"}

    return reg


def test_typed_events_and_upcasting(ledger_dsn: str) -> None:
    reg = make_registry()
    with Ledger(ledger_dsn, registry=reg) as led:
        led.append("account-1", [Opened(owner="ann", currency="USD"), Deposited(amount=5)])
        led.append("account-2", [NewEvent("AccountOpened", {"name": "bob"}, schema_version=1)])
        led.append("account-3", [NewEvent("AccountOpened", {"owner": "cy"}, schema_version=2)])
        events = led.read_all()
        assert [e.event for e in events] == [Opened(owner="ann", currency="USD"), Deposited(amount=5),
                                             Opened(owner="bob", currency="EUR"),
                                             Opened(owner="cy", currency="EUR")]
        assert events[0].schema_version == 3 and events[2].schema_version == 1
        assert events[2].data == {"name": "bob"}  # stored shape is never rewritten

        with pytest.raises(UnknownEventTypeError, match=r"events\[0\]\.type: event type 'Nope'"):
            led.append("account-1", [NewEvent("Nope", {})])

    # A reader that lacks an upcaster or the type says so, naming the position.
    partial = EventRegistry()
    partial.register(Opened, name="AccountOpened", version=3)
    with Ledger(ledger_dsn, registry=partial) as led:
        with pytest.raises(UpcastError, match=r"position 3: no upcaster from schema version 1 to 2"):
            led.read_stream("account-2")
        with pytest.raises(UnknownEventTypeError, match="'Deposited' at position 2"):
            led.read_all()
        assert led.read_all(decode=False)[1].event is None


def test_custom_schema_is_quoted(pg_dsn: str) -> None:
    schema = 'Ledger "Q" 1'
    install(pg_dsn, schema)
    with Ledger(pg_dsn, schema=schema) as led:
        led.append("a-1", [ev()])
        assert led.read_all()[0].stream_id == "a-1"
        assert led.verify().ok
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("select count(*) from \"Ledger \"\"Q\"\" 1\".events").fetchone() == (1,)


def test_retry_with_a_newer_expected_version_is_the_same_request(ledger: Ledger) -> None:
    """After an unknown outcome a client re-reads and retries: the key still wins."""
    first = ledger.append("acct-1", [ev(1)], 0, idempotency_key="op-1")
    retry = ledger.append("acct-1", [ev(1)], 1, idempotency_key="op-1")
    assert retry.duplicate and retry.position == first.position
    looked_up = ledger.idempotent_result("op-1")
    assert looked_up is not None and looked_up.position == first.position and looked_up.versions == {"acct-1": 1}
    assert ledger.idempotent_result("op-404") is None


def test_log_mapping_topic_key_value(ledger: Ledger) -> None:
    from kappaflow.ledger.logmap import POSITION_HEADER, event_value, ledger_topic, to_log_record

    ledger.append("bank account-1", [NewEvent("Opened", {"owner": "ann"})], stream_type="bank account")
    rec = ledger.read_all(hashes=True)[0]
    topic, record = to_log_record("bank", rec)
    assert topic == "bank.bank_account" == ledger_topic("bank", "bank account")
    assert record.key == b"bank account-1"
    assert dict(record.headers)[POSITION_HEADER] == b"1"
    value = orjson.loads(record.value or b"")
    assert value["data"] == {"owner": "ann"} and value["stream_version"] == 1 and value["hash"] == rec.hash.hex()
    assert record.timestamp_ms == int(rec.recorded_at.timestamp() * 1000)
    # the same value from a row as the PostgreSQL connector decodes it (JSON as text, bytes as base64)
    import base64

    row = {"position": 1, "stream_id": rec.stream_id, "stream_type": rec.stream_type, "stream_version": 1,
           "event_type": "Opened", "schema_version": 1, "payload": '{"owner": "ann"}', "metadata": "{}",
           "recorded_at": rec.recorded_at, "hash": base64.b64encode(rec.hash).decode()}
    assert event_value(row) == value


def test_load_events_gives_typed_version_pairs_for_folding(ledger_dsn: str) -> None:
    """The lean catch-up read a command handler makes: (stream_version, event), upcast, from a version."""
    with Ledger(ledger_dsn, registry=make_registry()) as led:
        led.append("account-1", [NewEvent("AccountOpened", {"name": "ann"}, schema_version=1),
                                 Deposited(amount=5), Deposited(amount=7, note="x")])
        led.append("account-2", [Deposited(amount=1)])
        assert led.load_events("account-1") == [(1, Opened(owner="ann", currency="EUR")), (2, Deposited(amount=5)),
                                                (3, Deposited(amount=7, note="x"))]
        assert led.load_events("account-1", from_version=3) == [(3, Deposited(amount=7, note="x"))]
        assert led.load_events("account-1", from_version=4) == []
        assert led.load_events("account-9") == []
        with pytest.raises(InvalidAppendError, match="from_version"):
            led.load_events("account-1", from_version=0)
    with Ledger(ledger_dsn) as led:  # no registry: the stored JSON, not upcast
        assert led.load_events("account-1", from_version=1)[0] == (1, {"name": "ann"})
    partial = EventRegistry()
    partial.register(Opened, name="AccountOpened", version=3)
    with Ledger(ledger_dsn, registry=partial) as led:  # a reader lacking an upcaster or a type says so
        with pytest.raises(UpcastError, match="position 1: no upcaster from schema version 1 to 2"):
            led.load_events("account-1")
        with pytest.raises(UnknownEventTypeError, match="'Deposited' at position 4"):
            led.load_events("account-2")
