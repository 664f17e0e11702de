"""Source kind ``ledger``: configuration, `kappaflow source add --ledger`, the connector factory."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kappaflow.cli.app import app
from kappaflow.cli.capture import make_connector
from kappaflow.config import LedgerSourceConfig, Settings
from kappaflow.connectors.ledger import LedgerConnector
from kappaflow.errors import ConfigError


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.chdir(tmp_path)
    return CliRunner()


def test_source_add_ledger_round_trips(runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res = runner.invoke(app, ["source", "add", "bank", "--ledger", "postgresql://app@localhost:5432/bank",
                              "--ledger-schema", "books", "--password-env", "BANK_PW"])
    assert res.exit_code == 0, res.output
    text = (tmp_path / "kappaflow.toml").read_text()
    assert 'kind = "ledger"' in text and 'schema_name = "books"' in text and "tables" not in text
    monkeypatch.setenv("BANK_PW", "s3cret")
    src = Settings.load(tmp_path / "kappaflow.toml", environ={}).source("bank")
    assert isinstance(src, LedgerSourceConfig)
    pg = src.postgres_config()
    assert pg.tables == ["books.events"]
    assert pg.slot_name == "kappaflow_bank" and pg.publication_name == "kappaflow_bank"
    assert "s3cret" in pg.connect_dsn() and "s3cret" not in repr(pg)
    res = runner.invoke(app, ["source", "list"])
    assert "ledger" in res.output and "books.events" in res.output


@pytest.mark.parametrize(("args", "message"), [
    (["--ledger", "postgresql://h/db", "--postgres", "postgresql://h/db"], "exactly one of"),
    (["--postgres", "postgresql://h/db", "--ledger-schema", "s"], "--ledger-schema goes with --ledger"),
    (["--ledger", "postgresql://h/db", "--tables", "public.t"], "do not apply to --ledger"),
    (["--ledger", "mysql://h/db"], "postgresql://"),
    (["--ledger", "postgresql://u:topsecret@h/db"], "password"),
    (["--ledger", "postgresql://h/db", "--ledger-schema", "a.b"], "without '.'"),
])
def test_bad_ledger_sources_are_named(runner: CliRunner, args: list[str], message: str) -> None:
    res = runner.invoke(app, ["source", "add", "x", *args])
    assert res.exit_code != 0
    out = res.output + (res.stderr if res.stderr_bytes is not None else "")
    assert message in out.replace("\n", " "), out
    assert "topsecret" not in out


def test_toml_ledger_source_and_factory(tmp_path: Path) -> None:
    path = tmp_path / "kappaflow.toml"
    path.write_text('[sources.bank]\nkind = "ledger"\ndsn = "postgresql://app@h/bank"\nslot = "my_slot"\n')
    src = Settings.load(path, environ={}).source("bank")
    assert isinstance(src, LedgerSourceConfig) and src.schema_name == "kappaflow_ledger"
    assert src.postgres_config().slot_name == "my_slot"
    path.write_text('[sources.bank]\nkind = "ledger"\ndsn = "postgresql://app@h/bank"\ntables = ["public.t"]\n')
    with pytest.raises(ConfigError, match=r"sources\.bank\.ledger\.tables: .*always captures <schema_name>\.events"):
        Settings.load(path, environ={})

    from kappaflow.log.embedded import EmbeddedLog

    with EmbeddedLog(tmp_path / "log") as log:
        conn = make_connector(src, log, partitions=2, progress=False)
        assert isinstance(conn, LedgerConnector) and conn.postgres.partitions == 2
        assert conn.postgres.mappers.keys() == {"kappaflow_ledger.events"}
