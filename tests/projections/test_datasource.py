"""The `kappaflow` Spark data source on both log backends: batch, streaming, options."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from kappaflow.errors import ConfigError
from kappaflow.log.base import Record, TopicConfig
from kappaflow.projections.datasource import LogRange, log_options_to_spark, parse_offsets, plan_ranges

pytestmark = pytest.mark.integration


Loaded = tuple[Any, str, str, dict[str, str]]  # log, topic, log URL, data source options of the client


@pytest.fixture(params=["embedded", "kafka-python", "confluent"])
def loaded(request: pytest.FixtureRequest) -> tuple[Any, str, str, dict[str, str]]:
    """A topic with 3 partitions: 30 keyed records (key k<i % 10>), a tombstone, headers; on the embedded
    log and on Kafka, written and read (on the executors) with each Kafka client."""
    kind = str(request.param)
    log = request.getfixturevalue({"embedded": "embedded_log", "kafka-python": "kafka_log",
                                   "confluent": "confluent_log"}[kind])
    topic = "ds-" + uuid.uuid4().hex[:10]
    log.create_topic(topic, TopicConfig(partitions=3))
    recs = [Record(f"k{i % 10}".encode(), f"v{i}".encode(), (("kf.op", b"u"),)) for i in range(30)]
    recs.append(Record(b"k3", None))
    log.append(topic, recs)
    if kind == "embedded":
        return log, topic, str(log.path), {}
    url = "kafka://" + request.getfixturevalue("kafka_broker").bootstrap
    return log, topic, url, log_options_to_spark({"client": kind})


def _read(spark: Any, loaded: Loaded, **options: str) -> list[Any]:
    _, topic, url, client = loaded
    reader = spark.read.format("kappaflow").option("log", url).option("topics", topic).options(**client)
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load().orderBy("partition", "offset").collect()


def test_batch_read_gives_every_record_with_its_position(spark: Any, loaded: Loaded) -> None:
    log, topic, *_ = loaded
    rows = _read(spark, loaded, maxRecordsPerPartition="4")
    assert len(rows) == 31
    ends = log.end_offsets(topic)
    for p in range(3):
        mine = [r for r in rows if r.partition == p]
        assert [r.offset for r in mine] == list(range(ends[p]))
        expected = log.read(topic, p, 0, 100)
        assert [(r.key, r.value) for r in mine] == [
            (bytearray(e.key), None if e.value is None else bytearray(e.value)) for e in expected
        ]
    tomb = [r for r in rows if r.value is None]
    assert len(tomb) == 1 and tomb[0].key == b"k3" and tomb[0].op is None
    assert {r.op for r in rows if r.value is not None} == {"u"} and rows[0].topic == topic


def test_offsets_options_and_latest_per_key(spark: Any, loaded: Loaded) -> None:
    log, topic, *_ = loaded
    ends = log.end_offsets(topic)
    start = {topic: {"0": 1, "1": 2}}
    end = {topic: {"0": ends[0] - 1}}
    rows = _read(spark, loaded, startingOffsets=json.dumps(start), endingOffsets=json.dumps(end))
    got = {(r.partition, r.offset) for r in rows}
    want = (
        {(0, o) for o in range(1, ends[0] - 1)} | {(1, o) for o in range(2, ends[1])} | {(2, o) for o in range(ends[2])}
    )
    assert got == want
    latest = _read(spark, loaded, latestPerKey="true")
    by_key: dict[bytes, Any] = {}
    for p in range(3):
        for rec in log.read(topic, p, 0, 100):
            by_key[rec.key] = rec
    assert {(bytes(r.key), r.offset) for r in latest} == {(k, r.offset) for k, r in by_key.items()}
    assert next(r for r in latest if r.key == b"k3").value is None  # the tombstone is k3's latest


def test_streaming_read_from_stored_offsets(spark: Any, loaded: Loaded, tmp_path: Any) -> None:
    log, topic, url, client = loaded
    seen: list[tuple[int, int]] = []

    def batch(df: Any, _id: int) -> None:
        seen.extend((r.partition, r.offset) for r in df.select("partition", "offset").collect())

    start = {topic: {"0": 2}}
    q = (
        spark.readStream.format("kappaflow")
        .option("log", url)
        .options(**client)
        .option("topics", topic)
        .option("startingOffsets", json.dumps(start))
        .option("maxRecordsPerTrigger", "7")
        .load()
        .writeStream.foreachBatch(batch)
        .option("checkpointLocation", str(tmp_path / "c"))
        .start()
    )
    try:
        q.processAllAvailable()
        log.append(topic, [Record(b"k1", b"late")])
        q.processAllAvailable()
    finally:
        q.stop()
    ends = log.end_offsets(topic)
    want = {(0, o) for o in range(2, ends[0])} | {(p, o) for p in (1, 2) for o in range(ends[p])}
    assert sorted(seen) == sorted(want)  # every record once, none before the start
    progress = [p for p in q.recentProgress if p["numInputRows"]]
    assert progress and all(p["numInputRows"] <= 7 + 3 for p in progress)  # admission control


def test_bad_options_are_named(spark: Any, tmp_path: Any) -> None:
    with pytest.raises(Exception, match="topics"):
        spark.read.format("kappaflow").option("log", str(tmp_path)).load().collect()
    with pytest.raises(ConfigError, match="startingOffsets"):
        parse_offsets("startingOffsets", "{nope", "earliest")
    with pytest.raises(ConfigError, match=r"startingOffsets.*t\.0"):
        parse_offsets("startingOffsets", '{"t": {"0": "x"}}', "earliest")


def test_plan_ranges_splits_partitions() -> None:
    ranges = plan_ranges({"t": {0: 2}}, {"t": {0: 10, 1: 3}}, 4)
    assert [(r.partition, r.start, r.end) for r in ranges] == [(0, 2, 6), (0, 6, 10), (1, 0, 3)]
    assert isinstance(ranges[0], LogRange)
