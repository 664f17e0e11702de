"""Consistent, chunked, resumable initial snapshot (``op=r`` events).

Consistency: the snapshot transaction imports the snapshot exported by
``CREATE_REPLICATION_SLOT ... EXPORT_SNAPSHOT`` (``SET TRANSACTION SNAPSHOT``), so
it sees exactly the rows committed before the slot's consistent point ``C``;
streaming then starts at ``C``. Snapshot positions carry ``lsn=C`` and order
before every streamed change.

Chunks: rows are read in primary-key order, ``snapshot_chunk_rows`` at a time
(keyset pagination: ``WHERE (k1, k2) > (last) ORDER BY k1, k2 LIMIT n``). After a
chunk's records are appended, the offset records the chunk's last key.

Resume after a crash: the exported snapshot died with the crashed process, so
the remaining chunks are read from a *fresh* snapshot, and streaming still starts
at ``C`` (the slot was never acknowledged past it). Rows changed between ``C``
and the fresh snapshot are therefore read in their newer state and then the
stream replays the changes from ``C`` on top: the compacted log converges to the
table exactly; only the event history of those keys shows the newer read before
the older changes. Re-read chunks get new, higher positions (the index continues
after the largest one already in the log), so positions stay strictly increasing.
Tables keyed by ``key_columns`` instead of a primary key are read in one chunk
(a non-unique key cannot be paginated safely) and restart from their start.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from itertools import repeat
from typing import Any

from psycopg import pq, sql

from kappaflow.connectors.base import SnapshotSource, StopSignal, TrustedRecord
from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres.context import PgCapture
from kappaflow.connectors.postgres.offset import PgOffset, SnapshotProgress, TableProgress
from kappaflow.connectors.postgres.replication import wait_fd
from kappaflow.connectors.postgres.rows import copy_fields, read_value
from kappaflow.connectors.postgres.slots import TableInfo
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.errors import SourceError

__all__ = ["PgSnapshotSource", "SnapshotProgressDisplay"]

_HEADERS_R = (("kf.op", b"r"),)


class SnapshotProgressDisplay:
    """A rich progress bar per table (rows, rows/s, ETA) on stderr; no-op when disabled."""

    def __init__(self, enabled: bool | None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> SnapshotProgressDisplay:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                ProgressColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.text import Text

            class RateColumn(ProgressColumn):
                def render(self, task: Any) -> Text:
                    speed = task.finished_speed or task.speed
                    return Text("-- rows/s" if speed is None else f"{speed:,.0f} rows/s", style="progress.data.speed")

            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), RateColumn(),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=Console(stderr=True), transient=False,
            )
            self._progress.__enter__()
        return self

    def add(self, table: str, total: int | None, done: int) -> None:
        if self._progress is not None:
            self._tasks[table] = self._progress.add_task(table, total=total or None, completed=done)

    def advance(self, table: str, rows: int, finished: bool = False) -> None:
        if self._progress is not None:
            task = self._tasks[table]
            self._progress.advance(task, rows)
            if finished:
                t = self._progress.tasks[[x.id for x in self._progress.tasks].index(task)]
                self._progress.update(task, total=t.completed)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)


class PgSnapshotSource(SnapshotSource):
    def __init__(self, cap: PgCapture, *, chunk_rows: int, progress: bool | None = None,
                 snapshot_name: str | None = None) -> None:
        self.cap = cap
        self.chunk_rows = max(1, chunk_rows)
        self.progress = progress
        self.snapshot_name = snapshot_name

    def execute(self, offset: Any, stop: StopSignal) -> PgOffset:
        assert isinstance(offset, PgOffset)
        cap = self.cap
        snap = offset.snapshot
        if snap is None:
            raise SourceError("snapshot started without snapshot progress in the offset (internal error)")
        conn = slots.connect(cap.dsn, what="connecting for the snapshot")
        pg = conn.pgconn
        try:
            self._exec(pg, b"BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            if self.snapshot_name:
                self._exec(pg, b"SET TRANSACTION SNAPSHOT '" + self.snapshot_name.encode() + b"'")
            if snap.lsn < 0:  # initial_only without a slot: stamp positions with the current LSN
                res = self._exec(pg, b"SELECT pg_current_wal_insert_lsn()::text")
                snap.lsn = slots._lsn_or_none((res.get_value(0, 0) or b"0/0").decode()) or 0
                offset.lsn = snap.lsn
            # continue after the largest snapshot index already in the log (re-read chunks get new positions)
            for sk in cap.tails.values():
                if sk[0] == snap.lsn and sk[1] == 0:
                    snap.next_index = max(snap.next_index, sk[2] + 1)
            todo = [t for t in cap.tables.values() if not snap.tables.setdefault(t.qualified, TableProgress()).done]
            for name, done_tp in snap.tables.items():  # per-table progress for metrics: [rows, total, done]
                if done_tp.done:
                    cap.summary.snapshot_tables[name] = [done_tp.rows, done_tp.rows, 1]
            with SnapshotProgressDisplay(self.progress) as display:
                for i, info in enumerate(todo):
                    if stop.is_set():
                        break
                    tp = snap.tables[info.qualified]
                    total = info.estimated_rows if info.estimated_rows > 0 else self._count(pg, info)
                    cap.summary.snapshot_tables[info.qualified] = [tp.rows, total or 0, 0]
                    display.add(info.qualified, total, tp.rows)
                    self._table(pg, info, tp, snap, offset, stop, display, last_table=i == len(todo) - 1)
            self._exec(pg, b"COMMIT")
        finally:
            conn.close()
        if not stop.is_set() and all(tp.done for tp in snap.tables.values()):
            snap.completed = True
        return offset

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _exec(pg: Any, query: bytes, params: Sequence[bytes] | None = None) -> Any:
        res = pg.exec_(query) if params is None else pg.exec_params(query, list(params))
        if res.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
            msg = (res.error_message or pg.error_message).decode(errors="replace").strip()
            raise SourceError(f"snapshot query failed: {msg}")
        return res

    def _count(self, pg: Any, info: TableInfo) -> int:
        q = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(info.schema, info.name))
        res = self._exec(pg, q.as_string(self.cap.conn).encode())
        return int(res.get_value(0, 0) or 0)

    def _copy(self, pg: Any, query: bytes) -> list[bytes]:
        """Run ``COPY (query) TO STDOUT``; the rows as text lines, read without holding the GIL idle."""
        pg.send_query(query)  # raises psycopg.OperationalError when the connection is gone
        res = pg.get_result()
        if res is None or res.status != pq.ExecStatus.COPY_OUT:
            msg = (res.error_message if res is not None else pg.error_message).decode(errors="replace").strip()
            while pg.get_result() is not None:
                pass
            raise SourceError(f"snapshot query failed: {msg}")
        rows: list[bytes] = []
        append = rows.append
        get = pg.get_copy_data
        fd = pg.socket
        while True:
            n, data = get(1)
            if n > 0:
                append(bytes(data))
            elif n == 0:
                wait_fd(fd, 1.0)
                pg.consume_input()
            else:
                break
        end = pg.get_result()
        while pg.get_result() is not None:
            pass
        if end is not None and end.status != pq.ExecStatus.COMMAND_OK:
            raise SourceError(f"snapshot query failed: {end.error_message.decode(errors='replace').strip()}")
        return rows

    def _table(self, pg: Any, info: TableInfo, tp: TableProgress, snap: SnapshotProgress, offset: PgOffset,
               stop: StopSignal, display: SnapshotProgressDisplay, *, last_table: bool) -> None:
        cap = self.cap
        lsn = snap.lsn
        tc = cap.codec_for(info, PgPosition(lsn, snap.next_index, True))
        conn = cap.conn
        cols = sql.SQL(", ").join(sql.Identifier(n) for n in tc.names)
        table = sql.Identifier(info.schema, info.name)
        keys = sql.SQL(", ").join(sql.Identifier(k) for k in tc.key)
        chunked = not info.key_from_config
        limit = sql.Literal(self.chunk_rows + 1)
        if not chunked:
            tp.last_key = None

        def query(last_key: list[str] | None) -> bytes:
            if not chunked:
                q = sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT").format(cols, table)
            elif last_key is None:
                q = sql.SQL("COPY (SELECT {} FROM {} ORDER BY {} LIMIT {}) TO STDOUT").format(cols, table, keys, limit)
            else:
                # text literals of unknown type take the key columns' types
                after = sql.SQL(", ").join(sql.Literal(k) for k in last_key)
                q = sql.SQL("COPY (SELECT {} FROM {} WHERE ({}) > ({}) ORDER BY {} LIMIT {}) TO STDOUT").format(
                    cols, table, keys, after, keys, limit)
            return q.as_string(conn).encode()

        prefixes: dict[str, bytes] = {}
        values_json = tc.values_json
        key_idx = tc.key_idx
        mapper = tc.mapper
        where = f"snapshot of {info.qualified}"
        while not stop.is_set():
            lines = self._copy(pg, query(tp.last_key))
            n = len(lines)
            more = chunked and n > self.chunk_rows
            take = self.chunk_rows if more else n
            now_ms = int(time.time() * 1000)
            times = b'"ts_ms":%d,"ts_us":%d,"ts_ns":%d' % (now_ms, now_ms * 1000, now_ms * 1_000_000)
            pending = cap.pending
            skipped = 0  # rows of a mapped table the log already holds (a resumed snapshot)
            if mapper is not None:  # an append-only table whose rows map to records (mapping.py)
                for r in range(take):
                    raw = copy_fields(lines[r])
                    if not cap.emit_mapped(tc, dict(zip(tc.names, raw, strict=True)), where,
                                           PgPosition(lsn, snap.next_index + r, True)):
                        skipped += 1
                snap.next_index += take
            else:
                recs = pending.by_topic.get(tc.topic)
                if recs is None:
                    recs = pending.by_topic[tc.topic] = []
                first = snap.next_index
                pfx = prefixes.get("true")
                if pfx is None:
                    pfx = prefixes["true"] = tc.source_prefix(now_ms, "true", None, lsn)
                rkeys, values = tc.encode_reads(lines[:take] if more else lines, pfx, times, first)
                # the snapshot's first and last rows say so in source.snapshot
                marked = [(0, "first")] if first == 0 and take else []
                if last_table and not more and take and not (first == 0 and take == 1):
                    marked.append((take - 1, "last"))
                for r, marker in marked:
                    mpfx = prefixes.get(marker)
                    if mpfx is None:
                        mpfx = prefixes[marker] = tc.source_prefix(now_ms, marker, None, lsn)
                    after, _key, _big = values_json(copy_fields(lines[r]))
                    values[r] = read_value(after, mpfx, first + r, times)
                recs.extend(map(TrustedRecord, rkeys, values, repeat(_HEADERS_R, take)))
                snap.next_index = first + take
                pending.count += take
            if take:
                last = copy_fields(lines[take - 1])
                tp.last_key = [(last[i] or b"").decode() for i in key_idx]
            tp.rows += take
            cap.summary.snapshot_rows += take
            cap.summary.events += take - skipped
            cap.summary.duplicates_skipped += skipped
            offset.events += take - skipped
            if not more:
                tp.done = True
            progress = cap.summary.snapshot_tables.get(info.qualified)
            if progress is not None:  # once per chunk, not per row
                progress[0] = tp.rows
                progress[2] = int(tp.done)
            if cap.pending.count >= self.chunk_rows or tp.done:
                cap.flush(offset)
            display.advance(info.qualified, take, finished=tp.done)
            if tp.done:
                return

