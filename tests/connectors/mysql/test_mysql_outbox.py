"""Outbox tables on a real MariaDB, checked against Debezium's documented outbox event router
behaviour (topic ``outbox.event.<aggregatetype>``, key the aggregateid, value the unwrapped
payload, ``id`` header, deletes skipped, updates warned and skipped)."""

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
import pytest
from pydantic import ValidationError

from kappaflow.config import MySQLSourceConfig
from kappaflow.connectors.mysql.connector import MySQLConnector
from kappaflow.errors import ConfigError
from kappaflow.log import open_log
from kappaflow.log.base import Log
from tests._kill import stored_offset, wait_for

pytestmark = [pytest.mark.integration]

OUTBOX_DDL = ("CREATE TABLE outbox (id VARCHAR(36) PRIMARY KEY, aggregatetype VARCHAR(255), "
              "aggregateid VARCHAR(255), type VARCHAR(255) NOT NULL, payload JSON)")


def cfg_for(mh: Any, server: Any, db: str, name: str = "src", **outbox: Any) -> MySQLSourceConfig:
    outbox.setdefault("tables", [f"{db}.outbox"])
    return MySQLSourceConfig(name=name, dsn=mh.dsn(server, db), tables=[f"{db}.outbox"], heartbeat_interval_s=0.5,
                             outbox=outbox)


def run(cfg: MySQLSourceConfig, log: Log, **kw: Any) -> Any:
    return MySQLConnector.from_config(cfg, log, partitions=2, flush_interval_s=0.05, progress=False,
                                      **kw).run(until_caught_up=True)


def events(log: Log, topic: str) -> list[Any]:
    if topic not in log.list_topics():
        return []
    return [r for p in range(log.partitions(topic)) for r in log.iter_partition(topic, p)]


def headers(rec: Any) -> dict[str, bytes]:
    return dict(rec.headers)


def insert_event(conn: Any, agg_type: str | None, agg_id: str | None, typ: str, payload: Any,
                 delete: bool = True) -> str:
    eid = str(uuid.uuid4())
    with conn.cursor() as cur:
        cur.execute("INSERT INTO outbox VALUES (%s, %s, %s, %s, %s)",
                    (eid, agg_type, agg_id, typ, None if payload is None else orjson.dumps(payload).decode()))
        if delete:
            cur.execute("DELETE FROM outbox WHERE id = %s", (eid,))
    conn.commit()
    return eid


def session(server: Any, db: str) -> Any:
    import pymysql

    return pymysql.connect(autocommit=False, **server.connect_args(db))


