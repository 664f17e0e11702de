"""Read-your-writes: wait_for_projection against a positions table, and its timeout error."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from kappaflow.errors import ConfigError
from kappaflow.ledger import (
    Ledger,
    LedgerRelay,
    LogProjectionPositions,
    NewEvent,
    PostgresProjectionPositions,
    ProjectionPositions,
    ProjectionTimeoutError,
    wait_for_projection,
)
from kappaflow.ledger.relay import record_position

pytestmark = pytest.mark.integration


@pytest.fixture
def positions_table(ledger_dsn: str) -> str:
    # The shape the projections part owns (kappaflow.projection_positions); created here for the test.
    with psycopg.connect(ledger_dsn, autocommit=True) as conn:
        conn.execute("create schema if not exists kappaflow")
        conn.execute("create table if not exists kappaflow.projection_positions "
                     "(projection text, source text, position bigint, primary key (projection, source))")
    return ledger_dsn


def test_wait_returns_once_the_projection_has_processed_the_position(positions_table: str) -> None:
    dsn = positions_table
    with Ledger(dsn) as ledger, psycopg.connect(dsn, autocommit=True) as conn:
        r = ledger.append("acct-1", [NewEvent("X", {}), NewEvent("X", {})])
        conn.execute("insert into kappaflow.projection_positions values ('balances', 'bank', 1)")
        with pytest.raises(ProjectionTimeoutError) as err:
            wait_for_projection(dsn, "balances", r.position, timeout=0.2)
        assert (err.value.projection, err.value.position, err.value.reached) == ("balances", 2, 1)
        assert "projection 'balances' did not reach ledger position 2 within 0.2 s (processed up to position 1)" \
            in str(err.value)
        assert err.value.transient

        started = threading.Event()

        def projector() -> None:  # a projection catching up in the background
            started.set()
            with psycopg.connect(dsn, autocommit=True) as c2:
                c2.execute("update kappaflow.projection_positions set position = 2 where projection = 'balances'")

        t = threading.Thread(target=projector)
        t.start()
        assert wait_for_projection(dsn, "balances", r.position, timeout=10) >= 2
        t.join()
        with pytest.raises(ProjectionTimeoutError, match="no recorded position"):
            wait_for_projection(dsn, "activity", 1, timeout=0)


def test_positions_source_filter_and_next_to_read(positions_table: str) -> None:
    dsn = positions_table
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("insert into kappaflow.projection_positions values ('v', 'bank', 10), ('v', 'other', 99)")
    bank = PostgresProjectionPositions(dsn, source="bank")
    assert isinstance(bank, ProjectionPositions)
    assert bank.processed("v") == 10
    assert PostgresProjectionPositions(dsn, source="bank", next_to_read=True).processed("v") == 9
    assert wait_for_projection(bank, "v", 10, timeout=1) == 10
    with pytest.raises(ProjectionTimeoutError):
        wait_for_projection(bank, "v", 11, timeout=0.05)
    bank.close()


def test_any_protocol_object_and_bad_arguments(ledger_dsn: str) -> None:
    class InMemory:
        def processed(self, projection: str, position: int) -> int | None:
            return {"p": 5}.get(projection)

    assert wait_for_projection(InMemory(), "p", 5, timeout=0) == 5
    with pytest.raises(ConfigError, match="position: expected an integer >= 0"):
        wait_for_projection(InMemory(), "p", -1)
    with pytest.raises(ConfigError, match="projection_positions does not exist"):
        wait_for_projection(ledger_dsn, "p", 1, timeout=1)


def test_wait_through_the_log_before_the_events_topic_exists(ledger_dsn: str, embedded_log: Any) -> None:
    """The first event of a stream type has not reached the log (its topic does not exist yet):
    the wait waits (and times out naming the position) instead of failing; once the event is in
    the log and the projection's offset passes it, it returns."""
    from kappaflow.migrations import upgrade

    upgrade(ledger_dsn, "projections@head")
    with Ledger(ledger_dsn) as ledger, psycopg.connect(ledger_dsn, autocommit=True) as conn:
        r = ledger.append("acct-1", [NewEvent("Opened", {})])
        positions = LogProjectionPositions(ledger_dsn, embedded_log, ledger, "bank")
        with pytest.raises(ProjectionTimeoutError) as err:
            wait_for_projection(positions, "balances", r.position, timeout=0.2)
        assert (err.value.position, err.value.reached) == (1, None)

        relay = LedgerRelay(ledger, embedded_log, "bank", partitions=2)
        while relay.run_once():
            pass
        topic, part = positions.locate(r.position)
        offsets = [rec.offset for rec in embedded_log.iter_partition(topic, part) if record_position(rec) == 1]
        assert len(offsets) == 1
        conn.execute("insert into kappaflow.projection_positions (projection, target, topic, partition, next_offset) "
                     "values ('balances', 'live', %s, %s, %s)", (topic, part, offsets[0] + 1))
        assert wait_for_projection(positions, "balances", r.position, timeout=5) == 1
        positions.close()
