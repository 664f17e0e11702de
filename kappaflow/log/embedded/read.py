"""Reads of the embedded log: records, record columns for Arrow, end offsets."""

from __future__ import annotations

import sqlite3
import struct
from bisect import bisect_left
from collections.abc import Iterator
from typing import NamedTuple

from kappaflow.errors import CorruptLogError, ValidationError
from kappaflow.log.base import LogRecord, check_read_args
from kappaflow.log.embedded.codec import BatchDamaged, decode, decode_fields, decode_index, encode_headers, first_bad
from kappaflow.log.embedded.topics import EmbeddedTopics

__all__ = ["EmbeddedRead", "RecordColumns"]


class RecordColumns(NamedTuple):
    """Consecutive records of one partition as parallel columns, one entry per record.

    What `EmbeddedLog.read_columns` yields: the stored batches' fields without a
    `LogRecord` per record, ready for column builders such as ``pyarrow.array``.
    `headers` are the encoded header blobs (``b""`` for none;
    `kappaflow.log.embedded.codec.decode_headers` turns one into header pairs).
    """

    offsets: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]
    timestamps_ms: list[int]
    headers: list[bytes]


class EmbeddedRead(EmbeddedTopics):
    """Read records or columns of one partition; end offsets (readers never take a write lock)."""

    def read(self, topic: str, partition: int, offset: int, max_records: int = 10_000) -> list[LogRecord]:
        t = self._topic(topic)
        self._check_partition(t, partition)
        check_read_args(topic, partition, offset, max_records)
        out: list[LogRecord] = []
        with t.rlock:
            conn = self._rconn(t)
            nxt = offset
            try:
                cur = conn.execute(t.read_sql[partition], (offset,))
                try:
                    while len(out) < max_records:
                        row = cur.fetchone()
                        if row is None:
                            break
                        if row[1] < nxt:
                            continue
                        try:
                            recs = decode(topic, partition, row, nxt, max_records - len(out))
                        except BatchDamaged as dmg:
                            out += dmg.records
                            if out:
                                return out
                            raise CorruptLogError(
                                f"embedded log file is damaged: {t.path} (topic {topic!r} partition "
                                f"{partition} offset {dmg.offset}): {dmg.reason}; records before offset "
                                f"{dmg.offset} are readable",
                                path=str(t.path), topic=topic, partition=partition, offset=dmg.offset,
                            ) from None
                        if recs:
                            out += recs
                            nxt = recs[-1].offset + 1
                finally:
                    cur.close()
            except sqlite3.Error as exc:
                if out:
                    return out
                raise self._db_error(exc, t.path, topic, partition, nxt) from None
        return out

    def read_columns(self, topic: str, partition: int, start: int = 0, end: int | None = None, *,
                     batches_per_fetch: int = 16) -> Iterator[RecordColumns]:
        """Records with ``start <= offset < end`` (default: the end offset now), as columns.

        Why: a bulk reader (the projections' Spark data source) that wants columns pays
        about half of `read`'s cost per record: stored batches are cut straight into
        columns, headers stay encoded, and no `LogRecord` is built. The same checks as
        `read` apply (batch index and record CRC32s). One chunk per stored batch;
        `batches_per_fetch` batches are fetched per query, and the read lock is not held
        between chunks, so the writer and other readers go on meanwhile. At a damaged
        batch the records before the damage are still yielded, then CorruptLogError
        names the file, topic, partition and offset (as `read` does).
        """
        t = self._topic(topic)
        self._check_partition(t, partition)
        if type(start) is not int or start < 0:
            raise ValidationError(f"topic {topic!r} partition {partition} start: expected an int >= 0, got {start!r}")
        if end is not None and (type(end) is not int or end < 0):
            raise ValidationError(f"topic {topic!r} partition {partition} end: expected an int >= 0 or None, "
                                  f"got {end!r}")
        if type(batches_per_fetch) is not int or batches_per_fetch < 1:
            raise ValidationError(f"read_columns batches_per_fetch: expected an int >= 1, got {batches_per_fetch!r}")
        stop = self.end_offset(topic, partition) if end is None else end
        sql = t.read_sql[partition]
        # The first row may be the batch before `offset` (offset in a compaction gap): fetch
        # at least two, so a fetch that moves nothing forward means the partition has ended.
        fetch = max(2, batches_per_fetch)
        offset = start
        while offset < stop:
            with t.rlock:
                try:
                    cur = self._rconn(t).execute(sql, (offset,))
                    try:
                        rows = cur.fetchmany(fetch)
                    finally:
                        cur.close()
                except sqlite3.Error as exc:
                    raise self._db_error(exc, t.path, topic, partition, offset) from None
            progressed = False
            for base, last, n, idx, data, crc in rows:
                if last < offset:
                    continue
                try:
                    d = decode_index(base, last, n, idx, crc)
                    lo = bisect_left(d.offsets, offset)
                    hi = bisect_left(d.offsets, stop)
                    if lo >= hi:
                        if hi < n:
                            return  # the range ends before this batch's records
                        continue
                    keys, values, heads = decode_fields(d, data, lo, hi)
                    damaged = first_bad(d, keys, values, heads, lo) is not None
                except (ValueError, struct.error):
                    damaged = True
                if damaged:
                    # `read` returns the verified records before the damage, then names it
                    yield from self._columns_via_read(topic, partition, offset, stop)
                    return
                yield RecordColumns(d.offsets[lo:hi], keys, values, d.timestamps[lo:hi].tolist(), heads)
                offset = d.offsets[hi - 1] + 1
                progressed = True
                if hi < n:
                    return
            if not progressed:
                return

    def _columns_via_read(self, topic: str, partition: int, offset: int, stop: int) -> Iterator[RecordColumns]:
        while offset < stop:
            recs = [r for r in self.read(topic, partition, offset, min(10_000, stop - offset)) if r.offset < stop]
            if not recs:
                return
            yield RecordColumns([r.offset for r in recs], [r.key for r in recs], [r.value for r in recs],
                                [r.timestamp_ms for r in recs],
                                [encode_headers(r.headers, i) for i, r in enumerate(recs)])
            offset = recs[-1].offset + 1

    def end_offset(self, topic: str, partition: int) -> int:
        t = self._topic(topic)
        self._check_partition(t, partition)
        if t.ends is not None:
            return t.ends[partition]
        with t.rlock:
            try:
                row = self._rconn(t).execute("SELECT end_offset FROM ends WHERE partition = ?", (partition,)).fetchone()
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, topic, partition) from None
        if row is None:
            raise CorruptLogError(f"embedded log file is damaged: {t.path}: no end offset for partition {partition}",
                                  path=str(t.path), topic=topic, partition=partition)
        return int(row[0])

    def end_offsets(self, topic: str) -> dict[int, int]:
        t = self._topic(topic)
        if t.ends is not None:
            return dict(enumerate(t.ends))
        with t.rlock:
            try:
                rows = self._rconn(t).execute("SELECT partition, end_offset FROM ends").fetchall()
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, topic) from None
        return {p: e for p, e in sorted(rows) if p < t.config.partitions}
