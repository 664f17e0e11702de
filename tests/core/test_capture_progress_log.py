"""Capture without a terminal logs a timestamped progress line per interval (issue 13 item 9).

The capture runs as a real process with stderr redirected to a file (as under a service manager),
against the session's PostgreSQL and MariaDB, while rows are written; it used to print nothing
until it ended.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests._kill import wait_for

pytestmark = pytest.mark.integration

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ "
LINE = re.compile(STAMP + r"(?P<src>\S+): (?P<phase>streaming|snapshot|starting), (?P<changes>[\d,]+) changes"
                  r"(?: \((?P<rate>[\d,]+)/s\))?.*, position (?P<pos>\S+), lag (?P<lag>.+)$")


def _start(tmp_path: Path, source_toml: str, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    cfg = tmp_path / "kappaflow.toml"
    cfg.write_text(f'[log]\nurl = "{tmp_path / "log"}"\npartitions = 1\n{source_toml}')
    err = tmp_path / "stderr.txt"
    env = {**os.environ, "COLUMNS": ""}
    with err.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kappaflow.cli.capture", name, "--config", str(cfg),
                                 "--log-every", "0.5"], stdout=subprocess.DEVNULL, stderr=f, env=env)
    return proc, err


def _lines(err: Path) -> list[str]:
    return [ln for ln in err.read_text().splitlines() if ln.strip()]


def _run_while_writing(tmp_path: Path, source_toml: str, name: str, write: Callable[[int], None]) -> list[str]:
    proc, err = _start(tmp_path, source_toml, name)
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            write(i)
            stop.wait(0.02)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        def streaming_lines() -> list[Any]:
            assert proc.poll() is None, f"capture exited early: {err.read_text()}"
            found = [m for m in (LINE.match(ln) for ln in _lines(err)) if m and m["phase"] == "streaming"
                     and m["rate"] is not None and int(m["changes"].replace(",", "")) > 0]
            return found if len(found) >= 2 else []

        try:
            found = wait_for(streaming_lines, 120, "two streaming progress lines with a rate")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the capture's stderr so far:\n{err.read_text()[-3000:]}") from None
    finally:
        stop.set()
        t.join()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, err.read_text()
    counts = [int(m["changes"].replace(",", "")) for m in found]
    assert counts == sorted(counts), counts
    assert all(m["src"] == f"{name}:".rstrip(":") for m in found)
    lines = _lines(err)
    assert all(re.match(STAMP, ln) for ln in lines), lines  # every line carries its time
    return [m.string for m in found]


def test_postgres_capture_logs_progress_with_slot_lag(tmp_path: Path, pg_dsn: str) -> None:
    name = f"p{os.getpid()}x{abs(hash(pg_dsn)) % 10**6}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn = psycopg.connect(pg_dsn, autocommit=True)
    try:
        found = _run_while_writing(
            tmp_path, f'[sources.{name}]\nkind = "postgres"\ndsn = "{pg_dsn}"\ntables = ["public.t"]\n', name,
            lambda i: conn.execute("INSERT INTO t VALUES (%s, 'x')", (i,)))
    finally:
        conn.close()
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            slot = f"kappaflow_{name}"
            wait_for(lambda: not c.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
                                           (slot,)).fetchone(), 60, "the stopped capture to release its slot")
            c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                      (slot,))
    last = LINE.match(found[-1])
    assert last is not None and re.fullmatch(r"[0-9A-F]+/[0-9A-F]+", last["pos"]), found
    assert re.fullmatch(r"[\d,.]+ (bytes|kB|MB)", last["lag"]), found


def test_mysql_capture_logs_progress_with_binlog_lag(tmp_path: Path, mariadb_server: Any, mariadb_db: str) -> None:
    import pymysql

    name = "m" + mariadb_db.replace("_", "")
    mariadb_server.execute("CREATE TABLE t (id INT PRIMARY KEY, v TEXT)", db=mariadb_db)
    conn = pymysql.connect(**mariadb_server.connect_args(mariadb_db), autocommit=True)
    dsn = f"mysql://root@{mariadb_server.host}:{mariadb_server.port}/{mariadb_db}"
    try:
        found = _run_while_writing(
            tmp_path, f'[sources.{name}]\nkind = "mysql"\ndsn = "{dsn}"\ntables = ["{mariadb_db}.t"]\n'
            f"server_id = {5000 + os.getpid() % 1000}\n", name,
            lambda i: conn.cursor().execute("INSERT INTO t VALUES (%s, 'x')", (i,)))
    finally:
        conn.close()
    last = LINE.match(found[-1])
    assert last is not None and re.fullmatch(r".+\.\d+:\d+", last["pos"]), found
    assert re.fullmatch(r"[\d,.]+ (bytes|kB|MB)|\d+ binlog file\(s\) behind", last["lag"]), found
