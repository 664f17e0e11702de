"""Outbox tables and logical messages on a real PostgreSQL, checked against Debezium's documented
outbox event router behaviour (topic ``outbox.event.<aggregatetype>``, key the aggregateid,
value the unwrapped payload, ``id`` header, deletes skipped, updates warned and skipped).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from pg_helpers import capture, config, records, wait_for

from kappaflow.connectors.postgres.connector import PostgresConnector
from kappaflow.errors import ConfigError, SourceError
from kappaflow.log import open_log
from kappaflow.log.base import Log
from tests._kill import stored_offset

pytestmark = [pytest.mark.integration]

OUTBOX_DDL = ("CREATE TABLE outbox (id uuid PRIMARY KEY, aggregatetype varchar(255), aggregateid varchar(255), "
              "type varchar(255) NOT NULL, payload jsonb)")
DLQ = "kf.dead_letter.source.{}"


class Crash(BaseException):
    """Stands for the process dying at a writer step (not an Exception: nothing may swallow it)."""


def outbox_config(dsn: str, name: str, **outbox: Any) -> Any:
    outbox.setdefault("tables", ["public.outbox"])
    return config(dsn, name, ["public.outbox"], outbox=outbox)


def headers(rec: Any) -> dict[str, bytes]:
    return dict(rec.headers)


def events(log: Log, topic: str) -> list[Any]:
    return records(log, topic) if topic in log.list_topics() else []


def insert_event(conn: Any, agg_type: str | None, agg_id: str | None, typ: str, payload: Any,
                 delete: bool = True) -> str:
    """One outbox row, deleted in the same transaction (the usual outbox pattern) unless told not to."""
    eid = str(uuid.uuid4())
    with conn.transaction():
        conn.execute("INSERT INTO outbox VALUES (%s, %s, %s, %s, %s)",
                     (eid, agg_type, agg_id, typ, None if payload is None else orjson.dumps(payload).decode()))
        if delete:
            conn.execute("DELETE FROM outbox WHERE id = %s", (eid,))
    return eid


def test_outbox_rows_are_routed_like_debeziums_event_router(pg_dsn: str, sql: Any, source_name: str,
                                                            embedded_log: Log,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    sql(OUTBOX_DDL)
    sql("INSERT INTO outbox VALUES ('4d47e190-0402-4048-bc2c-89dd54343cdc', 'order', '1', 'OrderCreated', "
        "'{\"id\": 1, \"status\": \"ENTERED\"}')")  # still in the table at the snapshot: read by it
    cfg = outbox_config(pg_dsn, source_name)
    capture(cfg, embedded_log)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        e2 = insert_event(conn, "order", "1", "OrderShipped", {"id": 1, "status": "SHIPPED"})
        e3 = insert_event(conn, "customer", "42", "CustomerCreated", {"id": 42, "name": "Ada"})
        e4 = insert_event(conn, "order", "2", "OrderCreated", {"id": 2}, delete=False)
        conn.execute("UPDATE outbox SET type = 'Changed' WHERE id = %s", (e4,))  # not expected: skipped
        e5 = insert_event(conn, "order", None, "OrderCreated", {"id": 3})  # no key: dead letter
        e6 = insert_event(conn, "order", "7", "OrderDeleted", None)  # NULL payload: no value
        conn.execute("TRUNCATE outbox")  # cleaning the outbox up produces nothing
    capture(cfg, embedded_log)

    orders = events(embedded_log, "outbox.event.order")
    by_id = {headers(r)["id"].decode(): r for r in orders}
    assert sorted(by_id) == sorted(["4d47e190-0402-4048-bc2c-89dd54343cdc", e2, e4, e6])
    assert len(orders) == 4  # one record per INSERT: no deletes, no update
    first = by_id["4d47e190-0402-4048-bc2c-89dd54343cdc"]
    assert first.key == b'"1"'  # the aggregateid, as Debezium's JsonConverter writes a string key
    assert orjson.loads(first.value) == {"id": 1, "status": "ENTERED"}  # the payload, unwrapped
    assert headers(first)["type"] == b"OrderCreated"
    assert orjson.loads(headers(first)["kf.pos"])["snapshot"] is True
    shipped = by_id[e2]
    assert orjson.loads(shipped.value) == {"id": 1, "status": "SHIPPED"}
    assert orjson.loads(headers(shipped)["kf.pos"])["snapshot"] is False
    assert shipped.partition == first.partition  # one aggregate, one partition, in commit order
    assert shipped.offset > first.offset
    assert by_id[e6].value is None
    [customer] = events(embedded_log, "outbox.event.customer")
    assert (customer.key, headers(customer)["id"].decode()) == (b'"42"', e3)
    assert orjson.loads(customer.value) == {"id": 42, "name": "Ada"}
    # the table itself produces no change events: its rows are events, not state
    assert f"{source_name}.public.outbox" not in embedded_log.list_topics()

    [dead] = events(embedded_log, DLQ.format(source_name))
    doc = orjson.loads(dead.value)
    assert "aggregateid (table_field_event_key) is NULL" in doc["reason"]
    assert doc["table"] == "public.outbox" and doc["row"]["id"] == e5
    assert doc["position"]["kind"] == "pg" and doc["position"]["lsn"] > 0
    assert "position" in doc["where"]  # names the row's position
    assert any("UPDATE of outbox table public.outbox" in r.getMessage() for r in caplog.records)

    capture(cfg, embedded_log)  # a restart writes nothing twice
    assert len(events(embedded_log, "outbox.event.order")) == 4
    assert len(events(embedded_log, DLQ.format(source_name))) == 1
    assert embedded_log.list_topics()["outbox.event.order"].cleanup_policy.value == "delete"


def test_custom_columns_and_placement(pg_dsn: str, sql: Any, source_name: str, embedded_log: Log) -> None:
    sql("CREATE TABLE events (event_id bigint PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL, "
        "event_type text, body text, occurred_at timestamptz)")
    cfg = config(pg_dsn, source_name, ["public.events"], outbox={
        "tables": ["public.events"], "table_field_event_id": "event_id", "table_field_event_key": "aggregate_id",
        "table_field_event_payload": "body", "route_by_field": "aggregate_type",
        "route_topic_replacement": "events.${routedByValue}", "table_field_event_timestamp": "occurred_at",
        "table_fields_additional_placement": "event_type:header:eventType,aggregate_type:envelope:kind",
        "table_expand_json_payload": True})
    capture(cfg, embedded_log)
    sql("INSERT INTO events VALUES (1, 'invoice', 'A-1', 'Issued', '{\"n\":  1}', '2026-01-02 03:04:05.678+00'), "
        "(2, 'invoice', 'A-1', 'Paid', 'not json', NULL)")
    capture(cfg, embedded_log)
    recs = sorted(events(embedded_log, "events.invoice"), key=lambda r: r.offset)
    assert [headers(r)["id"] for r in recs] == [b"1", b"2"]
    assert [headers(r)["eventType"] for r in recs] == [b"Issued", b"Paid"]
    assert orjson.loads(recs[0].value) == {"payload": {"n": 1}, "kind": "invoice"}
    assert recs[0].timestamp_ms == 1767323045678
    # Debezium keeps a payload that does not parse as it is (and says so)
    assert orjson.loads(recs[1].value) == {"payload": "not json", "kind": "invoice"}
    assert headers(recs[1])["kf.outbox.payload"] == b"invalid-json"


def test_logical_messages_as_an_outbox_without_a_table(pg_dsn: str, sql: Any, source_name: str,
                                                       embedded_log: Log) -> None:
    sql("CREATE TABLE other (id int PRIMARY KEY)")
    cfg = config(pg_dsn, source_name, ["public.other"], outbox={"message_prefix": "outbox"})
    capture(cfg, embedded_log)
    msg = {"id": "m-1", "aggregatetype": "order", "aggregateid": "9", "type": "OrderCreated",
           "payload": {"id": 9, "total": "12.50"}}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO other VALUES (1)")
            conn.execute("SELECT pg_logical_emit_message(true, 'outbox', %s)", (orjson.dumps(msg).decode(),))
        conn.execute("SELECT pg_logical_emit_message(false, 'outbox', %s)",
                     (orjson.dumps({**msg, "id": "m-2", "type": "OrderPaid"}).decode(),))
        with conn.transaction():  # rolled back: never decoded
            conn.execute("SELECT pg_logical_emit_message(true, 'outbox', %s)",
                         (orjson.dumps({**msg, "id": "m-x"}).decode(),))
            raise psycopg.Rollback()
        conn.execute("SELECT pg_logical_emit_message(true, 'someone-else', 'ignored')")
        conn.execute("SELECT pg_logical_emit_message(true, 'outbox', 'not json')")
    capture(cfg, embedded_log)
    recs = sorted(events(embedded_log, "outbox.event.order"), key=lambda r: r.offset)
    assert [headers(r)["id"] for r in recs] == [b"m-1", b"m-2"]
    assert {r.key for r in recs} == {b'"9"'}
    assert orjson.loads(recs[0].value) == {"id": 9, "total": "12.50"}
    assert headers(recs[1])["type"] == b"OrderPaid"
    [dead] = events(embedded_log, DLQ.format(source_name))
    assert "not a JSON object" in orjson.loads(dead.value)["reason"]
    capture(cfg, embedded_log)
    assert len(events(embedded_log, "outbox.event.order")) == 2


def test_a_missing_column_stops_the_capture_at_its_start(pg_dsn: str, sql: Any, source_name: str,
                                                        embedded_log: Log) -> None:
    sql("CREATE TABLE outbox (id uuid PRIMARY KEY, aggregatetype text, aggregateid text, type text)")
    with pytest.raises(ConfigError, match=r"outbox table public\.outbox has no column 'payload'.*"
                                          r"table\.field\.event\.payload"):
        capture(outbox_config(pg_dsn, source_name), embedded_log)
    sql("ALTER TABLE outbox ADD COLUMN payload jsonb")
    with pytest.raises(ConfigError, match=r"outbox table public\.outbox has no column 'kind'"):
        capture(outbox_config(pg_dsn, source_name, table_fields_additional_placement="kind:header"),
                embedded_log)


def test_an_update_is_fatal_when_configured(pg_dsn: str, sql: Any, source_name: str, embedded_log: Log) -> None:
    sql(OUTBOX_DDL)
    cfg = outbox_config(pg_dsn, source_name, table_op_invalid_behavior="fatal")
    capture(cfg, embedded_log)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        eid = insert_event(conn, "order", "1", "OrderCreated", {"id": 1}, delete=False)
        conn.execute("UPDATE outbox SET type = 'x' WHERE id = %s", (eid,))
    with pytest.raises(SourceError, match=r"UPDATE of outbox table public\.outbox"):
        capture(cfg, embedded_log)
    # nothing was acknowledged past the update: with the behaviour relaxed, the insert comes once
    capture(outbox_config(pg_dsn, source_name, table_op_invalid_behavior="warn"), embedded_log)
    assert [headers(r)["id"].decode() for r in events(embedded_log, "outbox.event.order")] == [eid]


# -- concurrent writers, kill -9 -------------------------------------------------------------------
def _writer(dsn: str, wid: int, n: int, seen: list[tuple[str, str, int]], stop: threading.Event) -> None:
    rng = random.Random(wid)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(n):
            if stop.is_set():
                return
            agg = f"{wid}-{rng.randint(0, 4)}"
            eid = insert_event(conn, rng.choice(["order", "customer"]), agg, "Changed",
                               {"writer": wid, "seq": i, "agg": agg}, delete=rng.random() < 0.8)
            seen.append((eid, agg, i))


def test_concurrent_writes_and_kill9_lose_and_double_nothing(tmp_path: Path, pg_dsn: str, sql: Any,
                                                              source_name: str) -> None:
    sql(OUTBOX_DDL)
    log_url = str(tmp_path / "log")
    cfg_path = tmp_path / "kappaflow.toml"
    cfg_path.write_text(
        f'[log]\nurl = "{log_url}"\npartitions = 3\ncompact_interval_s = 0\n\n'
        f'[sources.{source_name}]\nkind = "postgres"\ndsn = "{pg_dsn}"\ntables = ["public.outbox"]\n'
        'heartbeat_interval_s = 0.5\n\n'
        f'[sources.{source_name}.outbox]\ntables = ["public.outbox"]\n')
    cmd = [sys.executable, "-m", "kappaflow.cli.capture", source_name, "--config", str(cfg_path), "--no-progress"]
    seen: list[tuple[str, str, int]] = []
    stop = threading.Event()
    writers = [threading.Thread(target=_writer, args=(pg_dsn, w, 150, seen, stop)) for w in range(3)]
    env = {**os.environ}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(tmp_path), env=env)
    try:
        wait_for(lambda: (o := stored_offset(log_url, source_name, False)) is not None
                 and o["phase"] == "streaming", 60, "the capture to stream")
        for t in writers:
            t.start()
        for kill_at in (60, 200, 330):  # kill -9 mid-stream, at seeded points of the writes
            wait_for(lambda k=kill_at: len(seen) >= k, 120, f"{kill_at} outbox events to be written")
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(tmp_path),
                                    env=env)
        for t in writers:
            t.join(timeout=120)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            end = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]  # type: ignore[index]
        hi, lo = end.split("/")
        target = (int(hi, 16) << 32) | int(lo, 16)
        wait_for(lambda: ((stored_offset(log_url, source_name, False) or {}).get("lsn", 0)) >= target, 120,
                 "the capture to reach the end of the writes")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(seen) == 450
    log = open_log(log_url, read_only=True)
    try:
        got = [r for t in ("outbox.event.order", "outbox.event.customer") for r in events(log, t)]
        ids = Counter(headers(r)["id"].decode() for r in got)
        assert not [i for i, n in ids.items() if n > 1], "an outbox event was written twice"
        assert set(ids) == {eid for eid, _a, _i in seen}, "an outbox event was lost"
        # per topic and aggregate (one writer's, written in sequence): one partition, in commit order
        per_agg: dict[tuple[str, bytes | None], list[tuple[int, int, int]]] = {}
        for r in got:
            per_agg.setdefault((r.topic, r.key), []).append((r.partition, r.offset, orjson.loads(r.value)["seq"]))
        for (topic, key), evs in per_agg.items():
            assert len({p for p, _o, _s in evs}) == 1, f"{topic} {key!r}: events in more than one partition"
            seqs = [q for _p, _o, q in sorted(evs)]
            assert seqs == sorted(seqs), f"{topic} {key!r}: events out of commit order {seqs}"
        assert not events(log, DLQ.format(source_name))
    finally:
        log.close()


def test_restart_after_a_crash_before_the_offset_skips_what_the_log_holds(pg_dsn: str, sql: Any,
                                                                         source_name: str,
                                                                         embedded_log: Log) -> None:
    """The writer's step after the records, before the offset: the restart re-reads the transactions
    and the outbox tails say they are in the log already."""
    sql(OUTBOX_DDL)
    cfg = outbox_config(pg_dsn, source_name)
    capture(cfg, embedded_log)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for i in range(20):
            insert_event(conn, "order", str(i % 4), "E", {"i": i})

    def fault(step: str) -> None:
        if step == "after_records":
            raise Crash(step)

    crashing = PostgresConnector(cfg, embedded_log, partitions=3, progress=False, fault=fault)
    with pytest.raises(Crash):
        crashing.run(until_caught_up=True)
    partial = len(events(embedded_log, "outbox.event.order"))  # the first batch's records are in, its offset not
    assert 0 < partial <= 20
    again = capture(cfg, embedded_log)
    assert again.duplicates_skipped == partial  # re-read from the old offset, found in the log, not re-appended
    got = events(embedded_log, "outbox.event.order")
    assert len(got) == 20
    assert sorted(orjson.loads(r.value)["i"] for r in got) == list(range(20))
