"""`[sources.<name>] keep_history`: a table's topic keeps every version (delete policy, no retention
limit on Kafka), through capture and compaction; what capture refuses. Real PostgreSQL, both logs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from pg_helpers import capture, config, records
from typer.testing import CliRunner

from kappaflow.cli.app import app
from kappaflow.config import Settings
from kappaflow.doctor import Status, check_log
from kappaflow.errors import ConfigError
from kappaflow.log.base import CleanupPolicy, Log, TopicConfig
from kappaflow.log.embedded import EmbeddedLog

pytestmark = pytest.mark.integration


def _tables(sql: Callable[..., Any], source: str) -> tuple[str, str]:
    kept, other = f"public.{source}_holders", f"public.{source}_orders"
    for t in (kept, other):
        sql(f"CREATE TABLE {t} (id int PRIMARY KEY, name text NOT NULL)")
        sql(f"INSERT INTO {t} VALUES (1, 'v0'), (2, 'w0')")
    return kept, other


def _change(sql: Callable[..., Any], table: str, rounds: int) -> None:
    for i in range(1, rounds + 1):
        sql(f"UPDATE {table} SET name = %s WHERE id = 1", (f"v{i}",))
    sql(f"DELETE FROM {table} WHERE id = 2")


def _versions(log: Log, topic: str) -> list[str | None]:
    """Key 1's names in log order (every version the topic holds)."""
    out = []
    for rec in records(log, topic):
        if rec.key is not None and orjson.loads(rec.key) == {"id": 1} and rec.value is not None:
            out.append(orjson.loads(rec.value)["after"]["name"])
    return out


@pytest.mark.parametrize("log_kind", ["embedded", "kafka", "confluent"])
def test_keep_history_topic_keeps_every_version_through_compaction(
    request: pytest.FixtureRequest, log_kind: str, pg_dsn: str, sql: Callable[..., Any], source_name: str
) -> None:
    log: Log = request.getfixturevalue(f"{log_kind}_log")
    kept, other = _tables(sql, source_name)
    cfg = config(pg_dsn, source_name, [kept, other], keep_history=[kept])
    capture(cfg, log)
    _change(sql, kept, 4)
    _change(sql, other, 4)
    capture(cfg, log)
    kept_topic, other_topic = f"{source_name}.{kept}", f"{source_name}.{other}"
    kcfg, ocfg = log.topic_config(kept_topic), log.topic_config(other_topic)
    assert kcfg.cleanup_policy is CleanupPolicy.DELETE and not kcfg.compacted
    assert ocfg.compacted
    if log_kind != "embedded":  # the broker would delete after its default retention otherwise
        assert (kcfg.retention_ms, kcfg.retention_bytes) == (-1, -1)
        return  # Kafka's log cleaner compacts on the broker: nothing to trigger here
    far = 10**13  # compaction "now" far past every record's timestamp and tombstone retention
    assert log.compact(kept_topic, now_ms=far).removed == 0  # type: ignore[attr-defined]
    assert log.compact(other_topic, now_ms=far).removed > 0  # type: ignore[attr-defined]
    stats = log.compact_all(now_ms=far)  # type: ignore[attr-defined]
    assert kept_topic not in stats and other_topic in stats
    assert _versions(log, kept_topic) == ["v0", "v1", "v2", "v3", "v4"]
    assert _versions(log, other_topic) == ["v4"]
    deleted = [r for r in records(log, kept_topic) if r.key is not None and orjson.loads(r.key) == {"id": 2}]
    assert [r.value is None for r in deleted] == [False, False, True]  # insert, delete, tombstone: all kept


def test_keep_history_refuses_a_compacted_topic_and_says_what_to_do(
    embedded_log: Log, pg_dsn: str, sql: Callable[..., Any], source_name: str
) -> None:
    kept, other = _tables(sql, source_name)
    capture(config(pg_dsn, source_name, [kept, other]), embedded_log)  # topics created compacted
    with pytest.raises(ConfigError) as err:
        capture(config(pg_dsn, source_name, [kept, other], keep_history=[kept]), embedded_log)
    msg = str(err.value)
    assert f"sources.{source_name}.keep_history" in msg
    assert f"{source_name}.{kept}" in msg and "cleanup.policy=compact" in msg
    assert "kappaflow log delete" in msg and "kappaflow snapshot" in msg
    assert f"{source_name}.{other}" not in msg


