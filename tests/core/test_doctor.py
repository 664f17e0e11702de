"""`kappaflow doctor` against live servers: each misconfiguration gets an actionable finding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kappaflow.cli.app import app
from kappaflow.config import MySQLSourceConfig, PostgresSourceConfig, Settings
from kappaflow.doctor import Finding, Status, run_checks
from kappaflow.log import CleanupPolicy, TopicConfig
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
