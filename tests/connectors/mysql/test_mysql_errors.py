"""Bad configuration and bad servers give clear, terminal errors naming the problem and the fix."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kappaflow.errors import ConfigError, SourceError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def statement_server() -> Iterator[Any]:
    """A second tiny MariaDB whose binlog is statement-based (and row image MINIMAL)."""
    from kappaflow.testing.servers.mariadb import PrivateMariaDB

    server = PrivateMariaDB(binlog_format="STATEMENT", row_image="MINIMAL").start()
    try:
        yield server
    finally:
        server.stop()


def test_statement_binlog_is_refused(statement_server: Any, embedded_log: Any, mh: Any) -> None:
    statement_server.execute("CREATE DATABASE d", "CREATE TABLE d.t (id INT PRIMARY KEY)")
    conn = mh.connector(statement_server, "d", embedded_log, ["d.t"])
    with pytest.raises(SourceError) as err:
        conn.run(until_caught_up=True)
    msg = str(err.value)
    assert "binlog_format is 'STATEMENT', expected 'ROW'" in msg
    assert "binlog_row_image is 'MINIMAL', expected 'FULL'" in msg
    assert not err.value.transient
    assert embedded_log.list_topics().get("src.d.t") is None  # nothing was created


def test_user_without_replication_privileges(mariadb_server: Any, mariadb_db: str, embedded_log: Any,
                                             mh: Any) -> None:
    db = mariadb_db
    user = f"ro_{db[-6:]}"
    mariadb_server.execute("CREATE TABLE t (id INT PRIMARY KEY)", f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'",
                           f"GRANT SELECT ON `{db}`.* TO '{user}'@'%'", db=db)
    try:
        from kappaflow.connectors.mysql.connector import MySQLConnector

        conn = MySQLConnector(name="src", log=embedded_log, dsn=mh.dsn(mariadb_server, db, user), password="pw",
                              tables=[f"{db}.t"])
        with pytest.raises(SourceError) as err:
            conn.run(until_caught_up=True)
        msg = str(err.value)
        assert "missing privilege(s) REPLICATION SLAVE, REPLICATION CLIENT" in msg
        assert f"GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO '{user}'" in msg
        assert "pw" not in msg
        # with the grants it works
        mariadb_server.execute(f"GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO '{user}'@'%'")
        summary = conn.run(until_caught_up=True)
        assert summary.phase == "stopped"
    finally:
        mariadb_server.execute(f"DROP USER IF EXISTS '{user}'@'%'")


def test_wrong_password_is_terminal_and_secret_free(mariadb_server: Any, mariadb_db: str, embedded_log: Any,
                                                    mh: Any) -> None:
    from kappaflow.connectors.mysql.connector import MySQLConnector

    conn = MySQLConnector(name="src", log=embedded_log, dsn=mh.dsn(mariadb_server, mariadb_db),
                          password="s3cret-Value", tables=[f"{mariadb_db}.t"])
    with pytest.raises(SourceError) as err:
        conn.run(until_caught_up=True)
    assert "authentication failed for root@" in str(err.value) and "s3cret" not in str(err.value)
    assert not err.value.transient


def test_unreachable_server_is_transient(embedded_log: Any) -> None:
    from kappaflow.connectors.mysql.connector import MySQLConnector
    from kappaflow.testing.servers._process import free_port

    conn = MySQLConnector(name="src", log=embedded_log, dsn=f"mysql://root@127.0.0.1:{free_port()}/d", tables=["d.t"])
    with pytest.raises(SourceError) as err:
        conn.run(until_caught_up=True)
    assert err.value.transient and "cannot reach" in str(err.value)


def test_missing_table_and_missing_key(mariadb_server: Any, mariadb_db: str, embedded_log: Any, mh: Any) -> None:
    db = mariadb_db
    with pytest.raises(ConfigError, match=rf"table {db}.nope does not exist"):
        mh.connector(mariadb_server, db, embedded_log, [f"{db}.nope"]).run(until_caught_up=True)
    mariadb_server.execute("CREATE TABLE k (a INT NOT NULL, b INT)", "INSERT INTO k VALUES (1, 2)", db=db)
    with pytest.raises(SourceError, match=rf"{db}.k: no primary key.*--key-columns {db}.k="):
        mh.connector(mariadb_server, db, embedded_log, [f"{db}.k"]).run(until_caught_up=True)
    with pytest.raises(SourceError, match=r"key_columns names column\(s\) \['zz'\] the table does not have"):
        mh.connector(mariadb_server, db, embedded_log, [f"{db}.k"], key_columns={f"{db}.k": ["zz"]},
                     name="src2").run(until_caught_up=True)
    # with key_columns a keyless table is captured
    s = mh.connector(mariadb_server, db, embedded_log, [f"{db}.k"], key_columns={f"{db}.k": ["a"]},
                     name="src3").run(until_caught_up=True)
    assert s.snapshot_rows == 1


def test_keyless_tables_are_refused_before_the_snapshot(mariadb_server: Any, mariadb_db: str, embedded_log: Any,
                                                        mh: Any) -> None:
    """Issue 13 items 8/21: capture used to snapshot the keyed tables and stop at the first keyless one;
    now every keyless table and nullable key column is named before any row is read."""
    db = mariadb_db
    mariadb_server.execute("CREATE TABLE a (id INT PRIMARY KEY)", "INSERT INTO a VALUES (1), (2)",
                           "CREATE TABLE b (x INT)", "CREATE TABLE c (y INT NOT NULL, UNIQUE KEY c_y (y))",
                           "CREATE TABLE d (z INT)", db=db)
    conn = mh.connector(mariadb_server, db, embedded_log, [f"{db}.a", f"{db}.b", f"{db}.c", f"{db}.d"],
                        key_columns={f"{db}.d": ["z"]})
    with pytest.raises(SourceError, match="3 table\\(s\\) cannot be captured") as err:
        conn.run(until_caught_up=True)
    msg = str(err.value)
    assert f"{db}.b: no primary key" in msg and f"--key-columns {db}.c=y" in msg and "index c_y" in msg, msg
    assert f"{db}.d: key column(s) z may be NULL" in msg and "MODIFY `z` int(11) NOT NULL" in msg, msg
    assert not err.value.transient
    assert f"src.{db}.a" not in embedded_log.list_topics()  # nothing was snapshotted


def test_built_from_the_config_models(embedded_log: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's factory builds the connectors from kappaflow.config models (no server contacted)."""
    from kappaflow.config import DebeziumSourceConfig, MySQLSourceConfig, SnapshotMode
    from kappaflow.connectors.debezium import DebeziumSource
    from kappaflow.connectors.mysql.connector import MySQLConnector

    monkeypatch.setenv("KAPPAFLOW_SOURCE_SHOP_PASSWORD", "pw")
    cfg = MySQLSourceConfig(name="shop", dsn="mysql://app@db.example:3307/shop", tables=["shop.orders"],
                            snapshot_mode=SnapshotMode.INITIAL_ONLY, decimal_mode="precise", server_id=6000)
    conn = MySQLConnector.from_config(cfg, embedded_log, partitions=3)
    assert (conn.args.host, conn.args.port, conn.args.user, conn.args.password) == ("db.example", 3307, "app", "pw")
    assert conn.snapshot_mode == "initial_only" and conn.codec.decimal_mode == "precise" and conn.server_id == 6000
    assert conn.partitions == 3 and conn.table_names == ["shop.orders"]
    dcfg = DebeziumSourceConfig(name="dbz", bootstrap="k1:9092,k2:9092", topics=["srv.inv.customers"],
                                schemas_enabled=True)
    src = DebeziumSource.from_config(dcfg, embedded_log, partitions=2)
    assert src.topics == ["srv.inv.customers"] and src.decoder.schemas_enabled is True and src.partitions == 2
    with pytest.raises(ConfigError, match="snapshot_mode"):
        MySQLConnector(name="x", log=embedded_log, dsn="mysql://a@b/c", snapshot_mode="sometimes")
