"""Bad input gives clear, actionable errors with a retry verdict (and never a password)."""

from __future__ import annotations

import struct
import threading
import uuid
from typing import Any

import orjson
import psycopg
import pytest
from pg_helpers import capture, compacted, config, table_state, wait_for
from pydantic import SecretStr

from kappaflow.config import PostgresSourceConfig, SnapshotMode
from kappaflow.connectors.base import StopSignal
from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres.connector import PostgresConnector
from kappaflow.connectors.postgres.context import PgCapture
from kappaflow.connectors.postgres.offset import PgOffset
from kappaflow.connectors.postgres.replication import ReplicationConnection
from kappaflow.connectors.postgres.streaming import PgStreamingSource
from kappaflow.errors import ConfigError, Retry, SourceError, ValidationError
from kappaflow.log.base import Log

pytestmark = pytest.mark.integration


def test_unreachable_server_is_transient_and_hides_the_password(embedded_log: Log) -> None:
    cfg = PostgresSourceConfig(name="x", dsn="postgresql://app@127.0.0.1:1/shop", password=SecretStr("s3cr3t-pw"),
                               tables=["public.t"])
    with pytest.raises(SourceError) as ei:
        capture(cfg, embedded_log)
    assert ei.value.retry is Retry.TRANSIENT
    assert "cannot reach PostgreSQL" in str(ei.value) and "port=1" in str(ei.value)
    assert "s3cr3t-pw" not in str(ei.value)


def test_wrong_database_is_terminal(pg_server: Any, embedded_log: Log) -> None:
    cfg = PostgresSourceConfig(name="x", dsn=pg_server.dsn("no_such_db"), password=SecretStr("s3cr3t-pw"),
                               tables=["public.t"])
    with pytest.raises(SourceError, match="does not exist") as ei:
        capture(cfg, embedded_log)
    assert ei.value.retry is Retry.TERMINAL and "s3cr3t-pw" not in str(ei.value)


def test_wal_level_replica_is_refused_with_instructions(embedded_log: Log) -> None:
    """The machine's packaged PostgreSQL runs with wal_level=replica."""
    dsn = "postgresql://postgres@127.0.0.1:5432/postgres"
    try:
        with psycopg.connect(dsn, connect_timeout=3) as conn:
            level = conn.execute("SHOW wal_level").fetchone()[0]  # type: ignore[index]
    except psycopg.OperationalError:
        pytest.skip("no PostgreSQL at 127.0.0.1:5432")
    if level == "logical":
        pytest.skip("the system PostgreSQL already has wal_level=logical")
    with pytest.raises(SourceError, match=r"wal_level = replica.*ALTER SYSTEM SET wal_level = logical") as ei:
        capture(config(dsn, "walcheck", []), embedded_log)
    assert ei.value.retry is Retry.TERMINAL


def test_role_without_replication_is_refused(pg_server: Any, pg_dsn: str, sql: Any, embedded_log: Log) -> None:
    role = f"norepl_{uuid.uuid4().hex[:8]}"
    sql(f"CREATE ROLE {role} LOGIN")
    try:
        dsn = pg_dsn.replace("postgres@", f"{role}@")
        with pytest.raises(SourceError, match=rf"role '{role}'.*lacks the REPLICATION attribute.*ALTER ROLE"):
            capture(config(dsn, "norepl", []), embedded_log)
    finally:
        sql(f"DROP ROLE {role}")


def test_unknown_table_names_it_and_lists_the_known_ones(pg_dsn: str, sql: Any, source_name: str,
                                                         embedded_log: Log) -> None:
    sql("CREATE TABLE orders (id int PRIMARY KEY)")
    with pytest.raises(SourceError, match=r"unknown table public.ordrs .*tables in schema 'public': orders"):
        capture(config(pg_dsn, source_name, ["public.ordrs"]), embedded_log)


def test_table_without_primary_key(pg_dsn: str, sql: Any, source_name: str, embedded_log: Log) -> None:
    """Issue 13 item 8: a keyless table is refused once, with both fixes (key columns and replica identity)."""
    sql("CREATE TABLE events (tenant int NOT NULL, seq int NOT NULL, payload text)")
    sql("INSERT INTO events VALUES (1, 1, 'a'), (1, 2, 'b')")
    with pytest.raises(SourceError) as ei:
        capture(config(pg_dsn, source_name, ["public.events"]), embedded_log)
    msg = str(ei.value)
    assert "public.events" in msg and "no primary key" in msg, msg
    assert f"kappaflow source add {source_name} ... --key-columns public.events=" in msg, msg
    assert "key_columns = { \"public.events\"" in msg, msg
    assert "ALTER TABLE public.events REPLICA IDENTITY FULL" in msg, msg
    keyed = config(pg_dsn, source_name, ["public.events"], key_columns={"public.events": ["tenant", "seq"]})
    with pytest.raises(SourceError, match="REPLICA IDENTITY FULL"):
        capture(keyed, embedded_log)
    with pytest.raises(ConfigError, match=r"key_columns\['public.events'\]: no column\(s\) \['nope'\]"):
        capture(config(pg_dsn, source_name, ["public.events"], key_columns={"public.events": ["nope"]}),
                embedded_log)
    sql("ALTER TABLE events REPLICA IDENTITY FULL")
    capture(keyed, embedded_log)
    sql("UPDATE events SET payload = 'c' WHERE seq = 2")
    sql("DELETE FROM events WHERE seq = 1")
    capture(keyed, embedded_log)
    got = compacted(embedded_log, f"{source_name}.public.events")
    assert got == {b'{"tenant":1,"seq":2}': {"tenant": 1, "seq": 2, "payload": "c"}}


