"""Bad input is refused before anything is written, with a typed error naming the field."""

from __future__ import annotations

import datetime as dt
import decimal
import uuid
from typing import Any

import pytest
from pydantic import BaseModel

from kappaflow.errors import ValidationError
from kappaflow.ledger import (
    EventRegistry,
    EventTooLargeError,
    ExpectedVersion,
    InvalidAppendError,
    Ledger,
    NewEvent,
    StreamAppend,
    UnknownEventTypeError,
    parse_expected_version,
)
from kappaflow.ledger.errors import LedgerNotInstalledError

pytestmark = pytest.mark.integration


def test_non_json_payload_names_the_field(ledger: Ledger) -> None:
    with pytest.raises(InvalidAppendError) as err:
        bad = {"items": [1, {"amount": decimal.Decimal("1.5")}]}
        ledger.append("a-1", [NewEvent("X", {"ok": 1}), NewEvent("X", bad)])
    assert err.value.field == "events[1].data.items[1].amount"
    assert "Decimal is not JSON-serialisable" in str(err.value)
    assert isinstance(err.value, ValidationError)

    with pytest.raises(InvalidAppendError) as err:
        ledger.append("a-1", [NewEvent("X", {"k": {1: "int key"}})])
    assert err.value.field == "events[0].data.k[1]"
    with pytest.raises(InvalidAppendError) as err:
        ledger.append("a-1", [NewEvent("X", {"big": 2**70})])
    assert err.value.field == "events[0].data.big" and "64-bit" in str(err.value)
    with pytest.raises(InvalidAppendError) as err:
        ledger.append("a-1", [NewEvent("X", {"s": "nul\x00here"})])
    assert err.value.field == "events[0].data.s"
    with pytest.raises(InvalidAppendError) as err:
        ledger.append("a-1", [NewEvent("X", ["not", "an", "object"])])  # type: ignore[arg-type]
    assert err.value.field == "events[0].data"
    with pytest.raises(InvalidAppendError) as err:
        ledger.append("a-1", [NewEvent("X", {})], metadata={"trace": object()})
    assert err.value.field == "events[0].metadata.trace"
    # orjson-native types are fine
    ledger.append("a-1", [NewEvent("X", {"at": dt.datetime(2024, 1, 2, tzinfo=dt.UTC), "id": uuid.UUID(int=1)})])
    assert ledger.read_all()[0].data == {"at": "2024-01-02T00:00:00+00:00", "id": str(uuid.UUID(int=1))}
    assert ledger.head().position == 1


def test_oversized_event_is_refused(ledger_dsn: str) -> None:
    with Ledger(ledger_dsn, max_event_bytes=1000) as led:
        led.append("a-1", [NewEvent("X", {"s": "x" * 900})])
        with pytest.raises(EventTooLargeError) as err:
            led.append("a-1", [NewEvent("X", {}), NewEvent("X", {"s": "x" * 1000})])
        assert err.value.field == "events[1]" and err.value.limit == 1000 and err.value.size > 1000
        assert "max_event_bytes" in str(err.value)
        assert led.head().position == 1
    with Ledger(ledger_dsn) as led, pytest.raises(EventTooLargeError):  # default limit 1 MiB
        led.append("a-1", [NewEvent("X", {"s": "x" * (1024 * 1024)})])


def test_unknown_event_type(ledger_dsn: str) -> None:
    class Registered(BaseModel):
        a: int

    class NotRegistered(BaseModel):
        a: int

    reg = EventRegistry()
    reg.register(Registered)
    with Ledger(ledger_dsn, registry=reg) as led:
        with pytest.raises(UnknownEventTypeError) as err:
            led.append("a-1", [Registered(a=1), NotRegistered(a=2)])
        assert err.value.field == "events[1]" and err.value.event_type.endswith("NotRegistered")
        with pytest.raises(UnknownEventTypeError) as err:
            led.append_many([StreamAppend("a-1", [Registered(a=1)]), StreamAppend("b-1", [NewEvent("Zed", {})])])
        assert err.value.field == "parts[1].events[0].type"
    with Ledger(ledger_dsn) as led:  # no registry: typed objects cannot be encoded
        with pytest.raises(UnknownEventTypeError, match="no EventRegistry"):
            led.append("a-1", [Registered(a=1)])
        assert led.head().position == 0
    lenient = EventRegistry(strict=False)
    with Ledger(ledger_dsn, registry=lenient) as led:
        led.append("a-1", [NewEvent("Zed", {})])


@pytest.mark.parametrize("bad", [-1, -5, "abc", "-3", 1.5, True, None, "", [1], "1.0"])
def test_negative_or_malformed_expected_version(ledger: Ledger, bad: Any) -> None:
    with pytest.raises(InvalidAppendError) as err:
        ledger.append("acct-7", [NewEvent("X", {})], bad)
    assert err.value.field == "expected_version (stream 'acct-7')"
    assert "expected an integer >= 0 or one of any/no_stream/stream_exists" in str(err.value)
    assert ledger.head().position == 0


def test_expected_version_parsing() -> None:
    assert parse_expected_version(ExpectedVersion.NO_STREAM) == -2
    assert parse_expected_version("exists") == -3
    assert parse_expected_version(" Any ") == -1
    assert parse_expected_version("12") == 12
    assert parse_expected_version(0) == 0


@pytest.mark.parametrize(("call", "field"), [
    (lambda led: led.append("", [NewEvent("X", {})]), "stream_id"),
    (lambda led: led.append(5, [NewEvent("X", {})]), "stream_id"),
    (lambda led: led.append("a-1", []), "events (stream 'a-1')"),
    (lambda led: led.append("a-1", NewEvent("X", {})), "events (stream 'a-1')"),
    (lambda led: led.append("a-1", [NewEvent("", {})]), "events[0].type"),
    (lambda led: led.append("a-1", [NewEvent("X", {}, schema_version=0)]), "events[0].schema_version"),
    (lambda led: led.append("a-1", [NewEvent("X", {})], idempotency_key=""), "idempotency_key"),
    (lambda led: led.append("a-1", [NewEvent("X", {})], stream_type=""), "stream_type (stream 'a-1')"),
    (lambda led: led.append_many([]), "parts"),
    (lambda led: led.append_many([StreamAppend("a-1", [NewEvent("X", {})]),
                                  StreamAppend("a-1", [NewEvent("X", {})])]), "stream_id"),
    (lambda led: led.read_all(from_position=0), "from_position"),
    (lambda led: led.read_stream("a-1", from_version=-1), "from_version"),
])
def test_other_bad_arguments_name_the_field(ledger: Ledger, call: Any, field: str) -> None:
    with pytest.raises(InvalidAppendError) as err:
        call(ledger)
    assert err.value.field == field


def test_missing_schema_says_how_to_install(pg_dsn: str) -> None:
    with Ledger(pg_dsn, schema="nowhere") as led, \
            pytest.raises(LedgerNotInstalledError, match="kappaflow ledger install"):
        led.append("a-1", [NewEvent("X", {})])
