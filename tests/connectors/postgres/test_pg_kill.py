"""kill -9 the PostgreSQL capture at seeded moments while a writer runs: the shipped capture
contract suite (``kappaflow.connectors.testing``) with a PostgreSQL source driver; and SIGTERM.

The suite kills the capture during the snapshot (at a seeded writer step of a seeded snapshot
batch) and while streaming, restarts it, and checks that per key every change an independent
slot (created before the capture's) decodes from the WAL is in the log once, in commit order.
The driver also checks that the compacted log equals the tables, row for row, and that no
record (snapshot reads included) was written twice.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from pg_helpers import compacted, positions, records, table_state

from kappaflow.connectors.base import record_position
from kappaflow.connectors.postgres.decoder import Begin, Delete, Insert, PgOutputDecoder, Update
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.connectors.testing import KafkaCaptureContract, SourceDriver, stored_offset, wait_for
from kappaflow.log import open_log
from kappaflow.log.base import Log

pytestmark = [pytest.mark.integration]

TABLES = ["public.acct", "public.audit"]
Key = tuple[str, int]  # (table, id)
Change = tuple[int, str]  # (commit LSN, op)


def _write_config(tmp: Path, name: str, dsn: str, log_url: str) -> Path:
    path = tmp / "kappaflow.toml"
    path.write_text(f'[log]\nurl = "{log_url}"\npartitions = 3\ncompact_interval_s = 0\n\n'
                    f"[sources.{name}]\n{_source_config(dsn, 250)}")
    return path


def _source_config(dsn: str, chunk_rows: int) -> str:
    return (f'kind = "postgres"\ndsn = "{dsn}"\ntables = {orjson.dumps(TABLES).decode()}\n'
            f"snapshot_chunk_rows = {chunk_rows}\nheartbeat_interval_s = 0.5\n")


def _capture_cmd(config: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "kappaflow.cli.capture", name, "--config", str(config), "--no-progress"]


class PostgresDriver(SourceDriver):
    """Two tables; random transactions: transfers with an audit row, new accounts, closures and
    renumbering (a key change: a delete of the old key and a create of the new one)."""

    # 50-row chunks: a snapshot of 120+ batches, so kills at batches 2..30 all land inside it
    snapshot_batches = (2, 30)
    min_commits = 50

    def __init__(self, dsn: str, name: str) -> None:
        self.dsn, self.name = dsn, name
        self.next_id = 100_000

    def source_config(self) -> str:
        return _source_config(self.dsn, 50)

    def prepare(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE acct (id int PRIMARY KEY, balance int NOT NULL, note text)")
            conn.execute("CREATE TABLE audit (id bigserial PRIMARY KEY, src int, dst int, amount int)")
            conn.execute("INSERT INTO acct SELECT i, 1000, repeat('x', i % 50) FROM generate_series(1, 6000) i")
            conn.execute(f'CREATE PUBLICATION "kappaflow_{self.name}" FOR TABLE acct, audit')
            conn.execute("SELECT pg_create_logical_replication_slot('verify', 'pgoutput')")

    def session(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True)

    def write_one(self, conn: psycopg.Connection[Any], rng: random.Random) -> None:
        r = rng.random()
        a, b = rng.randint(1, 6000), rng.randint(1, 6000)
        with conn.transaction():
            if r < 0.7:
                conn.execute("UPDATE acct SET balance = balance - 1 WHERE id = %s", (a,))
                conn.execute("UPDATE acct SET balance = balance + 1 WHERE id = %s", (b,))
                conn.execute("INSERT INTO audit (src, dst, amount) VALUES (%s, %s, 1)", (a, b))
            elif r < 0.8:
                conn.execute("INSERT INTO acct VALUES (%s, 0, 'new') ON CONFLICT DO NOTHING", (self.next_id,))
                self.next_id += 1
            elif r < 0.9:
                conn.execute("DELETE FROM acct WHERE id = %s", (a,))
            else:
                conn.execute("UPDATE acct SET id = %s WHERE id = %s", (self.next_id, a))
                self.next_id += 1

    def expected(self, offset: Any) -> dict[Key, list[Change]]:
        """Per (table, id), the changes an independent slot decodes from the WAL at or after the
        snapshot's LSN, in commit order."""
        dec = PgOutputDecoder()
        out: dict[Key, list[Change]] = {}
        commit = 0
        with psycopg.connect(self.dsn) as conn:
            rows = conn.execute(
                "SELECT data FROM pg_logical_slot_peek_binary_changes('verify', NULL, NULL, 'proto_version', '1', "
                "'publication_names', %s)", (f"kappaflow_{self.name}",)).fetchall()
        for (data,) in rows:
            msg = dec.decode(bytes(data))
            if isinstance(msg, Begin):
                commit = msg.final_lsn
            elif isinstance(msg, Insert | Update | Delete) and commit >= offset["snapshot"]["lsn"]:
                table = dec.relations[msg.relid].name
                if isinstance(msg, Insert):
                    out.setdefault((table, int(msg.new[0])), []).append((commit, "c"))
                elif isinstance(msg, Delete):
                    out.setdefault((table, int(msg.old[0])), []).append((commit, "d"))
                elif msg.old_kind == "K":  # the key changed: a delete of the old key, a create of the new
                    assert msg.old is not None
                    out.setdefault((table, int(msg.old[0])), []).append((commit, "d"))
                    out.setdefault((table, int(msg.new[0])), []).append((commit, "c"))
                else:
                    out.setdefault((table, int(msg.new[0])), []).append((commit, "u"))
        return out

    def logged(self, log: Log) -> dict[Key, list[Change]]:
        """Per (table, id), the streamed change events of the log, partition by partition."""
        out: dict[Key, list[Change]] = {}
        for table in ("acct", "audit"):
            for rec in records(log, f"{self.name}.public.{table}"):
                if rec.value is None:
                    continue  # a tombstone after a delete
                pos = record_position(rec)
                assert isinstance(pos, PgPosition), f"record without a PostgreSQL position: {rec}"
                if pos.snapshot:
                    continue
                doc = orjson.loads(rec.value)
                row = doc["after"] if doc["after"] is not None else doc["before"]
                out.setdefault((table, int(row["id"])), []).append((pos.lsn, doc["op"]))
        return out

    def check_log(self, log: Log) -> None:
        for table in ("acct", "audit"):
            topic = f"{self.name}.public.{table}"
            assert compacted(log, topic) == table_state(self.dsn, f"public.{table}", self.name), f"{table} differs"
            twice = [p for p, n in Counter(positions(log, topic)).items() if n > 1]
            assert not twice, f"written twice in {topic}: {twice[:5]}"

    def close(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                         "WHERE slot_name = 'verify' AND database = current_database()")


