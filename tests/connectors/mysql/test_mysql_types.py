"""Every MySQL/MariaDB type round-trips, and the snapshot and the binlog agree on every value."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pytest

from kappaflow.events import JSON_NULL, EventCodec, FieldType, TableSchema

pytestmark = pytest.mark.integration

DDL = """CREATE TABLE alltypes (
  id INT PRIMARY KEY, ti TINYINT, tiu TINYINT UNSIGNED, si SMALLINT, siu SMALLINT UNSIGNED, mi MEDIUMINT,
  miu MEDIUMINT UNSIGNED, i INT, iu INT UNSIGNED, bi BIGINT, biu BIGINT UNSIGNED, d DECIMAL(10,3),
  d2 DECIMAL(30,10), f FLOAT, db DOUBLE, dt DATE, tm TIME(6), tm0 TIME, dtt DATETIME(6), dtt0 DATETIME,
  ts TIMESTAMP(6) NULL, ts0 TIMESTAMP NULL, y YEAR, b1 BIT(1), b10 BIT(10), e ENUM('a','b''q','c'),
  s SET('x','y','z'), j JSON, c CHAR(5), vc VARCHAR(300), tx TEXT, bn BINARY(4), vb VARBINARY(10), bl BLOB,
  u8 VARCHAR(10) CHARACTER SET utf8mb4, l1 VARCHAR(10) CHARACTER SET latin1, mt MEDIUMTEXT, lb LONGBLOB)"""

COLS = ("ti, tiu, si, siu, mi, miu, i, iu, bi, biu, d, d2, f, db, dt, tm, tm0, dtt, dtt0, ts, ts0, y, b1, b10, e, s, "
        "j, c, vc, tx, bn, vb, bl, u8, l1, mt, lb")
EXTREMES = ("-128, 255, -32768, 65535, -8388608, 16777215, -2147483648, 4294967295, -9223372036854775808, "
            "18446744073709551615, -1234567.891, 12345678901234567890.0123456789, 1.2345678, 0.1, '2024-02-29', "
            "'-838:59:59.000001', '12:00:00', '2024-01-02 03:04:05.123456', '1000-01-01 00:00:00', "
            "'2024-01-02 03:04:05.654321', '1970-01-01 00:00:01', 2155, b'1', b'1010101010', 'b''q', 'x,z', "
            "'{\"a\": [1, 2.5, \"x\", null, true], \"b\": {\"c\": \"d\"}}', 'ab', 'vc', 'text é', x'00010203', "
            "x'ff00', x'deadbeef', 'ü😀', 'é', 'mt', x'00'")
EDGES = ("0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1e300, '1000-01-01', '00:00:00', '838:59:59', "
         "'9999-12-31 23:59:59.999999', '2024-05-06 07:08:09', '2038-01-19 03:14:07.999999', NULL, 0, b'0', "
         "b'0000000001', '', '', 'null', '', '', '', 'ab', '', '', '', '', '', ''")

EXPECTED_EXTREMES: dict[str, Any] = {
    "ti": -128, "tiu": 255, "si": -32768, "siu": 65535, "mi": -8388608, "miu": 16777215, "i": -2147483648,
    "iu": 4294967295, "bi": -9223372036854775808, "biu": Decimal("18446744073709551615"),
    "d": Decimal("-1234567.891"), "d2": Decimal("12345678901234567890.0123456789"), "f": 1.2345678, "db": 0.1,
    "dt": dt.date(2024, 2, 29), "tm": -dt.timedelta(hours=838, minutes=59, seconds=59, microseconds=1),
    "tm0": dt.timedelta(hours=12), "dtt": dt.datetime(2024, 1, 2, 3, 4, 5, 123456),
    "dtt0": dt.datetime(1000, 1, 1), "ts": dt.datetime(2024, 1, 2, 3, 4, 5, 654321, tzinfo=dt.UTC),
    "ts0": dt.datetime(1970, 1, 1, 0, 0, 1, tzinfo=dt.UTC), "y": 2155, "b1": True,
    "b10": (0b1010101010).to_bytes(2, "little"), "e": "b'q", "s": frozenset({"x", "z"}),
    "j": {"a": [1, 2.5, "x", None, True], "b": {"c": "d"}}, "c": "ab", "vc": "vc", "tx": "text é",
    "bn": b"\x00\x01\x02\x03", "vb": b"\xff\x00", "bl": b"\xde\xad\xbe\xef", "u8": "ü😀", "l1": "é", "mt": "mt",
    "lb": b"\x00",
}
EXPECTED_EDGES: dict[str, Any] = {
    "f": 0.0, "db": -1e300, "dt": dt.date(1000, 1, 1), "tm": dt.timedelta(0), "tm0": dt.timedelta(hours=838,
                                                                                                minutes=59, seconds=59),
    "dtt": dt.datetime(9999, 12, 31, 23, 59, 59, 999999),
    "ts": dt.datetime(2038, 1, 19, 3, 14, 7, 999999, tzinfo=dt.UTC),
    "ts0": None, "y": 0, "b1": False, "b10": b"\x01\x00", "e": "", "s": frozenset(), "j": JSON_NULL, "c": "",
    "bn": b"ab\x00\x00", "vb": b"", "bl": b"", "lb": b"", "biu": Decimal(0), "d": Decimal("0.000"),
}


def _rows_by_id(log: Any, mh: Any, codec: EventCodec, schema: TableSchema) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for doc_rec in mh.values(log, "src." + schema.name.split(".", 1)[1]):
        if doc_rec.value is None:
            continue
        ev = codec.decode_value(doc_rec.value, schema)
        out.setdefault(ev.after["id"], []).append(ev)
    return out


@pytest.mark.parametrize("decimal_mode", ["string", "precise"])
def test_all_types_round_trip_snapshot_and_binlog(mariadb_server: Any, mariadb_db: str, embedded_log: Any,
                                                  mh: Any, decimal_mode: str) -> None:
    db = mariadb_db
    mariadb_server.execute(
        DDL, "SET SESSION sql_mode=''", f"INSERT INTO alltypes (id, {COLS}) VALUES (1, {EXTREMES}), (2, {EDGES})",
        "INSERT INTO alltypes (id, dtt0, dt) VALUES (3, '0000-00-00 00:00:00', '0000-00-00')", db=db)
    conn = mh.connector(mariadb_server, db, embedded_log, [f"{db}.alltypes"], decimal_mode=decimal_mode)
    conn.run(until_caught_up=True)  # snapshot: ids 1-3 as op=r
    mariadb_server.execute(
        "SET SESSION sql_mode=''", f"INSERT INTO alltypes (id, {COLS}) VALUES (11, {EXTREMES}), (12, {EDGES})",
        "INSERT INTO alltypes (id, dtt0, dt) VALUES (13, '0000-00-00 00:00:00', '0000-00-00')", db=db)
    conn.run(until_caught_up=True)  # binlog: ids 11-13 as op=c

    # one schema record: the binlog's TableMapEvent gives the same schema as information_schema
    schema_recs = [r for r in mh.values(embedded_log, "src.__schema") if r.value is not None]
    assert len(schema_recs) == 1
    import orjson

    schema = TableSchema.from_dict(orjson.loads(schema_recs[0].value))
    assert schema.key == ("id",)
    types = {c.name: c.type for c in schema.columns}
    assert types["biu"] is FieldType.DECIMAL and types["iu"] is FieldType.INT64 and types["tm"] is FieldType.INTERVAL
    assert types["ts"] is FieldType.TIMESTAMPTZ and types["dtt"] is FieldType.TIMESTAMP and types["j"] is FieldType.JSON
    assert types["b1"] is FieldType.BOOLEAN and types["b10"] is FieldType.BITS and types["s"] is FieldType.SET
    assert types["f"] is FieldType.FLOAT32 and types["bn"] is FieldType.BYTES

    codec = EventCodec(decimal_mode)
    rows = _rows_by_id(embedded_log, mh, codec, schema)
    assert sorted(rows) == [1, 2, 3, 11, 12, 13]
    for sid, bid, expected in ((1, 11, EXPECTED_EXTREMES), (2, 12, EXPECTED_EDGES), (3, 13, {})):
        (snap,), (binlog,) = rows[sid], rows[bid]
        assert snap.op.value == "r" and binlog.op.value == "c"
        a, b = dict(snap.after), dict(binlog.after)
        a.pop("id"), b.pop("id")
        assert a == b, {k: (a[k], b[k]) for k in a if a[k] != b.get(k)}
        for col, value in expected.items():
            assert a[col] == value, (sid, col, a[col], value)
    # zero dates: NULL in nullable columns
    assert rows[3][0].after["dtt0"] is None and rows[3][0].after["dt"] is None
    # the JSON encoding of a TIMESTAMP is a UTC instant ending in Z; DATETIME is micros without zone
    raw = next(orjson.loads(r.value) for r in mh.values(embedded_log, f"src.{db}.alltypes")
               if r.value is not None and orjson.loads(r.value)["after"]["id"] == 11)
    assert raw["after"]["ts"] == "2024-01-02T03:04:05.654321Z"
    assert raw["after"]["dtt"] == 1704164645123456
