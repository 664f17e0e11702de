"""`kappaflow source add|list|remove` edit kappaflow.toml and reject bad arguments clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kappaflow.cli.app import app
from kappaflow.config import Settings


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.chdir(tmp_path)
    return CliRunner()


def test_add_list_remove(runner: CliRunner, tmp_path: Path) -> None:
    res = runner.invoke(app, ["source", "add", "shop", "--postgres", "postgresql://app@localhost:5432/shop",
                              "--tables", "public.orders,public.customers", "--key-columns", "public.log=id,seq"])
    assert res.exit_code == 0, res.output
    s = Settings.load(tmp_path / "kappaflow.toml", environ={})
    src = s.source("shop")
    assert src.kind == "postgres" and src.tables == ["public.orders", "public.customers"]
    assert src.key_columns == {"public.log": ["id", "seq"]}
    res = runner.invoke(app, ["source", "add", "db2", "--mysql", "mysql://root@127.0.0.1:3306/app",
                              "--tables", "app.a"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["source", "list"])
    assert "shop" in res.output and "db2" in res.output and "mysql" in res.output
    res = runner.invoke(app, ["source", "remove", "shop"])
    assert res.exit_code == 0
    assert "shop" not in Settings.load(tmp_path / "kappaflow.toml", environ={}).sources


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["source", "add", "x"], "exactly one of"),
        (["source", "add", "x", "--postgres", "postgresql://u:topsecret@h/db"], "password"),
        (["source", "add", "x", "--postgres", "mysql://h/db"], "postgresql://"),
        (["source", "add", "x", "--postgres", "postgresql://h/db", "--key-columns", "t"], "TABLE=COL"),
        (["source", "remove", "ghost"], "unknown source 'ghost'"),
    ],
)
def test_bad_arguments(runner: CliRunner, args: list[str], message: str) -> None:
    res = runner.invoke(app, args)
    assert res.exit_code != 0
    out = res.output + (res.stderr if res.stderr_bytes is not None else "")
    assert message in out.replace("\n", " "), out
    assert "topsecret" not in out


def test_duplicate_source_needs_replace(runner: CliRunner) -> None:
    args = ["source", "add", "s", "--postgres", "postgresql://h/db"]
    assert runner.invoke(app, args).exit_code == 0
    res = runner.invoke(app, args)
    assert res.exit_code != 0 and "--replace" in res.output
    assert runner.invoke(app, [*args, "--replace"]).exit_code == 0