def test_outbox_rows_are_routed_like_debeziums_event_router(mariadb_server: Any, mariadb_db: str,
                                                            embedded_log: Log, mh: Any,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    db = mariadb_db
    mariadb_server.execute(OUTBOX_DDL, "INSERT INTO outbox VALUES ('4d47e190-0402-4048-bc2c-89dd54343cdc', "
                           "'order', '1', 'OrderCreated', '{\"id\": 1, \"status\": \"ENTERED\"}')", db=db)
    cfg = cfg_for(mh, mariadb_server, db)
    run(cfg, embedded_log)  # the snapshot reads the row still in the table
    conn = session(mariadb_server, db)
    try:
        e2 = insert_event(conn, "order", "1", "OrderShipped", {"id": 1, "status": "SHIPPED"})
        e3 = insert_event(conn, "customer", "42", "CustomerCreated", {"id": 42})
        e4 = insert_event(conn, "order", "2", "OrderCreated", {"id": 2}, delete=False)
        with conn.cursor() as cur:
            cur.execute("UPDATE outbox SET type = 'Changed' WHERE id = %s", (e4,))
        conn.commit()
        e5 = insert_event(conn, None, "3", "OrderCreated", {"id": 3})  # no aggregatetype: dead letter
        with conn.cursor() as cur:
            cur.execute("TRUNCATE outbox")
    finally:
        conn.close()
    run(cfg, embedded_log)

    orders = events(embedded_log, "outbox.event.order")
    by_id = {headers(r)["id"].decode(): r for r in orders}
    assert sorted(by_id) == sorted(["4d47e190-0402-4048-bc2c-89dd54343cdc", e2, e4]) and len(orders) == 3
    first = by_id["4d47e190-0402-4048-bc2c-89dd54343cdc"]
    assert first.key == b'"1"'
    assert orjson.loads(first.value) == {"id": 1, "status": "ENTERED"}
    assert headers(first)["type"] == b"OrderCreated"
    assert orjson.loads(headers(first)["kf.pos"])["snapshot"] is True
    shipped = by_id[e2]
    assert orjson.loads(shipped.value) == {"id": 1, "status": "SHIPPED"}
    pos = orjson.loads(headers(shipped)["kf.pos"])
    assert pos["kind"] == "binlog" and pos["snapshot"] is False
    assert (shipped.partition, shipped.offset > first.offset) == (first.partition, True)
    [customer] = events(embedded_log, "outbox.event.customer")
    assert (customer.key, headers(customer)["id"].decode()) == (b'"42"', e3)
    assert f"src.{db}.outbox" not in embedded_log.list_topics()
    [dead] = events(embedded_log, "kf.dead_letter.source.src")
    doc = orjson.loads(dead.value)
    assert "aggregatetype (route_by_field) is NULL" in doc["reason"] and doc["row"]["id"] == e5
    assert doc["position"]["kind"] == "binlog" and "binlog" in doc["where"]
    assert any("UPDATE of outbox table" in r.getMessage() for r in caplog.records)

    s = run(cfg, embedded_log)  # a restart writes nothing twice
    assert len(events(embedded_log, "outbox.event.order")) == 3
    assert s.events == 0


def test_a_missing_column_stops_the_capture_at_its_start(mariadb_server: Any, mariadb_db: str,
                                                        embedded_log: Log, mh: Any) -> None:
    db = mariadb_db
    mariadb_server.execute("CREATE TABLE outbox (id VARCHAR(36) PRIMARY KEY, aggregatetype VARCHAR(50), "
                           "aggregateid VARCHAR(50), type VARCHAR(50))", db=db)
    with pytest.raises(ConfigError, match=rf"outbox table {db}\.outbox has no column 'payload'"):
        run(cfg_for(mh, mariadb_server, db), embedded_log)
    with pytest.raises(ValidationError, match="message_prefix"):
        MySQLSourceConfig(name="x", dsn=mh.dsn(mariadb_server, db), outbox={"message_prefix": "outbox"})


def _writer(server: Any, db: str, wid: int, n: int, seen: list[str], stop: threading.Event) -> None:
    rng = random.Random(wid)
    conn = session(server, db)
    try:
        for i in range(n):
            if stop.is_set():
                return
            agg = f"{wid}-{rng.randint(0, 4)}"
            seen.append(insert_event(conn, "order", agg, "Changed", {"writer": wid, "seq": i},
                                     delete=rng.random() < 0.8))
    finally:
        conn.close()


def test_concurrent_writes_and_kill9_lose_and_double_nothing(tmp_path: Path, mariadb_server: Any, mariadb_db: str,
                                                              mh: Any) -> None:
    db = mariadb_db
    mariadb_server.execute(OUTBOX_DDL, db=db)
    name = "m" + os.urandom(4).hex()
    log_url = str(tmp_path / "log")
    cfg_path = tmp_path / "kappaflow.toml"
    cfg_path.write_text(
        f'[log]\nurl = "{log_url}"\npartitions = 3\ncompact_interval_s = 0\n\n'
        f'[sources.{name}]\nkind = "mysql"\ndsn = "{mh.dsn(mariadb_server, db)}"\ntables = ["{db}.outbox"]\n'
        f"heartbeat_interval_s = 0.5\nserver_id = {random.Random(name).randint(10_000, 2**31)}\n\n"
        f'[sources.{name}.outbox]\ntables = ["{db}.outbox"]\n')
    cmd = [sys.executable, "-m", "kappaflow.cli.capture", name, "--config", str(cfg_path), "--no-progress"]
    seen: list[str] = []
    stop = threading.Event()
    writers = [threading.Thread(target=_writer, args=(mariadb_server, db, w, 120, seen, stop)) for w in range(3)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(tmp_path))

    def logged() -> list[Any]:
        if not Path(log_url).exists():
            return []
        log = open_log(log_url, read_only=True)
        try:
            return events(log, "outbox.event.order")
        finally:
            log.close()

    try:
        wait_for(lambda: (o := stored_offset(log_url, name, False)) is not None and o["phase"] == "streaming", 60,
                 "the capture to stream")
        for t in writers:
            t.start()
        for kill_at in (50, 170, 280):
            wait_for(lambda k=kill_at: len(seen) >= k, 120, f"{kill_at} outbox events to be written")
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(tmp_path))
        for t in writers:
            t.join(timeout=120)
        wait_for(lambda: len(logged()) >= len(seen), 120, "every outbox event to reach the log")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(seen) == 360
    got = logged()
    ids = Counter(headers(r)["id"].decode() for r in got)
    assert not [i for i, n in ids.items() if n > 1], "an outbox event was written twice"
    assert set(ids) == set(seen), "an outbox event was lost"
    per_agg: dict[bytes | None, list[tuple[int, int, int]]] = {}
    for r in got:
        per_agg.setdefault(r.key, []).append((r.partition, r.offset, orjson.loads(r.value)["seq"]))
    for key, evs in per_agg.items():
        assert len({p for p, _o, _s in evs}) == 1, f"{key!r}: events in more than one partition"
        seqs = [q for _p, _o, q in sorted(evs)]
        assert seqs == sorted(seqs), f"{key!r}: events out of commit order {seqs}"
