"""Connector offsets stored in the log itself: a compacted topic keyed by source name.

Keeping offsets in the same log as the data (like Kafka Connect's
``connect-offsets``) means one durable store, one backup, and no second system
to keep consistent. The topic is compacted, so its size stays proportional to
the number of sources; readers look for the latest record of their key from the
end backwards, so loading stays cheap even before compaction has run.

Offsets are plain JSON-safe dicts produced by a connector's offset context
(``to_dict``/``from_dict``). The topic holds *where to resume*, and is always
written after the records it covers are durable; see ``connectors/base.py``
for how connectors combine it with the positions stored in data records.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from kappaflow.connectors.cuts import cut_to_json
from kappaflow.errors import ValidationError
from kappaflow.log.base import CleanupPolicy, Log, LogRecord, Record, TopicConfig

__all__ = ["OFFSETS_TOPIC", "OffsetStore", "find_last"]

OFFSETS_TOPIC = "_kappaflow_offsets"  # not "__...": Kafka clients treat "__" topics as internal


def _key(source: str) -> bytes:
    return orjson.dumps({"source": source})


def find_last(log: Log, topic: str, partition: int, match: Any = None, *,
              first_window: int = 64) -> LogRecord | None:
    """The last record of a partition (optionally the last one with ``match(record)`` true).

    Scans backwards in growing windows, so the cost is proportional to how far back
    the wanted record is, not to the partition's size.
    """
    end = log.end_offset(topic, partition)
    window = first_window
    while end > 0:
        start = max(0, end - window)
        found = None
        for rec in _iter(log, topic, partition, start, end):
            if match is None or match(rec):
                found = rec
        if found is not None:
            return found
        end = start
        window *= 4
    return None


def _iter(log: Log, topic: str, partition: int, start: int, end: int) -> Iterator[LogRecord]:
    return log.iter_partition(topic, partition, start, end)


class OffsetStore:
    """Load and save one dict per source on the compacted offsets topic."""

    def __init__(self, log: Log, topic: str = OFFSETS_TOPIC, *, compact_every: int = 10_000) -> None:
        self.log = log
        self.topic = topic
        self._compact_every = compact_every
        self._saves = 0
        if topic not in log.list_topics():
            log.create_topic(topic, TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT), exist_ok=True)

    def load(self, source: str) -> dict[str, Any] | None:
        """The latest offset dict saved for ``source``, or None (never saved, or deleted)."""
        key = _key(source)
        rec = find_last(self.log, self.topic, 0, lambda r: r.key == key)
        if rec is None or rec.value is None:
            return None
        try:
            doc = orjson.loads(rec.value)
        except orjson.JSONDecodeError as exc:
            raise ValidationError(f"offsets topic {self.topic!r} partition 0 offset {rec.offset}: value for "
                                  f"source {source!r} is not JSON ({exc})") from None
        offset = doc.get("offset") if isinstance(doc, dict) else None
        if not isinstance(offset, dict):
            raise ValidationError(f"offsets topic {self.topic!r} partition 0 offset {rec.offset}: expected "
                                  f"an object with an 'offset' object for source {source!r}")
        return offset

    def save(self, source: str, offset: dict[str, Any], *, cut: Mapping[str, Mapping[int, int]] | None = None) -> None:
        """Append the new offset durably (returns after the log acknowledged it).

        `cut`: the source's consistent cut (``connectors/cuts.py``), stored in the same record."""
        doc: dict[str, Any] = {"source": source, "offset": offset, "ts_ms": int(time.time() * 1000)}
        if cut is not None:
            doc["cut"] = cut_to_json(cut)
        value = orjson.dumps(doc)
        self.log.append(self.topic, [Record(_key(source), value)])
        self._saves += 1
        if self._compact_every and self._saves % self._compact_every == 0:
            self.log.compact(self.topic)

    def delete(self, source: str) -> None:
        """Forget a source's offset (a tombstone); the next capture starts from scratch."""
        self.log.append(self.topic, [Record(_key(source), None)])
