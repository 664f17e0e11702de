"""Lost replication slots and ``kappaflow capture --resnapshot`` (issue 22, item 3).

A private PostgreSQL with ``max_slot_wal_keep_size = 1MB``: while the capture is stopped, rows are
deleted, updated and inserted, then WAL is generated (``pg_switch_wal`` + ``CHECKPOINT``) until the
server invalidates the slot (``wal_status = lost``). The capture must stop with an error that names
the slot and ``kappaflow capture NAME --resnapshot``; the re-snapshot must bring the log, and the
views that follow it (a latest-row view and a grouped count/sum, in PostgreSQL, through Spark), back
to the source: deleted rows gone, updates present, no row counted twice. A kill -9 mid-snapshot and
mid-deletes, followed by plain ``capture`` runs, must converge to the same. And ``--resnapshot`` on
a healthy source refuses, unless ``--force``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from pg_helpers import compacted, positions, records, table_state

from kappaflow.config import PostgresSourceConfig
from kappaflow.connectors.base import StopSignal, record_position
from kappaflow.connectors.postgres import PostgresConnector
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.connectors.resnapshot import ResnapshotRequest
from kappaflow.connectors.testing import _KILL_AT_SNAPSHOT_BATCH, stored_offset
from kappaflow.errors import Retry, SourceError
from kappaflow.log import open_log
from kappaflow.log.base import Log
from kappaflow.log.embedded import EmbeddedLog

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def small_wal_pg() -> Iterator[Any]:
    """A private PostgreSQL that invalidates a slot once it retains more than 1 MB of WAL."""
    from kappaflow.testing.servers.postgres import PrivatePostgres

    server = PrivatePostgres(settings={"max_slot_wal_keep_size": "1MB", "wal_keep_size": "0"}).start()
    try:
        yield server
    finally:
        server.stop()


def lose_slot(dsn: str, slot: str) -> None:
    """Write WAL, switch segments and checkpoint until the server invalidates ``slot`` (bounded)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE IF NOT EXISTS wal_filler (id bigserial PRIMARY KEY, pad text)")
        status = None
        for _ in range(30):
            row = c.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
            assert row is not None, f"slot {slot} vanished while generating WAL"
            status = row[0]
            if status == "lost":
                return
            c.execute("INSERT INTO wal_filler (pad) SELECT repeat('x', 2000) FROM generate_series(1, 300)")
            c.execute("SELECT pg_switch_wal()")
            c.execute("CHECKPOINT")
    raise AssertionError(f"slot {slot} still has wal_status={status!r} after 30 WAL segment switches")


def _accounts(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn) as conn:  # one transaction
        for s in statements:
            conn.execute(s)


SCHEMA = ("CREATE TABLE public.accounts (id bigint PRIMARY KEY, branch int NOT NULL, balance bigint NOT NULL, "
          "note text)")
SEED = "INSERT INTO public.accounts SELECT g, 1 + g % 4, 100 * g, 'n' || g FROM generate_series(1, {n}) g"
WHILE_LOST = (
    "DELETE FROM public.accounts WHERE id % 10 = 0",
    "UPDATE public.accounts SET balance = balance + 1000 WHERE id % 7 = 0",
    "UPDATE public.accounts SET branch = 9 WHERE id = 11",
    "INSERT INTO public.accounts SELECT g, 1 + g % 4, g, 'late' FROM generate_series(100001, 100030) g",
)


def _resnapshot_deletes(log: Log, topic: str) -> Counter[bytes]:
    """How many re-snapshot deletes (``kf_resnapshot``) each key got."""
    out: Counter[bytes] = Counter()
    for rec in records(log, topic):
        if rec.value is not None and b'"kf_resnapshot":true' in rec.value:
            doc = orjson.loads(rec.value)
            assert doc["op"] == "d" and doc["after"] is None, doc
            assert doc["before"] is not None and {"id", "branch", "balance"} <= set(doc["before"]), \
                f"a re-snapshot delete must carry the row as the log held it: {doc}"
            assert rec.key is not None
            out[rec.key] += 1
    return out


