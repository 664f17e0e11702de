"""The streaming fast path writes exactly what EventCodec writes for the equivalent ChangeEvent."""

from __future__ import annotations

import copy
import datetime as dt
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest

from kappaflow.connectors.mysql.schema_tracking import TableState
from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.mysql.types import ColumnSpec
from kappaflow.connectors.mysql.writer import ChangeBatcher
from kappaflow.events import ChangeEvent, EventCodec, Op, SourceInfo, TransactionInfo
from kappaflow.log.embedded import EmbeddedLog

SPECS = (
    ColumnSpec("id", "int", nullable=False),
    ColumnSpec("ti", "tinyint"), ColumnSpec("siu", "smallint", unsigned=True),
    ColumnSpec("biu", "bigint", unsigned=True), ColumnSpec("d", "decimal", precision=10, scale=3),
    ColumnSpec("f", "float"), ColumnSpec("db", "double"), ColumnSpec("dt", "date"),
    ColumnSpec("tm", "time", fsp=6), ColumnSpec("dtt", "datetime", fsp=6), ColumnSpec("ts", "timestamp", fsp=3),
    ColumnSpec("tsn", "timestamp", nullable=False), ColumnSpec("y", "year"), ColumnSpec("b1", "bit", bits=1),
    ColumnSpec("b10", "bit", bits=10), ColumnSpec("e", "enum", values=("a", "b")),
    ColumnSpec("s", "set", values=("x", "y", "z")), ColumnSpec("sn", "set", nullable=False, values=("x",)),
    ColumnSpec("j", "json"), ColumnSpec("c", "char"), ColumnSpec("bn", "binary", octets=4),
    ColumnSpec("vb", "varbinary"), ColumnSpec("bl", "blob"), ColumnSpec("dz", "datetime", nullable=False),
)

# values as mysql-replication decodes them
RAW: dict[str, Any] = {
    "id": 7, "ti": -5, "siu": 65535, "biu": 18446744073709551615, "d": Decimal("-12.500"),
    "f": 1.100000023841858, "db": 0.1, "dt": dt.date(2024, 2, 29),
    "tm": dt.timedelta(days=-35, seconds=3600, microseconds=1), "dtt": dt.datetime(2024, 1, 2, 3, 4, 5, 123456),
    "ts": dt.datetime(2024, 1, 2, 3, 4, 5, 500000), "tsn": dt.datetime(1970, 1, 1), "y": 1900, "b1": "1",
    "b10": "1010101010", "e": "b", "s": {"z", "x"}, "sn": None, "j": '{"a": [1, 2.5, null]}', "c": "é😀",
    "bn": b"ab", "vb": "", "bl": b"\x00\xff", "dz": None,
}


@pytest.mark.parametrize("mode", ["string", "precise", "double"])
@pytest.mark.parametrize("op", [Op.CREATE, Op.UPDATE, Op.DELETE])
def test_fast_path_is_byte_identical_to_the_codec(tmp_path: Path, mode: str, op: Op) -> None:
    state = TableState("shop", "t", "src.shop.t", SPECS, ("id",))
    codec = EventCodec(mode)
    with EmbeddedLog(tmp_path / "log") as log:
        batcher = ChangeBatcher(log, source="src", codec=codec, partitions=2, threaded=False)
        after = dict(RAW, ti=6)
        none_sources = {"sn": "empty set", "dz": "out of datetime2 range"}
        if op is Op.UPDATE:
            raw = {"before_values": dict(RAW), "before_none_sources": dict(none_sources),
                   "after_values": dict(after), "after_none_sources": dict(none_sources)}
        else:
            raw = {"values": dict(RAW), "none_sources": dict(none_sources)}
        nxt = batcher.add_rows(state, op, [copy.deepcopy(raw)], "binlog.000003", 1234, 5, "0-1-9", 1, 1700000000000,
                               1800000000000, thread=42, query="UPDATE t SET ti=6 WHERE id=7")
        assert nxt == 6
        recs = batcher._pending[("src.shop.t", None)]

        model_before = state.convert_binlog_row(dict(RAW), none_sources)
        model_after = state.convert_binlog_row(dict(after), none_sources)
        pos = BinlogPosition("binlog.000003", 1234, 5, "0-1-9", 1)
        # Debezium's thread and query in the source block, the transaction block (GTID as its id)
        src = SourceInfo("mysql", "src", "shop", None, "t", pos, 1700000000000, "0-1-9",
                         extra={"thread": 42, "query": "UPDATE t SET ti=6 WHERE id=7"})
        ev = ChangeEvent(op, {"id": 7}, None if op is Op.CREATE else model_before,
                         None if op is Op.DELETE else (model_after if op is Op.UPDATE else model_before), src,
                         1800000000000, TransactionInfo("0-1-9", 6, 1))
        assert recs[0].value == codec.encode_value(ev, state.schema)
        assert recs[0].key == codec.encode_key({"id": 7}, state.schema)
        assert dict(recs[0].headers)["kf.pos"] == orjson.dumps(pos.to_dict())
        assert dict(recs[0].headers)["kf.op"] == op.value.encode()
        if op is Op.DELETE:
            assert recs[1].value is None and recs[1].key == recs[0].key  # the tombstone
        # and the Python values decode back from the record
        back = codec.decode_value(recs[0].value, state.schema)
        row = back.after if back.after is not None else back.before
        assert row is not None
        if mode != "double":  # "double" is lossy by design
            assert row["biu"] == Decimal(18446744073709551615) and row["d"] == Decimal("-12.500")
        assert row["y"] == 0 and row["b1"] is True
        assert row["b10"] == (0b1010101010).to_bytes(2, "little") and row["s"] == frozenset({"x", "z"})
        assert row["sn"] == frozenset() and row["bn"] == b"ab\x00\x00" and row["vb"] == b""
        assert row["ts"] == dt.datetime(2024, 1, 2, 3, 4, 5, 500000, tzinfo=dt.UTC)
        assert row["tsn"] == dt.datetime(1970, 1, 1, tzinfo=dt.UTC)  # NOT NULL zero timestamp: the epoch
        assert row["dz"] == dt.datetime(1970, 1, 1) and row["f"] == 1.1
        assert row["tm"] == -dt.timedelta(hours=838, minutes=59, seconds=59, microseconds=1)  # library bug fixed
        assert row["j"] == {"a": [1, 2.5, None]}
        batcher.close()


