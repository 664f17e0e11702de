"""Consistent cuts (connectors/cuts.py): what the capture writer records and where readers stop.

The writer stores, with each offsets record, the end offset of every partition of its source
at the last transaction boundary; a batch that ends inside a transaction repeats the previous
cut. Readers cap their end offsets at the newest cut, pick among recent cuts for a record
budget, and never split a transaction larger than the budget.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from kappaflow.connectors.cuts import CutIndex, consistent_ends
from kappaflow.connectors.offsets import OffsetStore
from kappaflow.connectors.writer import Batch, CaptureWriter
from kappaflow.log.base import Record, TopicConfig


@dataclass
class Names:
    """One test's source and its two topics (unique: the Kafka broker is shared by the session)."""

    source: str
    a: str
    b: str

    @classmethod
    def fresh(cls) -> Names:
        source = f"src{uuid.uuid4().hex[:8]}"
        return cls(source, f"{source}.public.a", f"{source}.public.b")


def recs(n: int, prefix: str) -> list[Record]:
    return [Record(f"{prefix}{i}".encode(), b"v") for i in range(n)]


def write(writer: CaptureWriter, appends: list[tuple[str, int, int]], *, cut: bool, offset: int) -> None:
    batch = Batch(offset={"n": offset}, cut=cut)
    for topic, partition, n in appends:
        batch.add(topic, recs(n, f"{topic}-{offset}-"), partition)
    writer.submit(batch)


@pytest.fixture
def names() -> Names:
    return Names.fresh()


@pytest.fixture
def writer(any_log: Any, names: Names) -> Any:
    for t in (names.a, names.b):
        any_log.create_topic(t, TopicConfig(partitions=2), exist_ok=True)
    w = CaptureWriter(any_log, OffsetStore(any_log), names.source, threaded=False)
    yield w
    w.close()


def test_cut_per_transaction_boundary_and_repeated_inside_one(any_log: Any, writer: CaptureWriter,
                                                              names: Names) -> None:
    index = CutIndex(any_log)
    index.refresh()
    assert index.cut(names.source) is None  # nothing recorded yet: readers read to the end
    write(writer, [(names.a, 0, 2), (names.b, 1, 3)], cut=True, offset=1)
    index.refresh()
    first = index.cut(names.source)
    assert first == {names.a: {0: 2, 1: 0}, names.b: {0: 0, 1: 3}}
    # a transaction written in two batches: the first part repeats the previous cut
    write(writer, [(names.a, 1, 4)], cut=False, offset=1)
    index.refresh()
    assert index.cut(names.source) == first
    ends = {t: dict(any_log.end_offsets(t)) for t in (names.a, names.b)}
    assert ends[names.a] == {0: 2, 1: 4}
    assert consistent_ends(index, [names.a, names.b], {}, ends) == first  # the reader stops before the part
    write(writer, [(names.b, 0, 1)], cut=True, offset=2)
    index.refresh()
    assert index.cut(names.source) == {names.a: {0: 2, 1: 4}, names.b: {0: 1, 1: 3}}
    assert OffsetStore(any_log).load(names.source) == {"n": 2}  # the offset itself is unchanged in shape


def test_restarted_writer_covers_the_tail_of_a_killed_run(any_log: Any, writer: CaptureWriter, names: Names) -> None:
    write(writer, [(names.a, 0, 2)], cut=True, offset=1)
    any_log.append(names.a, recs(3, "tail"), partition=1)  # a part written by a run killed mid-transaction
    again = CaptureWriter(any_log, OffsetStore(any_log), names.source, threaded=False)
    try:
        # the restarted capture completes the transaction in another partition, then records a cut
        write(again, [(names.b, 0, 1)], cut=True, offset=2)
    finally:
        again.close()
    index = CutIndex(any_log)
    index.refresh()
    assert index.cut(names.source) == {names.a: {0: 2, 1: 3}, names.b: {0: 1, 1: 0}}


