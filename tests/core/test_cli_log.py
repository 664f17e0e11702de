"""`kappaflow log tail` piped: whole records, one per line, and --json (issue 13 item 23)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kappaflow.cli.app import app
from kappaflow.log import CleanupPolicy, Record, TopicConfig
from kappaflow.log.embedded import EmbeddedLog

# A Debezium change event value as the Debezium tutorial shows it (customers table, schema-less JSON):
# https://debezium.io/documentation/reference/stable/tutorial.html ("Viewing a create event").
EVENT = {"before": None, "after": {"id": 1004, "first_name": "Anne", "last_name": "Kretchmar",
                                   "email": "annek@noanswer.org"},
         "source": {"version": "2.5.0.Final", "connector": "mysql", "name": "dbserver1", "db": "inventory",
                    "table": "customers", "file": "mysql-bin.000003", "pos": 154, "row": 0},
         "op": "c", "ts_ms": 1486500577691}


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COLUMNS", raising=False)
    (tmp_path / "kappaflow.toml").write_text('[log]\nurl = "log"\n')
    log = EmbeddedLog(tmp_path / "log")
    try:
        log.create_topic("dbserver1.inventory.customers",
                         TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT))
        log.append("dbserver1.inventory.customers", [Record(b'{"id":1004}', json.dumps(EVENT).encode()),
                                                     Record(b'{"id":1004}', None)], partition=0)
    finally:
        log.close()
    return CliRunner()


def test_tail_prints_each_record_whole_on_one_line(runner: CliRunner) -> None:
    res = runner.invoke(app, ["log", "tail", "dbserver1.inventory.customers"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert len(lines) == 2, lines  # used to wrap the JSON at 80 columns
    assert lines[0] == f'dbserver1.inventory.customers[0]@0 {{"id":1004}} {json.dumps(EVENT)}'
    assert lines[1] == 'dbserver1.inventory.customers[0]@1 {"id":1004} null (tombstone)'


def test_tail_json(runner: CliRunner) -> None:
    res = runner.invoke(app, ["log", "tail", "dbserver1.inventory.customers", "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert rows == [
        {"topic": "dbserver1.inventory.customers", "partition": 0, "offset": 0, "key": {"id": 1004}, "value": EVENT},
        {"topic": "dbserver1.inventory.customers", "partition": 0, "offset": 1, "key": {"id": 1004}, "value": None},
    ]
