"""kill -9 the capture process at seeded moments while a writer runs; then check exactness.

The capture runs as a real process (``python -m kappaflow.cli.capture NAME --config ...``).
Each trial kills it during the snapshot (first trials: at a seeded writer step of a seeded
snapshot batch) or while streaming (after a seeded pause), and starts it again. At the end,
with the writer stopped and one clean ``--until-caught-up`` run:

* the compacted log equals the tables, row for row;
* no record was written twice (positions are unique per topic);
* every committed change is present exactly once: per transaction and table, the log
  holds as many streamed events as an independent slot (created before the capture's)
  decodes from the WAL.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from pg_helpers import compacted, positions, table_state

from kappaflow.connectors.postgres.decoder import Begin, Delete, Insert, PgOutputDecoder, Update
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.log import open_log
from tests._kill import BackgroundWriter, kill_trials, open_for_check, run_until_caught_up, stored_offset, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TABLES = ["public.acct", "public.audit"]


def _write_config(tmp: Path, name: str, dsn: str, log_url: str, client: str | None = None,
                  chunk_rows: int = 250) -> Path:
    path = tmp / "kappaflow.toml"
    path.write_text(
        # every streamed event is counted below: the capture's background compaction stays off
        f'[log]\nurl = "{log_url}"\npartitions = 3\ncompact_interval_s = 0\n\n'
        f'[sources.{name}]\nkind = "postgres"\ndsn = "{dsn}"\ntables = {orjson.dumps(TABLES).decode()}\n'
        f"snapshot_chunk_rows = {chunk_rows}\nheartbeat_interval_s = 0.5\n"
        + (f'\n[log.kafka]\nclient = "{client}"\n' if client else "")
    )
    return path


def _capture_cmd(config: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "kappaflow.cli.capture", name, "--config", str(config), "--no-progress"]


class Writer(BackgroundWriter):
    """Random transactions: transfers with an audit row, new accounts, closures, renumbering."""

    def __init__(self, dsn: str, seed: int) -> None:
        super().__init__(seed)
        self.dsn = dsn
        self.next_id = 100_000

    def session(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True)

    def write_one(self, conn: psycopg.Connection[Any]) -> None:
        r = self.rng.random()
        a, b = self.rng.randint(1, 6000), self.rng.randint(1, 6000)
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


def _expected_streamed(dsn: str, slot: str, publication: str, from_lsn: int) -> Counter[tuple[str, int]]:
    """(table, commit LSN) -> change events, decoded from an independent slot's WAL."""
    dec = PgOutputDecoder()
    expected: Counter[tuple[str, int]] = Counter()
    commit = 0
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
            "'publication_names', %s)", (slot, publication)).fetchall()
    for (data,) in rows:
        msg = dec.decode(bytes(data))
        if isinstance(msg, Begin):
            commit = msg.final_lsn
        elif isinstance(msg, Insert | Update | Delete) and commit >= from_lsn:
            table = dec.relations[msg.relid].name
            key_change = isinstance(msg, Update) and msg.old_kind == "K"
            expected[(table, commit)] += 2 if key_change else 1
    return expected


def _trials(tmp_path: Path, dsn: str, name: str, log_url: str, kafka: bool, kills: int, seed: int,
            client: str | None = None) -> None:
    rng = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int PRIMARY KEY, balance int NOT NULL, note text)")
        conn.execute("CREATE TABLE audit (id bigserial PRIMARY KEY, src int, dst int, amount int)")
        conn.execute("INSERT INTO acct SELECT i, 1000, repeat('x', i % 50) FROM generate_series(1, 6000) i")
        conn.execute(f'CREATE PUBLICATION "kappaflow_{name}" FOR TABLE acct, audit')
        conn.execute("SELECT pg_create_logical_replication_slot('verify', 'pgoutput')")
    # 50-row chunks: a snapshot of 120+ batches, so three kills at batches 2..30 all land inside it
    config = _write_config(tmp_path, name, dsn, log_url, client, chunk_rows=50)
    cmd = _capture_cmd(config, name)
    writer = Writer(dsn, seed)
    writer.start()
    try:
        phases = kill_trials(cmd, tmp_path, log_url, name, kafka=kafka, kills=kills, snapshot_kills=3, rng=rng,
                             streaming_pause=(0.05, 0.6), snapshot_batches=(2, 30))
    finally:
        writer.stop()
    assert writer.error is None, writer.error
    assert writer.commits > 50
    assert "snapshot" in phases and "streaming" in phases, phases
    run_until_caught_up(cmd, tmp_path)

    log = open_for_check(log_url, kafka)
    try:
        final = stored_offset(log_url, name, kafka)
        assert final is not None and final["snapshot"]["completed"]
        seen: Counter[tuple[str, int]] = Counter()
        for table in ("acct", "audit"):
            topic = f"{name}.public.{table}"
            assert compacted(log, topic) == table_state(dsn, f"public.{table}", name), f"{table} differs"
            pos = positions(log, topic)
            twice = [p for p, n in Counter(pos).items() if n > 1]
            assert not twice, f"written twice in {topic}: {twice[:5]}"
            for p, tomb in pos:
                assert isinstance(p, PgPosition)
                if not tomb and not p.snapshot:
                    seen[(table, p.lsn)] += 1
        expected = _expected_streamed(dsn, "verify", f"kappaflow_{name}", final["snapshot"]["lsn"])
        assert seen == expected
    finally:
        log.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot('verify')")


def test_kill_9_during_snapshot_and_streaming_embedded(tmp_path: Path, pg_dsn: str, source_name: str) -> None:
    _trials(tmp_path, pg_dsn, source_name, str(tmp_path / "log"), kafka=False, kills=11, seed=1234)


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])  # capture with each Kafka client
def test_kill_9_kafka(tmp_path: Path, pg_dsn: str, source_name: str, kafka_broker: Any, client: str) -> None:
    _trials(tmp_path, pg_dsn, source_name, f"kafka://{kafka_broker.bootstrap}", kafka=True, kills=5, seed=99,
            client=client)


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
