"""Pure pieces of the MySQL connector: GTID sets, DDL recognition, DSNs, the offset's dict form."""

from __future__ import annotations

import pytest

from kappaflow.connectors.mysql.gtid import GtidState
from kappaflow.connectors.mysql.offset import MySQLOffset, SnapshotProgress
from kappaflow.connectors.mysql.schema_tracking import ddl_tables
from kappaflow.connectors.mysql.server import parse_dsn
from kappaflow.errors import ConfigError, ValidationError


def test_gtid_sets_in_both_flavours() -> None:
    m = GtidState("mariadb", "0-1-41,2-5-7")
    m.add("0-1-42")
    m.add("1-3-1")
    assert str(m) == "0-1-42,1-3-1,2-5-7"
    with pytest.raises(ValidationError, match="domain-server-seq"):
        GtidState("mariadb", "3E11FA47-71CA-11E1-9E33-C80AA9429562:1-5")
    uuid = "3e11fa47-71ca-11e1-9e33-c80aa9429562"
    y = GtidState("mysql", f"{uuid}:1-5")
    y.add(f"{uuid}:6")
    y.add(f"{uuid}:8")
    assert str(y) == f"{uuid}:1-6:8"
    assert str(y.copy()) == str(y)
    assert not GtidState("mysql", "")


@pytest.mark.parametrize(("sql", "expected"), [
    ("ALTER TABLE t ADD COLUMN x INT", ("ALTER", [("db", "t")])),
    ("alter online table `my db`.`my``t` drop column y", ("ALTER", [("my db", "my`t")])),
    ("/* c */ CREATE TABLE IF NOT EXISTS shop.orders (id int)", ("CREATE", [("shop", "orders")])),
    ("CREATE OR REPLACE TABLE o (id int)", ("CREATE", [("db", "o")])),
    ("DROP TABLE IF EXISTS a, other.b", ("DROP", [("db", "a"), ("other", "b")])),
    ("TRUNCATE shop.t", ("TRUNCATE", [("shop", "t")])),
    ("TRUNCATE TABLE t", ("TRUNCATE", [("db", "t")])),
    ("RENAME TABLE a TO b, c TO d", ("RENAME", [("db", "a"), ("db", "b"), ("db", "c"), ("db", "d")])),
    ("INSERT INTO t VALUES (1)", None),
    ("CREATE DATABASE x", None),
])
def test_ddl_statements_name_their_tables(sql: str, expected: object) -> None:
    assert ddl_tables(sql, "db") == expected


def test_dsn_parsing() -> None:
    a = parse_dsn("mysql://app@db.example:3307/shop?unix_socket=/run/mysqld.sock", "pw")
    assert (a.host, a.port, a.user, a.password, a.database, a.unix_socket) == (
        "db.example", 3307, "app", "pw", "shop", "/run/mysqld.sock")
    assert parse_dsn("mariadb://root@localhost/").database is None
    assert "pw" not in a.where()
    with pytest.raises(ConfigError, match="mysql://"):
        parse_dsn("postgresql://x@y/z")


def test_offset_round_trip_and_bad_offsets() -> None:
    o = MySQLOffset("mariadb", "binlog.000002", 1234, "0-1-9", phase="snapshot",
                    snapshot=SnapshotProgress(["d.a", "d.b"], 1, '{"id":5}', 17, {"d.a": 12}),
                    stream_start={"file": "binlog.000002", "pos": 4, "gtid": "0-1-1"})
    assert MySQLOffset.from_dict(o.to_dict()) == o
    assert not o.snapshot.done  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match="mysql offset: malformed stored offset"):
        MySQLOffset.from_dict({"kind": "mysql", "flavor": "oracle", "file": "x.1", "pos": 1})
    with pytest.raises(ValidationError, match="not 'mysql'"):
        MySQLOffset.from_dict({"kind": "pg", "lsn": 1})
