"""The offsets store: one compacted record per source in the log itself, read from the end."""

from __future__ import annotations

import orjson
import pytest

from kappaflow.connectors.base import TrustedRecord, record_position, tail_positions
from kappaflow.connectors.offsets import OFFSETS_TOPIC, OffsetStore, find_last
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.errors import ValidationError
from kappaflow.log.base import CleanupPolicy, Log, Record, TopicConfig


@pytest.mark.integration
def test_save_load_delete_per_source(any_log: Log, unique_topic: str) -> None:
    store = OffsetStore(any_log, topic=unique_topic)
    assert any_log.topic_config(unique_topic).cleanup_policy is CleanupPolicy.COMPACT
    assert store.load("shop") is None
    store.save("shop", {"lsn": 1})
    store.save("crm", {"lsn": 7})
    for i in range(2, 300):  # many saves: the latest wins, found from the end
        store.save("shop", {"lsn": i})
    assert store.load("shop") == {"lsn": 299}
    assert store.load("crm") == {"lsn": 7}  # far back: the backward scan widens its window
    again = OffsetStore(any_log, topic=unique_topic)  # a restarted process reads the same
    assert again.load("shop") == {"lsn": 299}
    store.delete("shop")
    assert again.load("shop") is None and again.load("crm") == {"lsn": 7}


@pytest.mark.integration
def test_malformed_offset_names_topic_and_offset(embedded_log: Log) -> None:
    store = OffsetStore(embedded_log)
    embedded_log.append(OFFSETS_TOPIC, [Record(orjson.dumps({"source": "x"}), b"not json")])
    with pytest.raises(ValidationError, match=rf"offsets topic '{OFFSETS_TOPIC}' partition 0 offset 0: .*not JSON"):
        store.load("x")


@pytest.mark.integration
def test_tail_positions_read_headers_and_values(embedded_log: Log) -> None:
    embedded_log.create_topic("t", TopicConfig(partitions=2, cleanup_policy=CleanupPolicy.COMPACT))
    value = orjson.dumps({"op": "c", "source": {"kf_pos": PgPosition(10, 1).to_dict()}})
    tomb_pos = orjson.dumps(PgPosition(10, 2).to_dict())
    embedded_log.append("t", [TrustedRecord(b"a", value, (("kf.op", b"c"),))], partition=0)
    embedded_log.append("t", [TrustedRecord(b"b", value, ()),
                              TrustedRecord(b"b", None, (("kf.op", b"d"), ("kf.pos", tomb_pos)))], partition=1)
    assert tail_positions(embedded_log, ["t", "missing"]) == {("t", 0): PgPosition(10, 1), ("t", 1): PgPosition(10, 2)}
    last = find_last(embedded_log, "t", 1)
    assert last is not None and record_position(last) == PgPosition(10, 2)
    assert find_last(embedded_log, "t", 0, lambda r: r.key == b"zzz") is None