def test_keep_history_refuses_a_retention_limit(
    kafka_log: Log, pg_dsn: str, sql: Callable[..., Any], source_name: str
) -> None:
    kept, other = _tables(sql, source_name)
    kafka_log.create_topic(f"{source_name}.{kept}", TopicConfig(partitions=3, retention_ms=604_800_000))
    with pytest.raises(ConfigError, match=r"retention\.ms=604800000"):
        capture(config(pg_dsn, source_name, [kept, other], keep_history=[kept]), kafka_log)


def test_keep_history_table_must_be_captured(
    tmp_path: Path,
    embedded_log: Log,
    pg_dsn: str,
    sql: Callable[..., Any],
    source_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept, other = _tables(sql, source_name)
    (tmp_path / "kappaflow.toml").write_text(
        f'[sources.{source_name}]\nkind = "postgres"\ndsn = "{pg_dsn}"\ntables = ["{other}"]\n'
        f'keep_history = ["{kept}"]\n'
    )
    with pytest.raises(ConfigError, match=rf"sources\.{source_name}\.keep_history: \['{kept}'\] not among"):
        Settings.load(tmp_path / "kappaflow.toml")
    # `source add --keep-history` saves it, and refuses an uncaptured table the same way
    (tmp_path / "kappaflow.toml").write_text("")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(
        app,
        [
            "source",
            "add",
            source_name,
            "--postgres",
            pg_dsn,
            "--tables",
            f"{kept},{other}",
            "--keep-history",
            kept,
            "--no-check",
        ],
    )
    assert res.exit_code == 0, res.output
    assert Settings.load(tmp_path / "kappaflow.toml").source(source_name).keep_history == [kept]  # type: ignore[union-attr]
    res = CliRunner().invoke(
        app, ["source", "add", "other", "--postgres", pg_dsn, "--tables", other, "--keep-history", kept, "--no-check"]
    )
    assert res.exit_code != 0 and "keep_history" in res.output and kept in res.output, res.output
    # a source capturing every table: checked against the server's tables when capture starts
    missing = f"public.{source_name}_nope"
    with pytest.raises(ConfigError, match=rf"sources\.{source_name}\.keep_history: \['{missing}'\] not captured"):
        capture(config(pg_dsn, source_name, [], keep_history=[missing]), embedded_log)


def test_cli_moves_a_compacted_topic_to_keep_history(
    tmp_path: Path, pg_dsn: str, sql: Callable[..., Any], source_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fix capture's error names: `log delete`, capture again; `source status` and `doctor` show it."""
    kept, other = _tables(sql, source_name)
    topic = f"{source_name}.{kept}"
    (tmp_path / "kappaflow.toml").write_text(
        f'[log]\nurl = "log"\n\n[sources.{source_name}]\nkind = "postgres"\ndsn = "{pg_dsn}"\n'
        f'tables = ["{kept}", "{other}"]\nkeep_history = ["{kept}"]\n'
    )
    settings = Settings.load(tmp_path / "kappaflow.toml")
    cfg = settings.source(source_name)
    monkeypatch.chdir(tmp_path)
    with EmbeddedLog(tmp_path / "log") as log:
        capture(config(pg_dsn, source_name, [kept, other]), log)  # before keep_history: compacted
    res = CliRunner().invoke(app, ["source", "status", source_name, "--json"])
    assert res.exit_code == 0, res.output
    assert "compaction removes old versions" in json.loads(res.output)["keep_history"][topic]
    with EmbeddedLog(tmp_path / "log") as log, pytest.raises(ConfigError, match=r"cleanup\.policy=compact"):
        capture(cfg, log)
    res = CliRunner().invoke(app, ["log", "delete", topic, "--yes"])
    assert res.exit_code == 0 and f"deleted {topic}" in res.output, res.output
    with EmbeddedLog(tmp_path / "log") as log:
        capture(cfg, log)
        assert not log.topic_config(topic).compacted
    res = CliRunner().invoke(app, ["source", "status", source_name, "--json"])
    assert json.loads(res.output)["keep_history"] == {
        topic: "every version kept (cleanup.policy=delete, no retention limit)"
    }, res.output
    findings = {f.check: f for f in check_log(settings)}
    assert findings[f"topic {topic}"].status is Status.OK, findings
    res = CliRunner().invoke(app, ["log", "delete", "no.such.topic", "--yes"])
    assert res.exit_code != 0 and "no.such.topic" in res.output
