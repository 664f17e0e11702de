"""The log side of ``--resnapshot`` (``connectors/resnapshot.py``): which keys vanished, and their deletes.

Built on the embedded log with records shaped as the PostgreSQL connector writes them (change events
with ``source.kf_pos``, tombstones with the ``kf.pos`` header): no database needed.
"""

from __future__ import annotations

from typing import Any

import orjson

from kappaflow.connectors.base import TrustedRecord, record_position
from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.connectors.resnapshot import delete_value, last_values, lost_position, stale_keys, vanished_rows
from kappaflow.errors import Retry
from kappaflow.log.base import CleanupPolicy, Log, TopicConfig


def _event(op: str, row: dict[str, Any] | None, pos: PgPosition, before: dict[str, Any] | None = None) -> bytes:
    return orjson.dumps({"before": before, "after": row, "op": op, "ts_ms": 1, "ts_us": 1000, "ts_ns": 1_000_000,
                         "source": {"connector": "postgresql", "lsn": pos.lsn, "snapshot": str(pos.snapshot).lower(),
                                    "kf_pos": pos.to_dict()}, "transaction": None})


def _key(i: int) -> bytes:
    return orjson.dumps({"id": i})


def _tomb(i: int, pos: PgPosition) -> TrustedRecord:
    return TrustedRecord(_key(i), None, (("kf.op", b"d"), ("kf.pos", orjson.dumps(pos.to_dict()))))


def test_stale_keys_are_live_rows_older_than_the_resnapshot(embedded_log: Log) -> None:
    log = embedded_log
    log.create_topic("s.public.t", TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT))
    old = [PgPosition(100, i, True) for i in range(5)]  # the first snapshot: ids 0..4
    recs = [TrustedRecord(_key(i), _event("r", {"id": i, "v": i}, old[i]), (("kf.op", b"r"),)) for i in range(5)]
    # streamed: id 1 updated, id 2 deleted (event + tombstone), both before the re-snapshot
    recs.append(TrustedRecord(_key(1), _event("u", {"id": 1, "v": 11}, PgPosition(200, 0)), (("kf.op", b"u"),)))
    recs.append(TrustedRecord(_key(2), _event("d", None, PgPosition(300, 0), {"id": 2}), (("kf.op", b"d"),)))
    recs.append(_tomb(2, PgPosition(300, 0)))
    start = PgPosition(500, 0, True)
    # the re-snapshot read ids 0 and 4 again; ids 1 and 3 vanished while the slot was lost
    recs.append(TrustedRecord(_key(0), _event("r", {"id": 0, "v": 0}, PgPosition(500, 0, True)), (("kf.op", b"r"),)))
    recs.append(TrustedRecord(_key(4), _event("r", {"id": 4, "v": 4}, PgPosition(500, 1, True)), (("kf.op", b"r"),)))
    log.append("s.public.t", recs, partition=0)

    stale = stale_keys(log, "s.public.t", 0, start)
    assert sorted(orjson.loads(k)["id"] for k in stale) == [1, 3]
    rows = {orjson.loads(k)["id"]: row for k, row, _ in vanished_rows(log, "s.public.t", 0, stale)}
    assert rows == {1: {"id": 1, "v": 11}, 3: {"id": 3, "v": 3}}  # the row as the log last held it

    # a delete written for id 1 at the re-snapshot's position resolves it: the scan is idempotent
    log.append("s.public.t", [_tomb(1, PgPosition(500, 2, True))], partition=0)
    assert [orjson.loads(k)["id"] for k in stale_keys(log, "s.public.t", 0, start)] == [3]


def test_delete_value_moves_the_last_row_to_before_with_the_new_position(embedded_log: Log) -> None:
    log = embedded_log
    log.create_topic("m.d.t", TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT))
    old = BinlogPosition("bin.000001", 400, 0, "0-1-3", 1)
    last = orjson.dumps({"before": None, "after": {"id": 7, "v": "x"}, "op": "c", "ts_ms": 1,
                         "source": {"connector": "mysql", "file": "bin.000001", "pos": 400, "row": 0, "gtid": "0-1-3",
                                    "snapshot": "false", "kf_pos": old.to_dict()}, "transaction": {"id": "0-1-3"}})
    log.append("m.d.t", [TrustedRecord(_key(7), last, (("kf.op", b"c"),))], partition=0)
    start = BinlogPosition("bin.000009", 4, 0, None, None, snapshot=True)
    stale = stale_keys(log, "m.d.t", 0, start)
    assert list(stale) == [_key(7)]
    ((key, value),) = list(last_values(log, "m.d.t", 0, stale))
    pos = BinlogPosition("bin.000009", 900, 3, None, 1, snapshot=True)
    doc = orjson.loads(delete_value(value, pos, 5, {"file": "bin.000009", "pos": 900, "row": 3, "gtid": None}) or b"")
    assert doc["op"] == "d" and doc["after"] is None and doc["before"] == {"id": 7, "v": "x"}
    assert doc["kf_resnapshot"] is True and doc["transaction"] is None and doc["ts_ms"] == 5
    assert doc["source"]["snapshot"] == "true" and doc["source"]["gtid"] is None
    rec = TrustedRecord(key, orjson.dumps(doc))
    assert record_position(rec) == pos  # type: ignore[arg-type]
    assert delete_value(None, pos, 5, {}) is None  # no row held: only the tombstone is written


def test_lost_position_names_the_recovery() -> None:
    err = lost_position("shop", "replication slot 'kappaflow_shop' was invalidated (wal_status=lost)", "h:5432")
    assert err.retry is Retry.TERMINAL
    assert "kappaflow capture shop --resnapshot" in str(err) and "wal_status=lost" in str(err)
