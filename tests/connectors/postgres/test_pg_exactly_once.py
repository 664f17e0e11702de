"""The commit protocol, step by step: a crash at each step loses nothing and writes nothing twice.

Steps (see ``connectors/postgres/streaming.py`` and ``connectors/writer.py``): 1 decode,
2 append records, 3 append offset, 4 publish durable, 5 acknowledge upstream. A crash is
an exception raised by the writer's fault hook at a step; the next run must resume
exactly, and the slot must never have been acknowledged past the stored offset.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from pg_helpers import capture, compacted, config, positions, table_state

from kappaflow.connectors.offsets import OffsetStore
from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres.connector import PostgresConnector
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.log.base import Log

pytestmark = pytest.mark.integration


class Crash(BaseException):
    """Stands for the process dying at a step (not an Exception: nothing may swallow it)."""


def crash_at(step: str, nth: int) -> Callable[[str], None]:
    seen = Counter[str]()

    def fault(name: str) -> None:
        seen[name] += 1
        if name == step and seen[name] == nth:
            raise Crash(f"crash at {step} #{nth}")

    return fault


def _changes(pg_dsn: str) -> int:
    """Five transactions over two tables; returns the number of change events they produce."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for i in range(5):
            with conn.transaction():
                conn.execute("INSERT INTO a VALUES (%s, 'x')", (100 + i,))
                conn.execute("UPDATE b SET v = v || 'u' WHERE id = %s", (i + 1,))
                conn.execute("DELETE FROM a WHERE id = %s", (i + 1,))
    return 15


def _assert_exact(log: Log, source: str, pg_dsn: str, streamed: int) -> None:
    for table in ("a", "b"):
        topic = f"{source}.public.{table}"
        assert compacted(log, topic) == table_state(pg_dsn, f"public.{table}", source)
        pos = positions(log, topic)
        dup = [p for p, n in Counter(pos).items() if n > 1]
        assert not dup, f"records written twice in {topic}: {dup}"
    events = [p for t in ("a", "b") for p, tomb in positions(log, f"{source}.public.{t}")
              if not tomb and isinstance(p, PgPosition) and not p.snapshot]
    assert len(events) == streamed == len(set(events))


def _acked_at_most_stored(log: Log, source: str, cfg: Any, pg_dsn: str) -> None:
    stored = OffsetStore(log).load(source)
    assert stored is not None
    with slots.connect(pg_dsn) as conn:
        info = slots.slot_info(conn, cfg.slot_name)
    assert info is not None and (info.confirmed_flush_lsn or 0) <= stored["lsn"], \
        "the slot was acknowledged past the offset stored in the log"


@pytest.mark.parametrize(("step", "nth"), [("before_records", 2), ("after_records", 2), ("after_records", 4),
                                           ("after_offset", 3)])
def test_crash_at_each_commit_step_then_restart_is_exact(pg_dsn: str, sql: Any, source_name: str,
                                                         embedded_log: Log, step: str, nth: int) -> None:
    sql("CREATE TABLE a (id int PRIMARY KEY, v text)")
    sql("CREATE TABLE b (id int PRIMARY KEY, v text)")
    sql("INSERT INTO a SELECT i, 'a' FROM generate_series(1, 10) i")
    sql("INSERT INTO b SELECT i, 'b' FROM generate_series(1, 10) i")
    cfg = config(pg_dsn, source_name, ["public.a", "public.b"])
    capture(cfg, embedded_log)
    streamed = _changes(pg_dsn)
    crashing = PostgresConnector(cfg, embedded_log, partitions=3, progress=False, batch_records=2, linger_s=0,
                                 fault=crash_at(step, nth))
    with pytest.raises(Crash):
        crashing.run(until_caught_up=True)
    _acked_at_most_stored(embedded_log, source_name, cfg, pg_dsn)
    again = capture(cfg, embedded_log)
    if step == "after_records":
        assert again.duplicates_skipped > 0  # re-streamed records found already in the log, not re-appended
    _assert_exact(embedded_log, source_name, pg_dsn, streamed)


@pytest.mark.parametrize(("step", "nth", "resumed_rows"), [("after_offset", 4, 699), ("after_records", 3, 799)])
def test_snapshot_resumes_from_the_last_completed_chunk(pg_dsn: str, sql: Any, source_name: str,
                                                        embedded_log: Log, step: str, nth: int,
                                                        resumed_rows: int) -> None:
    sql("CREATE TABLE a (id int PRIMARY KEY, v text)")
    sql("INSERT INTO a SELECT i, 'a' FROM generate_series(1, 1000) i")
    cfg = config(pg_dsn, source_name, ["public.a"], snapshot_chunk_rows=100)
    # batch 1 stores the slot's consistent point (an offset, no records); batches 2.. are chunks
    # of 100 rows: after_offset #4 = after chunk 3's offset; after_records #3 = chunk 3's rows
    crashing = PostgresConnector(cfg, embedded_log, partitions=3, progress=False, fault=crash_at(step, nth))
    with pytest.raises(Crash):
        crashing.run(until_caught_up=True)
    sql("UPDATE a SET v = 'changed meanwhile' WHERE id IN (50, 950)")
    sql("DELETE FROM a WHERE id = 951")
    again = capture(cfg, embedded_log)
    assert again.snapshot_rows == resumed_rows
    topic = f"{source_name}.public.a"
    assert compacted(embedded_log, topic) == table_state(pg_dsn, "public.a", source_name)
    # re-read rows get new positions: positions never repeat and increase in every partition
    pos = positions(embedded_log, topic)
    assert len({p for p, tomb in pos if not tomb}) == len([p for p, tomb in pos if not tomb])
    for p in range(embedded_log.partitions(topic)):
        ps = [pp for pp, _ in positions_in(embedded_log, topic, p)]
        assert ps == sorted(ps)


def positions_in(log: Log, topic: str, partition: int) -> list[tuple[Any, bool]]:
    from kappaflow.connectors.base import record_position

    return [(record_position(r), r.value is None) for r in log.iter_partition(topic, partition)]


def test_counts_with_many_small_batches(pg_dsn: str, sql: Any, source_name: str, embedded_log: Log) -> None:
    sql("CREATE TABLE a (id int PRIMARY KEY, v text)")
    sql("CREATE TABLE b (id int PRIMARY KEY, v text)")
    sql("INSERT INTO a SELECT i, 'a' FROM generate_series(1, 10) i")
    sql("INSERT INTO b SELECT i, 'b' FROM generate_series(1, 10) i")
    cfg = config(pg_dsn, source_name, ["public.a", "public.b"])
    capture(cfg, embedded_log)
    streamed = _changes(pg_dsn)
    summary = capture(cfg, embedded_log, batch_records=2, linger_s=0)
    assert summary.events == streamed and summary.records == streamed + 5  # + one tombstone per delete
    stored = OffsetStore(embedded_log).load(source_name)
    assert stored is not None and stored["events"] == 20 + streamed
    _assert_exact(embedded_log, source_name, pg_dsn, streamed)
