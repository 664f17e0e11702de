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
                              "--tables", "public.orders,public.customers", "--key-columns", "public.log=id,seq",
                              "--no-check"])
    assert res.exit_code == 0, res.output
    s = Settings.load(tmp_path / "kappaflow.toml", environ={})
    src = s.source("shop")
    assert src.kind == "postgres" and src.tables == ["public.orders", "public.customers"]
    assert src.key_columns == {"public.log": ["id", "seq"]}
    res = runner.invoke(app, ["source", "add", "db2", "--mysql", "mysql://root@127.0.0.1:3306/app",
                              "--tables", "app.a", "--no-check"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["source", "list"])
    assert "shop" in res.output and "db2" in res.output and "mysql" in res.output
    res = runner.invoke(app, ["source", "remove", "shop", "--keep-slot"])
    assert res.exit_code == 0, res.output
    assert "kept (--keep-slot)" in res.output
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
    args = ["source", "add", "s", "--postgres", "postgresql://h/db", "--no-check"]
    assert runner.invoke(app, args).exit_code == 0
    res = runner.invoke(app, args)
    assert res.exit_code != 0 and "--replace" in res.output
    assert runner.invoke(app, [*args, "--replace"]).exit_code == 0


# -- issue 13 item 15: the file is edited in place ------------------------------------------------------------

HAND_WRITTEN = """\
# kappaflow for the shop: keep this comment
[log]
url = ".kappaflow/log"   # the default, written on purpose
partitions = 4

[sources.legacy]   # the old inventory database
kind = "mysql"
dsn = "mysql://app@inventory:3306/inv"
tables = ["inv.items"]  # only this one

[spark]
master = "local[*]"
"""


def test_add_and_remove_keep_comments_order_and_explicit_values(runner: CliRunner, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kappaflow.toml"
    path.write_text(HAND_WRITTEN)
    monkeypatch.setenv("KAPPAFLOW_LOG__PARTITIONS", "8")  # an override must not be frozen into the file
    res = runner.invoke(app, ["source", "add", "shop", "--postgres", "postgresql://app@db:5432/shop",
                              "--tables", "public.orders", "--no-check"])
    assert res.exit_code == 0, res.output
    text = path.read_text()
    # the new table goes after the other sources; every byte the user wrote is still there, in order
    start, end = text.index("[sources.shop]"), text.index("[spark]")
    added = text[start:end]
    assert text[:start] + text[end:] == HAND_WRITTEN, text
    assert "[sources.shop]" in added and 'kind = "postgres"' in added and "public.orders" in added, added
    assert "partitions" not in added and "password" not in added
    src = Settings.load(path, environ={}).source("shop")
    assert src.tables == ["public.orders"]
    # --replace keeps the table's place and the comments of the keys that stay
    path.write_text(text.replace('tables = ["public.orders"]', 'tables = ["public.orders"]  # mine'))
    res = runner.invoke(app, ["source", "add", "shop", "--postgres", "postgresql://app@db:5432/shop",
                              "--tables", "public.orders", "--password-env", "PW", "--no-check", "--replace"])
    assert res.exit_code == 0, res.output
    text = path.read_text()
    assert 'tables = ["public.orders"]  # mine' in text and 'password_env = "PW"' in text, text
    res = runner.invoke(app, ["source", "remove", "shop", "--keep-slot"])
    assert res.exit_code == 0, res.output
    assert path.read_text() == HAND_WRITTEN


def test_config_option_names_the_file_that_is_edited(runner: CliRunner, tmp_path: Path) -> None:
    other = tmp_path / "conf" / "other.toml"
    other.parent.mkdir()
    other.write_text("# mine\n")
    res = runner.invoke(app, ["--config", str(other), "source", "add", "s", "--debezium", "k:9092",
                              "--topics", "dbz.public.t"])
    assert res.exit_code == 0, res.output
    assert "[sources.s]" in other.read_text() and other.read_text().startswith("# mine\n")
    assert not (tmp_path / "kappaflow.toml").exists()