def test_key_change_becomes_delete_and_create(tmp_path: Path) -> None:
    specs = (ColumnSpec("id", "int", nullable=False), ColumnSpec("v", "varchar"))
    state = TableState("shop", "t", "src.shop.t", specs, ("id",))
    with EmbeddedLog(tmp_path / "log") as log:
        batcher = ChangeBatcher(log, source="src", codec=EventCodec(), partitions=1, threaded=False)
        raw = {"before_values": {"id": 1, "v": "a"}, "before_none_sources": {},
               "after_values": {"id": 2, "v": "a"}, "after_none_sources": {}}
        assert batcher.add_rows(state, Op.UPDATE, [raw], "b.000001", 10, 0, None, 1, 0, 0) == 2
        recs = batcher._pending[("src.shop.t", None)]
        assert [(r.key, None if r.value is None else orjson.loads(r.value)["op"]) for r in recs] == [
            (b'{"id":1}', "d"), (b'{"id":1}', None), (b'{"id":2}', "c")]
        rows = [orjson.loads(r.value)["source"]["row"] for r in recs if r.value is not None]
        assert rows == [0, 1]  # two positions: nothing shares a position
        assert [orjson.loads(r.value)["transaction"] for r in recs if r.value is not None] == [
            {"id": "file=b.000001,pos=10", "total_order": 1, "data_collection_order": 1},
            {"id": "file=b.000001,pos=10", "total_order": 2, "data_collection_order": 2}]
        batcher.close()


def test_data_collection_order_runs_through_key_changes_and_rows_events(tmp_path: Path) -> None:
    """Debezium numbers a transaction's events per table (data_collection_order) and overall (total_order);
    a key change in the middle of a rows event is two events, and a second rows event of the same
    transaction carries on from where the first one stopped."""
    specs = (ColumnSpec("id", "int", nullable=False), ColumnSpec("v", "varchar"))
    state = TableState("shop", "t", "src.shop.t", specs, ("id",))

    def upd(old: int, new: int) -> dict[str, Any]:
        return {"before_values": {"id": old, "v": "a"}, "before_none_sources": {},
                "after_values": {"id": new, "v": "b"}, "after_none_sources": {}}

    with EmbeddedLog(tmp_path / "log") as log:
        batcher = ChangeBatcher(log, source="src", codec=EventCodec(), partitions=1, threaded=False)
        nxt = batcher.add_rows(state, Op.UPDATE, [upd(5, 5), upd(1, 2), upd(6, 6)], "b.000001", 10, 0, None, 1, 0, 0)
        assert nxt == 4
        nxt = batcher.add_rows(state, Op.DELETE, [{"values": {"id": 7, "v": "c"}, "none_sources": {}}], "b.000001",
                               10, nxt, None, 1, 0, 0)
        assert nxt == 5
        recs = batcher._pending[("src.shop.t", None)]
        blocks = [orjson.loads(r.value)["transaction"] for r in recs if r.value is not None]
        assert [(b["total_order"], b["data_collection_order"]) for b in blocks] == [(i, i) for i in range(1, 6)]
        assert batcher.tx_counts == {"src.shop.t": 5}
        batcher.close()
