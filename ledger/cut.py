"""The log as of a ledger position: per-partition end offsets of a consistent cut.

Ledger topics are partitioned, so "the first N records" of each partition is not a point in
the ledger's history: a transfer's debit may be in one partition and its credit in another.
`offsets_at` turns a ledger position P (a commit point) into end offsets -- for every
partition of the source's topics, the offset of its first record past P -- so a replay to
those offsets folds exactly the events at positions <= P, whole commits only.

Positions increase along every partition (the relay and the connector append in ledger
order), so each partition is cut by binary search on the ``kf.ledger.position`` header.
"""

from __future__ import annotations

from collections.abc import Iterable

from kappaflow.errors import ValidationError
from kappaflow.ledger.relay import record_position
from kappaflow.log.base import Log


def offsets_at(log: Log, source: str, position: int, topics: Iterable[str] | None = None) -> dict[str, dict[int, int]]:
    """{topic: {partition: end offset}} holding exactly the ledger events at positions <= `position`.

    `topics`: the ledger topics to cut (default: every ``<source>.*`` topic but the schema topic).
    """
    if topics is None:
        topics = [t for t in log.list_topics() if t.startswith(source + ".") and t != source + ".__schema"]
    out: dict[str, dict[int, int]] = {}
    for topic in topics:
        out[topic] = {p: _cut(log, topic, p, position) for p in range(log.partitions(topic))}
    return out


def _cut(log: Log, topic: str, partition: int, position: int) -> int:
    lo, hi = 0, log.end_offset(topic, partition)
    while lo < hi:  # smallest offset whose record is past `position`
        mid = (lo + hi) // 2
        recs = log.read(topic, partition, mid, 1)
        if not recs:
            hi = mid
            continue
        pos = record_position(recs[0])
        if pos is None:
            raise ValidationError(f"{topic}[{partition}] offset {recs[0].offset}: no kf.ledger.position header; "
                                  "not a ledger topic")
        if pos <= position:
            lo = recs[0].offset + 1
        else:
            hi = mid
    while True:  # past the end offset the log reported (a broker may report it too low): read on
        recs = log.read(topic, partition, lo, 1000)
        keep = [r for r in recs if (record_position(r) or 0) <= position]
        if not keep:
            return lo
        lo = keep[-1].offset + 1
        if len(keep) < len(recs):
            return lo


__all__ = ["offsets_at"]
