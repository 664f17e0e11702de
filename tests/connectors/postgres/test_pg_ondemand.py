"""On-demand snapshots of a running PostgreSQL capture (issue 22, items 1 and 2), on a real server.

What is checked against the source itself (not against kappaflow's own output): after a snapshot
that raced concurrent updates, deletes and inserts of the rows it was reading, the compacted log
equals the table row for row; a kill -9 mid-snapshot resumes from the last durable chunk (every
chunk but at most the one in flight is read once); pause / resume / stop; add-table and
remove-table through the CLI; and the bad inputs, with their messages.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from pg_helpers import capture, compacted, config, records, table_state, wait_for

from kappaflow.connectors.base import StopSignal, record_position
from kappaflow.connectors.ondemand import FileChannel
from kappaflow.connectors.postgres.connector import PostgresConnector
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.connectors.testing import stored_offset
from kappaflow.log import open_log
from kappaflow.log.base import Log

pytestmark = [pytest.mark.integration]

WIDE = ", ".join(f"c{i} text" for i in range(10))


def _make_table(sql: Any, name: str, rows: int) -> None:
    sql(f"CREATE TABLE {name} (id int PRIMARY KEY, v int NOT NULL, ts timestamptz DEFAULT now(), {WIDE})")
    cols = ", ".join(f"'{name}-' || i || '-{i}'" for i in range(10))
    sql(f"INSERT INTO {name} SELECT i, 0, now(), {cols} FROM generate_series(1, {rows}) i")


class Writer(threading.Thread):
    """Random updates, deletes and inserts over a table's whole key range until stopped (seeded)."""

    def __init__(self, dsn: str, table: str, top: int, seed: int = 7) -> None:
        super().__init__(daemon=True)
        self.dsn, self.table, self.top = dsn, table, top
        self.rng = random.Random(seed)
        self.halt = threading.Event()
        self.commits = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.halt.is_set():
                    r = self.rng.random()
                    k = self.rng.randint(1, self.top)
                    with conn.transaction():
                        if r < 0.6:
                            conn.execute(f"UPDATE {self.table} SET v = v + 1, c0 = md5(random()::text) "
                                         "WHERE id = %s", (k,))
                        elif r < 0.8:
                            conn.execute(f"DELETE FROM {self.table} WHERE id = %s", (k,))
                        else:
                            conn.execute(f"INSERT INTO {self.table} (id, v) VALUES (%s, -1) ON CONFLICT (id) DO "
                                         "UPDATE SET v = excluded.v", (k,))
                    self.commits += 1
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        assert not self.is_alive(), "writer did not stop"
        if self.error is not None:
            raise self.error


class Running:
    """A capture running in a thread of this process (embedded log opened here as the writer)."""

    def __init__(self, cfg: Any, log: Log) -> None:
        self.connector = PostgresConnector(cfg, log, partitions=3, progress=False)
        self.stop_signal = StopSignal()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.error is not None or (self.connector.summary is not None
                                                    and self.connector.summary.phase == "streaming"),
                 60, "the capture to stream")
        self._raise()

    def _run(self) -> None:
        try:
            self.connector.run(self.stop_signal)
        except BaseException as exc:
            self.error = exc

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def ondemand(self) -> dict[str, Any]:
        self._raise()
        s = self.connector.summary
        return dict(s.ondemand) if s is not None else {}

    def close(self) -> None:
        self.stop_signal.set("test")
        self.thread.join(60)
        assert not self.thread.is_alive(), "capture did not stop"
        self._raise()


def _snapshot_reads(log: Log, topic: str) -> list[tuple[PgPosition, bytes]]:
    """(position, key) of every on-demand read (``source.snapshot`` = "incremental"), in position order."""
    out = []
    for rec in records(log, topic):
        if rec.value is None:
            continue
        doc = orjson.loads(rec.value)
        if doc["op"] == "r" and doc["source"]["snapshot"] == "incremental":
            pos = record_position(rec)
            assert isinstance(pos, PgPosition) and pos.snapshot
            assert rec.key is not None
            out.append((pos, rec.key))
    return sorted(out, key=lambda pk: pk[0].sort_key())


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "log"


@pytest.fixture
def elog(log_dir: Path) -> Iterator[Log]:
    log = open_log(str(log_dir), compact_interval_s=None)
    yield log
    log.close()