def test_keyless_tables_are_all_named_in_one_error(pg_dsn: str, sql: Any, source_name: str,
                                                   embedded_log: Log) -> None:
    sql("CREATE TABLE a (x int)")
    sql("CREATE TABLE b (y int NOT NULL)")
    sql("CREATE UNIQUE INDEX b_y ON b (y)")
    with pytest.raises(SourceError, match="2 tables cannot be captured") as ei:
        capture(config(pg_dsn, source_name, ["public.a", "public.b"]), embedded_log)
    msg = str(ei.value)
    assert "table public.a cannot be captured" in msg and "table public.b cannot be captured" in msg, msg
    assert "--key-columns public.b=y" in msg and "index b_y" in msg, msg  # a ready-made key is suggested


def test_nullable_key_columns_are_refused_before_the_snapshot(pg_dsn: str, sql: Any, source_name: str,
                                                             embedded_log: Log) -> None:
    """Issue 13 item 21: a NULL key used to pass capture and fail only in the replay."""
    sql("CREATE TABLE n (a int, b text)")
    sql("ALTER TABLE n REPLICA IDENTITY FULL")
    sql("INSERT INTO n VALUES (1, 'x')")
    with pytest.raises(SourceError, match=r"key column\(s\) a may be NULL.*ALTER TABLE public.n ALTER COLUMN a "
                       r"SET NOT NULL") as ei:
        capture(config(pg_dsn, source_name, ["public.n"], key_columns={"public.n": ["a"]}), embedded_log)
    assert ei.value.retry is Retry.TERMINAL
    assert f"{source_name}.public.n" not in embedded_log.list_topics()


def test_slot_dropped_underneath(pg_dsn: str, sql: Any, source_name: str, embedded_log: Log) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY)")
    sql("INSERT INTO t VALUES (1)")
    cfg = config(pg_dsn, source_name, ["public.t"])
    stop = StopSignal()
    conn = PostgresConnector(cfg, embedded_log, partitions=1, progress=False)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            conn.run(stop)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    try:
        with slots.connect(pg_dsn) as c:
            info = wait_for(lambda: (i := slots.slot_info(c, cfg.slot_name)) is not None and i.active and i, 30,
                            "the slot to be active")
            c.execute("SELECT pg_terminate_backend(%s)", (info.active_pid,))
            wait_for(lambda: not (slots.slot_info(c, cfg.slot_name) or info).active, 30, "the walsender to exit")
            c.execute("SELECT pg_drop_replication_slot(%s)", (cfg.slot_name,))
        t.join(30)
        assert not t.is_alive()
    finally:
        stop.set("test")
        t.join()
    assert errors and isinstance(errors[0], SourceError) and errors[0].transient  # connection lost: retryable
    sql("INSERT INTO t VALUES (2)")
    with pytest.raises(SourceError, match=rf"slot .* is gone \(dropped\?\).*kappaflow capture {source_name} "
                                          "--resnapshot") as ei:
        capture(cfg, embedded_log)
    assert ei.value.retry is Retry.TERMINAL
    # a repair: a new slot and a full snapshot (snapshot_mode = "always"; `--resnapshot` in test_pg_lost_slot.py)
    capture(config(pg_dsn, source_name, ["public.t"], snapshot_mode=SnapshotMode.ALWAYS), embedded_log)
    assert compacted(embedded_log, f"{source_name}.public.t") == table_state(pg_dsn, "public.t")


def test_slot_in_use_by_another_process(pg_dsn: str, sql: Any, source_name: str, embedded_log: Log) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY)")
    cfg = config(pg_dsn, source_name, ["public.t"])
    capture(cfg, embedded_log)
    other = ReplicationConnection(pg_dsn)
    try:
        other.start(cfg.slot_name, 0, [cfg.publication_name])
        with pytest.raises(SourceError, match=r"in use by another process \(PID \d+\)") as ei:
            capture(cfg, embedded_log)
        assert ei.value.retry is Retry.TRANSIENT
    finally:
        other.close()


def test_malformed_pgoutput_in_the_stream_names_message_and_byte(pg_dsn: str, sql: Any, source_name: str,
                                                                embedded_log: Log) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    cap = PgCapture(source=source_name, dsn=pg_dsn, log=embedded_log, tables=["public.t"], key_columns={},
                    partitions=1)
    try:
        cap.prepare_log()
        src = PgStreamingSource(cap, None, slot="x", publication="p")  # type: ignore[arg-type]
        src.offset = PgOffset(slot="x", lsn=0)
        src.caught_up = False
        src.idle_candidate = 0

        def w(payload: bytes) -> bytes:
            return b"w" + struct.pack(">QQq", 0x2_0000_0100, 0x2_0000_0100, 0) + payload

        rel = (b"R" + struct.pack(">I", 42) + b"public\0t\0d" + struct.pack(">h", 2)
               + b"\x01id\0" + struct.pack(">Ii", 23, -1) + b"\x00v\0" + struct.pack(">Ii", 25, -1))
        begin = b"B" + struct.pack(">QqI", 0x2_0000_0200, 0, 9)
        good = b"I" + struct.pack(">I", 42) + b"N" + struct.pack(">h", 2) + b"t" + struct.pack(">I", 1) + b"1" + b"n"
        src._process([w(begin), w(rel), w(good)], 0, None)
        bad = b"I" + struct.pack(">I", 42) + b"N" + struct.pack(">h", 2) + b"t" + struct.pack(">I", 9) + b"12"
        with pytest.raises(ValidationError, match=r"malformed pgoutput Insert message at WAL position 2/100: "
                                                  r"at byte 9: expected column 1 of 2: 9 value bytes"):
            src._process([w(bad)], 0, None)
        assert orjson.loads(cap.pending.by_topic[f"{source_name}.public.t"][0].value)["after"] == {"id": 1, "v": None}
    finally:
        cap.close()
