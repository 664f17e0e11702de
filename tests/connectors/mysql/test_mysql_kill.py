"""kill -9 during the snapshot and during streaming, with writes going on: the log stays exact.

Each seeded trial: a table with rows, a writer thread changing it in small transactions, the
capture in a subprocess killed with SIGKILL once while it snapshots and once while it streams,
then a final run to catch up. Checked:

* the compacted log equals the table, row for row;
* no position appears twice among the change events (nothing written twice);
* every change the binlog holds after the capture's start (parsed independently with plain
  mysql-replication) is in the log at its position (nothing committed is missing).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUNNER = str(Path(__file__).with_name("capture_runner.py"))
TRIALS = 10


def _wait(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _offsets(log_dir: Path) -> list[dict[str, Any]]:
    from kappaflow.connectors.offsets import OFFSETS_TOPIC
    from kappaflow.log.embedded import EmbeddedLog

    if not (log_dir / "meta.db").exists():
        return []
    with EmbeddedLog(log_dir, read_only=True) as log:
        if OFFSETS_TOPIC not in log.list_topics():
            return []
        return [orjson.loads(r.value)["offset"] for r in log.iter_partition(OFFSETS_TOPIC, 0)
                if r.value is not None and orjson.loads(r.key) == {"source": "src"}]


class Writer(threading.Thread):
    """Random inserts, updates and deletes in small transactions until stopped."""

    def __init__(self, server: Any, db: str, rng: random.Random, first_id: int) -> None:
        super().__init__(daemon=True)
        self.server, self.db, self.rng = server, db, rng
        self.next_id = first_id
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.transactions = 0

    def run(self) -> None:
        import pymysql

        conn = pymysql.connect(host=self.server.host, port=self.server.port, user="root", password="",
                               database=self.db, autocommit=False)
        rng = self.rng
        try:
            with conn.cursor() as cur:
                while not self.stop_event.is_set():
                    for _ in range(rng.randint(1, 3)):
                        r = rng.random()
                        if r < 0.4:
                            cur.execute("INSERT INTO t VALUES (%s, %s, %s)", (self.next_id, rng.randint(0, 99),
                                                                             f"s{self.next_id}"))
                            self.next_id += 1
                        elif r < 0.8:
                            cur.execute("UPDATE t SET v = v + 1, s = %s WHERE id = %s",
                                        (f"u{rng.randint(0, 999)}", rng.randint(0, self.next_id)))
                        else:
                            cur.execute("DELETE FROM t WHERE id = %s", (rng.randint(0, self.next_id),))
                    conn.commit()
                    self.transactions += 1
                    time.sleep(0.003)  # pacing the load, not synchronising
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            conn.close()


def _binlog_changes(server: Any, db: str, start: dict[str, Any]) -> set[tuple[str, int, int]]:
    """Positions (file, transaction start, row index) of every change to db.t after ``start``."""
    from pymysqlreplication import BinLogStreamReader
    from pymysqlreplication.event import MariadbGtidEvent
    from pymysqlreplication.row_event import DeleteRowsEvent, UpdateRowsEvent, WriteRowsEvent

    reader = BinLogStreamReader(
        connection_settings={"host": server.host, "port": server.port, "user": "root", "password": ""},
        server_id=9999, resume_stream=True, log_file=start["file"], log_pos=start["pos"], blocking=False,
        only_events=[MariadbGtidEvent, WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent], enable_logging=False)
    out = set()
    txn, row = 0, 0
    for ev in reader:
        if isinstance(ev, MariadbGtidEvent):
            txn, row = ev.packet.log_pos - ev.event_size, 0
            continue
        if ev.schema != db or ev.table != "t":
            continue
        for _ in ev.rows:
            out.add((reader.log_file, txn, row))
            row += 1
    reader.close()
    return out


def _run_until_killed(log_dir: Path, dsn: str, db: str, chunk: int, ready: Any, timeout: float = 60) -> None:
    proc = subprocess.Popen([sys.executable, RUNNER, str(log_dir), dsn, f"{db}.t", str(chunk)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None:
                _out, err = proc.communicate()
                raise AssertionError(f"capture exited early ({proc.returncode}): {err.decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("capture did not reach the kill point in time")
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()


@pytest.mark.parametrize("seed", range(TRIALS))
def test_kill_during_snapshot_and_streaming(mariadb_server: Any, tmp_path: Path, mh: Any, seed: int) -> None:
    from kappaflow.log.embedded import EmbeddedLog

    rng = random.Random(seed)
    db = f"kill{seed}_{os.getpid()}"
    mariadb_server.execute(f"DROP DATABASE IF EXISTS `{db}`", f"CREATE DATABASE `{db}`")
    try:
        seed_rows = rng.randint(150, 400)
        mariadb_server.execute("CREATE TABLE t (id INT PRIMARY KEY, v INT, s VARCHAR(20))",
                               "INSERT INTO t VALUES " + ",".join(f"({i},{i % 7},'r{i}')" for i in range(seed_rows)),
                               db=db)
        writer = Writer(mariadb_server, db, random.Random(seed * 7919), seed_rows)
        writer.start()
        log_dir = tmp_path / "log"
        dsn = mh.dsn(mariadb_server, db)
        chunk = rng.choice([10, 20, 35])

        # 1. killed while snapshotting: after 1..4 committed chunks
        saves = rng.randint(1, 4)
        _run_until_killed(log_dir, dsn, db, chunk, lambda: len(_offsets(log_dir)) >= saves)
        assert _offsets(log_dir)[-1]["phase"] == "snapshot"
        # 2. killed while streaming: some time after the snapshot completed
        linger = rng.uniform(0.05, 0.6)
        streaming_since: list[float] = []

        def streaming_for_a_while() -> bool:
            offs = _offsets(log_dir)
            if offs and offs[-1]["phase"] == "streaming":
                if not streaming_since:
                    streaming_since.append(time.monotonic())
                return time.monotonic() - streaming_since[0] >= linger
            return False

        _run_until_killed(log_dir, dsn, db, chunk, streaming_for_a_while)
        writer.stop_event.set()
        writer.join(10)
        assert writer.error is None, writer.error
        assert writer.transactions > 10

        # 3. catch up in-process and check the log against the table and the binlog
        with EmbeddedLog(log_dir) as log:
            conn = mh.connector(mariadb_server, db, log, [f"{db}.t"], partitions=3)
            conn.run(until_caught_up=True)
            topic = f"src.{db}.t"
            state = {orjson.loads(k)["id"]: (v["v"], v["s"]) for k, v in mh.compacted(log, topic).items()}
            table = {r["id"]: (r["v"], r["s"]) for r in mh.table_rows(mariadb_server, db, "t")}
            assert state == table
            positions = [orjson.dumps(d["source"]["kf_pos"], option=orjson.OPT_SORT_KEYS)
                         for d in mh.events(log, topic) if d["op"] != "t"]
            assert len(positions) == len(set(positions)), "a change was written twice"
            logged = {(d["source"]["file"], d["source"]["pos"], d["source"]["row"]) for d in mh.events(log, topic)
                      if not d["source"]["kf_pos"]["snapshot"]}
            offset = _offsets(log_dir)[-1]
            expected = _binlog_changes(mariadb_server, db, offset["stream_start"])
            assert expected, "the trial made no changes after the capture started"
            missing = expected - logged
            assert not missing, f"{len(missing)} committed change(s) missing, e.g. {sorted(missing)[:3]}"
    finally:
        mariadb_server.execute(f"DROP DATABASE IF EXISTS `{db}`")
