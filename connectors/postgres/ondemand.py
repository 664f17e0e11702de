"""On-demand snapshots while PostgreSQL streaming continues (DBLog watermarks, no signal table).

Per chunk of ``snapshot_chunk_rows`` rows in key order, in the capture thread, between two reads of
the replication stream:

1. write the **low watermark** ``L``: ``pg_logical_emit_message(false, 'kappaflow_snapshot:<slot>',
   'low:<chunk id>')`` -- a non-transactional logical message, WAL only, no table, so the read-only
   variant works on PostgreSQL 13+ with nothing created on the source;
2. read the chunk: ``COPY (SELECT cols FROM t WHERE (key) > (last) AND (where) ORDER BY key LIMIT n)``
   in a ``REPEATABLE READ, READ ONLY`` transaction of its own (no lock beyond the ACCESS SHARE every
   SELECT takes, so writers never wait);
3. write the **high watermark** ``H`` (``'high:<chunk id>'``).

Streaming goes on meanwhile. The *window* notes every key the stream changes in the table: it opens
when the first chunk starts (the stream's position then is at or before ``L``) and runs from one
``H`` to the next, a superset of DBLog's ``[L, H]`` with no gap between chunks. When the stream
reaches ``H`` the chunk is emitted as ``op=r`` reads at position ``(H, snapshot, i)``, **minus the
keys changed in the window** -- for those the stream already wrote a state at least as new as the
chunk's -- and minus those of the previous window, a margin for a transaction whose commit record
precedes ``L`` but that was not yet visible to the chunk's snapshot. A ``TRUNCATE`` in the window
drops the whole chunk, which is read again. ``L`` itself marks the chunk in the WAL: a ``H`` is
acted on only after its own ``L`` went by.
``H``'s LSN sits after every change decoded before it and before every one decoded after it, so the
positions keep increasing in every partition and a chunk row never overwrites a newer change.

Progress (:class:`kappaflow.connectors.ondemand.OnDemandState`: per table the last key read, rows,
chunks) rides in the capture's offset (``PgOffset.ondemand``), flushed in the same batch as the
chunk's records. After a kill -9 the capture resumes from the last durable chunk: watermarks of the
dead run met again in the replayed WAL are ignored (unknown chunk id), and the chunk that was in
flight is read again with a new window and new, higher positions. Exactly-once in effect: nothing
is missed, and a key read twice (only keys of that one chunk) carries the same or a newer state.

The ``--where`` text is the user's SQL for their own database: it is put in the query as written
(identifiers are always quoted, values never spliced) and validated on the server first
(:func:`validate_request`), and every chunk runs in a READ ONLY transaction.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any

import orjson
import psycopg
from psycopg import pq, sql

from kappaflow.connectors.base import TrustedRecord
from kappaflow.connectors.ondemand import (
    BEAT_INTERVAL_S,
    FileChannel,
    OnDemandState,
    RequestChannel,
    SnapshotRequest,
    TableRun,
    progress_view,
)
from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres.decoder import LogicalMessage
from kappaflow.connectors.postgres.replication import wait_fd
from kappaflow.connectors.postgres.rows import copy_fields
from kappaflow.connectors.postgres.slots import TableInfo, split_table_name
from kappaflow.errors import Retry, SourceError

if TYPE_CHECKING:
    from kappaflow.connectors.postgres.context import PendingBatch
    from kappaflow.connectors.postgres.streaming import PgStreamingSource

__all__ = ["WATERMARK_PREFIX", "PgOnDemand", "estimate_rows", "validate_request"]

WATERMARK_PREFIX = "kappaflow_snapshot"
_HEADERS_R = (("kf.op", b"r"),)
POLL_S = 0.5


def _qualified(name: str) -> str:
    s, t = split_table_name(name)
    return f"{s}.{t}"


def estimate_rows(conn: psycopg.Connection, info: TableInfo, where: str | None) -> int:
    """The planner's row estimate of the (filtered) table, for the ETA; also proves ``where`` parses."""
    q = sql.SQL("EXPLAIN (FORMAT JSON) SELECT 1 FROM {}").format(sql.Identifier(info.schema, info.name))
    if where:
        q = q + sql.SQL(" WHERE (") + sql.SQL(where) + sql.SQL(")")  # user SQL
    row = conn.execute(q).fetchone()
    plan = row[0] if row else None
    if isinstance(plan, str):
        plan = orjson.loads(plan)
    try:
        return int(plan[0]["Plan"]["Plan Rows"])  # type: ignore[index]
    except (TypeError, KeyError, IndexError, ValueError):
        return 0