class TestPostgresCapture(KafkaCaptureContract):
    kills = 11
    snapshot_kills = 3
    kafka_kills = 5
    kafka_snapshot_kills = 3
    seed = 1234
    streaming_pause = (0.05, 0.6)

    @pytest.fixture
    def driver(self, pg_dsn: str, source_name: str) -> Iterator[PostgresDriver]:
        driver = PostgresDriver(pg_dsn, source_name)
        yield driver
        driver.close()

    @pytest.fixture
    def kafka_bootstrap(self, kafka_broker: Any) -> str:
        return str(kafka_broker.bootstrap)


def test_sigterm_stops_cleanly_and_acknowledges(tmp_path: Path, pg_dsn: str, source_name: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int PRIMARY KEY, balance int NOT NULL, note text)")
        conn.execute("CREATE TABLE audit (id bigserial PRIMARY KEY, src int, dst int, amount int)")
        conn.execute("INSERT INTO acct SELECT i, 0, 'n' FROM generate_series(1, 100) i")
    log_url = str(tmp_path / "log")
    config = _write_config(tmp_path, source_name, pg_dsn, log_url)
    proc = subprocess.Popen(_capture_cmd(config, source_name), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=str(tmp_path))
    try:
        wait_for(lambda: (o := stored_offset(log_url, source_name, False)) is not None
                 and o["phase"] == "streaming", 60, "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("UPDATE acct SET balance = 1 WHERE id <= 10")
            end = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]  # type: ignore[index]
        hi, lo = end.split("/")
        target = (int(hi, 16) << 32) | int(lo, 16)
        wait_for(lambda: ((stored_offset(log_url, source_name, False) or {}).get("lsn", 0)) >= target, 60,
                 "the update to be captured")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.decode()
    assert b"SIGTERM received" in out
    with psycopg.connect(pg_dsn) as conn:
        confirmed = conn.execute("SELECT confirmed_flush_lsn::text, active FROM pg_replication_slots "
                                 "WHERE slot_name = %s", (f"kappaflow_{source_name}",)).fetchone()
    assert confirmed is not None and confirmed[1] is False  # released
    hi, lo = confirmed[0].split("/")
    assert (int(hi, 16) << 32) | int(lo, 16) >= target  # everything durable was acknowledged before exit
    log = open_log(log_url, read_only=True)
    try:
        assert compacted(log, f"{source_name}.public.acct") == table_state(pg_dsn, "public.acct", source_name)
    finally:
        log.close()