def test_ondemand_snapshot_races_updates_deletes_and_inserts(pg_dsn: str, sql: Any, source_name: str, elog: Log,
                                                             log_dir: Path) -> None:
    rows = 6000
    _make_table(sql, "big", rows)
    cfg = config(pg_dsn, source_name, ["public.big"], snapshot_mode="never", snapshot_chunk_rows=250)
    run = Running(cfg, elog)
    writer = Writer(pg_dsn, "big", rows + 500)
    try:
        writer.start()
        wait_for(lambda: writer.commits > 50 or writer.error, 30, "the writer to start")
        channel = FileChannel(log_dir)
        seq = channel.submit(source_name, "start", ["public.big"])
        channel.close()
        assert seq >= 1
        wait_for(lambda: run.ondemand().get("state") == "done", 180, "the on-demand snapshot to finish")
        writer.stop()
        assert writer.commits > 200, f"only {writer.commits} concurrent commits: the race was not exercised"
    finally:
        writer.halt.set()
        run.close()
    capture(cfg, elog)  # everything committed is in the log
    topic = f"{source_name}.public.big"
    assert compacted(elog, topic) == table_state(pg_dsn, "public.big", source_name)
    view = run.connector.summary.ondemand  # type: ignore[union-attr]
    table = view["tables"]["public.big"]
    reads = _snapshot_reads(elog, topic)
    chunks = {p.lsn for p, _ in reads}
    # every row read went into a chunk: written, or left out because the stream changed its key meanwhile
    assert len(chunks) <= table["chunks"] and table["chunks"] >= (table["rows"] + table["dropped"]) // 250, \
        (len(chunks), table)
    assert len(reads) == table["rows"]
    twice = [k for k, n in Counter(k for _, k in reads).items() if n > 1]
    assert not twice, f"keys read twice: {twice[:5]}"
    stored = stored_offset(str(log_dir), source_name, False)
    assert stored is not None and stored["ondemand"]["state"] == "done"


def test_ondemand_where_pause_resume_stop(pg_dsn: str, sql: Any, source_name: str, elog: Log,
                                          log_dir: Path) -> None:
    _make_table(sql, "big", 3000)
    sql("CREATE TABLE tick (id int PRIMARY KEY)")
    cfg = config(pg_dsn, source_name, ["public.big", "public.tick"], snapshot_mode="never", snapshot_chunk_rows=100)
    run = Running(cfg, elog)
    channel = FileChannel(log_dir)
    ticks = iter(range(1, 1000))

    def stream_moved() -> None:
        """One change through the stream (a loop turn of the capture has passed once it is in the log)."""
        i = next(ticks)
        sql("INSERT INTO tick VALUES (%s)", (i,))
        key = orjson.dumps({"id": i})
        wait_for(lambda: key in compacted(elog, f"{source_name}.public.tick"), 30, f"tick {i} in the log")

    try:
        channel.submit(source_name, "start", ["public.big"], "id % 2 = 0")
        wait_for(lambda: run.ondemand().get("rows", 0) >= 300, 60, "a few chunks")
        channel.submit(source_name, "pause")
        wait_for(lambda: run.ondemand().get("state") == "paused", 30, "the pause")
        rows = run.ondemand()["rows"]
        for _ in range(3):
            stream_moved()
        assert run.ondemand()["rows"] == rows, "chunks were read while paused"
        assert run.ondemand()["eta_s"] is not None and run.ondemand()["rows_per_s"] > 0
        channel.submit(source_name, "resume")
        wait_for(lambda: run.ondemand().get("state") == "done", 60, "the resumed snapshot to finish")
        done = run.ondemand()
        assert done["rows"] == 1500  # only the even ids: --where
        # a second snapshot, stopped midway: progress is kept, nothing more is read
        channel.submit(source_name, "start", ["public.big"])
        wait_for(lambda: run.ondemand().get("state") == "running" and run.ondemand().get("rows", 0) >= 200, 60,
                 "the second snapshot to read")
        channel.submit(source_name, "stop")
        wait_for(lambda: run.ondemand().get("state") == "stopped", 30, "the stop")
        rows = run.ondemand()["rows"]
        stream_moved()
        assert run.ondemand()["rows"] == rows < 3000
    finally:
        channel.close()
        run.close()
    reads = _snapshot_reads(elog, f"{source_name}.public.big")
    assert len(reads) == 1500 + rows
    assert all(orjson.loads(k)["id"] % 2 == 0 for _, k in reads[:1500]), "--where was not applied"
    stored = stored_offset(str(log_dir), source_name, False)
    assert stored is not None and stored["ondemand"]["state"] == "stopped"


# -- through the CLI, in other processes -----------------------------------------------------------------

def _write_config(tmp: Path, name: str, dsn: str, tables: list[str], chunk_rows: int) -> Path:
    path = tmp / "kappaflow.toml"
    path.write_text(f'[log]\nurl = "{tmp / "log"}"\npartitions = 3\ncompact_interval_s = 0\n\n'
                    f'[sources.{name}]\nkind = "postgres"\ndsn = "{dsn}"\ntables = {orjson.dumps(tables).decode()}\n'
                    f"snapshot_chunk_rows = {chunk_rows}\nheartbeat_interval_s = 0.5\n")
    return path


