"""Purged binlog positions and ``kappaflow capture --resnapshot`` on MariaDB (issue 22, item 3).

A private MariaDB: while the capture is stopped, rows are deleted, updated and inserted, then the
binary logs holding those changes are purged (``PURGE BINARY LOGS``). The capture must stop with an
error naming ``kappaflow capture NAME --resnapshot``; the re-snapshot must bring the log back to the
table (deleted rows gone, updates present, each vanished key deleted once, positions growing along
every partition), stream on afterwards, and refuse a healthy source unless forced.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from kappaflow.connectors.base import record_position
from kappaflow.connectors.resnapshot import ResnapshotRequest
from kappaflow.errors import Retry, SourceError
from kappaflow.log.base import Log

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def purge_server() -> Iterator[Any]:
    """Its own server: purging binary logs must not disturb other tests."""
    from kappaflow.testing.servers.mariadb import PrivateMariaDB

    server = PrivateMariaDB().start()
    try:
        yield server
    finally:
        server.stop()


def _purge_to_current(server: Any) -> None:
    server.execute("FLUSH BINARY LOGS")
    (current,) = [r[0] for r in server.execute("SHOW MASTER STATUS")]
    deadline = time.monotonic() + 20
    # MariaDB keeps a file until its binlog checkpoint (crash recovery) is done: purge until it is gone
    while len(server.execute(f"PURGE BINARY LOGS TO '{current}'", "SHOW BINARY LOGS")) > 1:
        assert time.monotonic() < deadline, "the server never let the old binlog files be purged"
        time.sleep(0.1)


def _state(mh: Any, log: Log, topic: str) -> dict[int, tuple[Any, Any]]:
    return {orjson.loads(k)["id"]: (v["v"], v["note"]) for k, v in mh.compacted(log, topic).items()}


def _table(mh: Any, server: Any) -> dict[int, tuple[Any, Any]]:
    return {r["id"]: (r["v"], r["note"]) for r in mh.table_rows(server, "d", "t")}


def _check(mh: Any, server: Any, log: Log, topic: str, deleted: set[int]) -> None:
    assert _state(mh, log, topic) == _table(mh, server), "the log differs from the table"
    seen: Counter[Any] = Counter()
    dels: Counter[int] = Counter()
    for p in range(log.partitions(topic)):
        keys = []
        for rec in log.iter_partition(topic, p):
            pos = record_position(rec)
            assert pos is not None, rec
            keys.append(pos.sort_key())
            seen[(pos, rec.value is None)] += 1
            if rec.value is not None and b'"kf_resnapshot":true' in rec.value:
                doc = orjson.loads(rec.value)
                assert doc["op"] == "d" and doc["before"]["id"] == orjson.loads(rec.key)["id"], doc
                assert "v" in doc["before"] and "note" in doc["before"], "the delete carries the row the log held"
                dels[doc["before"]["id"]] += 1
        assert keys == sorted(keys), f"positions out of order in partition {p}"
    assert not [k for k, n in seen.items() if n > 1], "a record written twice"
    assert set(dels) == deleted and set(dels.values()) <= {1}, dels


def test_purged_binlog_stops_with_the_recovery_and_resnapshot_converges(purge_server: Any, tmp_path: Any,
                                                                         mh: Any) -> None:
    from kappaflow.log.embedded import EmbeddedLog

    server = purge_server
    server.execute("DROP DATABASE IF EXISTS d", "CREATE DATABASE d",
                   "CREATE TABLE d.t (id INT PRIMARY KEY, v INT, note VARCHAR(20))",
                   "INSERT INTO d.t SELECT seq, seq, CONCAT('n', seq) FROM d.seq_1_to_200")
    topic = "src.d.t"
    with EmbeddedLog(tmp_path / "log") as log:
        mh.connector(server, "d", log, ["d.t"], snapshot_chunk_rows=30).run(until_caught_up=True)
        assert _state(mh, log, topic) == _table(mh, server)

        # the capture is stopped; meanwhile rows change and the binlogs holding the changes are purged
        server.execute("DELETE FROM d.t WHERE id % 10 = 0", "UPDATE d.t SET v = v + 1000 WHERE id % 7 = 0",
                       "INSERT INTO d.t SELECT seq, seq, 'late' FROM d.seq_1001_to_1020")
        _purge_to_current(server)
        with pytest.raises(SourceError) as ei:
            mh.connector(server, "d", log, ["d.t"], snapshot_chunk_rows=30).run(until_caught_up=True)
        assert ei.value.retry is Retry.TERMINAL
        assert "kappaflow capture src --resnapshot" in str(ei.value) and "purged" in str(ei.value), str(ei.value)

        conn = mh.connector(server, "d", log, ["d.t"], snapshot_chunk_rows=30)
        conn.resnapshot = request = ResnapshotRequest()
        summary = conn.run(until_caught_up=True)
        assert request.started and any("purged" in s for s in request.said), request.said
        assert summary.snapshot_rows == 200 - 20 + 20
        _check(mh, server, log, topic, set(range(10, 201, 10)))

        # streaming goes on from the new position
        server.execute("DELETE FROM d.t WHERE id = 1", "UPDATE d.t SET v = -1 WHERE id = 2")
        mh.connector(server, "d", log, ["d.t"]).run(until_caught_up=True)
        assert _state(mh, log, topic) == _table(mh, server)

        # a healthy source: refused, unless forced (then safe: no key deleted that the table has)
        conn = mh.connector(server, "d", log, ["d.t"])
        conn.resnapshot = ResnapshotRequest()
        with pytest.raises(SourceError, match=r"--resnapshot refused: the resume point .* is still in the server's "
                                              r"binary logs.*--force"):
            conn.run(until_caught_up=True)
        conn = mh.connector(server, "d", log, ["d.t"], snapshot_chunk_rows=30)
        conn.resnapshot = ResnapshotRequest(force=True)
        conn.run(until_caught_up=True)
        _check(mh, server, log, topic, set(range(10, 201, 10)))
