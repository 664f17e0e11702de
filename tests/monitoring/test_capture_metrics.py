"""A running capture's /metrics, scraped over HTTP while changes flow (issue 21).

The capture is a real process (``python -m kappaflow.cli.capture --metrics-port 0``) against the
session's PostgreSQL; the test makes a known number of changes in a known number of transactions
and checks the counters equal them, and that the source-side figures (retained WAL of the slot,
source lag, confirmed LSN) are exported. The metric names and the exposition format are
Prometheus's (parsed with prometheus_client's own parser); the source password given in the
environment never appears in the scrape or the process's output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kappaflow.log import open_log
from tests._kill import wait_for
from tests.monitoring._scrape import endpoint_of, fetch, scrape, value

pytestmark = pytest.mark.integration

SECRET = "s3cret-Pw-4-metrics"


def start_capture(tmp_path: Path, dsn: str, name: str = "shop", *, extra_env: dict[str, str] | None = None,
                  extra_toml: str = "") -> tuple[subprocess.Popen[bytes], Path, Path]:
    cfg = tmp_path / "kappaflow.toml"
    cfg.write_text(
        f'[log]\nurl = "{tmp_path / "log"}"\npartitions = 2\n'
        f'[sources.{name}]\nkind = "postgres"\ndsn = "{dsn}"\ntables = ["public.orders"]\n'
        "heartbeat_interval_s = 1.0\n"
        '[metrics]\nprobe_interval_s = 0.5\n' + extra_toml
    )
    err = tmp_path / f"capture-{name}.log"
    env = {**os.environ, f"KAPPAFLOW_SOURCE_{name.upper()}_PASSWORD": SECRET, **(extra_env or {})}
    with err.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kappaflow.cli.capture", name, "--config", str(cfg),
                                 "--metrics-port", "0", "--log-every", "1"],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    return proc, err, cfg


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_orders(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, amount int NOT NULL)")
        for i in range(rows):
            conn.execute("INSERT INTO orders VALUES (%s, %s)", (i, i))


def test_capture_metrics_count_the_changes_made(pg_dsn: str, tmp_path: Path) -> None:
    make_orders(pg_dsn, 30)  # read by the snapshot
    proc, err, _cfg = start_capture(tmp_path, pg_dsn)
    try:
        url = endpoint_of(err)
        wait_for(lambda: value(scrape(url), "kappaflow_capture_phase", source="shop", phase="streaming") == 1, 120,
                 "the capture to stream")
        first = scrape(url)
        assert value(first, "kappaflow_capture_changes_total", source="shop") == 30
        assert value(first, "kappaflow_capture_snapshot_rows_total", source="shop", table="public.orders") == 30
        assert value(first, "kappaflow_capture_snapshot_progress_ratio", source="shop", table="public.orders") == 1
        # 12 transactions: 10 single inserts, one multi-row update (30 changes), one delete of 5 rows
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for i in range(100, 110):
                conn.execute("INSERT INTO orders VALUES (%s, 1)", (i,))
            conn.execute("UPDATE orders SET amount = amount + 1 WHERE id < 30")
            conn.execute("DELETE FROM orders WHERE id >= 105")
        expected = 30 + 10 + 30 + 5

        def settled() -> dict | None:
            s = scrape(url)
            return s if value(s, "kappaflow_capture_changes_total", source="shop") == expected else None

        s = wait_for(settled, 120, f"kappaflow_capture_changes_total to reach {expected}")
        wait_for(lambda: value(scrape(url), "kappaflow_capture_transactions_total", source="shop") == 12, 60,
                 "12 transactions counted")
        # what the log holds for the table = what this process appended to it (counted once durable)
        end = expected + 5  # each delete is followed by its tombstone
        wait_for(lambda: value(scrape(url), "kappaflow_log_records_appended_total", topic="shop.public.orders")
                 == end, 60, f"{end} records appended")
        with open_log(str(tmp_path / "log"), read_only=True) as log:
            assert sum(log.end_offsets("shop.public.orders").values()) == end
        assert (value(s, "kappaflow_log_disk_bytes", topic="shop.public.orders") or 0) > 0
        slot = "kappaflow_shop"
        # the server's figures are read at most every probe_interval_s (0.5 s here): the next reading
        s = wait_for(lambda: (lambda x: x if (value(x, "kappaflow_capture_retained_wal_bytes", source="shop",
                                                      slot=slot) or 0) > 0 else None)(scrape(url)),
                     60, "the slot's retained WAL")
        assert value(s, "kappaflow_capture_unconfirmed_wal_bytes", source="shop", slot=slot) is not None
        with psycopg.connect(pg_dsn) as conn:
            lsn = conn.execute("SELECT confirmed_flush_lsn - '0/0' FROM pg_replication_slots "
                               "WHERE slot_name = %s", (slot,)).fetchone()[0]
        confirmed = value(s, "kappaflow_capture_confirmed_position", source="shop")
        assert confirmed is not None and abs(confirmed - int(lsn)) < 1 << 24, (confirmed, lsn)
        # idle now: the heartbeat's round trip is the lag, measured every second
        lag = value(s, "kappaflow_capture_source_lag_seconds", source="shop")
        assert lag is not None and 0 <= lag < 60, lag
        assert value(s, "kappaflow_capture_errors_total", source="shop", kind="transient") == 0
        assert value(s, "kappaflow_capture_restarts_total", source="shop") == 0
        body = fetch(url)
        assert SECRET not in body
    finally:
        stop(proc)
    output = err.read_text()
    assert SECRET not in output
    assert "metrics on http://127.0.0.1:" in output


def test_capture_errors_and_restarts_are_counted_and_the_password_stays_out(tmp_path: Path) -> None:
    """A source that refuses connections: each failed run is a transient error and a restart (the capture
    retries with backoff); the metric labels name the source only, and the password given for it appears
    neither in the scrape nor in the retry lines."""
    from kappaflow.testing.servers._process import free_port

    dsn = f"postgresql://app@127.0.0.1:{free_port()}/shop"  # nothing listens there
    proc, err, _cfg = start_capture(tmp_path, dsn)
    try:
        url = endpoint_of(err)
        s = wait_for(lambda: (lambda x: x if (value(x, "kappaflow_capture_restarts_total", source="shop") or 0) >= 2
                              else None)(scrape(url)), 120, "two restarts")
        assert (value(s, "kappaflow_capture_errors_total", source="shop", kind="transient") or 0) >= 2
        assert value(s, "kappaflow_capture_errors_total", source="shop", kind="terminal") == 0
        assert value(s, "kappaflow_capture_phase", source="shop", phase="starting") == 1
        assert SECRET not in fetch(url)
    finally:
        stop(proc)
    text = err.read_text()
    assert "retrying in" in text and SECRET not in text


def test_mysql_capture_metrics(tmp_path: Path, mariadb_server: Any, mariadb_db: str) -> None:
    """The same counters for a MariaDB binlog capture, and its position figures: binlog files and bytes
    behind (0 once caught up) and the confirmed position as file sequence * 2^32 + byte position."""
    import pymysql

    name = "m" + mariadb_db.replace("_", "")
    mariadb_server.execute("CREATE TABLE t (id INT PRIMARY KEY, v TEXT)", db=mariadb_db)
    mariadb_server.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')", db=mariadb_db)
    dsn = f"mysql://root@{mariadb_server.host}:{mariadb_server.port}/{mariadb_db}"
    cfg = tmp_path / "kappaflow.toml"
    cfg.write_text(f'[log]\nurl = "{tmp_path / "log"}"\npartitions = 1\n'
                   f'[sources.{name}]\nkind = "mysql"\ndsn = "{dsn}"\ntables = ["{mariadb_db}.t"]\n'
                   f"server_id = {6000 + os.getpid() % 1000}\n[metrics]\nprobe_interval_s = 0.5\n")
    err = tmp_path / "capture.log"
    with err.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kappaflow.cli.capture", name, "--config", str(cfg),
                                 "--metrics-port", "0", "--log-every", "0"], stdout=f, stderr=subprocess.STDOUT)
    try:
        url = endpoint_of(err)
        wait_for(lambda: value(scrape(url), "kappaflow_capture_phase", source=name, phase="streaming") == 1, 120,
                 "the capture to stream")
        conn = pymysql.connect(**mariadb_server.connect_args(mariadb_db), autocommit=True)
        try:
            with conn.cursor() as cur:
                for i in range(10, 15):  # 5 transactions
                    cur.execute("INSERT INTO t VALUES (%s, 'x')", (i,))
                cur.execute("UPDATE t SET v = 'y'")  # 1 transaction, 7 changes
        finally:
            conn.close()

        def settled() -> Any:
            s = scrape(url)
            done = (value(s, "kappaflow_capture_changes_total", source=name) == 2 + 5 + 7
                    and value(s, "kappaflow_capture_transactions_total", source=name) == 6
                    and value(s, "kappaflow_capture_binlog_bytes_behind", source=name) == 0)
            return s if done else None

        s = wait_for(settled, 120, "14 changes in 6 transactions, nothing behind")
        assert value(s, "kappaflow_capture_binlog_files_behind", source=name) == 0
        table = f"{mariadb_db}.t"
        assert value(s, "kappaflow_capture_snapshot_rows_total", source=name, table=table) == 2
        assert value(s, "kappaflow_capture_snapshot_progress_ratio", source=name, table=table) == 1
        with pymysql.connect(**mariadb_server.connect_args(mariadb_db)) as c, c.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            file, pos = cur.fetchone()[:2]
        expected = (int(file.rsplit(".", 1)[1]) << 32) + pos
        assert value(s, "kappaflow_capture_confirmed_position", source=name) == expected
        lag = value(s, "kappaflow_capture_source_lag_seconds", source=name)
        assert lag is not None and 0 <= lag < 60
    finally:
        stop(proc)
