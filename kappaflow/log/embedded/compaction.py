"""Compaction of the embedded log: per-key compaction, giving space back, the maintenance thread."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

from kappaflow.errors import CorruptLogError, LogError, UnknownTopicError, ValidationError
from kappaflow.log.base import CompactionStats
from kappaflow.log.embedded.codec import Batch, decode_fields, decode_index, encode, first_bad
from kappaflow.log.embedded.control import CompactionRequest, ControlChannel
from kappaflow.log.embedded.files import _BATCH_SELECT, _PAGE_SIZE, _log, _now_ms, _Topic
from kappaflow.log.embedded.space import (
    AUTO_VACUUM_INCREMENTAL,
    Pacer,
    Stopped,
    auto_vacuum,
    file_bytes,
    free_pages,
    reclaim,
    vacuum_full,
)
from kappaflow.log.embedded.topics import EmbeddedTopics

__all__ = ["EmbeddedCompaction"]

_COMPACT_CHUNK_RECORDS = 50_000  # records rewritten per compaction transaction (appends wait this long)
_COMPACT_CHUNK_BYTES = 16 << 20  # ... or this many bytes, whichever comes first
_COMPACT_SCAN_BATCHES = 16  # stored batches read per query (each query is its own short read transaction)
_MIN_DIRTY_RATIO = 0.5  # background compaction when dirty >= ratio * kept (Kafka's min.cleanable.dirty.ratio)
_BACKGROUND_SHARE = 0.3  # background compaction works at most this share of wall time (appends go on)
_RECLAIM_MIN_BYTES = 4 << 20  # give free pages back once at least this much is free
_REQUEST_POLL_S = 0.25  # how often the writer looks for `kappaflow log compact` requests


class EmbeddedCompaction(EmbeddedTopics):
    """Compact topics (writer only): on request from other processes and in the background."""

    def compact(self, topic: str, *, now_ms: int | None = None) -> CompactionStats:
        """Keep the latest record per key; remove tombstones `delete_retention_ms` after compaction first saw them.

        Like Kafka (KIP-534), a tombstone's retention starts when compaction first sees it
        as the latest record of its key; with retention 0 it goes in that same pass. From the
        first record whose timestamp (the append time, unless the producer gave one) is less
        than `min_compaction_lag_ms` old, records are neither removed nor count as superseding
        older ones (Kafka's uncleanable head). Runs in chunks of transactions so
        appends (which wait on the same lock) proceed in between; a crash mid-compaction
        leaves a valid, partly compacted log (each chunk swaps old batches for rewritten
        ones in one transaction). Afterwards the freed pages go back to the file system
        (incremental auto-vacuum; `bytes_before`/`bytes_after` in the result).
        """
        self._require_writer("compact")
        now = _now_ms() if now_ms is None else now_ms
        if type(now) is not int:
            raise ValidationError(f"compact now_ms: expected an int, got {now_ms!r}")
        return self._compact_topic(self._topic(topic), now, Pacer())

    def compact_all(self, topic: str | None = None, *, full_vacuum: bool = False,
                    now_ms: int | None = None) -> dict[str, CompactionStats]:
        """Compact one topic or every compact-policy topic, then give the space back.

        ``full_vacuum``: every free page goes back (`vacuum`); a file created without
        incremental auto-vacuum (an older log) is rewritten once by a full VACUUM, which blocks
        appends to that topic while it runs (see `space`). Without it such files only
        reuse their free pages, and incremental files keep up to a few MiB free.
        """
        self._require_writer("compact")
        now = _now_ms() if now_ms is None else now_ms
        if type(now) is not int:
            raise ValidationError(f"compact now_ms: expected an int, got {now_ms!r}")
        return self._compact_all(topic, full_vacuum, now, Pacer())

    def _compact_all(self, topic: str | None, full_vacuum: bool, now: int, pacer: Pacer) -> dict[str, CompactionStats]:
        names = [topic] if topic is not None else [n for n, c in self.list_topics().items() if c.compacted]
        out: dict[str, CompactionStats] = {}
        for name in names:
            stats = self._compact_topic(self._topic(name), now, pacer)
            if full_vacuum:
                self.vacuum(name, stats)
            out[name] = stats
        return out

    def vacuum(self, topic: str, stats: CompactionStats | None = None) -> CompactionStats:
        """Give every free page of a topic file back to the file system.

        An incremental auto-vacuum file frees them in short steps (appends go on). A file
        created without auto-vacuum (an older log) is rewritten once by a full VACUUM, which
        switches it to incremental mode; appends to the topic wait while that runs (the whole
        file is rewritten in one transaction).
        """
        self._require_writer("vacuum")
        t = self._topic(topic)
        stats = stats or CompactionStats(topic=topic)
        with t.clock:
            with t.wlock:
                conn = self._wconn(t)
                if stats.bytes_before is None:
                    stats.bytes_before = file_bytes(t.path)
                incremental = auto_vacuum(conn) == AUTO_VACUUM_INCREMENTAL
            try:
                if incremental:
                    reclaim(conn, t.wlock)
                else:
                    vacuum_full(conn, t.wlock)
                    stats.full_vacuum = True
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, t.name) from None
            stats.bytes_after = file_bytes(t.path)
        return stats

    def _compact_topic(self, t: _Topic, now: int, pacer: Pacer) -> CompactionStats:
        stats = CompactionStats(topic=t.name)
        if not t.config.compacted:
            return stats
        with t.clock:
            stats.bytes_before = file_bytes(t.path)
            dirty = t.dirty
            due: list[int] = []
            head = 0  # records left out as younger than min_compaction_lag_ms: still dirty
            for p in range(t.config.partitions):
                nd, young = self._compact_partition(t, p, now, stats, pacer)
                head += young
                if nd is not None:
                    due.append(nd)
            t.dirty = max(0, t.dirty - dirty) + head
            t.kept = stats.kept
            t.next_due_ms = min(due) if due else None
            self.last_compaction[t.name] = stats
            self._reclaim(t, pacer)
            stats.bytes_after = file_bytes(t.path)
        return stats

    def _reclaim(self, t: _Topic, pacer: Pacer) -> None:
        """Give free pages back (incremental auto-vacuum files only; caller holds t.clock)."""
        with t.wlock:
            conn = self._wconn(t)
            try:
                if auto_vacuum(conn) != AUTO_VACUUM_INCREMENTAL or free_pages(conn) * _PAGE_SIZE < _RECLAIM_MIN_BYTES:
                    return
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, t.name) from None
        try:
            reclaim(conn, t.wlock, pacer.step)
        except sqlite3.Error as exc:
            raise self._db_error(exc, t.path, t.name) from None

    def _scan(self, conn: sqlite3.Connection, t: _Topic, p: int, start: int, end: int) -> Iterator[
            tuple[int, int, int, bytes, bytes, int]]:
        """Stored batches of partition `p` with start <= base < end, a few per short read transaction.

        Never one long read transaction: that would stop WAL checkpoints (the WAL would grow
        by everything compaction rewrites, and freed pages could not be given back).
        """
        sql = _BATCH_SELECT.format(p=p) + " WHERE base >= ? AND base < ? ORDER BY base LIMIT ?"
        while start < end:
            try:
                rows = conn.execute(sql, (start, end, _COMPACT_SCAN_BATCHES)).fetchall()
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, t.name, p, start) from None
            if not rows:
                return
            yield from rows
            start = rows[-1][1] + 1  # past the last batch's last offset: batches rewritten meanwhile start below

    def _compact_partition(self, t: _Topic, p: int, now: int, stats: CompactionStats,
                           pacer: Pacer) -> tuple[int | None, int]:
        """Compact partition `p`: (when its oldest kept tombstone expires, how many offsets the lag left out)."""
        retention = t.config.delete_retention_ms
        with t.wlock:
            self._wconn(t)
            assert t.ends is not None
            end = t.ends[p]
        # Pass 1, on short private read snapshots (appends continue): the latest offset of each
        # key below the horizon: the first record younger than min_compaction_lag_ms (by its
        # timestamp, as Kafka does), or the end. Records from the horizon on stay as they are
        # and supersede nothing.
        cutoff = now - self._min_lag_ms if self._min_lag_ms else None
        horizon = end
        scan = self._open_topic_file(t, writer=False)
        try:
            latest: dict[bytes | None, int] = {}
            for n_rows, row in enumerate(self._scan(scan, t, p, 0, end), 1):
                d, keys, _, _ = self._verified(t, p, row)
                if cutoff is not None and max(d.timestamps) > cutoff:
                    young = next(i for i, ts in enumerate(d.timestamps) if ts > cutoff)
                    horizon = d.offsets[young]
                    latest.update(zip(keys[:young], d.offsets[:young], strict=True))
                    break
                latest.update(zip(keys, d.offsets, strict=True))
                if n_rows % _COMPACT_SCAN_BATCHES == 0:
                    pacer.step()
            try:
                seen = dict(scan.execute("SELECT offset, seen_ms FROM tombstones WHERE partition = ? AND offset < ?",
                                         (p, horizon)))
            except sqlite3.Error as exc:
                raise self._db_error(exc, t.path, t.name, p) from None
            latest.pop(None, None)  # keyless records (never in compacted topics) are kept
            # Pass 2: rewrite batches that hold superseded records or expired tombstones.
            keep_seen: dict[int, int] = {}
            removed = kept = tomb_removed = 0
            deletes: list[int] = []
            out: list[tuple[int, int | None, bytes | None, bytes, int, int]] = []  # off,key,val,head,ts,crc
            inserts: list[Batch] = []
            pending = pending_bytes = 0

            def flush_out() -> None:
                if out:
                    offs, ks, vs, hs, ts, cs = zip(*out, strict=True)
                    heads = list(hs) if any(hs) else None
                    inserts.append(encode(list(offs), 0, ks, vs, ts, heads, cs))
                    out.clear()

            def commit_chunk() -> None:
                flush_out()
                if not deletes and not inserts:
                    return
                with t.wlock:
                    conn = self._wconn(t)
                    try:
                        conn.execute("BEGIN IMMEDIATE")
                        try:
                            conn.executemany(f"DELETE FROM p{p} WHERE base = ?", [(b,) for b in deletes])
                            conn.executemany(t.insert_sql[p], inserts)
                            conn.execute("COMMIT")
                        except BaseException:
                            if conn.in_transaction:
                                conn.execute("ROLLBACK")
                            raise
                    except sqlite3.Error as exc:
                        raise self._db_error(exc, t.path, t.name, p) from None
                deletes.clear()
                inserts.clear()
                pacer.step()

            for row in self._scan(scan, t, p, 0, horizon):
                base, n = row[0], row[2]
                d, keys, values, heads = self._verified(t, p, row)
                offsets = d.offsets
                lat = [latest.get(k, o) if k is not None and o < horizon else o
                       for k, o in zip(keys, offsets, strict=True)]
                has_tombs = -1 in d.vlen
                if lat == offsets and not has_tombs:
                    kept += n
                    if n * 2 >= self._batch_records:
                        flush_out()  # keep this batch as it is; merged output must not span it
                        continue
                    keep = range(n)
                else:
                    keep_list = []
                    for i, (o, lo, vl) in enumerate(zip(offsets, lat, d.vlen, strict=True)):
                        if lo != o:
                            removed += 1
                            continue
                        if vl < 0 and o < horizon:
                            first = seen.get(o, now)
                            if now >= first + retention:
                                removed += 1
                                tomb_removed += 1
                                continue
                            keep_seen[o] = first
                        keep_list.append(i)
                    keep = keep_list  # type: ignore[assignment]
                    kept += len(keep_list)
                    if len(keep_list) == n and n * 2 >= self._batch_records:
                        flush_out()
                        continue
                deletes.append(base)
                ts = d.timestamps
                crcs = d.crcs
                for i in keep:
                    out.append((offsets[i], keys[i], values[i], heads[i], ts[i], crcs[i]))  # type: ignore[arg-type]
                    if len(out) >= self._batch_records:
                        flush_out()
                pending += n
                pending_bytes += len(row[4])
                if pending >= _COMPACT_CHUNK_RECORDS or pending_bytes >= _COMPACT_CHUNK_BYTES:
                    commit_chunk()
                    pending = pending_bytes = 0
            commit_chunk()
            with t.wlock:
                conn = self._wconn(t)
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    conn.execute("DELETE FROM tombstones WHERE partition = ? AND offset < ?", (p, horizon))
                    conn.executemany("INSERT INTO tombstones VALUES (?, ?, ?)",
                                     [(p, o, s) for o, s in keep_seen.items()])
                    conn.execute("COMMIT")
                except sqlite3.Error as exc:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise self._db_error(exc, t.path, t.name, p) from None
        finally:
            scan.close()
        stats.removed += removed
        stats.kept += kept
        stats.tombstones_removed += tomb_removed
        stats.per_partition[p] = removed
        return min((s + retention for s in keep_seen.values()), default=None), end - horizon

    def _verified(self, t: _Topic, p: int, row: tuple[int, int, int, bytes, bytes, int]) -> tuple[
            Any, list[bytes | None], list[bytes | None], list[bytes]]:
        """Decode a whole batch for compaction, refusing to rewrite damaged data."""
        base, last, n, idx, data, crc = row
        try:
            d = decode_index(base, last, n, idx, crc)
            keys, values, heads = decode_fields(d, data)
        except Exception as exc:
            raise CorruptLogError(
                f"embedded log file is damaged: {t.path} (topic {t.name!r} partition {p} offset {base}): {exc}; "
                "compaction stopped without changing this batch",
                path=str(t.path), topic=t.name, partition=p, offset=base) from None
        bad = first_bad(d, keys, values, heads)
        if bad is not None:
            raise CorruptLogError(
                f"embedded log file is damaged: {t.path} (topic {t.name!r} partition {p} offset "
                f"{d.offsets[bad]}): record CRC32 mismatch; compaction stopped without changing this batch",
                path=str(t.path), topic=t.name, partition=p, offset=d.offsets[bad])
        return d, keys, values, heads

    # --- the maintenance thread: requests from other processes, background compaction ----------
    def _maintain(self, interval: float | None) -> None:
        """Serve `kappaflow log compact` requests; with `interval`, compact dirty topics on our own."""
        poll = min(_REQUEST_POLL_S, interval) if interval is not None else _REQUEST_POLL_S
        next_auto = time.monotonic() + interval if interval is not None else None
        while not self._stop.wait(poll):
            self._serve_requests()
            if next_auto is not None and interval is not None and time.monotonic() >= next_auto:
                self._background_pass()
                next_auto = time.monotonic() + interval

    def _serve_requests(self) -> None:
        control = self._control
        if control is None:
            return
        try:
            if not control.changed():
                return
            requests = control.take()
        except LogError as exc:
            if not self._closed:
                _log.warning("embedded log %s: cannot read compaction requests: %s", self._path, exc)
            return
        for req in requests:
            self.serve(req, control)

    def serve(self, req: CompactionRequest, control: ControlChannel) -> None:
        """Run one compaction request and write its result back (any error is the request's result)."""
        started = time.monotonic()
        try:
            stats = self._compact_all(req.topic, req.full_vacuum, _now_ms(), Pacer(1.0, self._stop))
        except Stopped:  # closing: the next writer runs it
            with contextlib.suppress(LogError):
                control.requeue(req.id)
            return
        except Exception as exc:  # the requester prints it; the writer goes on
            with contextlib.suppress(LogError):
                control.fail(req.id, f"{type(exc).__name__}: {exc}")
            return
        result = {"writer_pid": os.getpid(), "seconds": round(time.monotonic() - started, 3),
                  "topics": {name: st.to_dict() for name, st in stats.items()}}
        with contextlib.suppress(LogError):
            control.finish(req.id, result)

    def _background_pass(self) -> None:
        """Compact each compact-policy topic whose dirty share or tombstone clock says so, paced."""
        pacer = Pacer(_BACKGROUND_SHARE, self._stop)
        for t in [t for t in list(self._topics.values()) if t.config.compacted]:
            if self._stop.is_set():
                return
            now = _now_ms()
            dirty = t.dirty > 0 and t.dirty >= _MIN_DIRTY_RATIO * t.kept
            if not dirty and (t.next_due_ms is None or now < t.next_due_ms):
                continue
            try:
                self._compact_topic(t, now, pacer)
            except Stopped:
                return
            except UnknownTopicError:
                continue
            except Exception as exc:  # surface it, keep serving the other topics
                if self._closed:
                    return
                _log.exception("background compaction of topic %r in %s failed", t.name, self._path)
                self.background_errors.append(exc)
                t.dirty, t.next_due_ms = 0, None  # retried after the next append, not every tick
            self._serve_requests()  # a waiting `log compact` goes before the next topic
        self.compaction_runs += 1