def _check_log(log: Log, dsn: str, source: str, deleted_ids: set[int]) -> None:
    topic = f"{source}.public.accounts"
    assert compacted(log, topic) == table_state(dsn, "public.accounts", source), "the log differs from the table"
    twice = [p for p, n in Counter(positions(log, topic)).items() if n > 1]
    assert not twice, f"records written twice: {twice[:5]}"
    for p in range(log.partitions(topic)):  # positions grow along every partition
        keys = [record_position(r).sort_key() for r in log.iter_partition(topic, p)]  # type: ignore[union-attr]
        assert keys == sorted(keys), f"positions out of order in partition {p}"
    dels = _resnapshot_deletes(log, topic)
    assert {orjson.loads(k)["id"] for k in dels} == deleted_ids, "each row deleted while lost gets one delete"
    assert set(dels.values()) == {1}, f"a key deleted twice by the re-snapshot: {dels.most_common(3)}"


# --- the views ----------------------------------------------------------------------------------------

def _projections(src: str, tag: str) -> dict[str, Any]:
    from kappaflow.projections import Count, Projection, Sum

    topic = f"{src}.public.accounts"
    return {
        "latest": type("AccountsLatest", (Projection,), {"name": f"acct_latest_{tag}", "sources": [topic],
                                                          "key": ["id"]}),
        "by_branch": type("AccountsByBranch", (Projection,), {
            "name": f"acct_by_branch_{tag}", "sources": [topic], "key": ["branch"],
            "aggregates": {"n": Count(), "total": Sum("balance")}}),
    }


EXPECTED = {
    "latest": ("SELECT id, branch, balance, note FROM public.accounts", "id, branch, balance, note"),
    "by_branch": ("SELECT branch, count(*), sum(balance) FROM public.accounts GROUP BY branch", "branch, n, total"),
}


@dataclass
class World:
    server: Any
    source_dsn: str
    views_dsn: str
    log_dir: Path
    source: str
    rt: Any = None
    projections: dict[str, Any] = field(default_factory=dict)

    @property
    def slot(self) -> str:
        return f"kappaflow_{self.source}"

    def config(self, **kw: Any) -> PostgresSourceConfig:
        kw.setdefault("snapshot_chunk_rows", 40)
        return PostgresSourceConfig(name=self.source, dsn=self.source_dsn, tables=["public.accounts"],
                                    heartbeat_interval_s=0.5, **kw)

    def capture(self, resnapshot: ResnapshotRequest | None = None, **kw: Any) -> Any:
        with EmbeddedLog(self.log_dir) as log:
            conn = PostgresConnector(self.config(**kw), log, partitions=3, progress=False)
            conn.resnapshot = resnapshot
            return conn.run(StopSignal(), until_caught_up=True)

    def check_views(self, when: str) -> None:
        with psycopg.connect(self.source_dsn) as src, psycopg.connect(self.views_dsn) as views:
            for name, (query, cols) in EXPECTED.items():
                want = sorted(src.execute(query).fetchall())  # type: ignore[arg-type]
                view = self.projections[name].name
                got = sorted(views.execute(f'SELECT {cols} FROM public."{view}"').fetchall())  # type: ignore[arg-type]
                assert got == want, f"{when}: view {name} differs from the source ({len(got)} vs {len(want)} rows)"


@pytest.fixture
def world(small_wal_pg: Any, pg_server: Any, tmp_path: Path) -> Iterator[World]:
    """The source on the small-WAL server; the views on the shared one (their writes must not make WAL that
    invalidates the new slot)."""
    tag = uuid.uuid4().hex[:8]
    src_db, views_db = f"lost_src_{tag}", f"lost_views_{tag}"
    w = World(small_wal_pg, small_wal_pg.create_database(src_db), pg_server.create_database(views_db),
              tmp_path / "log", f"ls{tag}")
    try:
        _accounts(w.source_dsn, SCHEMA)
        yield w
    finally:
        if w.rt is not None:
            w.rt.close()
        with psycopg.connect(w.source_dsn, autocommit=True) as c:
            c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                      "WHERE slot_name = %s AND NOT active", (w.slot,))
        small_wal_pg.drop_database(src_db)
        pg_server.drop_database(views_db)