def validate_request(conn: psycopg.Connection, tables: Sequence[str], where: str | None,
                     key_columns: dict[str, list[str]] | None = None, *, source: str) -> list[tuple[TableInfo, int]]:
    """Each table exists and has a key, and ``where`` parses and runs against each (in a READ ONLY
    transaction that is rolled back); the tables' infos and row estimates. Clear errors otherwise."""
    if not tables:
        raise SourceError("--tables: name at least one table (schema.table)", retry=Retry.TERMINAL)
    out = []
    keys = {_qualified(k): v for k, v in (key_columns or {}).items()}
    for name in tables:
        schema, table = split_table_name(name)
        info = slots.load_table(conn, schema, table, keys.get(f"{schema}.{table}"), source=source)
        if not info.key:
            raise SourceError(f"table {info.qualified} has no key: add a primary key or set key_columns",
                              retry=Retry.TERMINAL)
        try:
            conn.execute("BEGIN READ ONLY")
            try:
                if where:
                    probe = (sql.SQL("SELECT 1 FROM {} WHERE (").format(sql.Identifier(schema, table))
                             + sql.SQL(where) + sql.SQL(") LIMIT 0"))  # user SQL
                    conn.execute(probe)
                est = estimate_rows(conn, info, where)
            finally:
                conn.execute("ROLLBACK")
        except psycopg.Error as exc:
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SourceError(f"--where {where!r} does not run against {info.qualified}: {msg}",
                              retry=Retry.TERMINAL) from None
        out.append((info, est))
    return out


@dataclass
class _Chunk:
    """The chunk in flight: read, waiting for the stream to reach its watermarks."""

    id: str
    run: TableRun
    topic: str
    lines: list[bytes]
    more: bool
    started: float
    low_seen: bool = False


