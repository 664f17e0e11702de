"""Capture behaviour: DML, truncate, DDL mid-stream, resume, the commit order, snapshot modes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kappaflow.connectors.offsets import OffsetStore
from kappaflow.events import TableSchema

pytestmark = pytest.mark.integration


def _ops(log: Any, mh: Any, topic: str) -> list[tuple[str, Any, Any]]:
    return [(d["op"], (d["before"] or {}).get("id"), d["after"]) for d in mh.events(log, topic)]


def test_inserts_updates_deletes_truncate(mariadb_server: Any, mariadb_db: str, embedded_log: Any, mh: Any) -> None:
    db = mariadb_db
    mariadb_server.execute("CREATE TABLE t (id INT PRIMARY KEY, v VARCHAR(10))",
                           "INSERT INTO t VALUES (1,'a'),(2,'b')", db=db)
    conn = mh.connector(mariadb_server, db, embedded_log, [f"{db}.t"])
    s1 = conn.run(until_caught_up=True)
    assert s1.snapshot_rows == 2
    mariadb_server.execute("INSERT INTO t VALUES (3,'c')", "UPDATE t SET v='B' WHERE id=2", "DELETE FROM t WHERE id=1",
                           "UPDATE t SET id=30 WHERE id=3", "BEGIN", "INSERT INTO t VALUES (4,'d')",
                           "INSERT INTO t VALUES (5,'e')", "COMMIT", db=db)
    conn.run(until_caught_up=True)
    topic = f"src.{db}.t"
    docs = mh.events(embedded_log, topic)
    assert [d["op"] for d in docs] == ["r", "r", "c", "u", "d", "d", "c", "c", "c"]
    assert docs[3]["before"] == {"id": 2, "v": "b"} and docs[3]["after"] == {"id": 2, "v": "B"}
    # the key change: delete of 3, create of 30, in one transaction with two row numbers
    assert (docs[5]["before"]["id"], docs[6]["after"]["id"]) == (3, 30)
    assert docs[6]["source"]["row"] == docs[5]["source"]["row"] + 1
    assert docs[7]["source"]["pos"] == docs[8]["source"]["pos"] and \
        [docs[7]["source"]["row"], docs[8]["source"]["row"]] == [0, 1]
    assert docs[2]["source"]["gtid"] and docs[2]["source"]["server_id"] == 1
    state = {orjson.loads(k)["id"]: v["v"] for k, v in mh.compacted(embedded_log, topic).items()}
    assert state == {2: "B", 30: "c", 4: "d", 5: "e"}
    tombstones = [r.key for r in mh.values(embedded_log, topic) if r.value is None]
    assert sorted(tombstones) == [b'{"id":1}', b'{"id":3}']

    mariadb_server.execute("TRUNCATE TABLE t", "INSERT INTO t VALUES (9,'z')", db=db)
    conn.run(until_caught_up=True)
    docs = mh.events(embedded_log, topic)
    truncs = [d for d in docs if d["op"] == "t"]
    assert len(truncs) == 2  # one marker per partition, same position
    assert truncs[0]["source"]["kf_pos"] == truncs[1]["source"]["kf_pos"]
    # every row the table held comes back as a delete carrying the row, at the truncate's position
    removed = [d for d in docs if d.get("kf_truncate")]
    assert sorted((d["before"]["id"], d["before"]["v"]) for d in removed) == [(2, "B"), (4, "d"), (5, "e"), (30, "c")]
    assert all(d["op"] == "d" and d["after"] is None and d["source"] == truncs[0]["source"] for d in removed)
    assert {orjson.loads(k)["id"] for k in mh.compacted(embedded_log, topic)} == {9}
    assert mh.table_rows(mariadb_server, db, "t") == [{"id": 9, "v": "z"}]


def test_ddl_mid_stream_add_drop_rename_column(mariadb_server: Any, mariadb_db: str, embedded_log: Any,
                                               mh: Any) -> None:
    db = mariadb_db
    mariadb_server.execute("CREATE TABLE t (id INT PRIMARY KEY, a INT, b VARCHAR(5))", "INSERT INTO t VALUES (1,1,'x')",
                           db=db)
    conn = mh.connector(mariadb_server, db, embedded_log, [f"{db}.t"])
    conn.run(until_caught_up=True)
    # all of this happens while the connector is down: catching up must decode each row with the
    # columns it was written with (the TableMapEvent's metadata), not today's table
    mariadb_server.execute(
        "INSERT INTO t VALUES (2,2,'y')",
        "ALTER TABLE t ADD COLUMN c DECIMAL(5,2) DEFAULT 1.5", "INSERT INTO t (id,a,b) VALUES (3,3,'z')",
        "ALTER TABLE t DROP COLUMN a", "UPDATE t SET b='w' WHERE id=1",
        "ALTER TABLE t RENAME COLUMN b TO bb", "INSERT INTO t VALUES (4,'v',2.25)", db=db)
    conn.run(until_caught_up=True)
    docs = mh.events(embedded_log, f"src.{db}.t")
    afters = [d["after"] for d in docs]
    assert afters == [
        {"id": 1, "a": 1, "b": "x"},
        {"id": 2, "a": 2, "b": "y"},
        {"id": 3, "a": 3, "b": "z", "c": "1.50"},
        {"id": 1, "b": "w", "c": "1.50"},
        {"id": 4, "bb": "v", "c": "2.25"},
    ]
    assert docs[3]["before"] == {"id": 1, "b": "x", "c": "1.50"}
    schema_docs = [orjson.loads(r.value) for r in mh.values(embedded_log, "src.__schema")]
    assert [d["change"] for d in schema_docs] == ["CREATE", "ALTER", "ALTER", "ALTER"]
    assert [[c["name"] for c in d["columns"]] for d in schema_docs] == [
        ["id", "a", "b"], ["id", "a", "b", "c"], ["id", "b", "c"], ["id", "bb", "c"]]
    assert "ADD COLUMN c" in schema_docs[1]["ddl"] and "RENAME COLUMN" in schema_docs[3]["ddl"]
    assert TableSchema.from_dict(schema_docs[-1]).column("c").scale == 2
    # a later run does not repeat known schemas
    conn.run(until_caught_up=True)
    assert len(list(mh.values(embedded_log, "src.__schema"))) == 4

    mariadb_server.execute("DROP TABLE t", db=db)
    conn.run(until_caught_up=True)
    last = list(mh.values(embedded_log, "src.__schema"))[-1]
    assert last.key == f'"{db}.t"'.encode() and last.value is None  # the dropped table's tombstone


def test_stop_and_resume_without_duplicates(mariadb_server: Any, mariadb_db: str, embedded_log: Any,
                                            mh: Any) -> None:
    db = mariadb_db
    mariadb_server.execute("CREATE TABLE t (id INT PRIMARY KEY, v INT)", db=db)
    conn = mh.connector(mariadb_server, db, embedded_log, [f"{db}.t"])
    conn.run(until_caught_up=True)
    for rnd in range(3):
        mariadb_server.execute(*(f"INSERT INTO t VALUES ({rnd * 10 + i}, {i})" for i in range(10)), db=db)
        s = conn.run(until_caught_up=True)
        assert s.duplicates_skipped == 0
    docs = mh.events(embedded_log, f"src.{db}.t")
    assert len(docs) == 30
    positions = [orjson.dumps(d["source"]["kf_pos"]) for d in docs]
    assert len(set(positions)) == 30
    offset = OffsetStore(embedded_log).load("src")
    assert offset is not None and offset["phase"] == "streaming" and offset["gtid"]


@pytest.mark.parametrize("crash_at", ["after_records", "after_offset"])
def test_commit_order_crash_between_steps(mariadb_server: Any, mariadb_db: str, any_log: Any, mh: Any,
                                          crash_at: str) -> None:
    """Step 1 (records) then step 2 (offset): a crash between them re-reads, and nothing is written twice.

    On both log backends (embedded, and Kafka through the tansu broker)."""
    db = mariadb_db
    embedded_log = any_log
    name = "src" + db[-6:]
    mariadb_server.execute("CREATE TABLE t (id INT PRIMARY KEY, v INT)", db=db)
    conn = mh.connector(mariadb_server, db, embedded_log, [f"{db}.t"], snapshot_mode="never", name=name)
    conn.run(until_caught_up=True)
    before = OffsetStore(embedded_log).load(name)
    mariadb_server.execute("BEGIN", "INSERT INTO t VALUES (1,1),(2,2)", "UPDATE t SET v=3 WHERE id=1", "COMMIT",
                           db=db)

    class Crash(Exception):
        pass

    def fault(step: str) -> None:
        if step == crash_at:
            raise Crash(step)

    crashing = mh.connector(mariadb_server, db, embedded_log, [f"{db}.t"], snapshot_mode="never", fault=fault,
                            threaded_writer=False, name=name)
    with pytest.raises(Crash):
        crashing.run(until_caught_up=True)
    after_crash = OffsetStore(embedded_log).load(name)
    if crash_at == "after_records":
        assert after_crash == before  # the offset did not move: the records are not acknowledged
    else:
        assert after_crash != before
    assert len(mh.events(embedded_log, f"{name}.{db}.t")) == 3  # the records are durable either way
    s = conn.run(until_caught_up=True)
    docs = mh.events(embedded_log, f"{name}.{db}.t")
    assert [d["op"] for d in docs] == ["c", "c", "u"]
    if crash_at == "after_records":
        assert s.duplicates_skipped == 3


def test_snapshot_modes(mariadb_server: Any, mariadb_db: str, tmp_path: Any, mh: Any) -> None:
    from kappaflow.log.embedded import EmbeddedLog

    db = mariadb_db
    mariadb_server.execute("CREATE TABLE t (id INT PRIMARY KEY)", "INSERT INTO t VALUES (1),(2),(3)", db=db)
    with EmbeddedLog(tmp_path / "never") as log:
        mh.connector(mariadb_server, db, log, [f"{db}.t"], snapshot_mode="never").run(until_caught_up=True)
        assert mh.events(log, f"src.{db}.t") == []
    with EmbeddedLog(tmp_path / "only") as log:
        c = mh.connector(mariadb_server, db, log, [f"{db}.t"], snapshot_mode="initial_only", snapshot_chunk_rows=2,
                         progress=True)  # the progress bar (stderr) must not disturb anything
        s = c.run(until_caught_up=True)
        assert s.snapshot_rows == 3 and OffsetStore(log).load("src")["phase"] == "done"
        docs = mh.events(log, f"src.{db}.t")
        assert [d["source"]["snapshot"] for d in docs] == ["true", "true", "last"]
        mariadb_server.execute("INSERT INTO t VALUES (4)", db=db)
        c.run(until_caught_up=True)
        assert len(mh.events(log, f"src.{db}.t")) == 3  # initial_only never streams


def test_snapshot_watermarks_keep_concurrent_changes(mariadb_server: Any, mariadb_db: str, embedded_log: Any,
                                                     mh: Any) -> None:
    """Rows changed while the snapshot runs end up with their latest value, whatever the interleaving."""
    db = mariadb_db
    mariadb_server.execute("CREATE TABLE t (id INT PRIMARY KEY, v INT)",
                           "INSERT INTO t VALUES " + ",".join(f"({i},0)" for i in range(60)), db=db)
    calls = {"n": 0}

    def progress(table: str, rows: int, prog: Any) -> None:  # runs after each chunk: change rows ahead and behind
        calls["n"] += 1
        n = calls["n"]
        mariadb_server.execute(f"UPDATE t SET v={n} WHERE id IN ({n * 7 % 60}, {(n * 13 + 5) % 60})",
                               f"DELETE FROM t WHERE id={(n * 11 + 3) % 60}",
                               f"INSERT INTO t VALUES ({100 + n}, {n})", db=db)

    conn = mh.connector(mariadb_server, db, embedded_log, [f"{db}.t"], snapshot_chunk_rows=8, progress_cb=progress)
    conn.run(until_caught_up=True)
    assert calls["n"] >= 8
    state = {orjson.loads(k)["id"]: v["v"] for k, v in mh.compacted(embedded_log, f"src.{db}.t").items()}
    assert state == {r["id"]: r["v"] for r in mh.table_rows(mariadb_server, db, "t")}


def test_resume_by_gtid_when_the_binlog_file_is_purged(tmp_path: Any, mh: Any) -> None:
    """The stored file is gone: the capture continues from the stored GTID set; when changes it
    still needed were purged too, it stops with a clear terminal error instead of skipping them."""
    import time

    from kappaflow.errors import SourceError
    from kappaflow.log.embedded import EmbeddedLog
    from kappaflow.testing.servers.mariadb import PrivateMariaDB

    def purge_to_current() -> str:
        (current,) = [r[0] for r in server.execute("SHOW MASTER STATUS")]
        deadline = time.monotonic() + 20
        # MariaDB keeps a file until its binlog checkpoint (crash recovery) is done: purge until it is gone
        while len(server.execute(f"PURGE BINARY LOGS TO '{current}'", "SHOW BINARY LOGS")) > 1:
            assert time.monotonic() < deadline, "the server never let the old binlog files be purged"
            time.sleep(0.1)
        return str(current)

    server = PrivateMariaDB().start()  # its own server: purging binary logs must not disturb other tests
    try:
        server.execute("CREATE DATABASE d", "CREATE TABLE d.t (id INT PRIMARY KEY, v INT)")
        with EmbeddedLog(tmp_path / "log") as log:
            conn = mh.connector(server, "d", log, ["d.t"])
            conn.run(until_caught_up=True)
            first = OffsetStore(log).load("src")["file"]
            server.execute("FLUSH BINARY LOGS", "INSERT INTO d.t VALUES (1, 1)", "FLUSH BINARY LOGS")
            (kept,) = [r[0] for r in server.execute("SHOW BINARY LOGS") if r[0] != first][:1]
            deadline = time.monotonic() + 20
            while first in [r[0] for r in server.execute(f"PURGE BINARY LOGS TO '{kept}'", "SHOW BINARY LOGS")]:
                assert time.monotonic() < deadline, "the server never let the old binlog file be purged"
                time.sleep(0.1)
            conn.run(until_caught_up=True)  # the offset's file is gone; its GTID set leads to insert 1
            assert [d["after"]["id"] for d in mh.events(log, "src.d.t")] == [1]
            assert OffsetStore(log).load("src")["file"] != first

            # now the changes themselves are purged before the capture saw them
            server.execute("INSERT INTO d.t VALUES (2, 2)", "FLUSH BINARY LOGS")
            purge_to_current()
            with pytest.raises(SourceError, match="Could not find GTID state") as err:
                conn.run(until_caught_up=True)
            assert "kappaflow capture src --resnapshot" in str(err.value) and not err.value.transient
            # a way out: a new snapshot, streaming from the current position (--resnapshot: test_mysql_lost_position)
            server.execute("INSERT INTO d.t VALUES (3, 3)")
            again = mh.connector(server, "d", log, ["d.t"], snapshot_mode="always")
            assert again.run(until_caught_up=True).snapshot_rows == 3
            state = {orjson.loads(k)["id"] for k in mh.compacted(log, "src.d.t")}
            assert state == {1, 2, 3}
    finally:
        server.stop()


def test_snapshot_chunks_on_composite_typed_keys(mariadb_server: Any, mariadb_db: str, embedded_log: Any,
                                                 mh: Any) -> None:
    """Chunk boundaries on a (varchar, datetime, decimal, timestamp) key: every row exactly once."""
    db = mariadb_db
    rows = [(f"k{i % 3}", f"2024-01-0{1 + i % 2} 00:00:0{i % 5}.5", f"{i % 4}.25", f"2024-06-01 00:00:{i:02d}")
            for i in range(23)]
    mariadb_server.execute(
        "CREATE TABLE t (a VARCHAR(5), b DATETIME(6), c DECIMAL(6,2), d TIMESTAMP(0) NOT NULL DEFAULT "
        "'2024-01-01', v INT, PRIMARY KEY (a, b, c, d))",
        "SET time_zone='+00:00'",
        "INSERT IGNORE INTO t VALUES " + ",".join(f"('{a}','{b}',{c},'{d}',1)" for a, b, c, d in rows), db=db)
    s = mh.connector(mariadb_server, db, embedded_log, [f"{db}.t"], snapshot_chunk_rows=4).run(until_caught_up=True)
    table = mh.table_rows(mariadb_server, db, "t")
    assert s.snapshot_rows == len(table) == 23
    keys = [orjson.loads(k) for k in mh.compacted(embedded_log, f"src.{db}.t")]
    assert len(keys) == 23 and set(keys[0]) == {"a", "b", "c", "d"}
