"""The order of the records read from one Debezium topic partition, as source positions.

kappaflow orders a key's changes by their source position (``source.kf_pos``). A Debezium
topic gives one order that is always right for a key: the order of its partition, where
Debezium writes every change of a key, in the order it decided. The positions Debezium's
source blocks name do not always follow it:

- incremental snapshot reads (``"snapshot": "incremental"``) are emitted by DBLog's watermark
  algorithm: a chunk is read between a low and a high watermark written to the signalling
  table, the rows whose key changed inside that window are dropped from the chunk, and the
  rest is emitted when the high watermark arrives -- after the streamed changes of the
  window. Their ``lsn``/``txId`` is null (PostgreSQL) or the watermark's binlog ``file``/
  ``pos`` (MySQL): not where they belong among the streamed changes;
- blocking and initial snapshot reads carry the snapshot's position, which may equal or
  precede the last streamed change before the snapshot;
- PostgreSQL's ``lsn`` is the change's own WAL position, and transactions that overlap in the
  WAL are emitted in commit order, so it can go backwards;
- tombstones, flattened records without metadata fields and connectors kappaflow does not
  know carry no position at all.

The rule (:meth:`PartitionOrder.place`): a record keeps its own position when that is after
the last position given out in its input partition; otherwise -- and when it has none -- it
gets that last position's ``successor()``; the first record of a partition without a
position of its own gets its Kafka coordinates. Positions are therefore strictly increasing
in partition order, a snapshot read of a key lands after every change of the key Debezium
wrote before it and before every later one, and a record's position depends only on the
records before it in its partition -- the state is saved with the consumed offsets, so a
record read again after a crash gets the same position again.

The same state pairs a Debezium delete with the tombstone that follows it (the tombstone is
not needed: kappaflow writes its own) and recognises a tombstone whose delete is gone
(compacted away while the consumer was behind): that one deletes the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kappaflow.connectors.debezium.sources.generic import KafkaPosition
from kappaflow.events import Position

__all__ = ["PartitionOrder"]


class PartitionOrder:
    """Per input (topic, partition): the last position given out and the key of a trailing delete."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, int], Position] = {}
        self.deleted: dict[tuple[str, int], tuple[int, bytes]] = {}  # (offset of the delete, key bytes)

    def place(self, topic: str, partition: int, offset: int, own: Position | None) -> Position:
        """The position of the record at ``offset`` (see the module docstring)."""
        tp = (topic, partition)
        last = self.last.get(tp)
        if own is None:
            pos: Position = KafkaPosition(partition, offset) if last is None else last.successor()
        elif last is None or type(last) is not type(own) or own > last:
            pos = own
        else:
            pos = last.successor()
        self.last[tp] = pos
        return pos

    def last_position(self, topic: str, partition: int) -> Position | None:
        return self.last.get((topic, partition))

    # -- deletes and their tombstones -------------------------------------------------------------
    def note_delete(self, topic: str, partition: int, offset: int, key: bytes | None) -> None:
        if key is not None:
            self.deleted[(topic, partition)] = (offset, key)

    def note_other(self, topic: str, partition: int) -> None:
        self.deleted.pop((topic, partition), None)

    def tombstone_follows_delete(self, topic: str, partition: int, key: bytes) -> bool:
        """True for the tombstone Debezium writes right after a delete of the same key."""
        d = self.deleted.pop((topic, partition), None)
        return d is not None and d[1] == key

    # -- persistence (saved with the consumed offsets) --------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for (topic, p), pos in self.last.items():
            out.setdefault(topic, {})[str(p)] = {"pos": pos.to_dict()}
        for (topic, p), (off, key) in self.deleted.items():
            out.setdefault(topic, {}).setdefault(str(p), {})["deleted"] = [off, key.decode("utf-8", "replace")]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> PartitionOrder:
        order = cls()
        for topic, parts in (d or {}).items():
            for p, st in parts.items():
                if "pos" in st:
                    order.last[(topic, int(p))] = Position.from_dict(st["pos"])
                if "deleted" in st:
                    off, key = st["deleted"]
                    order.deleted[(topic, int(p))] = (int(off), key.encode())
        return order
