"""The append fast path: array literals built by the client, the one-round-trip group commit
(procedure ``append_durable``), idempotency rows written before positions are known."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kappaflow.ledger import ExpectedVersion, Ledger, NewEvent, StreamAppend
from kappaflow.ledger.store import _int_array, _text_array

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pg_conn(pg_server: Any) -> Any:
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        yield conn


# Any text PostgreSQL can store (no NUL), including quotes, backslashes, braces, commas,
# whitespace, "NULL" and non-ASCII.
_texts = st.lists(st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"])), max_size=6)


@settings(max_examples=150, deadline=None)
@given(items=_texts)
def test_text_array_literal_round_trips(pg_conn: Any, items: list[str]) -> None:
    row = pg_conn.execute("select %s::text[]", (_text_array(items),)).fetchone()
    assert row is not None and row[0] == items


def test_int_array_literal(pg_conn: Any) -> None:
    assert pg_conn.execute("select %s::bigint[]", (_int_array([0, -3, 2**62]),)).fetchone() == ([0, -3, 2**62],)
    assert pg_conn.execute("select %s::int[]", (_int_array([]),)).fetchone() == ([],)


def test_group_commit_uses_one_call_and_flushes_a_barrier(ledger: Ledger, ledger_dsn: str) -> None:
    r = ledger.append("order-1", [NewEvent("Noted", {"n": 1})])
    assert (r.first_position, r.position, r.duplicate) == (1, 1, False)
    with psycopg.connect(ledger_dsn) as conn:
        barriers = conn.execute("select count(*), sum(n) from kappaflow_ledger.durability_barrier").fetchone()
        default = conn.execute("show synchronous_commit").fetchone()
    assert barriers is not None and barriers[0] >= 1 and barriers[1] >= 1
    with ledger.connection() as conn:  # the append's asynchronous commit does not leak into the session
        assert conn.execute("show synchronous_commit").fetchone() == default


def test_duplicate_of_a_multi_stream_append_in_unsorted_order(ledger: Ledger) -> None:
    """The idempotency row names the append's FIRST event (stream order as given, not as locked)."""
    ledger.append("acct-0", [NewEvent("Noted", {"n": 0})])
    parts = [StreamAppend("acct-z", [NewEvent("Noted", {"n": 1}), NewEvent("Noted", {"n": 2})]),
             StreamAppend("acct-a", [NewEvent("Noted", {"n": 3})], ExpectedVersion.NO_STREAM)]
    first = ledger.append_many(parts, idempotency_key="t-1")
    assert (first.first_position, first.position) == (2, 4)
    ledger.append("acct-a", [NewEvent("Noted", {"n": 4})])
    again = ledger.append_many(parts, idempotency_key="t-1")
    assert again.duplicate
    assert (again.first_position, again.position, again.versions, again.recorded_at) == (
        first.first_position, first.position, first.versions, first.recorded_at)
    assert ledger.idempotent_result("t-1") == again
    assert [e.stream_id for e in ledger.read_all(from_position=2, limit=3)] == ["acct-z", "acct-z", "acct-a"]


def test_group_commit_off_uses_the_function(ledger_dsn: str) -> None:
    with Ledger(ledger_dsn, group_commit=False) as led:
        r = led.append("order-9", [NewEvent("Noted", {"n": 1})], idempotency_key="k")
        again = led.append("order-9", [NewEvent("Noted", {"n": 1})], idempotency_key="k")
        assert (r.position, again.position, again.duplicate) == (1, 1, True)
        assert led.verify().ok


def test_pool_limits_hands_over_and_drops_unhealthy_connections(ledger_dsn: str) -> None:
    import threading

    from kappaflow.ledger.connection import ConnectionPool
    from kappaflow.ledger.errors import LedgerUnavailableError

    pool = ConnectionPool(ledger_dsn, max_size=2)
    a, b = pool.acquire(), pool.acquire()
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # both connections are out: the third caller waits
    pool.release(a)
    waiter.join(10)
    assert got == [a]  # the released (healthy, idle) connection is handed over
    b.execute("begin")
    pool.release(b)  # inside a transaction: closed, not reused
    assert b.closed
    c = pool.acquire()
    assert c is not b and not c.closed
    pool.release(got[0])
    pool.release(c)
    blocked: list[BaseException] = []
    held: list[Any] = []

    def wait_for_close() -> None:
        try:
            held.extend((pool.acquire(), pool.acquire()))
            pool.acquire()
        except BaseException as exc:
            blocked.append(exc)

    t = threading.Thread(target=wait_for_close)
    t.start()
    t.join(0.2)
    pool.close()
    t.join(10)
    assert not t.is_alive() and isinstance(blocked[0], LedgerUnavailableError)
    for conn in held:
        conn.close()
