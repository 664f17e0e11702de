"""Read-your-writes: wait_for_projection against a positions table, and its timeout error."""

from __future__ import annotations

import threading
from pathlib import Path
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
def views_dsn(ledger_dsn: str) -> str:
    """The views database with kappaflow's own positions table, created by the real projections
    migration (the table a PostgreSQL-backed projection writes its log offsets to)."""
    from kappaflow.migrations import upgrade

    upgrade(ledger_dsn, "projections@head")
    return ledger_dsn


def relay_all(ledger: Ledger, log: Any, source: str = "bank") -> None:
    relay = LedgerRelay(ledger, log, source, partitions=2)
    while relay.run_once():
        pass


def offset_after(log: Any, topic: str, partition: int, position: int) -> int:
    """The next offset a projection stores once it processed the record of `position`."""
    return next(rec.offset for rec in log.iter_partition(topic, partition) if record_position(rec) == position) + 1


def processed(conn: psycopg.Connection, topic: str, partition: int, next_offset: int) -> None:
    """What the projection's PostgreSQL sink writes with each batch (see projections/sinks/postgres.py)."""
    conn.execute("insert into kappaflow.projection_positions as p (projection, target, topic, partition, next_offset) "
                 "values ('balances', 'live', %s, %s, %s) on conflict (projection, target, topic, partition) "
                 "do update set next_offset = excluded.next_offset", (topic, partition, next_offset))


def test_the_documented_call_with_a_views_dsn(views_dsn: str, embedded_log: Any) -> None:
    """``wait_for_projection(views_dsn, name, position)`` against kappaflow.projection_positions
    (issue 13 item 6: it used to query `position`/`source` columns that table does not have)."""
    dsn = views_dsn
    with Ledger(dsn) as ledger, psycopg.connect(dsn, autocommit=True) as conn:
        r = ledger.append("acct-1", [NewEvent("X", {}), NewEvent("X", {})])
        relay_all(ledger, embedded_log)
        kw: dict[str, Any] = {"log": embedded_log, "ledger": ledger, "source": "bank"}
        topic, part = LogProjectionPositions(dsn, embedded_log, ledger, "bank").locate(r.position)
        with pytest.raises(ProjectionTimeoutError, match="no recorded position"):
            wait_for_projection(dsn, "balances", r.position, timeout=0, **kw)
        processed(conn, topic, part, offset_after(embedded_log, topic, part, 1))
        with pytest.raises(ProjectionTimeoutError) as err:
            wait_for_projection(dsn, "balances", r.position, timeout=0.2, **kw)
        assert (err.value.projection, err.value.position, err.value.reached) == ("balances", 2, 1)
        assert "projection 'balances' did not reach ledger position 2 within 0.2 s (processed up to position 1)" \
            in str(err.value)
        assert err.value.transient

        def projector() -> None:  # the projection catching up in the background
            with psycopg.connect(dsn, autocommit=True) as c2:
                processed(c2, topic, part, offset_after(embedded_log, topic, part, 2))

        t = threading.Thread(target=projector)
        t.start()
        assert wait_for_projection(dsn, "balances", r.position, timeout=10, **kw) == 2
        t.join()


def test_the_documented_call_takes_log_ledger_and_source_from_the_project(
        views_dsn: str, tmp_path: Path, ledger: Ledger) -> None:
    """Only the DSN, the name and the position: the rest comes from kappaflow.toml."""
    from kappaflow.log.embedded import EmbeddedLog

    (tmp_path / "kappaflow.toml").write_text(
        f'[log]\nurl = "log"\n\n[sources.bank]\nkind = "ledger"\ndsn = "{views_dsn}"\n')
    r = ledger.append("acct-1", [NewEvent("X", {})])
    log = EmbeddedLog(tmp_path / "log")
    try:
        relay_all(ledger, log)
        topic, part = LogProjectionPositions(views_dsn, log, ledger, "bank").locate(r.position)
        with psycopg.connect(views_dsn, autocommit=True) as conn:
            processed(conn, topic, part, offset_after(log, topic, part, r.position))
    finally:
        log.close()
    cfg = tmp_path / "kappaflow.toml"
    assert wait_for_projection(views_dsn, "balances", r.position, timeout=10, config=cfg) == r.position
    (tmp_path / "other.toml").write_text('[log]\nurl = "log"\n')
    with pytest.raises(ConfigError, match=r"expected one ledger source in the configuration \(found: none\)"):
        wait_for_projection(views_dsn, "balances", r.position, config=tmp_path / "other.toml")


def test_custom_positions_table_source_filter_and_next_to_read(ledger_dsn: str) -> None:
    """A custom projector's own table of ledger positions (not kappaflow's offsets table)."""
    dsn = ledger_dsn
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("create table my_positions (projection text, source text, position bigint, "
                     "primary key (projection, source))")
        conn.execute("insert into my_positions values ('v', 'bank', 10), ('v', 'other', 99)")
    bank = PostgresProjectionPositions(dsn, "my_positions", source="bank")
    assert isinstance(bank, ProjectionPositions)
    assert bank.processed("v") == 10
    assert PostgresProjectionPositions(dsn, "my_positions", source="bank", next_to_read=True).processed("v") == 9
    assert wait_for_projection(bank, "v", 10, timeout=1) == 10
    with pytest.raises(ProjectionTimeoutError):
        wait_for_projection(bank, "v", 11, timeout=0.05)
    bank.close()
    with pytest.raises(ConfigError, match=r"public\.nope does not exist"):
        PostgresProjectionPositions(dsn, "nope").processed("v")


def test_any_protocol_object_and_bad_arguments(ledger_dsn: str, embedded_log: Any) -> None:
    class InMemory:
        def processed(self, projection: str, position: int) -> int | None:
            return {"p": 5}.get(projection)

    assert wait_for_projection(InMemory(), "p", 5, timeout=0) == 5
    with pytest.raises(ConfigError, match="position: expected an integer >= 0"):
        wait_for_projection(InMemory(), "p", -1)
    with Ledger(ledger_dsn) as ledger:  # the views database without the projections migrations
        ledger.append("acct-1", [NewEvent("X", {})])
        relay_all(ledger, embedded_log)
        with pytest.raises(ConfigError, match="projection_positions does not exist"):
            wait_for_projection(ledger_dsn, "p", 1, timeout=1, log=embedded_log, ledger=ledger, source="bank")


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
