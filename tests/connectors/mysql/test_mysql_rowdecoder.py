"""The compiled row decoder gives exactly the library path's JSON values, on a real binlog of every type."""

from __future__ import annotations

from typing import Any

import pytest

from kappaflow.connectors.mysql.schema_tracking import SchemaTracker

pytestmark = pytest.mark.integration

DDL = """CREATE TABLE r (
  id INT PRIMARY KEY, ti TINYINT, tiu TINYINT UNSIGNED, si SMALLINT, siu SMALLINT UNSIGNED, mi MEDIUMINT,
  miu MEDIUMINT UNSIGNED, i INT, iu INT UNSIGNED, bi BIGINT, biu BIGINT UNSIGNED, d DECIMAL(10,3),
  d2 DECIMAL(30,10), d0 DECIMAL(5,0), dn DECIMAL(20,9) NOT NULL DEFAULT 0, f FLOAT, db DOUBLE, dt DATE,
  t1 TIME(1), t3 TIME(3), t6 TIME(6), t0 TIME, dtt DATETIME(6), dt2 DATETIME(2), dtt0 DATETIME NOT NULL DEFAULT
  '2000-01-01', ts TIMESTAMP(6) NULL, ts0 TIMESTAMP NULL, y YEAR, b1 BIT(1), b10 BIT(10), b64 BIT(64),
  e ENUM('a','b''q','c'), s SET('x','y','z'), j JSON, c CHAR(5), vc VARCHAR(300), tx TEXT, bn BINARY(4),
  vb VARBINARY(10), bl BLOB, u8 VARCHAR(10) CHARACTER SET utf8mb4, l1 VARCHAR(10) CHARACTER SET latin1,
  mt MEDIUMTEXT, lb LONGBLOB)"""

_COLUMNS = ("ti", "tiu", "si", "siu", "mi", "miu", "i", "iu", "bi", "biu", "d", "d2", "d0", "dn", "f", "db", "dt",
            "t1", "t3", "t6", "t0", "dtt", "dt2", "dtt0", "ts", "ts0", "y", "b1", "b10", "b64", "e", "s", "j", "c",
            "vc", "tx", "bn", "vb", "bl", "u8", "l1", "mt", "lb")
VALUES = [
    "(1, -128, 255, -32768, 65535, -8388608, 16777215, -2147483648, 4294967295, -9223372036854775808, "
    "18446744073709551615, -1234567.891, 12345678901234567890.0123456789, -99999, -12345678901.000000001, 1.2345678, "
    "0.1, '2024-02-29', '-12:34:56.7', '-01:00:00.25', '-838:59:59.000001', '-00:00:01', '2024-01-02 03:04:05.123456',"
    " '1999-12-31 23:59:59.99', '1000-01-01', '2024-01-02 03:04:05.654321', '1970-01-01 00:00:01', 2155, b'1', "
    "b'1010101010', b'1111111111111111111111111111111111111111111111111111111111111111', 'b''q', 'x,z', "
    "'{\"a\": [1, 2.5, null, true]}', 'ab', 'vc', 'text é', x'00010203', x'ff00', x'deadbeef', 'ü😀', 'é', "
    "'mt', x'00')",
    "(2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.001, -0.0000000001, 0, 0.5, -1e38, -1e300, '1000-01-01', '00:00:00.5', "
    "'838:59:59.999', '00:00:00', '12:00:00', '9999-12-31 23:59:59.999999', '2024-05-06 07:08:09.01', "
    "'0000-00-00 00:00:00', '2038-01-19 03:14:07.999999', NULL, 0, b'0', b'0000000001', b'0', '', '', 'null', '', "
    "'', '', 'ab', '', '', '', '', '', '')",
    "(3, " + ", ".join("0" if n == "dn" else "'2000-01-01'" if n == "dtt0" else "NULL" for n in _COLUMNS) + ")",
]


@pytest.mark.parametrize("mode", ["string", "precise", "double"])
def test_compiled_decoder_equals_library_path(mariadb_server: Any, mariadb_db: str, mode: str) -> None:
    from pymysqlreplication import BinLogStreamReader
    from pymysqlreplication.row_event import DeleteRowsEvent, TableMapEvent, UpdateRowsEvent, WriteRowsEvent

    from kappaflow.connectors.mysql.server import master_status

    db = mariadb_db
    conn_rows = VALUES
    import pymysql

    c = pymysql.connect(host=mariadb_server.host, port=mariadb_server.port, user="root", password="",
                        database=db, autocommit=True)
    with c.cursor() as cur:
        cur.execute("SET SESSION sql_mode=''")
        cur.execute(DDL)
        cur.execute("SET time_zone='+00:00'")
        f, p = master_status(cur)
        cur.execute("INSERT INTO r VALUES " + ", ".join(conn_rows))
        cur.execute("UPDATE r SET vc = CONCAT(vc, 'x'), d = d + 1")
        cur.execute("DELETE FROM r WHERE id = 2")
    c.close()

    tracker = SchemaTracker("src", [(db, "r")])
    with pymysql.connect(host=mariadb_server.host, port=mariadb_server.port, user="root", password="") as ctl:
        tracker.refresh_hints(ctl, db, "r")
    reader = BinLogStreamReader(
        connection_settings={"host": mariadb_server.host, "port": mariadb_server.port, "user": "root", "password": ""},
        server_id=7777, resume_stream=True, log_file=f, log_pos=p, blocking=False, only_schemas=[db],
        only_events=[TableMapEvent, WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent], enable_logging=False)
    checked = 0
    state = dec = None
    for ev in reader:
        if isinstance(ev, TableMapEvent):
            state = tracker.from_table_map(ev)
            dec = state.row_decoder(ev.columns, mode)
            assert dec is not None, "every type of this table has a compiled reader"
            continue
        assert state is not None and dec is not None
        update = isinstance(ev, UpdateRowsEvent)
        fast = dec.decode_rows(ev, update)
        assert fast is not None
        lib_rows = ev.rows  # the compiled decoder did not move the packet: the library parses the same bytes
        to_json = state.json_converter(mode)
        assert len(fast) == len(lib_rows) > 0
        for a, b in zip(fast, lib_rows, strict=True):
            if update:
                assert a == (to_json(b["before_values"], b["before_none_sources"]),
                             to_json(b["after_values"], b["after_none_sources"]))
            else:
                assert a == to_json(b["values"], b["none_sources"])
            checked += 1
    reader.close()
    assert checked == 3 + 2 + 1  # row 3 is all NULLs: the UPDATE leaves it unchanged
