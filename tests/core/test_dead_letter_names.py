"""One dead-letter naming scheme (kappaflow/deadletters.py): projections write the new topic and still
read dead letters written under the old name; every component's topic is kf.dead_letter.<kind>.<name>."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

from kappaflow.deadletters import dead_letter_topic, legacy_dead_letter_topics
from kappaflow.log.base import CleanupPolicy, Record, TopicConfig
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.projections.deadletter import dead_letter_log_url, read_dead_letters, write_dead_letters


def test_one_scheme_for_sources_and_projections() -> None:
    assert dead_letter_topic("source", "dbz") == "kf.dead_letter.source.dbz"
    assert dead_letter_topic("projection", "dbz") == "kf.dead_letter.projection.dbz"  # never the same topic
    assert legacy_dead_letter_topics("source", "dbz") == ("dbz.__dead_letter",)
    assert legacy_dead_letter_topics("projection", "totals") == ("kf.deadletter.totals",)
    with pytest.raises(ValueError, match="expected 'source' or 'projection'"):
        dead_letter_topic("sink", "x")  # type: ignore[arg-type]


def test_projection_dead_letters_under_the_old_name_are_still_read(tmp_path: Path) -> None:
    log_url = str(tmp_path / "log")
    old = {"projection": "totals", "topic": "shop.public.orders", "partition": 0, "offset": 7, "key": None,
           "reason": "written by an earlier version", "ts_ms": int(time.time() * 1000)}
    legacy = EmbeddedLog(Path(dead_letter_log_url(log_url)))
    try:
        legacy.create_topic("kf.deadletter.totals", TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT))
        legacy.append("kf.deadletter.totals", [Record(b"shop.public.orders:0:7", orjson.dumps(old))])
    finally:
        legacy.close()
    assert write_dead_letters(log_url, {}, "totals", [
        {"topic": "shop.public.orders", "partition": 1, "offset": 3, "key": b"k", "reason": "apply() raised"}]) == 1
    got = read_dead_letters(log_url, {}, "totals")
    assert [(d["partition"], d["offset"], d["reason"]) for d in got] == [
        (0, 7, "written by an earlier version"), (1, 3, "apply() raised")]
    log = EmbeddedLog(Path(dead_letter_log_url(log_url)))
    try:
        assert "kf.dead_letter.projection.totals" in log.list_topics()  # new ones go to the new name
        assert sum(log.end_offsets("kf.dead_letter.projection.totals").values()) == 1
    finally:
        log.close()