class PgOnDemand:
    """The on-demand snapshot driver of one PostgreSQL streaming run (see the module docstring)."""

    def __init__(self, stream: PgStreamingSource, state: OnDemandState, channel: RequestChannel, *,
                 chunk_rows: int, slot: str) -> None:
        self.stream = stream
        self.cap = stream.cap
        self.state = state
        self.channel = channel
        self.chunk_rows = max(1, chunk_rows)
        self.prefix = f"{WATERMARK_PREFIX}:{slot}"
        self.chunk: _Chunk | None = None
        self.prev_keys: set[bytes] = set()
        # the window: keys of `track_topic` the stream changed since it opened (see _track)
        self.track_topic: str | None = None
        self.track_mark = 0  # records of track_topic in the pending batch already looked at
        self.track_keys: set[bytes] = set()
        self.track_truncated = False
        self._conn: psycopg.Connection | None = None
        self._next_poll = 0.0
        self._next_beat = 0.0
        self._seen_end = -1
        self.log_lines: list[str] = []  # what the requests did (the CLI prints them with --debug)
        self.cap.before_flush = self.before_flush
        self._publish()

    # -- the loop -------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Once per loop turn of the stream: requests, beat, and the next chunk when none is in flight."""
        if now >= self._next_poll:
            self._next_poll = now + POLL_S
            self._poll()
        if now >= self._next_beat:
            self._next_beat = now + BEAT_INTERVAL_S
            try:
                self.channel.beat(self.cap.source, {"ondemand": progress_view(self.state), "seq": self.state.seq,
                                                    "phase": self.cap.summary.phase})
            except Exception:  # a beat is best effort: the capture goes on without it
                pass
        if self.chunk is None and self.state.state == "running":
            run = self.state.current
            if run is None:
                self.state.finish_if_done()
                self._save()
                self._close_conn()
                self._track(None)
            else:
                self._start_chunk(run)

    def _poll(self) -> None:
        ch = self.channel
        if isinstance(ch, FileChannel) and not ch.changed() and self._seen_end >= 0:
            return
        self._seen_end = 1
        reqs = ch.since(self.cap.source, self.state.seq)
        if not reqs:
            return
        for req in reqs:
            self._apply(req)
        self._save()
        self._next_beat = 0.0  # tell the waiting CLI at once

    def _apply(self, req: SnapshotRequest) -> None:
        st = self.state
        if req.action == "add_table":
            for name in req.tables:
                self._add_table(_qualified(name))
            st.added.extend(_qualified(t) for t in req.tables if _qualified(t) not in st.added)
        elif req.action == "remove_table":
            for name in req.tables:
                self._remove_table(_qualified(name))
            st.seq = max(st.seq, req.seq)
            st.removed.extend(_qualified(t) for t in req.tables if _qualified(t) not in st.removed)
            return
        if req.action in ("start", "add_table"):
            req = SnapshotRequest(req.seq, req.source, req.action, tuple(_qualified(t) for t in req.tables),
                                  req.where, req.requested_ms)
            for name in req.tables:
                if name not in self.cap.tables:
                    st.seq = max(st.seq, req.seq)
                    self.log_lines.append(f"request {req.seq}: table {name} is not captured by this source")
                    return
        if req.action in ("stop", "pause") and self.chunk is not None:
            self.chunk = None  # its watermarks are ignored when they arrive; a resume reads it again
        self.log_lines.append(st.apply(req))
        if st.state != "running":
            self._close_conn()
            self._track(None)

    def _add_table(self, name: str) -> None:
        cap = self.cap
        if name in cap.tables:
            return
        schema, table = split_table_name(name)
        info = slots.load_table(cap.conn, schema, table, cap.key_columns.get(name), source=cap.source)
        cap.tables[name] = info
        topic = cap.topic_of(info)
        if topic not in cap.topic_partitions:
            existing = cap.log.list_topics().get(topic)
            if existing is None:
                cap.pending.creates.append((topic, cap.topic_config_for(name)))
            cap.topic_partitions[topic] = existing.partitions if existing else cap.partitions
        # the stream may have met the table's Relation message while it was not captured: take it again
        for relid, rel in list(self.stream.relations.items()):
            if f"{rel.namespace}.{rel.name}" == name:
                self.stream.rels.pop(relid, None)
                self.stream._relation(rel)

    def _remove_table(self, name: str) -> None:
        cap = self.cap
        cap.tables.pop(name, None)
        for relid, rel in list(self.stream.relations.items()):
            if f"{rel.namespace}.{rel.name}" == name:
                self.stream.rels[relid] = None
        self.state.tables = [t for t in self.state.tables if t.table != name or t.done]
        if self.chunk is not None and self.chunk.run.table == name:
            self.chunk = None
            self._track(None)

    def _save(self) -> None:
        """Make the state durable with the offset (a batch of its own, or with the pending records)."""
        self._publish()
        self.stream._flush(partial=self.stream.in_tx)

    def _publish(self) -> None:
        if self.state.seq or self.state.tables:  # offsets of sources never asked stay as they were
            self.stream.offset.ondemand = self.state.to_dict()
        self.cap.summary.ondemand = progress_view(self.state) or {}

    # -- one chunk --------------------------------------------------------------------------------
    def _connect(self) -> Any:
        if self._conn is None or self._conn.closed:
            self._conn = slots.connect(self.cap.dsn, what="connecting for an on-demand snapshot")
        return self._conn.pgconn

    def _close_conn(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None

    def _emit_watermark(self, what: str) -> None:
        self.cap.conn.execute("SELECT pg_logical_emit_message(false, %s, %s)", (self.prefix, what))

    def _start_chunk(self, run: TableRun) -> None:
        cap = self.cap
        info = cap.tables.get(run.table)
        if info is None:
            run.done = True
            self.log_lines.append(f"{run.table}: no longer captured, skipped")
            self._save()
            return
        t0 = time.monotonic()
        tc = cap.codec_for(info, self._position_now())
        if self.track_topic != tc.topic:
            self._track(tc.topic)  # the window opens before the low watermark is written
        if run.chunks == 0 and run.rows == 0 and not run.estimate:
            try:
                run.estimate = estimate_rows(cap.conn, info, run.where)
            except psycopg.Error:
                run.estimate = info.estimated_rows
        cid = uuid.uuid4().hex[:16]
        self._emit_watermark(f"low:{cid}")
        try:
            lines = self._copy(self._connect(), self._query(info, tc.names, tc.key, run))
        except SourceError as exc:
            # a bad --where (validated by the CLI, but the table may have changed): stop this snapshot,
            # keep streaming
            self.state.state = "stopped"
            self.state.finished_ms = int(time.time() * 1000)
            self.state.error = f"{run.table}: {exc}"
            self.log_lines.append(str(exc))
            self.cap.summary.stopped_reason = str(exc)
            self._save()
            return
        more = len(lines) > self.chunk_rows
        self.chunk = _Chunk(cid, run, tc.topic, lines[: self.chunk_rows] if more else lines, more, t0)
        self._emit_watermark(f"high:{cid}")

    def _position_now(self) -> Any:
        from kappaflow.connectors.postgres.source_info import PgPosition

        return PgPosition(self.stream.offset.lsn, 0, True)

    def _query(self, info: TableInfo, names: Sequence[str], key: Sequence[str], run: TableRun) -> bytes:
        conn = self.cap.conn
        cols = sql.SQL(", ").join(sql.Identifier(n) for n in names)
        keys = sql.SQL(", ").join(sql.Identifier(k) for k in key)
        conds: list[sql.Composable] = []
        if run.last_key is not None:
            after = sql.SQL(", ").join(sql.Literal(k) for k in run.last_key)  # text literals take the key types
            conds.append(sql.SQL("({}) > ({})").format(keys, after))
        if run.where:
            conds.append(sql.SQL("(") + sql.SQL(run.where) + sql.SQL(")"))  # user SQL
        where = sql.SQL(" WHERE ") + sql.SQL(" AND ").join(conds) if conds else sql.SQL("")
        q = sql.SQL("COPY (SELECT {} FROM {}{} ORDER BY {} LIMIT {}) TO STDOUT").format(
            cols, sql.Identifier(info.schema, info.name), where, keys, sql.Literal(self.chunk_rows + 1))
        return q.as_string(conn).encode()

    @staticmethod
    def _copy(pg: Any, query: bytes) -> list[bytes]:
        """``COPY (query) TO STDOUT`` in a REPEATABLE READ, READ ONLY transaction; the rows as text lines."""
        res = pg.exec_(b"BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        if res.status != pq.ExecStatus.COMMAND_OK:
            raise SourceError(f"on-demand snapshot: {pg.error_message.decode(errors='replace').strip()}")
        try:
            pg.send_query(query)
            res = pg.get_result()
            if res is None or res.status != pq.ExecStatus.COPY_OUT:
                msg = (res.error_message if res is not None else pg.error_message).decode(errors="replace").strip()
                while pg.get_result() is not None:
                    pass
                raise SourceError(f"on-demand snapshot query failed: {msg}", retry=Retry.TERMINAL)
            rows: list[bytes] = []
            append = rows.append
            get = pg.get_copy_data
            while True:
                n, data = get(1)
                if n > 0:
                    append(bytes(data))
                elif n == 0:
                    wait_fd(pg.socket, 1.0)
                    pg.consume_input()
                else:
                    break
            end = pg.get_result()
            while pg.get_result() is not None:
                pass
            if end is not None and end.status != pq.ExecStatus.COMMAND_OK:
                raise SourceError(f"on-demand snapshot query failed: "
                                  f"{end.error_message.decode(errors='replace').strip()}", retry=Retry.TERMINAL)
            return rows
        finally:
            pg.exec_(b"ROLLBACK")

    # -- the stream meets the watermarks ------------------------------------------------------------
    def on_message(self, msg: LogicalMessage) -> None:
        kind, _, cid = msg.content.decode(errors="replace").partition(":")
        ch = self.chunk
        if ch is None or cid != ch.id:
            return  # a watermark of a dead run, or of a stopped chunk
        if kind == "low":
            ch.low_seen = True
        elif kind == "high" and ch.low_seen:
            self._collect(self.cap.pending)
            self._emit(ch, msg.lsn)

    def _track(self, topic: str | None) -> None:
        """Open a fresh window on ``topic`` (None: close it).

        The window is open from the first chunk's start (the stream's position then is at or before
        the low watermark) and goes on from one high watermark to the next: a superset of DBLog's
        [low, high] window, which is safe (a key is left out of a chunk only when the stream wrote a
        state at least as new) and leaves no gap between chunks.
        """
        self.track_topic = topic
        self.track_mark = len(self.cap.pending.by_topic.get(topic, ())) if topic is not None else 0
        self.track_keys = set()
        self.track_truncated = False
        self.prev_keys = set()

    def before_flush(self, pending: PendingBatch) -> None:
        """The pending batch is about to go: note the window's keys in it first."""
        if self.track_topic is not None:
            self._collect(pending)
            self.track_mark = 0

    def _collect(self, pending: PendingBatch) -> None:
        topic = self.track_topic
        recs = pending.by_topic.get(topic) if topic is not None else None
        if recs:
            self.track_keys.update(r.key for r in recs[self.track_mark:] if r.key is not None)
            self.track_mark = len(recs)
        if topic is not None and any(t == topic for t, _p, _r in pending.truncates):
            self.track_truncated = True

    def _emit(self, ch: _Chunk, h_lsn: int) -> None:
        cap = self.cap
        run = ch.run
        self.chunk = None
        window, truncated = self.track_keys, self.track_truncated
        self.track_keys, self.track_truncated = set(), False
        if truncated:  # the table was emptied in the window: read the same range again
            self.prev_keys = window
            return
        info = cap.tables.get(run.table)
        if info is None:
            return
        tc = cap.codec_for(info, self._position_now())
        drop = window | self.prev_keys
        now_ms = int(time.time() * 1000)
        times = b'"ts_ms":%d,"ts_us":%d,"ts_ns":%d' % (now_ms, now_ms * 1000, now_ms * 1_000_000)
        pfx = tc.source_prefix(now_ms, "incremental", None, h_lsn)
        pending = cap.pending
        recs = pending.by_topic.get(tc.topic)
        if recs is None:
            recs = pending.by_topic[tc.topic] = []
        keys, values = tc.encode_reads(ch.lines, pfx, times, 0, drop)
        recs.extend(map(TrustedRecord, keys, values, repeat(_HEADERS_R, len(keys))))
        idx = len(keys)
        dropped = len(ch.lines) - idx
        pending.count += idx
        self.track_mark = len(recs)  # the chunk's own reads are not changes of the stream
        if ch.lines:
            fields = copy_fields(ch.lines[-1])
            run.last_key = [(fields[i] or b"").decode() for i in tc.key_idx]
        run.rows += idx
        run.dropped += dropped
        run.chunks += 1
        if not ch.more:
            run.done = True
        self.state.active_s += time.monotonic() - ch.started
        s = cap.summary
        s.events += idx
        s.snapshot_rows += idx
        self.stream.offset.events += idx
        s.snapshot_tables[run.table] = [run.rows, max(run.estimate, run.rows), int(run.done)]
        self.prev_keys = window
        self.state.finish_if_done()
        self._save()

    def close(self) -> None:
        self.cap.before_flush = None
        self._close_conn()
        try:
            self.channel.beat(self.cap.source, {"ondemand": progress_view(self.state), "seq": self.state.seq,
                                                "phase": "stopped", "stopped": True})
        except Exception:
            pass
        self.channel.close()


# -- what the CLI does on the source (kappaflow/cli/snapshot.py) -------------------------------------

def qualify(src: Any, name: str) -> str:
    return _qualified(name)


def cli_validate(src: Any, tables: Sequence[str], where: str | None) -> list[tuple[str, int]]:
    """`kappaflow snapshot`: every table is captured by the source, exists, has a key; ``where`` runs."""
    captured = {_qualified(t) for t in src.tables}
    conn = slots.connect(src.connect_dsn(), what=f"checking the snapshot request of source {src.name!r}")
    try:
        infos = validate_request(conn, tables, where, dict(src.key_columns), source=src.name)
    finally:
        conn.close()
    if captured:
        missing = [i.qualified for i, _ in infos if i.qualified not in captured]
        if missing:
            raise SourceError(f"--tables: {', '.join(missing)} not captured by source {src.name!r} (it captures "
                              f"{', '.join(sorted(captured))}); add it with `kappaflow source add-table "
                              f"{src.name} {missing[0]}`", retry=Retry.TERMINAL)
    return [(i.qualified, est) for i, est in infos]


def cli_add_table(src: Any, table: str) -> tuple[str, list[str]]:
    """`source add-table`: check the table, publish it (ALTER PUBLICATION ... ADD TABLE); its name and lines."""
    conn = slots.connect(src.connect_dsn(), what=f"adding a table to source {src.name!r}")
    try:
        [(info, _est)] = validate_request(conn, [table], None, dict(src.key_columns), source=src.name)
        if not src.tables:
            raise SourceError(f"source {src.name!r} captures every table (no tables list): {info.qualified} is "
                              "captured already", retry=Retry.TERMINAL)
        if info.qualified in {_qualified(t) for t in src.tables}:
            raise SourceError(f"source {src.name!r} captures {info.qualified} already", retry=Retry.TERMINAL)
        lines = []
        pub = src.publication_name
        row = conn.execute("SELECT puballtables FROM pg_publication WHERE pubname = %s", (pub,)).fetchone()
        if row is not None and not row[0]:
            if slots.ensure_publication(conn, pub, [info]):
                lines.append(f"publication {pub}: ALTER PUBLICATION ... ADD TABLE {info.qualified}")
        elif row is None:
            lines.append(f"publication {pub} does not exist yet: the capture creates it with the table")
        return info.qualified, lines
    finally:
        conn.close()


def cli_remove_table(src: Any, table: str) -> tuple[str, list[str]]:
    """`source remove-table`: stop publishing the table (ALTER PUBLICATION ... DROP TABLE); topic stays."""
    name = _qualified(table)
    captured = [_qualified(t) for t in src.tables]
    if name not in captured:
        raise SourceError(f"source {src.name!r} does not capture {name} (it captures "
                          f"{', '.join(captured) or 'every table'})", retry=Retry.TERMINAL)
    if len(captured) == 1:
        raise SourceError(f"{name} is the only table of source {src.name!r}: remove the source instead "
                          f"(kappaflow source remove {src.name})", retry=Retry.TERMINAL)
    lines = []
    conn = slots.connect(src.connect_dsn(), what=f"removing a table from source {src.name!r}")
    try:
        pub = src.publication_name
        schema, t = split_table_name(name)
        published = (schema, t) in set(slots.publication_tables(conn, pub))
        row = conn.execute("SELECT puballtables FROM pg_publication WHERE pubname = %s", (pub,)).fetchone()
        if published and row is not None and not row[0]:
            conn.execute(sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(sql.Identifier(pub),
                                                                              sql.Identifier(schema, t)))
            lines.append(f"publication {pub}: ALTER PUBLICATION ... DROP TABLE {name}")
    finally:
        conn.close()
    return name, lines
