"""`kappaflow source add|remove|status` against real servers (issue 13 items 4, 21, 23).

`source add` checks the tables capture would refuse before saving; `source remove` drops the
replication slot and publication that capture created (PostgreSQL's own catalog is the witness:
pg_replication_slots, pg_publication); `source status --json` is one JSON object.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from typer.testing import CliRunner

from kappaflow.cli.app import app
from kappaflow.config import Settings

pytestmark = pytest.mark.integration


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kappaflow.toml").write_text(f'[log]\nurl = "{tmp_path / "log"}"\npartitions = 1\n')
    return CliRunner()


@pytest.fixture
def name() -> str:
    return f"s{uuid.uuid4().hex[:10]}"


def _out(res: Any) -> str:
    return (res.output + (res.stderr if res.stderr_bytes is not None else "")).replace("\n", " ")


def _sql(dsn: str, *statements: str) -> list[Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows: list[Any] = []
        for s in statements:
            cur = conn.execute(s)
            rows = cur.fetchall() if cur.description else []
        return rows


def _saved(tmp_path: Path) -> dict[str, Any]:
    return dict(Settings.load(tmp_path / "kappaflow.toml", environ={}).sources)


def test_add_refuses_a_keyless_table_with_both_fixes(runner: CliRunner, tmp_path: Path, pg_dsn: str,
                                                     name: str) -> None:
    _sql(pg_dsn, "CREATE TABLE orders (id int PRIMARY KEY)",
         "CREATE TABLE history (tid int NOT NULL, delta int, mtime timestamp)")
    res = runner.invoke(app, ["source", "add", name, "--postgres", pg_dsn, "--tables", "public.orders,public.history"])
    out = _out(res)
    assert res.exit_code != 0, out
    assert "public.history: no primary key" in out and "--key-columns public.history=" in out, out
    assert "ALTER TABLE public.history REPLICA IDENTITY FULL" in out, out
    assert name not in _saved(tmp_path)


def test_add_refuses_nullable_and_duplicate_key_columns(runner: CliRunner, tmp_path: Path, pg_dsn: str,
                                                        name: str) -> None:
    _sql(pg_dsn, "CREATE TABLE h (tid int NOT NULL, seq int, note text)", "ALTER TABLE h REPLICA IDENTITY FULL",
         "INSERT INTO h VALUES (1, 1, 'a'), (1, 1, 'a'), (2, 1, 'b')")
    args = ["source", "add", name, "--postgres", pg_dsn, "--tables", "public.h"]
    res = runner.invoke(app, [*args, "--key-columns", "public.h=tid,seq"])
    out = _out(res)
    assert res.exit_code != 0 and "seq may be NULL" in out and "ALTER TABLE public.h ALTER COLUMN seq SET NOT NULL" \
        in out, out
    _sql(pg_dsn, "ALTER TABLE h ALTER COLUMN seq SET NOT NULL")
    res = runner.invoke(app, [*args, "--key-columns", "public.h=tid,seq"])
    out = _out(res)
    assert res.exit_code != 0 and "are not unique, e.g. tid=1, seq=1 (2 rows)" in out, out
    assert "one key to kappaflow" in out and name not in _saved(tmp_path), out  # says what duplicates mean
    _sql(pg_dsn, "ALTER TABLE h ADD COLUMN id int GENERATED ALWAYS AS IDENTITY")
    res = runner.invoke(app, [*args, "--key-columns", "public.h=id"])
    assert res.exit_code == 0, _out(res)
    assert _saved(tmp_path)[name].key_columns == {"public.h": ["id"]}


def test_add_unreachable_source_says_how_to_save_unchecked(runner: CliRunner, tmp_path: Path, name: str) -> None:
    from kappaflow.testing.servers._process import free_port

    args = ["source", "add", name, "--postgres", f"postgresql://app@127.0.0.1:{free_port()}/shop"]
    res = runner.invoke(app, args)
    assert res.exit_code != 0 and "--no-check" in _out(res) and name not in _saved(tmp_path)
    assert runner.invoke(app, [*args, "--no-check"]).exit_code == 0
    assert name in _saved(tmp_path)


def test_add_mysql_checks_keys_and_duplicates(runner: CliRunner, tmp_path: Path, mariadb_server: Any,
                                              mariadb_db: str, name: str) -> None:
    db = mariadb_db
    mariadb_server.execute("CREATE TABLE ok (id INT PRIMARY KEY)", "CREATE TABLE k (a INT NOT NULL, b INT)",
                           "INSERT INTO k VALUES (1, 1), (1, 2), (2, 3)", db=db)
    dsn = f"mysql://root@{mariadb_server.host}:{mariadb_server.port}/{db}"
    res = runner.invoke(app, ["source", "add", name, "--mysql", dsn, "--tables", f"{db}.ok,{db}.k"])
    out = _out(res)
    assert res.exit_code != 0 and f"{db}.k: no primary key" in out and f"--key-columns {db}.k=" in out, out
    res = runner.invoke(app, ["source", "add", name, "--mysql", dsn, "--tables", f"{db}.ok,{db}.k",
                              "--key-columns", f"{db}.k=a"])
    out = _out(res)
    assert res.exit_code != 0 and "are not unique, e.g. a=1 (2 rows)" in out, out
    res = runner.invoke(app, ["source", "add", name, "--mysql", dsn, "--tables", f"{db}.ok,{db}.k",
                              "--key-columns", f"{db}.k=a,b"])
    out = _out(res)
    assert res.exit_code != 0 and "b may be NULL" in out and "MODIFY `b` int(11) NOT NULL" in out, out
    mariadb_server.execute("ALTER TABLE k MODIFY b INT NOT NULL", db=db)
    res = runner.invoke(app, ["source", "add", name, "--mysql", dsn, "--tables", f"{db}.ok,{db}.k",
                              "--key-columns", f"{db}.k=a,b"])
    assert res.exit_code == 0, _out(res)
    res = runner.invoke(app, ["source", "remove", name])
    assert res.exit_code == 0 and "nothing to drop" in _out(res), _out(res)


def _slot_and_publication(dsn: str, name: str) -> tuple[bool, bool]:
    slot = _sql(dsn, f"SELECT 1 FROM pg_replication_slots WHERE slot_name = 'kappaflow_{name}'")
    pub = _sql(dsn, f"SELECT 1 FROM pg_publication WHERE pubname = 'kappaflow_{name}'")
    return bool(slot), bool(pub)


def _wait_released(dsn: str, slot: str) -> None:
    """The walsender leaves a slot a moment after its connection closes (bounded wait)."""
    deadline = time.monotonic() + 60
    while _sql(dsn, f"SELECT 1 FROM pg_replication_slots WHERE slot_name = '{slot}' AND active"):
        assert time.monotonic() < deadline, f"slot {slot} stayed active 60 s after its holder disconnected"
        time.sleep(0.1)


def test_remove_drops_the_slot_and_publication_capture_made(runner: CliRunner, tmp_path: Path, pg_dsn: str,
                                                            name: str) -> None:
    """Issue 13 item 4: `source remove` used to leave both behind, and the inactive slot retained WAL."""
    _sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t VALUES (1)")
    assert runner.invoke(app, ["source", "add", name, "--postgres", pg_dsn, "--tables", "public.t"]).exit_code == 0
    res = runner.invoke(app, ["capture", name, "--until-caught-up", "--no-progress"])
    assert res.exit_code == 0, _out(res)
    assert _slot_and_publication(pg_dsn, name) == (True, True)
    res = runner.invoke(app, ["source", "status", name, "--json"])
    assert res.exit_code == 0, _out(res)
    status = json.loads(res.stdout)
    assert status["slot"] == f"kappaflow_{name}" and status["topics"] == {f"{name}.public.t": 1}
    res = runner.invoke(app, ["source", "remove", name])
    out = _out(res)
    assert res.exit_code == 0, out
    assert f"replication slot 'kappaflow_{name}' dropped" in out and f"publication 'kappaflow_{name}' dropped" in out
    assert _slot_and_publication(pg_dsn, name) == (False, False)
    assert name not in _saved(tmp_path)


def test_remove_keep_slot_keeps_both(runner: CliRunner, tmp_path: Path, pg_dsn: str, name: str) -> None:
    _sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)")
    assert runner.invoke(app, ["source", "add", name, "--postgres", pg_dsn, "--tables", "public.t"]).exit_code == 0
    assert runner.invoke(app, ["capture", name, "--until-caught-up", "--no-progress"]).exit_code == 0
    res = runner.invoke(app, ["source", "remove", name, "--keep-slot"])
    assert res.exit_code == 0 and "pg_drop_replication_slot" in _out(res), _out(res)
    assert _slot_and_publication(pg_dsn, name) == (True, True)
    _sql(pg_dsn, f"SELECT pg_drop_replication_slot('kappaflow_{name}')")


def test_remove_refuses_while_the_slot_is_in_use(runner: CliRunner, tmp_path: Path, pg_dsn: str,
                                                 name: str) -> None:
    """A running capture holds the slot: nothing is dropped and the source stays configured."""
    from kappaflow.connectors.postgres.replication import ReplicationConnection

    _sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)")
    assert runner.invoke(app, ["source", "add", name, "--postgres", pg_dsn, "--tables", "public.t"]).exit_code == 0
    assert runner.invoke(app, ["capture", name, "--until-caught-up", "--no-progress"]).exit_code == 0
    _wait_released(pg_dsn, f"kappaflow_{name}")
    repl = ReplicationConnection(pg_dsn, application_name="holder")
    try:
        repl.start(f"kappaflow_{name}", 0, [f"kappaflow_{name}"])
        res = runner.invoke(app, ["source", "remove", name])
        out = _out(res)
        assert res.exit_code != 0 and "stop that capture first" in out and "--keep-slot" in out, out
        assert name in _saved(tmp_path)
    finally:
        repl.close()
    _wait_released(pg_dsn, f"kappaflow_{name}")
    assert runner.invoke(app, ["source", "remove", name]).exit_code == 0
    assert _slot_and_publication(pg_dsn, name) == (False, False)
