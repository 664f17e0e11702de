"""`kappaflow doctor` against live servers: each misconfiguration gets an actionable finding."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest
from typer.testing import CliRunner

from kappaflow.cli.app import app
from kappaflow.config import MySQLSourceConfig, PostgresSourceConfig, Settings
from kappaflow.doctor import Finding, Status, run_checks
from kappaflow.log import CleanupPolicy, Record, TopicConfig
from kappaflow.testing.servers._process import free_port
from kappaflow.testing.servers.postgres import PrivatePostgres


def _settings(tmp_path: Path, **sections: Any) -> Settings:
    s = Settings.load(None, environ={})
    s.base_dir = tmp_path
    s.log.url = str(tmp_path / "log")
    for key, value in sections.items():
        setattr(s, key, value)
    return s


def _find(findings: list[Finding], area: str, check: str) -> Finding:
    for f in findings:
        if f.area == area and f.check == check:
            return f
    raise AssertionError(f"no finding {area}/{check} in {findings}")


@pytest.fixture(scope="module")
def replica_pg() -> Any:
    server = PrivatePostgres(wal_level="replica").start()
    yield server
    server.stop()


def test_wal_level_replica_is_reported_with_the_fix(tmp_path: Path, replica_pg: Any) -> None:
    s = _settings(tmp_path, sources={"shop": PostgresSourceConfig(name="shop", dsn=replica_pg.dsn())})
    f = _find(run_checks(s), "source shop", "wal_level")
    assert f.status is Status.FAIL and "replica" in f.detail
    assert "wal_level = logical" in f.fix and "restart" in f.fix


def test_role_without_replication(tmp_path: Path, pg_server: Any) -> None:
    import psycopg

    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute("drop role if exists doctor_plain")
        conn.execute("create role doctor_plain login")
    dsn = f"postgresql://doctor_plain@{pg_server.host}:{pg_server.port}/postgres"
    s = _settings(tmp_path, sources={"shop": PostgresSourceConfig(name="shop", dsn=dsn)})
    findings = run_checks(s)
    assert _find(findings, "source shop", "wal_level").status is Status.OK
    f = _find(findings, "source shop", "replication role")
    assert f.status is Status.FAIL and "WITH REPLICATION" in f.fix


def test_topic_without_compaction(tmp_path: Path, pg_server: Any) -> None:
    s = _settings(tmp_path, sources={"shop": PostgresSourceConfig(name="shop", dsn=pg_server.dsn())})
    with s.open_log() as log:
        log.create_topic("shop.public.orders", TopicConfig(partitions=2, cleanup_policy=CleanupPolicy.DELETE))
        log.create_topic("shop.public.customers", TopicConfig(partitions=2, cleanup_policy=CleanupPolicy.COMPACT))
    findings = run_checks(s)
    bad = _find(findings, "log", "topic shop.public.orders")
    assert bad.status is Status.FAIL and "cleanup.policy=compact" in bad.fix
    assert not [f for f in findings if f.check == "topic shop.public.customers"]


def test_unreachable_broker_names_the_address(tmp_path: Path) -> None:
    port = free_port()
    s = _settings(tmp_path)
    s.log.url = f"kafka://127.0.0.1:{port}"
    f = _find(run_checks(s), "log", "reachable")
    assert f.status is Status.FAIL and f"127.0.0.1:{port}" in f.detail and "broker" in f.fix


def test_unreachable_postgres_and_password_never_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAPPAFLOW_SOURCE_SHOP_PASSWORD", "sup3rsecret")
    src = PostgresSourceConfig(name="shop", dsn=f"postgresql://app@127.0.0.1:{free_port()}/shop")
    findings = run_checks(_settings(tmp_path, sources={"shop": src}))
    f = _find(findings, "source shop", "connect")
    assert f.status is Status.FAIL
    assert all("sup3rsecret" not in (x.detail + x.fix) for x in findings)


def test_mysql_privileges(tmp_path: Path, mariadb_server: Any) -> None:
    mariadb_server.execute("CREATE USER IF NOT EXISTS 'doctor_plain'@'%'", "GRANT SELECT ON *.* TO 'doctor_plain'@'%'")
    root = MySQLSourceConfig(name="inv", dsn=f"mysql://root@127.0.0.1:{mariadb_server.port}/mysql")
    ok = run_checks(_settings(tmp_path, sources={"inv": root}))
    assert _find(ok, "source inv", "binlog_format").status is Status.OK
    assert _find(ok, "source inv", "privileges").status is Status.OK
    plain = MySQLSourceConfig(name="inv", dsn=f"mysql://doctor_plain@127.0.0.1:{mariadb_server.port}/mysql")
    bad = _find(run_checks(_settings(tmp_path, sources={"inv": plain})), "source inv", "privileges")
    assert bad.status is Status.FAIL and "REPLICATION SLAVE" in bad.fix


def test_cli_exit_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replica_pg: Any) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kappaflow.toml").write_text(
        f'[log]\nurl = "log"\n[sources.shop]\nkind = "postgres"\ndsn = "{replica_pg.dsn()}"\n')
    res = CliRunner().invoke(app, ["doctor"])
    assert res.exit_code == 1, res.output
    assert "wal_level" in res.output and "problem" in res.output


# -- issue 13 items 4, 5, 8, 23 --------------------------------------------------------------------------------

def _sql(dsn: str, *statements: str) -> list[Any]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        rows: list[Any] = []
        for s in statements:
            cur = conn.execute(s)
            rows = cur.fetchall() if cur.description else []
        return rows


def test_ledger_source_is_checked_not_crashed_on(tmp_path: Path, pg_dsn: str) -> None:
    """Doctor used to treat every non-PostgreSQL, non-MySQL source as Debezium: AttributeError 'bootstrap'."""
    from kappaflow.config import LedgerSourceConfig

    s = _settings(tmp_path, sources={"bank": LedgerSourceConfig(name="bank", dsn=pg_dsn)})
    findings = run_checks(s)
    assert _find(findings, "source bank", "connect").status is Status.OK
    assert _find(findings, "source bank", "wal_level").status is Status.OK
    f = _find(findings, "source bank", "table kappaflow_ledger.events")
    assert f.status is Status.FAIL and "kappaflow ledger install" in f.fix


def test_every_source_kind_is_checked_side_by_side(tmp_path: Path, pg_dsn: str, mariadb_server: Any) -> None:
    """One source of each registered kind in one configuration: each gets its own checks, none crashes doctor."""
    from kappaflow.config import SOURCE_MODELS, DebeziumSourceConfig, LedgerSourceConfig
    from kappaflow.connectors.registry import kinds

    sources = {
        "shop": PostgresSourceConfig(name="shop", dsn=pg_dsn),
        "inv": MySQLSourceConfig(name="inv", dsn=f"mysql://root@127.0.0.1:{mariadb_server.port}/mysql",
                                 tables=["mysql.db"]),
        "dbz": DebeziumSourceConfig(name="dbz", bootstrap=f"127.0.0.1:{free_port()}", topics=["pg.public.t"]),
        "bank": LedgerSourceConfig(name="bank", dsn=pg_dsn),
    }
    assert {s.kind for s in sources.values()} == set(kinds()) == set(SOURCE_MODELS)
    findings = run_checks(_settings(tmp_path, sources=sources))
    assert _find(findings, "source shop", "wal_level").status is Status.OK
    assert _find(findings, "source inv", "binlog_format").status is Status.OK
    assert _find(findings, "source dbz", "broker").status is Status.FAIL
    assert _find(findings, "source bank", "connect").status is Status.OK
    assert "kappaflow ledger install" in _find(findings, "source bank", "table kappaflow_ledger.events").fix


def test_binlog_row_metadata_is_checked(tmp_path: Path, mariadb_server: Any) -> None:
    """Capture refuses a server without binlog_row_metadata=FULL (connectors/mysql/server.py); doctor must too."""
    src = MySQLSourceConfig(name="inv", dsn=f"mysql://root@127.0.0.1:{mariadb_server.port}/mysql",
                            tables=["mysql.db"])
    s = _settings(tmp_path, sources={"inv": src})
    assert _find(run_checks(s), "source inv", "binlog_row_metadata").status is Status.OK
    mariadb_server.execute("SET GLOBAL binlog_row_metadata = 'MINIMAL'")
    try:
        f = _find(run_checks(s), "source inv", "binlog_row_metadata")
    finally:
        mariadb_server.execute("SET GLOBAL binlog_row_metadata = 'FULL'")
    assert f.status is Status.FAIL and "MINIMAL" in f.detail and "--binlog-row-metadata=FULL" in f.fix


def test_append_only_topics_of_debezium_and_ledger_sources(tmp_path: Path) -> None:
    """The Debezium source's dead-letter, message and transaction topics and its keyless tables' topics are
    append-only by design (connectors/debezium/source.py), and so are a ledger source's stream topics
    (connectors/ledger/connector.py): no false FAIL; compaction on a ledger stream topic is the real problem."""
    from kappaflow.config import DebeziumSourceConfig, LedgerSourceConfig

    s = _settings(tmp_path, sources={
        "dbz": DebeziumSourceConfig(name="dbz", bootstrap=f"127.0.0.1:{free_port()}", topics=["pg.public.t"]),
        "bank": LedgerSourceConfig(name="bank", dsn=f"postgresql://app@127.0.0.1:{free_port()}/bank")})
    delete = TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.DELETE)
    with s.open_log() as log:
        log.create_topic("dbz.__dead_letter", delete)
        log.create_topic("dbz.transaction", delete)
        log.create_topic("dbz.message", delete)
        log.create_topic("dbz.public.t", delete)  # a converted table topic: must be compacted
        # a table Debezium sent without a key: its __schema record names no key columns, append-only by design
        log.create_topic("dbz.__schema", TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT))
        log.append("dbz.__schema", [Record(b'"public.nokey"', orjson.dumps(
            {"name": "dbz.public.nokey", "columns": [{"name": "v", "type": "string", "optional": True}],
             "key": []}))], partition=0)
        log.create_topic("dbz.public.nokey", delete)
        log.create_topic("bank.Account", delete)
        log.create_topic("bank.Transfer", TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT))
    findings = [f for f in run_checks(s) if f.area == "log" and f.check.startswith("topic ")]
    by_topic = {f.check.removeprefix("topic "): f for f in findings}
    assert set(by_topic) == {"dbz.public.t", "bank.Transfer"}, findings
    assert "cleanup.policy=compact" in by_topic["dbz.public.t"].fix
    assert "cleanup.policy=delete" in by_topic["bank.Transfer"].fix


def test_keyless_table_fails_doctor_with_both_fixes(tmp_path: Path, pg_dsn: str) -> None:
    _sql(pg_dsn, "CREATE TABLE orders (id int PRIMARY KEY)", "CREATE TABLE history (tid int NOT NULL, delta int)")
    src = PostgresSourceConfig(name="shop", dsn=pg_dsn, tables=["public.orders", "public.history"])
    findings = run_checks(_settings(tmp_path, sources={"shop": src}))
    assert _find(findings, "source shop", "table public.orders").status is Status.OK
    f = _find(findings, "source shop", "table public.history")
    assert f.status is Status.FAIL and "no primary key" in f.detail
    assert "--key-columns public.history=" in f.fix and "ALTER TABLE public.history REPLICA IDENTITY FULL" in f.fix
    keyed = PostgresSourceConfig(name="shop", dsn=pg_dsn, tables=["public.history"],
                                 key_columns={"public.history": ["tid"]})
    f = _find(run_checks(_settings(tmp_path, sources={"shop": keyed})), "source shop", "table public.history")
    assert f.status is Status.FAIL and "REPLICA IDENTITY DEFAULT does not put key column(s) tid" in f.detail


def test_keyless_mysql_table_fails_doctor(tmp_path: Path, mariadb_server: Any, mariadb_db: str) -> None:
    mariadb_server.execute("CREATE TABLE k (a INT NOT NULL, b INT)", db=mariadb_db)
    src = MySQLSourceConfig(name="inv", dsn=f"mysql://root@127.0.0.1:{mariadb_server.port}/{mariadb_db}")
    f = _find(run_checks(_settings(tmp_path, sources={"inv": src})), "source inv", f"table {mariadb_db}.k")
    assert f.status is Status.FAIL and f"--key-columns {mariadb_db}.k=" in f.fix


def test_inactive_slots_retaining_wal_are_flagged_with_their_size(tmp_path: Path, pg_dsn: str) -> None:
    """Issue 13 item 4: an inactive slot retains WAL without limit; doctor used to pass."""
    import uuid

    orphan, ours = f"orphan_{uuid.uuid4().hex[:8]}", f"kappaflow_{uuid.uuid4().hex[:8]}"
    _sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, pad text)",
         f"SELECT pg_create_logical_replication_slot('{orphan}', 'pgoutput')",
         f"SELECT pg_create_logical_replication_slot('{ours}', 'pgoutput')",
         "INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(1, 2000) g")
    try:
        src = PostgresSourceConfig(name="shop", dsn=pg_dsn, tables=["public.t"], slot=ours)
        findings = run_checks(_settings(tmp_path, sources={"shop": src}))
        server = f"postgres {urlsplit(pg_dsn).hostname}:{urlsplit(pg_dsn).port}"
        f = _find(findings, server, f"slot {orphan}")
        assert f.status is Status.FAIL and "inactive" in f.detail and "of WAL" in f.detail, f
        retained = int(_sql(pg_dsn, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint FROM "
                            f"pg_replication_slots WHERE slot_name = '{orphan}'")[0][0])
        assert retained > 100_000 and f"pg_drop_replication_slot('{orphan}')" in f.fix
        assert any(unit in f.detail for unit in ("kB", "MB")), f.detail
        mine = _find(findings, "source shop", "slot")
        assert mine.status is Status.WARN and "retains" in mine.detail and "kappaflow capture shop" in mine.fix
        assert not [x for x in findings if x.check == f"slot {ours}"]  # reported once, with its source
    finally:
        _sql(pg_dsn, f"SELECT pg_drop_replication_slot('{orphan}')", f"SELECT pg_drop_replication_slot('{ours}')")


def test_piped_output_is_whole_and_json_is_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     replica_pg: Any) -> None:
    """Issue 13 item 23: piped, the 'how to fix' column was cut at 80 columns ("--binlog-forma…")."""
    import json

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COLUMNS", raising=False)
    (tmp_path / "kappaflow.toml").write_text(
        f'[log]\nurl = "log"\n[sources.shop]\nkind = "postgres"\ndsn = "{replica_pg.dsn()}"\n')
    res = CliRunner().invoke(app, ["doctor"])
    assert res.exit_code == 1
    assert "ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL" in res.output, res.output
    assert "…" not in res.output, res.output
    res = CliRunner().invoke(app, ["doctor", "--json"])
    assert res.exit_code == 1
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    wal = [r for r in rows if r["check"] == "wal_level"]
    assert wal and wal[0]["status"] == "fail" and "restart" in wal[0]["fix"], rows


def test_slot_wal_over_the_health_threshold_and_unset_keep_size_are_warned(tmp_path: Path, pg_dsn: str) -> None:
    """Issue 21: doctor warns when a slot retains more WAL than [health] max_retained_wal_bytes, and
    when max_slot_wal_keep_size is unset (-1, PostgreSQL's default: no limit on what a slot keeps)."""
    import uuid

    from kappaflow.config import HealthConfig

    slot = f"kappaflow_{uuid.uuid4().hex[:8]}"
    _sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, pad text)",
         f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')",
         "INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(1, 2000) g")
    try:
        assert _sql(pg_dsn, "SHOW max_slot_wal_keep_size")[0][0] == "-1"
        src = PostgresSourceConfig(name="shop", dsn=pg_dsn, tables=["public.t"], slot=slot)
        findings = run_checks(_settings(tmp_path, sources={"shop": src},
                                        health=HealthConfig(max_retained_wal_bytes=100_000)))
        over = _find(findings, "source shop", "retained WAL")
        assert over.status is Status.WARN and f"slot {slot} retains" in over.detail, over
        assert "max_retained_wal_bytes" in over.detail
        keep = _find(findings, "source shop", "max_slot_wal_keep_size")
        assert keep.status is Status.WARN and "ALTER SYSTEM SET max_slot_wal_keep_size" in keep.fix
        under = run_checks(_settings(tmp_path, sources={"shop": src}, health=HealthConfig()))  # 1 GiB
        assert not [f for f in under if f.check == "retained WAL"]
    finally:
        _sql(pg_dsn, f"SELECT pg_drop_replication_slot('{slot}')")
