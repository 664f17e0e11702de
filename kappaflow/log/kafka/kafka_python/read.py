"""Reads and end offsets of the kafka-python log (a reused reader consumer, no group joined)."""

from __future__ import annotations

import time

from kafka import TopicPartition
from kafka import errors as kerr

from kappaflow.errors import LogUnavailableError
from kappaflow.log.base import LogRecord, check_partition, check_read_args
from kappaflow.log.kafka.kafka_python.topics import KafkaTopics

__all__ = ["KafkaRead"]


class KafkaRead(KafkaTopics):
    """Read one partition from an offset; end offsets that hold on brokers whose ListOffsets lags."""

    def read(self, topic: str, partition: int, offset: int, max_records: int = 10_000) -> list[LogRecord]:
        config = self._topic(topic)
        check_partition(topic, partition, config.partitions)
        check_read_args(topic, partition, offset, max_records)
        tp = TopicPartition(topic, partition)
        with self._read_lock:
            try:
                return self._read_locked(tp, offset, max_records)
            except kerr.KafkaError as exc:
                self._reader_next = -1
                raise self._fail(exc, f"reading topic {topic!r} partition {partition} at offset {offset}",
                                 topic=topic) from None

    def _read_locked(self, tp: TopicPartition, offset: int, max_records: int) -> list[LogRecord]:
        consumer = self._reader_client()
        if self._reader_tp != tp:
            consumer.assign([tp])
            self._reader_tp = tp
            self._reader_next = -1
        if self._reader_next != offset:
            consumer.seek(tp, offset)
            self._reader_next = offset
        end: int | None = None
        hw = max(consumer.highwater(tp) or -1, self._highwater.get(tp, -1))
        if hw <= offset:
            # Possibly at the end: ask the broker now rather than waiting out a fetch.
            end = self._end_offsets(tp.topic, [tp.partition])[tp.partition]
            if offset >= end:
                return []
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                batch = consumer.poll(timeout_ms=100, max_records=max_records).get(tp)
            except kerr.OffsetOutOfRangeError:
                batch = None
                end = self._end_offsets(tp.topic, [tp.partition])[tp.partition]
                if offset >= end:
                    self._reader_next = -1
                    return []
                start = self._start_offset(tp)
                consumer.seek(tp, start)  # below the log start: the first record >= offset is there
            if batch:
                hw = consumer.highwater(tp)
                if hw is not None and hw > self._highwater.get(tp, -1):
                    self._highwater[tp] = hw
                topic, partition = tp
                out = [
                    LogRecord(topic, partition, r.offset, r.key, r.value,
                              tuple(r.headers) if r.headers else (), r.timestamp)
                    for r in batch
                ]
                self._reader_next = out[-1].offset + 1
                if out[0].offset < offset:
                    out = [r for r in out if r.offset >= offset]
                if out:
                    return out
                continue
            position = consumer.position(tp)
            if end is None:
                end = self._end_offsets(tp.topic, [tp.partition])[tp.partition]
            if position is not None and position >= end:
                # Only non-data batches (transaction markers, compacted gaps) lay between offset and end.
                self._reader_next = position
                return []
            if time.monotonic() > deadline:
                raise LogUnavailableError(
                    f"reading topic {tp.topic!r} partition {tp.partition} at offset {offset}: no records from "
                    f"the broker at {self._bootstrap} within {self._timeout_s:.0f}s although its end is {end}"
                )

    def _start_offset(self, tp: TopicPartition) -> int:
        with self._probe_lock:
            probe = self._probe_client()
            return int(probe.beginning_offsets([tp], timeout_ms=int(self._timeout_s * 1000))[tp])

    def end_offset(self, topic: str, partition: int) -> int:
        check_partition(topic, partition, self._topic(topic).partitions)
        return self._end_offsets(topic, [partition])[partition]

    def end_offsets(self, topic: str) -> dict[int, int]:
        return self._end_offsets(topic, list(range(self._topic(topic).partitions)))

    def _end_offsets(self, topic: str, partitions: list[int]) -> dict[int, int]:
        """End offsets that neither miss the tail nor trust a lagging ListOffsets answer.

        1. `lo` = ListOffsets(latest) per partition. Correct on Kafka; on tansu it is the base
           offset of the last batch + 1, i.e. it can point *inside* the last batch.
        2. If the highest high watermark seen by any fetch of this object is >= lo, it is the end (a high
           watermark h >= lo was observed when the batch holding offset lo-1 already
           existed, so no batch was written between that fetch and step 1, and h is the end
           as of step 1). Otherwise fetch at lo (a valid offset on both brokers) and wait
           until such a high watermark arrives.
        3. end = max(lo, that high watermark).
        """
        tps = [TopicPartition(topic, p) for p in partitions]
        timeout_ms = int(self._timeout_s * 1000)
        seen = self._highwater
        with self._probe_lock:
            try:
                probe = self._probe_client()
                lo = probe.end_offsets(tps, timeout_ms=timeout_ms)
                ends: dict[int, int] = {}
                pending = []
                for tp in tps:
                    hw = seen.get(tp)
                    if hw is not None and hw >= lo[tp]:
                        ends[tp.partition] = hw
                    else:
                        pending.append(tp)
                if pending:
                    # Only the partitions being probed are assigned: no pause/resume (kafka-python
                    # 3.0 can strand parked data of a resumed partition and never fetch it again).
                    if probe.assignment() != set(pending):
                        probe.assign(pending)
                    for tp in pending:
                        probe.seek(tp, lo[tp])
                    deadline = time.monotonic() + self._timeout_s
                    while pending:
                        probe.poll(timeout_ms=5, max_records=1)
                        for tp in list(pending):
                            hw = probe.highwater(tp)
                            if hw is not None and hw >= lo[tp]:
                                ends[tp.partition] = seen[tp] = max(hw, seen.get(tp, 0))
                                pending.remove(tp)
                                probe.seek(tp, hw)  # drop its buffered records; fetches here are now empty
                        if pending and time.monotonic() > deadline:
                            raise LogUnavailableError(
                                f"end offset of topic {topic!r} partitions {[tp.partition for tp in pending]}: "
                                f"no fetch answer from the broker at {self._bootstrap} within {self._timeout_s:.0f}s"
                            )
            except kerr.KafkaError as exc:
                raise self._fail(exc, f"end offsets of topic {topic!r}", topic=topic) from None
        return {tp.partition: max(int(lo[tp]), ends[tp.partition]) for tp in tps}
