"""Consistent cuts: where a source's transactions end in the log, so readers never split one.

A source transaction (a bank transfer: a debit and a credit; an UPDATE of two rows) usually
lands in several log partitions, possibly of several topics. A reader that stops at the log's
current end offsets can stop between them and show half a transaction. A **cut** is, for one
source, the end offset of every partition of every topic the source writes, taken at a
transaction boundary: everything below it is whole transactions, nothing above it belongs to
a transaction that is partly below.

Where cuts live: in the offsets record (``connectors/offsets.py``), field ``"cut"``
(``{topic: {"partition": end offset}}``). The capture writer (``connectors/writer.py``) appends
the offsets record after the records it covers are durable (step 3), so a cut never names
data that is not in the log, and it costs no extra append. A batch that ends inside a
transaction (a huge transaction written in parts, a TRUNCATE's tombstones) repeats the
previous cut, so the newest offsets record always carries the newest cut, also after
compaction. Readers:

* `CutTracker` (writer side) keeps the end offsets of the source's partitions: read from the
  log once at start (so a tail left by a capture killed mid-transaction is covered when the
  restarted capture completes it), then moved by every append's result;
* `CutIndex` (reader side) reads the offsets topic incrementally and keeps, per source, the
  newest cut and a bounded history of recent ones;
* `consistent_ends` caps a reader's end offsets at the newest cut of each source (and, with a
  record budget, at the newest cut within it, or the oldest cut past it: a transaction larger
  than the budget is read whole).

A topic belongs to the source named by its prefix (``<source>.<rest>``, source names have
no dots). Topics of a source that has never written a cut (logs written before cuts
existed, topics appended by hand, Debezium-produced topics) are read to their end, as before.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from kappaflow.log.base import Log

__all__ = ["CUT_FIELD", "Cut", "CutIndex", "CutTracker", "consistent_ends", "cut_from_json", "cut_to_json",
           "source_of"]

CUT_FIELD = "cut"
Cut = dict[str, dict[int, int]]  # topic -> partition -> end offset
HISTORY = 2048  # recent cuts kept per source by a reader (record budgets pick among them)
FIRST_WINDOW = 50_000  # offsets records a reader reads forward at its start (older ones: on demand, backwards)


def source_of(topic: str) -> str:
    """The source a topic belongs to: its name up to the first dot."""
    return topic.split(".", 1)[0]


def cut_to_json(cut: Mapping[str, Mapping[int, int]]) -> dict[str, dict[str, int]]:
    return {t: {str(p): e for p, e in parts.items()} for t, parts in cut.items()}


def cut_from_json(doc: Any) -> Cut | None:
    if not isinstance(doc, dict):
        return None
    try:
        return {str(t): {int(p): int(e) for p, e in parts.items()} for t, parts in doc.items()}
    except (AttributeError, TypeError, ValueError):
        return None


class CutTracker:
    """The writer's end offsets of every partition of its source, for the cut it records."""

    def __init__(self, log: Log, source: str) -> None:
        self.log = log
        self.prefix = source + "."
        self.ends: Cut | None = None
        self.last: Cut | None = None  # the last cut recorded (repeated by batches inside a transaction)

    def _load(self) -> Cut:
        if self.ends is None:
            self.ends = {t: dict(self.log.end_offsets(t)) for t in self.log.list_topics() if t.startswith(self.prefix)}
        return self.ends

    def know(self, topic: str) -> None:
        """Before a topic's first append in this run: its current end offsets (all partitions)."""
        ends = self._load()
        if topic not in ends:
            ends[topic] = dict(self.log.end_offsets(topic))

    def appended(self, topic: str, ends: Mapping[int, int]) -> None:
        parts = self._load()[topic]
        for p, e in ends.items():
            if e > parts.get(p, 0):
                parts[p] = e

    def cut(self) -> Cut:
        """The end offsets now (call at a transaction boundary, after the appends are durable)."""
        self.last = {t: dict(parts) for t, parts in self._load().items()}
        return self.last


class CutIndex:
    """The cuts recorded on a log's offsets topic, read incrementally (one reader per process)."""

    def __init__(self, log: Log, topic: str | None = None) -> None:
        from kappaflow.connectors.offsets import OFFSETS_TOPIC

        self.log = log
        self.topic = topic or OFFSETS_TOPIC
        self.next: int | None = None  # the next offsets record to read forward
        self.first = 0  # where the forward reading started; older records are searched per source on demand
        self.latest: dict[str, Cut] = {}
        self.history: dict[str, deque[Cut]] = {}
        self._searched: set[str] = set()
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """Read the offsets records appended since the last call."""
        with self._lock:
            if self.topic not in self.log.list_topics():
                return
            end = self.log.end_offset(self.topic, 0)
            if self.next is None or end < self.next:  # first call, or the topic was recreated: start over
                self.next = self.first = max(0, end - FIRST_WINDOW)
                self.latest.clear()
                self.history.clear()
                self._searched.clear()
            while self.next < end:
                recs = self.log.read(self.topic, 0, self.next, 5000)
                if not recs:
                    break
                for rec in recs:
                    found = _parse(rec.value)
                    if found is not None and self.latest.get(found[0]) != found[1]:
                        source, cut = found
                        self.latest[source] = cut
                        self.history.setdefault(source, deque(maxlen=HISTORY)).append(cut)
                self.next = recs[-1].offset + 1

    def cut(self, source: str) -> Cut | None:
        """The newest cut of `source` (None: it never recorded one)."""
        cut = self.latest.get(source)
        if cut is None and self.first > 0 and source not in self._searched:
            with self._lock:  # a source quiet since before the first window: search backwards, once
                self._searched.add(source)
                cut = self._search(source)
                if cut is not None and source not in self.latest:
                    self.latest[source] = cut
                    self.history.setdefault(source, deque(maxlen=HISTORY)).append(cut)
        return self.latest.get(source)

    def _search(self, source: str) -> Cut | None:
        end, window = self.first, 1024
        while end > 0:
            start = max(0, end - window)
            newest: Cut | None = None
            for rec in self.log.iter_partition(self.topic, 0, start, end):
                found = _parse(rec.value)
                if found is not None and found[0] == source:
                    newest = found[1]
            if newest is not None:
                return newest
            end, window = start, window * 4
        return None


