"""Appends to the embedded log: checks, batch encoding, one durable transaction per append."""

from __future__ import annotations

import sqlite3
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate, repeat
from operator import add, attrgetter, itemgetter

import numpy as np

from kappaflow.errors import RecordTooLargeError, ValidationError
from kappaflow.log.base import Appended, Record
from kappaflow.log.embedded.codec import Batch, build, encode, encode_headers, lengths
from kappaflow.log.embedded.files import _now_ms, _Topic
from kappaflow.log.embedded.topics import EmbeddedTopics
from kappaflow.log.partitioner import partitions_for

__all__ = ["EmbeddedAppend"]

_headers_of = attrgetter("headers")
_key_of = attrgetter("key")
_value_of = attrgetter("value")
_timestamp_of = attrgetter("timestamp_ms")


class EmbeddedAppend(EmbeddedTopics):
    """Append records: every check before anything is written, all partitions in one transaction."""

    def append(self, topic: str, records: Sequence[Record], *, partition: int | None = None) -> list[Appended]:
        return self._append(topic, records, partition, True)  # type: ignore[return-value]

    def append_quiet(self, topic: str, records: Sequence[Record], *, partition: int | None = None) -> None:
        """`append` without the per-record results (same checks, same durability).

        For callers that only need "durable when this returns" (the capture writer): building
        one result object per record is a sizeable part of an append's CPU.
        """
        self._append(topic, records, partition, False)

    def append_ends(self, topic: str, records: Sequence[Record], *, partition: int | None = None) -> dict[int, int]:
        """`append_quiet`, then every partition's end offset (kept in memory by the writer once it appended)."""
        if not records:
            return {}
        self._append(topic, records, partition, False)
        ends = self._topic(topic).ends
        assert ends is not None  # loaded by the append
        return dict(enumerate(ends))

    def _append(self, topic: str, records: Sequence[Record], partition: int | None,
                results: bool) -> list[Appended] | None:
        self._require_writer("append")
        t = self._topic(topic)
        n = len(records)
        if n == 0:
            return [] if results else None
        config = t.config
        types = set(map(type, records))
        if not all(issubclass(tp, Record) for tp in types):
            i = next(i for i, r in enumerate(records) if not isinstance(r, Record))
            raise ValidationError(
                f"topic {topic!r} record {i}: expected a kappaflow.log.Record, got {type(records[i]).__name__}")
        keys = list(map(_key_of, records))
        values = list(map(_value_of, records))
        given = list(map(_timestamp_of, records))
        now = _now_ms()
        stamps: list[int] = [now if s is None else s for s in given] if None in given else given
        try:
            ts_arr = array("q", stamps)
        except (TypeError, OverflowError):
            i = next(i for i, s in enumerate(stamps) if type(s) is not int or not -(2**63) <= s < 2**63)
            raise ValidationError(
                f"topic {topic!r} record {i}: timestamp_ms: expected an int (ms since the epoch) or None, "
                f"got {stamps[i]!r}") from None
        klen = lengths(keys)
        vlen = lengths(values)
        heads: list[bytes] | None = None
        hs = list(map(_headers_of, records))
        if any(hs):
            # Encoded once per distinct headers object: producers share one headers tuple per
            # kind of record (a connector's per-operation headers), so most appends encode 1-3.
            ids = list(map(id, hs))
            first = dict(zip(reversed(ids), range(n - 1, -1, -1), strict=True))  # id -> first index
            memo = {k: encode_headers(hs[i], i) if hs[i] else b""
                    for k, i in sorted(first.items(), key=itemgetter(1))}
            heads = list(map(memo.__getitem__, ids))
        if config.compacted and -1 in klen:
            i = klen.index(-1)
            raise ValidationError(
                f"topic {topic!r} record {i}: a compacted topic needs a key on every record, got key None")
        limit = config.max_record_bytes
        if -1 in klen or -1 in vlen:
            sizes = [max(a, 0) + max(b, 0) for a, b in zip(klen, vlen, strict=True)]
        else:
            sizes = list(map(add, klen, vlen))
        if heads is not None:
            sizes = list(map(add, sizes, map(len, heads)))
        biggest = max(sizes)
        if biggest > limit:
            i = sizes.index(biggest)
            raise RecordTooLargeError(
                f"topic {topic!r} record {i}: {biggest} bytes (key + value + headers) is over the topic's "
                f"max.message.bytes of {limit}; nothing of this append was written"
            )
        nparts = config.partitions
        if partition is not None:
            self._check_partition(t, partition)
            groups: dict[int, list[int] | None] = {partition: None}
            parts: list[int] | None = None
        elif nparts == 1:
            groups = {0: None}
            parts = None
        else:
            parts = partitions_for(keys, nparts)
            pa = np.asarray(parts, dtype=np.int64)
            order = np.argsort(pa, kind="stable")
            counts = np.bincount(pa, minlength=nparts)
            groups = {}
            pos = 0
            for p, c in enumerate(counts.tolist()):
                if c:
                    groups[p] = order[pos : pos + c].tolist()
                    pos += c
            if len(groups) == 1:
                groups = dict.fromkeys(groups)
        return self._write(t, groups, parts, n, keys, values, ts_arr, heads, klen, vlen, sizes, results)

    def _write(self, t: _Topic, groups: dict[int, list[int] | None], parts: list[int] | None, n: int,
               keys: list[bytes | None], values: list[bytes | None], ts_arr: array,
               heads: list[bytes] | None, klen: list[int], vlen: list[int], sizes: list[int],
               results: bool = True) -> list[Appended] | None:
        with t.wlock:
            self._check_open()
            conn = self._wconn(t)
            ends = t.ends
            assert ends is not None
            rows: list[tuple[int, list[Batch]]] = []
            new_ends: dict[int, int] = {}
            firsts: dict[int, int] = {}
            for p, idx in groups.items():
                if idx is None:
                    g_keys, g_values, g_ts, g_heads, g_sizes = keys, values, ts_arr, heads, sizes
                    g_klen, g_vlen = klen, vlen
                else:
                    get = itemgetter(*idx) if len(idx) > 1 else (lambda s, i=idx[0]: (s[i],))
                    g_keys, g_values, g_sizes = list(get(keys)), list(get(values)), list(get(sizes))
                    g_klen, g_vlen = list(get(klen)), list(get(vlen))
                    g_ts = array("q", get(ts_arr))
                    g_heads = None if heads is None else list(get(heads))
                base = ends[p]
                firsts[p] = base
                batches = []
                for a, b in self._chunks(g_sizes):
                    batches.append(encode(None, base + a, g_keys[a:b], g_values[a:b], g_ts[a:b],
                                          None if g_heads is None else g_heads[a:b],
                                          klens=g_klen[a:b], vlens=g_vlen[a:b]))
                rows.append((p, batches))
                new_ends[p] = base + len(g_keys)
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for p, batches in rows:
                        conn.executemany(t.insert_sql[p], batches)
                    conn.executemany("UPDATE ends SET end_offset = ? WHERE partition = ?",
                                     [(e, p) for p, e in new_ends.items()])
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, t.name) from None
            for p, e in new_ends.items():
                ends[p] = e
            t.dirty += n
        if not results:
            return None
        if parts is None:
            p = next(iter(groups))
            return build(Appended, n, repeat(p, n), range(firsts[p], firsts[p] + n))
        offsets = np.empty(n, dtype=np.int64)
        for p, idx in groups.items():
            if idx is None:  # every record went to p
                return build(Appended, n, repeat(p, n), range(firsts[p], firsts[p] + n))
            offsets[idx] = np.arange(firsts[p], firsts[p] + len(idx))
        return build(Appended, n, parts, offsets.tolist())

    def _chunks(self, sizes: list[int]) -> list[tuple[int, int]]:
        """Split records into batches of at most batch_records records and ~batch_bytes bytes."""
        m = len(sizes)
        cap = self._batch_records
        total = sum(sizes)
        if total <= self._batch_bytes:
            return [(a, min(a + cap, m)) for a in range(0, m, cap)]
        cum = list(accumulate(sizes))
        out = []
        a = 0
        while a < m:
            before = cum[a - 1] if a else 0
            b = bisect_right(cum, before + self._batch_bytes, a, min(a + cap, m))
            b = max(b, a + 1)
            out.append((a, b))
            a = b
        return out
