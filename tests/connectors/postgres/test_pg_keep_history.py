"""`[sources.<name>] keep_history`: a table's topic keeps every version (delete policy, no retention
limit on Kafka), through capture and compaction; what capture refuses. Real PostgreSQL, both logs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
from pg_helpers import capture, config, records

from kappaflow.config import Settings
from kappaflow.errors import ConfigError
from kappaflow.log.base import CleanupPolicy, Log, TopicConfig

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


@pytest.mark.parametrize("log_kind", ["embedded", "kafka"])
def test_keep_history_topic_keeps_every_version_through_compaction(
        request: pytest.FixtureRequest, log_kind: str, pg_dsn: str, sql: Callable[..., Any], source_name: str) -> None:
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
    if log_kind == "kafka":  # the broker would delete after its default retention otherwise
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
        embedded_log: Log, pg_dsn: str, sql: Callable[..., Any], source_name: str) -> None:
    kept, other = _tables(sql, source_name)
    capture(config(pg_dsn, source_name, [kept, other]), embedded_log)  # topics created compacted
    with pytest.raises(ConfigError) as err:
        capture(config(pg_dsn, source_name, [kept, other], keep_history=[kept]), embedded_log)
    msg = str(err.value)
    assert f"sources.{source_name}.keep_history" in msg
    assert f"{source_name}.{kept}" in msg and "cleanup.policy=compact" in msg
    assert "kappaflow log delete" in msg and "kappaflow snapshot" in msg
    assert f"{source_name}.{other}" not in msg


def test_keep_history_refuses_a_retention_limit(kafka_log: Log, pg_dsn: str, sql: Callable[..., Any],
                                                source_name: str) -> None:
    kept, other = _tables(sql, source_name)
    kafka_log.create_topic(f"{source_name}.{kept}", TopicConfig(partitions=3, retention_ms=604_800_000))
    with pytest.raises(ConfigError, match=r"retention\.ms=604800000"):
        capture(config(pg_dsn, source_name, [kept, other], keep_history=[kept]), kafka_log)


def test_keep_history_table_must_be_captured(tmp_path: Any, embedded_log: Log, pg_dsn: str,
                                             sql: Callable[..., Any], source_name: str) -> None:
    kept, other = _tables(sql, source_name)
    (tmp_path / "kappaflow.toml").write_text(
        f'[sources.{source_name}]\nkind = "postgres"\ndsn = "{pg_dsn}"\ntables = ["{other}"]\n'
        f'keep_history = ["{kept}"]\n')
    with pytest.raises(ConfigError, match=rf"sources\.{source_name}\.keep_history: \['{kept}'\] not among"):
        Settings.load(tmp_path / "kappaflow.toml")
    # a source capturing every table: checked against the server's tables when capture starts
    missing = f"public.{source_name}_nope"
    with pytest.raises(ConfigError, match=rf"sources\.{source_name}\.keep_history: \['{missing}'\] not captured"):
        capture(config(pg_dsn, source_name, [], keep_history=[missing]), embedded_log)