def _parse(value: bytes | None) -> tuple[str, Cut] | None:
    """(source, cut) of an offsets record that carries a cut."""
    if value is None or b'"cut"' not in value:
        return None
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    source = doc.get("source") if isinstance(doc, dict) else None
    cut = cut_from_json(doc.get(CUT_FIELD)) if isinstance(source, str) else None
    if cut is None or not isinstance(source, str):
        return None
    return source, cut


def _capped(cut: Cut, begin: Mapping[str, Mapping[int, int]], ends: Mapping[str, Mapping[int, int]],
            topics: Iterable[str]) -> dict[str, dict[int, int]]:
    """min(log end, cut), never below the reader's start (a partition missing from the cut has no
    complete transaction yet: it stays where the reader is)."""
    out: dict[str, dict[int, int]] = {}
    for t in topics:
        cparts = cut.get(t, {})
        out[t] = {}
        for p, e in ends[t].items():
            b = begin.get(t, {}).get(p, 0)
            out[t][p] = max(b, min(e, cparts.get(p, 0)))
    return out


def _backlog(end: Mapping[str, Mapping[int, int]], begin: Mapping[str, Mapping[int, int]]) -> int:
    return sum(max(0, e - begin.get(t, {}).get(p, 0)) for t, parts in end.items() for p, e in parts.items())


def consistent_ends(index: CutIndex, topics: list[str], begin: Mapping[str, Mapping[int, int]],
                    ends: Mapping[str, Mapping[int, int]], budget: int | None = None) -> dict[str, dict[int, int]]:
    """End offsets for a reader at `begin` that stop at a cut of every source (see the module docstring).

    `ends`: the log's end offsets of `topics` (read after `index.refresh()`, so every cut is at or below
    them). `budget`: the most records to admit; the newest cut within it, else the oldest cut past it
    (a transaction is never split to honour a budget), shared among sources by backlog.
    """
    by_source: dict[str, list[str]] = {}
    for t in topics:
        by_source.setdefault(source_of(t), []).append(t)
    per_source: dict[str, dict[str, dict[int, int]]] = {}
    for source, ts in by_source.items():
        cut = index.cut(source)
        if cut is None:
            per_source[source] = {t: dict(ends[t]) for t in ts}  # no cuts recorded: read what there is
        else:
            per_source[source] = _capped(cut, begin, ends, ts)
    if budget is not None:
        total = sum(_backlog(e, begin) for e in per_source.values())
        if total > budget:
            for source, ts in by_source.items():
                end = per_source[source]
                backlog = _backlog(end, begin)
                share = max(1, budget * backlog // total)
                if backlog <= share or index.cut(source) is None:
                    if index.cut(source) is None and backlog > share:
                        per_source[source] = _admit_plain(begin, end, share)
                    continue
                per_source[source] = _within(index.history.get(source, ()), begin, ends, ts, share) or end
    return {t: parts for end in per_source.values() for t, parts in end.items()}


def _within(history: Iterable[Cut], begin: Mapping[str, Mapping[int, int]], ends: Mapping[str, Mapping[int, int]],
            topics: list[str], share: int) -> dict[str, dict[int, int]] | None:
    """The newest cut that admits at most `share` records (and at least one), else the oldest past it."""
    best: dict[str, dict[int, int]] | None = None
    for cut in history:  # oldest first
        end = _capped(cut, begin, ends, topics)
        n = _backlog(end, begin)
        if n == 0:
            continue
        if n <= share:
            best = end
        else:
            return best or end
    return best


def _admit_plain(begin: Mapping[str, Mapping[int, int]], ends: Mapping[str, Mapping[int, int]],
                 budget: int) -> dict[str, dict[int, int]]:
    """Without cuts: at most `budget` records, shared among partitions in proportion to their backlog."""
    avail = {(t, p): max(0, e - begin.get(t, {}).get(p, 0)) for t, parts in ends.items() for p, e in parts.items()}
    total = sum(avail.values())
    if total <= budget:
        return {t: dict(parts) for t, parts in ends.items()}
    out: dict[str, dict[int, int]] = {t: {} for t in ends}
    for (t, p), a in avail.items():
        share = (a * budget) // total
        if a and share == 0:
            share = 1
        out[t][p] = begin.get(t, {}).get(p, 0) + min(a, share)
    return out