def test_lost_slot_stops_with_the_recovery_and_resnapshot_converges_the_views(world: World, spark: Any,
                                                                                tmp_path: Path) -> None:
    from kappaflow.projections.follow import FollowerGroup
    from kappaflow.projections.replay import replay
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink

    w = world
    _accounts(w.source_dsn, SEED.format(n=300))
    w.capture()
    _accounts(w.source_dsn, "UPDATE public.accounts SET balance = balance + 1 WHERE id % 5 = 0",
              "DELETE FROM public.accounts WHERE id = 3")
    w.capture()
    w.rt = Runtime(spark, str(w.log_dir), PostgresSink(w.views_dsn), checkpoint_dir=tmp_path / "ckpt")
    w.projections = _projections(w.source, w.source)
    for p in w.projections.values():
        replay(p, w.rt)
    w.check_views("replayed before the slot was lost")

    group = [FollowerGroup(p, w.rt, trigger="0.3s").start() for p in w.projections.values()]
    try:
        # the capture is stopped; meanwhile rows change and the server drops the WAL the slot needs
        _accounts(w.source_dsn, *WHILE_LOST)
        lose_slot(w.source_dsn, w.slot)
        with pytest.raises(SourceError) as ei:
            w.capture()
        msg = str(ei.value)
        assert ei.value.retry is Retry.TERMINAL
        assert w.slot in msg and "wal_status=lost" in msg and f"kappaflow capture {w.source} --resnapshot" in msg, msg
        assert "password" not in msg

        request = ResnapshotRequest()
        summary = w.capture(resnapshot=request)
        assert request.started and any("re-snapshot" in s for s in request.said), request.said
        assert summary.snapshot_rows == 299  # the rows in the table now: 300 - 1 - 30 deleted + 30 inserted
        with EmbeddedLog(w.log_dir) as log:
            _check_log(log, w.source_dsn, w.source, {i for i in range(10, 301, 10)})
        with psycopg.connect(w.source_dsn) as c:
            slot = c.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s",
                             (w.slot,)).fetchone()
        assert slot is not None and slot[0] != "lost", "the re-snapshot streams from a new slot"
        for g in group:
            assert g.wait_for(lambda g: g.caught_up(), timeout=240), "a follower did not catch up"
        w.check_views("followed through the re-snapshot")

        # streaming goes on from the new slot, and reaches the views
        _accounts(w.source_dsn, "DELETE FROM public.accounts WHERE id = 1",
                  "UPDATE public.accounts SET balance = 7 WHERE id = 2")
        w.capture()
        for g in group:
            assert g.wait_for(lambda g: g.caught_up(), timeout=240), "a follower did not catch up"
        w.check_views("followed after the re-snapshot")
    finally:
        for g in group:
            g.stop()
    for p in w.projections.values():
        replay(p, w.rt)
    w.check_views("replayed from the start of the log")


def test_resnapshot_of_a_healthy_source_refuses_unless_forced(world: World) -> None:
    w = world
    _accounts(w.source_dsn, SEED.format(n=50))
    with pytest.raises(SourceError, match=r"nothing was captured yet.*kappaflow capture"):
        w.capture(resnapshot=ResnapshotRequest())
    w.capture()
    _accounts(w.source_dsn, "DELETE FROM public.accounts WHERE id <= 5")  # not captured yet
    with EmbeddedLog(w.log_dir) as log:
        before = {t: log.end_offsets(t) for t in log.list_topics()}
    with pytest.raises(SourceError, match=rf"--resnapshot refused: replication slot '{w.slot}' is healthy.*--force"):
        w.capture(resnapshot=ResnapshotRequest())
    with EmbeddedLog(w.log_dir) as log:
        assert {t: log.end_offsets(t) for t in log.list_topics()} == before, "a refused re-snapshot wrote nothing"
    # --force: safe all the same; the deletes the old slot held and never streamed become re-snapshot deletes
    request = ResnapshotRequest(force=True)
    w.capture(resnapshot=request)
    assert any("--force" in s for s in request.said), request.said
    with EmbeddedLog(w.log_dir) as log:
        _check_log(log, w.source_dsn, w.source, {1, 2, 3, 4, 5})
    _accounts(w.source_dsn, "UPDATE public.accounts SET balance = -1 WHERE id = 6")
    w.capture()  # a plain capture streams on from the new slot
    with EmbeddedLog(w.log_dir) as log:
        assert compacted(log, f"{w.source}.public.accounts") == table_state(w.source_dsn, "public.accounts",
                                                                            w.source)