def _cli(config: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kappaflow.cli", "--config", str(config), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=str(config.parent),
                          env={**os.environ, "COLUMNS": "200"})


def _start_capture(config: Path, name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "kappaflow.cli.capture", name, "--config", str(config),
                             "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=str(config.parent))


def _alive(log_dir: Path, name: str) -> bool:
    if not (log_dir / "ondemand.db").exists():
        return False
    ch = FileChannel(log_dir)
    try:
        return ch.alive(name) is not None
    finally:
        ch.close()


def _end(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_kill9_mid_snapshot_resumes_from_the_last_chunk(tmp_path: Path, pg_dsn: str, sql: Any,
                                                        source_name: str) -> None:
    rows, chunk = 8000, 200
    _make_table(sql, "big", rows)
    cfg_path = _write_config(tmp_path, source_name, pg_dsn, ["public.big"], chunk)
    log_dir = tmp_path / "log"
    # the initial snapshot first, so the on-demand one re-reads rows the log already holds
    proc = _start_capture(cfg_path, source_name)
    writer = Writer(pg_dsn, "big", rows + 300, seed=11)
    try:
        wait_for(lambda: _alive(log_dir, source_name), 60, "the capture to stream")
        writer.start()
        out = _cli(cfg_path, "snapshot", source_name, "--tables", "public.big")
        assert out.returncode == 0, out.stderr
        assert "request" in out.stdout
        wait_for(lambda: ((stored_offset(str(log_dir), source_name, False) or {}).get("ondemand") or {})
                 .get("tables", [{}])[0].get("chunks", 0) >= 5, 60, "5 durable chunks")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        killed_at = stored_offset(str(log_dir), source_name, False)["ondemand"]["tables"][0]  # type: ignore[index]
        assert not killed_at["done"]
        proc = _start_capture(cfg_path, source_name)
        wait_for(lambda: ((stored_offset(str(log_dir), source_name, False) or {}).get("ondemand") or {})
                 .get("state") == "done", 120, "the resumed snapshot to finish")
        status = _cli(cfg_path, "snapshot", source_name, "--json")
        assert status.returncode == 0, status.stderr
        view = orjson.loads(status.stdout.strip().splitlines()[-1])
        assert view["state"] == "done" and view["tables"]["public.big"]["done"]
        writer.stop()
    finally:
        writer.halt.set()
        _end(proc)
    log = open_log(str(log_dir), compact_interval_s=None)
    try:
        capture(config(pg_dsn, source_name, ["public.big"]), log)
        topic = f"{source_name}.public.big"
        assert compacted(log, topic) == table_state(pg_dsn, "public.big", source_name)
        od = _snapshot_reads(log, topic)
        final = stored_offset(str(log_dir), source_name, False)["ondemand"]["tables"][0]  # type: ignore[index]
        chunks = {p.lsn for p, _ in od}
        # every chunk once, except at most the one in flight at the kill (read again after the restart)
        # (a chunk whose rows were all changed meanwhile writes no read, hence <=)
        assert len(chunks) <= final["chunks"] + 1, (len(chunks), final)
        doubled = [k for k, n in Counter(k for _, k in od).items() if n > 1]
        assert len(doubled) <= chunk, f"{len(doubled)} keys read twice: more than the one chunk in flight"
        assert final["rows"] <= len(od) <= final["rows"] + chunk
        assert killed_at["chunks"] < final["chunks"]
    finally:
        log.close()


def test_add_table_and_remove_table_through_the_cli(tmp_path: Path, pg_dsn: str, sql: Any,
                                                    source_name: str) -> None:
    _make_table(sql, "a", 100)
    _make_table(sql, "b", 1200)
    cfg_path = _write_config(tmp_path, source_name, pg_dsn, ["public.a"], 300)
    log_dir = tmp_path / "log"
    proc = _start_capture(cfg_path, source_name)
    try:
        wait_for(lambda: _alive(log_dir, source_name), 60, "the capture to stream")
        out = _cli(cfg_path, "source", "add-table", source_name, "public.b", "--wait")
        assert out.returncode == 0, out.stderr
        assert "ALTER PUBLICATION" in out.stdout and "done" in out.stdout
        assert 'public.b' in cfg_path.read_text()
        pub = sql("SELECT tablename FROM pg_publication_tables WHERE pubname = %s ORDER BY 1",
                  (f"kappaflow_{source_name}",))
        assert [r[0] for r in pub] == ["a", "b"]
        sql("UPDATE b SET v = 42 WHERE id <= 10")
        sql("DELETE FROM b WHERE id BETWEEN 11 AND 20")
        mark = sql("SELECT pg_current_wal_insert_lsn()::text")[0][0]
        hi, lo = mark.split("/")
        target = (int(hi, 16) << 32) | int(lo, 16)
        wait_for(lambda: (stored_offset(str(log_dir), source_name, False) or {}).get("lsn", 0) >= target, 60,
                 "b's changes to be captured")
        status = _cli(cfg_path, "source", "status", source_name, "--json")
        assert status.returncode == 0, status.stderr
        assert orjson.loads(status.stdout)["ondemand"]["tables"]["public.b"]["done"]
        out = _cli(cfg_path, "source", "remove-table", source_name, "public.b")
        assert out.returncode == 0, out.stderr
        assert "DROP TABLE" in out.stdout
        assert "public.b" not in cfg_path.read_text()
    finally:
        _end(proc)
    log = open_log(str(log_dir), read_only=True)
    try:
        topic = f"{source_name}.public.b"
        assert compacted(log, topic) == table_state(pg_dsn, "public.b", source_name)
        ends = log.end_offsets(topic)
    finally:
        log.close()
    sql("UPDATE b SET v = 7")  # not captured any more
    log = open_log(str(log_dir), compact_interval_s=None)
    try:
        capture(config(pg_dsn, source_name, ["public.a"]), log)
        assert log.end_offsets(topic) == ends, "a removed table is still captured"
    finally:
        log.close()


def test_bad_input_says_what_is_wrong(tmp_path: Path, pg_dsn: str, sql: Any, source_name: str) -> None:
    _make_table(sql, "a", 10)
    sql("CREATE TABLE nokey (x int, y text)")
    cfg_path = _write_config(tmp_path, source_name, pg_dsn, ["public.a"], 100)
    log = open_log(str(tmp_path / "log"), compact_interval_s=None)
    log.close()

    def err(*args: str) -> str:
        out = _cli(cfg_path, *args)
        assert out.returncode == 2, (out.stdout, out.stderr)
        return " ".join(out.stderr.split())

    assert "unknown table public.nope" in err("snapshot", source_name, "--tables", "public.nope")
    msg = err("snapshot", source_name, "--tables", "public.a", "--where", "id >>> 'x")
    assert "--where" in msg and "does not run against public.a" in msg
    msg = err("snapshot", source_name, "--tables", "public.a", "--where", "no_such_column = 1")
    assert "no_such_column" in msg
    msg = err("snapshot", source_name, "--tables", "public.nokey")
    assert "public.nokey cannot be captured" in msg and "key" in msg
    msg = err("source", "add-table", source_name, "public.nokey")
    assert "public.nokey cannot be captured" in msg
    msg = err("snapshot", source_name, "--tables", "public.a")
    assert "is not capturing" in msg
    assert "--where needs --tables" in err("snapshot", source_name, "--where", "id = 1")
    assert "at most one" in err("snapshot", source_name, "--pause", "--stop")
    msg = err("source", "remove-table", source_name, "public.a")
    assert "only table" in msg
    # checking a --where runs nothing of it (LIMIT 0): the sequence is untouched
    sql("CREATE SEQUENCE bumps")
    assert "is not capturing" in err("snapshot", source_name, "--tables", "public.a", "--where", "nextval('bumps') > 0")
    assert sql("SELECT last_value, is_called FROM bumps")[0] == (1, False)


def test_a_where_cannot_write_and_the_capture_goes_on(pg_dsn: str, sql: Any, source_name: str, elog: Log,
                                                      log_dir: Path) -> None:
    _make_table(sql, "a", 50)
    sql("CREATE SEQUENCE bumps")
    cfg = config(pg_dsn, source_name, ["public.a"], snapshot_mode="never", snapshot_chunk_rows=10)
    run = Running(cfg, elog)
    channel = FileChannel(log_dir)
    try:
        channel.submit(source_name, "start", ["public.a"], "nextval('bumps') > 0")
        wait_for(lambda: run.ondemand().get("state") == "stopped", 30, "the snapshot to be stopped")
        assert "read-only transaction" in run.ondemand()["error"]
        sql("UPDATE a SET v = 5 WHERE id = 1")  # streaming goes on
        wait_for(lambda: compacted(elog, f"{source_name}.public.a").get(orjson.dumps({"id": 1}), {}).get("v") == 5,
                 30, "the update to be streamed")
    finally:
        channel.close()
        run.close()
    assert sql("SELECT last_value, is_called FROM bumps")[0] == (1, False)
