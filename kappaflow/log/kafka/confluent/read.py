"""Reads and end offsets through librdkafka consumers (no consumer group is ever joined).

* **read**: one reused consumer assigned to the partition being read; it is re-assigned only
  when the caller jumps (another partition or offset), so sequential reads take what librdkafka
  prefetched. Records arrive in batches of `consume(n, 0)` (whatever is queued, at once) after
  one `poll()` that waits for the first; `enable.partition.eof` tells "reached the end" apart
  from "the broker has not answered yet". Reads are read_committed: records of aborted
  transactions are never returned, and a read stops at the last stable offset.
* **end offsets**: ListOffsets(latest) is not trusted alone, exactly as in the kafka-python
  client (`kappaflow.log.kafka.kafka_python.log.KafkaLog._end_offsets`): some brokers (tansu, the test broker)
  answer it with the base offset of the last batch + 1. The end is max(ListOffsets, a high
  watermark from a fetch) where any high watermark >= the ListOffsets answer is provably
  current; on a correct broker the fetch is skipped when a high watermark seen earlier (by any
  read of this log) already covers it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from itertools import repeat
from operator import itemgetter
from typing import Any, NamedTuple

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from kappaflow.errors import LogUnavailableError, UnknownTopicError
from kappaflow.log.base import LogRecord
from kappaflow.log.embedded.codec import build
from kappaflow.log.kafka.confluent.topics import TopicAdmin

__all__ = ["KafkaColumns", "Reader"]

# Typed views of Message's accessors (its stubs say Optional; a data message has all of them).
_offset: Callable[[Message], int] = Message.offset  # type: ignore[assignment]
_partition: Callable[[Message], int] = Message.partition  # type: ignore[assignment]
_topic: Callable[[Message], str] = Message.topic  # type: ignore[assignment]
_key = Message.key
_value = Message.value
_headers = Message.headers
_error = Message.error
_timestamp = Message.timestamp
_second = itemgetter(1)
_EOF = KafkaError._PARTITION_EOF


class KafkaColumns(NamedTuple):
    """Consecutive records of one partition as parallel columns (what `read_columns` yields).

    `headers` holds each record's header pairs as librdkafka returns them (a list, or None).
    """

    offsets: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]
    timestamps_ms: list[int]
    headers: list[Any]


class Reader:
    """The read side of one log: a reader consumer, a probe consumer and the admin's ListOffsets."""

    def __init__(self, reader: Callable[[], Consumer], probe: Callable[[], Consumer], admin: Callable[[], AdminClient],
                 *, bootstrap: str, timeout_s: float, topics: TopicAdmin) -> None:
        self._reader = reader
        self._probe = probe
        self._admin = admin
        self._bootstrap = bootstrap
        self._timeout_s = timeout_s
        self._topics = topics
        self._read_lock = threading.Lock()
        self._probe_lock = threading.Lock()
        # Highest high watermark seen per (topic, partition), from any fetch (see end_offsets).
        self._highwater: dict[tuple[str, int], int] = {}
        self._tp: tuple[str, int] | None = None
        self._next = -1  # the reader's position when it is known to be valid, else -1

    def forget(self, topic: str, detach: Callable[[], None]) -> None:
        """Drop what is known about `topic` (deleted); `detach` closes the consumers, while no read
        or probe runs (they are opened again on next use)."""
        with self._read_lock, self._probe_lock:
            self._tp, self._next = None, -1
            for tp in [tp for tp in self._highwater if tp[0] == topic]:
                del self._highwater[tp]
            detach()

    # --- records ---------------------------------------------------------------------------------
    def read(self, topic: str, partition: int, offset: int, max_records: int) -> list[LogRecord]:
        with self._read_lock:
            msgs = self._fetch(topic, partition, offset, max_records)
        n = len(msgs)
        if not n:
            return []
        return build(LogRecord, n, repeat(topic, n), repeat(partition, n), list(map(_offset, msgs)),
                     list(map(_key, msgs)), list(map(_value, msgs)),
                     [tuple(h) if h else () for h in map(_headers, msgs)],
                     list(map(_second, map(_timestamp, msgs))))

    def read_columns(self, topic: str, partition: int, start: int, end: int | None,
                     batches_per_fetch: int = 16) -> Iterator[KafkaColumns]:
        """Records with ``start <= offset < end`` (default: the end offset now) as columns.

        Why: the Spark data source wants columns; this skips building a `LogRecord` per record.
        Each chunk holds up to ``batches_per_fetch * 1024`` records (the embedded log's unit, so
        callers size chunks alike for both logs).
        """
        stop = self.end_offsets(topic, [partition])[partition] if end is None else end
        chunk = max(1, batches_per_fetch) * 1024
        offset = start
        while offset < stop:
            with self._read_lock:  # records up to `stop` exist: no end-offset check before fetching
                msgs = self._fetch(topic, partition, offset, min(chunk, stop - offset), known_end=stop)
            if not msgs:
                return
            if _offset(msgs[-1]) >= stop:
                msgs = [m for m in msgs if _offset(m) < stop]
                if not msgs:
                    return
            offsets = list(map(_offset, msgs))
            yield KafkaColumns(offsets, list(map(_key, msgs)), list(map(_value, msgs)),
                               list(map(_second, map(_timestamp, msgs))), list(map(_headers, msgs)))
            offset = offsets[-1] + 1

    def _fetch(self, topic: str, partition: int, offset: int, max_records: int,
               known_end: int = -1) -> list[Message]:
        """Data messages with offset >= `offset`, at most max_records; [] at the end. Caller holds the lock.

        `known_end`: an end offset the caller saw, which spares asking the broker while below it."""
        try:
            return self._fetch_locked(topic, partition, offset, max_records, known_end)
        except KafkaException as exc:
            self._tp, self._next = None, -1
            raise self._topics.fail(exc, f"reading topic {topic!r} partition {partition} at offset {offset}",
                                    topic=topic) from None

    def _fetch_locked(self, topic: str, partition: int, offset: int, max_records: int,
                      known_end: int) -> list[Message]:
        consumer = self._reader()
        tp = (topic, partition)
        if self._tp != tp or self._next != offset:
            consumer.assign([TopicPartition(topic, partition, offset)])
            self._tp, self._next = tp, offset
        known = max(self._cached_highwater(consumer, topic, partition), self._highwater.get(tp, -1), known_end)
        end: int | None = None
        if known <= offset:
            # Possibly at the end: ask the broker now rather than waiting out a fetch.
            end = self.end_offsets(topic, [partition])[partition]
            if offset >= end:
                return []
        consume = consumer.consume
        verified = False
        deadline = time.monotonic() + self._timeout_s
        while True:
            msgs = consume(max_records, 0)
            if not msgs:
                first = consumer.poll(0.1)
                if first is not None:
                    msgs = [first, *consume(max_records - 1, 0)] if max_records > 1 else [first]
            if msgs:
                errors = list(filter(None, map(_error, msgs)))
                eof_at = -1
                if errors:
                    for err, msg in zip(errors, [m for m in msgs if m.error() is not None], strict=True):
                        if err.code() != _EOF:
                            raise KafkaException(err)
                        if (_topic(msg), _partition(msg)) == tp:
                            eof_at = max(eof_at, _offset(msg))
                    msgs = [m for m in msgs if m.error() is None]
                if msgs:
                    last = msgs[-1]
                    if (_topic(last), _partition(last)) != tp or _offset(msgs[0]) < offset:
                        msgs = [m for m in msgs if _offset(m) >= offset and (_topic(m), _partition(m)) == tp]
                if msgs:
                    self._next = _offset(msgs[-1]) + 1
                    self._note_highwater(consumer, topic, partition)
                    return msgs
                if eof_at >= offset:
                    if verified:
                        # A fetch made after the end check reached the readable end: only non-data
                        # batches (transaction markers, compacted gaps, records of transactions not
                        # committed yet) lay between offset and here.
                        self._next = eof_at
                        self._note_highwater(consumer, topic, partition)
                        return []
                    # An end-of-partition event may be older than the caller's last append (it
                    # waited in the queue): trust the end offsets, and if records should be there,
                    # fetch again from `offset` (re-assigning drops every queued event).
                    end = self.end_offsets(topic, [partition])[partition]
                    if offset >= end:
                        self._next = offset
                        return []
                    consumer.assign([TopicPartition(topic, partition, offset)])
                    verified = True
            if time.monotonic() > deadline:
                if self._topics.check_gone(topic):
                    raise UnknownTopicError(topic)
                shown = "" if end is None else f" although its end is {end}"
                raise LogUnavailableError(
                    f"reading topic {topic!r} partition {partition} at offset {offset}: no records from the "
                    f"broker at {self._bootstrap} within {self._timeout_s:.0f}s{shown}")

    @staticmethod
    def _cached_highwater(consumer: Consumer, topic: str, partition: int) -> int:
        try:
            return int(consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)[1])
        except KafkaException:
            return -1

    def _note_highwater(self, consumer: Consumer, topic: str, partition: int) -> None:
        hw = self._cached_highwater(consumer, topic, partition)
        tp = (topic, partition)
        if hw > self._highwater.get(tp, -1):
            self._highwater[tp] = hw

    # --- end offsets -----------------------------------------------------------------------------
    def end_offsets(self, topic: str, partitions: list[int]) -> dict[int, int]:
        """End offsets that neither miss the tail nor trust a lagging ListOffsets answer.

        1. `lo` = ListOffsets(latest) per partition. Correct on Kafka; on tansu it is the base
           offset of the last batch + 1, i.e. it can point *inside* the last batch.
        2. If the highest high watermark seen by any fetch of this log is >= lo, it is the end
           (it was observed when the batch holding offset lo-1 already existed, so no batch was
           written between that fetch and step 1). Otherwise the probe consumer fetches at lo
           (a valid offset on both brokers) until such a high watermark arrives.
        3. end = max(lo, that high watermark).
        """
        lo = self._list_offsets(topic, partitions)
        ends: dict[int, int] = {}
        pending: list[int] = []
        for p in partitions:
            hw = self._highwater.get((topic, p))
            if hw is not None and hw >= lo[p]:
                ends[p] = hw
            else:
                pending.append(p)
        if pending:
            with self._probe_lock:
                try:
                    self._probe_highwater(topic, pending, lo, ends)
                except KafkaException as exc:
                    raise self._topics.fail(exc, f"end offsets of topic {topic!r}", topic=topic) from None
        return {p: max(lo[p], ends[p]) for p in partitions}

    def _probe_highwater(self, topic: str, pending: list[int], lo: dict[int, int], ends: dict[int, int]) -> None:
        probe = self._probe()
        probe.assign([TopicPartition(topic, p, lo[p]) for p in pending])
        deadline = time.monotonic() + self._timeout_s
        try:
            while pending:
                for msg in probe.consume(1000, 0.005):  # serves fetch responses; records are not needed
                    err = msg.error()
                    if err is not None and err.code() != _EOF:
                        raise KafkaException(err)
                for p in list(pending):
                    hw = self._cached_highwater(probe, topic, p)
                    if hw >= lo[p]:
                        ends[p] = hw
                        if hw > self._highwater.get((topic, p), -1):
                            self._highwater[(topic, p)] = hw
                        pending.remove(p)
                if pending and time.monotonic() > deadline:
                    raise LogUnavailableError(
                        f"end offset of topic {topic!r} partitions {pending}: no fetch answer from the broker "
                        f"at {self._bootstrap} within {self._timeout_s:.0f}s")
        finally:
            probe.unassign()

    def _list_offsets(self, topic: str, partitions: list[int]) -> dict[int, int]:
        """ListOffsets(latest), read_uncommitted: the offset the next record will get, on a correct broker."""
        request = {TopicPartition(topic, p): OffsetSpec.latest() for p in partitions}
        try:
            futures = self._admin().list_offsets(request, request_timeout=self._timeout_s)
            return {tp.partition: int(f.result().offset) for tp, f in futures.items()}
        except KafkaException as exc:
            raise self._topics.fail(exc, f"end offsets of topic {topic!r}", topic=topic) from None

    def close(self) -> None:
        self._tp, self._next = None, -1