def _write_config(tmp: Path, w: World) -> Path:
    path = tmp / "kappaflow.toml"
    path.write_text(f'[log]\nurl = "{w.log_dir}"\npartitions = 3\ncompact_interval_s = 0\n\n'
                    f'[sources.{w.source}]\nkind = "postgres"\ndsn = "{w.source_dsn}"\n'
                    'tables = ["public.accounts"]\nsnapshot_chunk_rows = 40\nheartbeat_interval_s = 0.5\n')
    return path


def _cli(config: Path, w: World, *args: str, kill_at: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [w.source, "--config", str(config), "--no-progress", "--until-caught-up", *args]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # error lines unwrapped
    if kill_at is None:
        cmd = [sys.executable, "-m", "kappaflow.cli.capture", *argv]
    else:
        cmd = [sys.executable, "-c", _KILL_AT_SNAPSHOT_BATCH, *argv]
        env["KF_TEST_KILL_AT"] = kill_at
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=str(config.parent), env=env)


def test_kill_9_during_resnapshot_then_plain_capture_converges(world: World, tmp_path: Path) -> None:
    w = world
    config = _write_config(tmp_path, w)
    _accounts(w.source_dsn, SEED.format(n=410))
    done = _cli(config, w)
    assert done.returncode == 0, done.stdout + done.stderr
    _accounts(w.source_dsn, *WHILE_LOST)
    lose_slot(w.source_dsn, w.slot)

    failed = _cli(config, w)
    assert failed.returncode != 0
    assert f"kappaflow capture {w.source} --resnapshot" in failed.stderr + failed.stdout, failed.stderr
    bad = _cli(config, w, "--force")
    assert bad.returncode != 0 and "--force only applies with --resnapshot" in bad.stderr + bad.stdout

    # kill -9 in the 4th snapshot batch (40-row chunks of 410 rows): mid-snapshot
    killed = _cli(config, w, "--resnapshot", kill_at="4:after_records")
    assert killed.returncode == -9, killed.stdout + killed.stderr
    off = stored_offset(str(w.log_dir), w.source, False)
    assert off is not None and off["phase"] == "snapshot" and off.get("resnapshot") is True, off
    read = sum(t["rows"] for t in off["snapshot"]["tables"].values())
    assert 0 < read < 410, off

    # a plain capture resumes it; kill it again between two partitions' deletes: the rest of the
    # snapshot is ceil(left / 40) batches, then one batch of deletes per partition
    left = 410 - 41 + 30 - read  # rows now: 410 - 41 deleted + 30 inserted, less those read (and stored)
    batches = -(-left // 40)
    killed = _cli(config, w, kill_at=f"{batches + 2}:after_records")
    assert killed.returncode == -9, killed.stdout + killed.stderr
    off = stored_offset(str(w.log_dir), w.source, False)
    assert off is not None and off["phase"] == "snapshot" and off.get("resnapshot") is True, off

    done = _cli(config, w)
    assert done.returncode == 0, done.stdout + done.stderr
    off = stored_offset(str(w.log_dir), w.source, False)
    assert off is not None and off["phase"] == "streaming" and not off.get("resnapshot"), off
    log = open_log(str(w.log_dir), read_only=True)
    try:
        _check_log(log, w.source_dsn, w.source, {i for i in range(10, 411, 10)})
        c = off["snapshot"]["lsn"]  # the new slot's consistent point
        snap = [p for p, tomb in positions(log, f"{w.source}.public.accounts")
                if isinstance(p, PgPosition) and p.snapshot and p.lsn == c and not tomb]
        assert len(snap) >= 410 - 41 + 30, "every row re-read at the new slot's consistent point"
    finally:
        log.close()
    # the stream goes on from the new slot
    _accounts(w.source_dsn, "DELETE FROM public.accounts WHERE id = 1")
    done = _cli(config, w)
    assert done.returncode == 0, done.stdout + done.stderr
    log = open_log(str(w.log_dir), read_only=True)
    try:
        assert compacted(log, f"{w.source}.public.accounts") == table_state(w.source_dsn, "public.accounts", w.source)
    finally:
        log.close()