def test_budget_picks_the_newest_cut_within_it_and_never_splits_a_transaction(
        any_log: Any, writer: CaptureWriter, names: Names) -> None:
    for i in range(1, 6):  # five transactions of 4 records, 2 per topic
        write(writer, [(names.a, 0, 2), (names.b, 1, 2)], cut=True, offset=i)
    write(writer, [(names.a, 1, 30), (names.b, 0, 30)], cut=True, offset=6)  # one transaction of 60 records
    index = CutIndex(any_log)
    index.refresh()
    ends = {t: dict(any_log.end_offsets(t)) for t in (names.a, names.b)}
    a, b = names.a, names.b
    assert consistent_ends(index, [a, b], {}, ends, budget=10) == {a: {0: 4, 1: 0}, b: {0: 0, 1: 4}}
    begin = {a: {0: 10, 1: 0}, b: {0: 0, 1: 10}}
    # the big transaction is larger than the budget: the batch grows to its cut
    assert consistent_ends(index, [a, b], begin, ends, budget=10) == {a: {0: 10, 1: 30}, b: {0: 30, 1: 10}}
    assert consistent_ends(index, [a, b], {}, ends, budget=1000) == ends


def test_sources_without_cuts_and_topics_newer_than_the_cut(any_log: Any, writer: CaptureWriter, names: Names) -> None:
    other = f"hand{uuid.uuid4().hex[:6]}.made"
    any_log.create_topic(other, TopicConfig(partitions=1), exist_ok=True)
    any_log.append(other, recs(5, "h"))
    write(writer, [(names.a, 0, 1)], cut=True, offset=1)
    newer = f"{names.source}.public.c"
    any_log.create_topic(newer, TopicConfig(partitions=1), exist_ok=True)
    any_log.append(newer, recs(2, "c"))  # not covered by any cut yet
    index = CutIndex(any_log)
    index.refresh()
    ends = {t: dict(any_log.end_offsets(t)) for t in (names.a, other, newer)}
    got = consistent_ends(index, [names.a, other, newer], {}, ends)
    assert got == {names.a: {0: 1, 1: 0}, other: {0: 5}, newer: {0: 0}}


@pytest.mark.integration
def test_spark_reads_stop_at_the_cut_unless_per_key(any_log: Any, writer: CaptureWriter, names: Names, spark: Any,
                                                     request: pytest.FixtureRequest) -> None:
    """The data source's batch read to 'latest' (what a replay reads) and a stream's micro-batch end at
    the newest cut; consistency=per_key reads to the log's end."""
    write(writer, [(names.a, 0, 3), (names.b, 1, 2)], cut=True, offset=1)
    write(writer, [(names.a, 1, 4)], cut=False, offset=1)  # the first part of a transaction
    url = str(any_log.path) if hasattr(any_log, "path") else f"kafka://{request.getfixturevalue('kafka_broker').bootstrap}"

    def read(**options: str) -> list[tuple[str, int, int]]:
        reader = spark.read.format("kappaflow").option("log", url).option("topics", f"{names.a},{names.b}")
        rows = reader.options(**options).load().collect()
        return sorted((r.topic, r.partition, r.offset) for r in rows)

    cut_rows = [(names.a, 0, i) for i in range(3)] + [(names.b, 1, i) for i in range(2)]
    assert read() == cut_rows
    assert len(read(consistency="per_key")) == 9
    with pytest.raises(Exception, match="consistency"):
        read(consistency="sometimes")

    from kappaflow.projections.datasource import _Options, _StreamReader

    stream = _StreamReader(_Options({"log": url, "topics": f"{names.a},{names.b}"}))
    assert stream.latestOffset(stream.initialOffset()) == {names.a: {"0": 3, "1": 0}, names.b: {"0": 0, "1": 2}}
    write(writer, [(names.b, 0, 1)], cut=True, offset=2)  # the transaction completes
    assert stream.latestOffset(stream.initialOffset()) == {names.a: {"0": 3, "1": 4}, names.b: {"0": 1, "1": 2}}


def test_a_reader_finds_a_quiet_source_cut_before_its_first_window(any_log: Any, writer: CaptureWriter, names: Names,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kappaflow.connectors import cuts

    write(writer, [(names.a, 0, 2)], cut=True, offset=1)
    for i in range(30):  # another source's offsets records push this one's out of the first window
        OffsetStore(any_log).save(f"busy{i}", {"n": i}, cut={"x.y": {0: i}})
    monkeypatch.setattr(cuts, "FIRST_WINDOW", 10)
    index = CutIndex(any_log)
    index.refresh()
    assert index.first > 0
    assert index.cut(names.source) == {names.a: {0: 2, 1: 0}, names.b: {0: 0, 1: 0}}
    assert index.cut("never") is None
