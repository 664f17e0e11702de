"""On-demand snapshots while MySQL/MariaDB binlog streaming continues (DBLog watermarks).

The initial snapshot's watermark method (``snapshot.py``), run on request between binlog items of
the streaming loop. Per chunk of ``snapshot_chunk_rows`` rows in key order:

1. **low watermark**: the binlog position the stream has processed up to now; from here the
   *window* notes every key of the table the stream changes (``CaptureEngine.touched``);
2. read the chunk: ``SELECT cols FROM t WHERE key > last AND (where) ORDER BY key LIMIT n`` (a
   plain consistent read, no lock, only the SELECT privilege);
3. **high watermark** ``H``: ``SHOW MASTER STATUS``; the stream is processed up to ``H``;
4. the chunk is written as ``op=r`` reads at ``(H, snapshot, i)`` minus the keys changed in the
   window (and in the previous one, a margin for a transaction binlogged before the low watermark
   but not yet visible to the read); a TRUNCATE in the window drops the chunk, which is read again.

MySQL has no logical messages, so the watermarks are binlog positions, not records: the method
needs no signal table and no write on the source. Progress rides in the offset
(``MySQLOffset.ondemand``), checkpointed in the same batch as the chunk's records; a resumed capture
reads the in-flight chunk again (same ``H`` and index when the binlog did not move: the duplicate
check skips the rows already in the log; a later ``H`` otherwise).

Tables are added to / removed from the binlog filter (the source's ``tables``) at a transaction
boundary; a table in a database the reader does not yet follow reopens the reader there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kappaflow.connectors.base import StopSignal
from kappaflow.connectors.mysql.engine import TRUNCATED, CaptureEngine, quote
from kappaflow.connectors.mysql.preflight import check_table
from kappaflow.connectors.mysql.schema_tracking import TableState
from kappaflow.connectors.mysql.server import connect, master_status, parse_dsn, source_error
from kappaflow.connectors.mysql.snapshot import _key_params
from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.mysql.types import snapshot_select_expr
from kappaflow.connectors.mysql.writer import key_of, make_source, now_ms
from kappaflow.connectors.ondemand import (
    BEAT_INTERVAL_S,
    FileChannel,
    OnDemandState,
    RequestChannel,
    SnapshotRequest,
    TableRun,
    progress_view,
)
from kappaflow.errors import Retry, SourceError
from kappaflow.events import ChangeEvent, Op, Snapshot

__all__ = ["MySQLOnDemand", "cli_add_table", "cli_remove_table", "cli_validate", "qualify"]

POLL_S = 0.5


def _split(name: str, default_db: str | None) -> tuple[str, str]:
    db, sep, table = name.partition(".")
    if not sep:
        if not default_db:
            raise SourceError(f"table {name!r}: write db.table (the DSN names no database)", retry=Retry.TERMINAL)
        return default_db, name
    return db, table


class MySQLOnDemand:
    """The on-demand snapshot driver of one MySQL streaming run (see the module docstring)."""

    def __init__(self, engine: CaptureEngine, state: OnDemandState, channel: RequestChannel, *,
                 chunk_rows: int, summary: Any) -> None:
        self.engine = engine
        self.state = state
        self.channel = channel
        self.chunk_rows = max(1, chunk_rows)
        self.summary = summary
        self.prev_keys: set[tuple[Any, ...]] = set()
        self._next_poll = 0.0
        self._next_beat = 0.0
        self._first_poll = True
        self.log_lines: list[str] = []
        self._pending_adds: list[tuple[str, str]] = []
        self._publish()

    # -- the loop -------------------------------------------------------------------------------
    def tick(self, stop: StopSignal) -> None:
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + POLL_S
            self._poll()
        if self._pending_adds and self.engine._txn is None:
            self._finish_adds()
        if now >= self._next_beat:
            self._beat()
        if self.state.state == "running" and self.engine._txn is None and not self._pending_adds:
            run = self.state.current
            if run is None:
                self.state.finish_if_done()
                self.engine.touched = None
                self._save()
            else:
                self._chunk(run, stop)

    def _beat(self, **extra: Any) -> None:
        self._next_beat = time.monotonic() + BEAT_INTERVAL_S
        try:
            self.channel.beat(self.engine.name, {"ondemand": progress_view(self.state), "seq": self.state.seq,
                                                 "phase": getattr(self.summary, "phase", ""), **extra})
        except Exception:  # best effort
            pass

    def _poll(self) -> None:
        ch = self.channel
        if isinstance(ch, FileChannel) and not ch.changed() and not self._first_poll:
            return
        self._first_poll = False
        reqs = ch.since(self.engine.name, self.state.seq)
        if not reqs:
            return
        for req in reqs:
            self._apply(req)
        self._save()
        self._next_beat = 0.0

    def _apply(self, req: SnapshotRequest) -> None:
        st = self.state
        eng = self.engine
        default_db = eng.args.database
        names = tuple(".".join(_split(t, default_db)) for t in req.tables)
        if req.action == "remove_table":
            for name in names:
                db, table = _split(name, None)
                eng.tracker.tables.discard((db, table))
                st.tables = [t for t in st.tables if t.table != name or t.done]
                if name not in st.removed:
                    st.removed.append(name)
            st.seq = max(st.seq, req.seq)
            return
        if req.action == "add_table":
            for name in names:
                db, table = _split(name, None)
                if (db, table) not in eng.tracker.tables:
                    self._pending_adds.append((db, table))
                if name not in st.added:
                    st.added.append(name)
        elif req.action == "start":
            unknown = [n for n in names if _split(n, None) not in eng.tracker.tables]
            if unknown:
                st.seq = max(st.seq, req.seq)
                self.log_lines.append(f"request {req.seq}: {', '.join(unknown)} not captured by this source")
                return
        self.log_lines.append(st.apply(SnapshotRequest(req.seq, req.source, req.action, names, req.where,
                                                       req.requested_ms)))
        if st.state != "running":
            eng.touched = None

    def _finish_adds(self) -> None:
        """Add tables to the binlog filter at a transaction boundary (reopen the reader for a new database)."""
        eng = self.engine
        reopen = False
        schemas = {db for db, _ in eng.tracker.tables}
        for db, table in self._pending_adds:
            reopen = reopen or db not in schemas
            eng.tracker.tables.add((db, table))
            eng.writer.ensure_topic(eng.tracker.topic(db, table))
            eng.refresh_hints(db, table)
        self._pending_adds = []
        if reopen and eng.reader is not None:
            eng.checkpoint(force_save=True, drain=True)
            eng.reader.close()
            eng.reader = None
            eng._items = None  # reopened from the resume point (a transaction boundary)

    def _save(self) -> None:
        self._publish()
        self.engine.checkpoint(force_save=True)

    def _publish(self) -> None:
        if self.state.seq or self.state.tables:  # offsets of sources never asked stay as they were
            self.engine.offset.ondemand = self.state.to_dict()
        if self.summary is not None:
            self.summary.ondemand = progress_view(self.state) or {}

    # -- one chunk ------------------------------------------------------------------------------------
    def _chunk(self, run: TableRun, stop: StopSignal) -> None:
        eng = self.engine
        db, table = _split(run.table, None)
        t0 = time.monotonic()
        state = eng.tracker.load(eng.ctl, db, table)
        if state is None or not state.key:
            run.done = True
            self.log_lines.append(f"{run.table}: {'dropped' if state is None else 'has no key'}, skipped")
            self._save()
            return
        if run.chunks == 0 and run.rows == 0 and not run.estimate:
            run.estimate = _estimate(eng.ctl, db, table, run.where)
        k = (db, table)
        if eng.touched is None or k not in eng.touched:
            # the low watermark: the window opens at the stream's position now, and then runs from one
            # high watermark to the next (no gap between chunks)
            eng.touched = {k: set()}
            self.prev_keys = set()
        try:
            rows = self._select(state, run)
        except SourceError as exc:
            eng.touched = None
            self.state.state = "stopped"
            self.state.finished_ms = int(time.time() * 1000)
            self.state.error = f"{run.table}: {exc}"
            self.log_lines.append(str(exc))
            self._save()
            return
        with eng.ctl.cursor() as cur:
            hfile, hpos = master_status(cur)  # the high watermark
        if not eng.pump_until(hfile, hpos, stop):
            eng.touched = None
            return  # stopped: the chunk is read again by the next run
        window = (eng.touched or {}).get(k, set())
        eng.touched = {k: set()}
        self._emit(state, run, rows, hfile, hpos, window, t0)

    def _select(self, state: TableState, run: TableRun) -> list[dict[str, Any]]:
        import pymysql

        eng = self.engine
        names = [s.name for s in state.specs]
        cols = ", ".join(snapshot_select_expr(s, quote(s.name)) for s in state.specs)
        key = list(state.key)
        conds: list[str] = []
        params: list[Any] = []
        if run.last_key is not None:
            last = eng.codec.decode_key(str(run.last_key).encode(), state.schema)
            assert last is not None
            to_sql = _key_params(state)
            vals = [to_sql[c](last[c]) for c in key]
            ors = []
            for i in range(len(key)):
                conj = [f"{quote(key[j])} = %s" for j in range(i)] + [f"{quote(key[i])} > %s"]
                ors.append("(" + " AND ".join(conj) + ")")
                params.extend([*vals[:i], vals[i]])
            conds.append("(" + " OR ".join(ors) + ")")
        if run.where:
            conds.append("(" + run.where.replace("%", "%%") + ")")  # the user's SQL (see cli_validate)
        where = (" WHERE " + " AND ".join(conds)) if conds else ""
        order = ", ".join(quote(c) for c in key)
        q = (f"SELECT {cols} FROM {quote(state.db)}.{quote(state.table)}{where} ORDER BY {order} "
             f"LIMIT {int(self.chunk_rows) + 1}")
        try:
            with eng.ctl.cursor() as cur:
                cur.execute("SET SESSION time_zone = '+00:00'")
                cur.execute("START TRANSACTION READ ONLY")  # the --where text cannot write
                try:
                    cur.execute(q, params)
                    raw = cur.fetchall()
                finally:
                    cur.execute("ROLLBACK")
        except pymysql.MySQLError as exc:
            raise source_error(exc, f"on-demand snapshot of {state.qualified}", eng.args.where()) from None
        conv = state.convert_snapshot_row
        return [conv(dict(zip(names, r, strict=True))) for r in raw]

    def _emit(self, state: TableState, run: TableRun, rows: list[dict[str, Any]], hfile: str, hpos: int,
              window: set[tuple[Any, ...]], t0: float) -> None:
        eng = self.engine
        k = (state.db, state.table)
        eng.tracker.states[k] = state
        # the stream passed every DDL up to H (the catalog was read before H): the schema at H, if new
        eng.writer.add_schema(state.qualified, state.schema,
                              BinlogPosition(hfile, hpos, self.state.next_index, None, eng.server.server_id,
                                             snapshot=True), change="CREATE", ddl=eng.tracker.take_ddl(*k))
        more = len(rows) > self.chunk_rows
        rows = rows[: self.chunk_rows]
        drop = window | self.prev_keys
        self.prev_keys = window
        if TRUNCATED in window:
            return  # the table was emptied in the window: read the same range again
        sid = eng.server.server_id
        now = now_ms()
        jrow = eng.codec.encode_row_values
        written = dropped = 0
        for row in rows:
            if drop:
                js = jrow(state.schema, row)
                if tuple(js[c] for c in state.key) in drop:
                    dropped += 1
                    continue
            pos = BinlogPosition(hfile, hpos, self.state.next_index, None, sid, snapshot=True)
            self.state.next_index += 1
            ev = ChangeEvent(Op.READ, {c: row[c] for c in state.key}, None, row,
                             make_source(state, eng.name, pos, now, None, Snapshot.INCREMENTAL), now)
            eng.writer.add_event(state, ev, pos)
            written += 1
        if rows:
            last_key = eng.codec.encode_key(key_of(state, rows[-1]), state.schema)
            assert last_key is not None
            run.last_key = last_key.decode()
        run.rows += written
        run.dropped += dropped
        run.chunks += 1
        if not more:
            run.done = True
        self.state.active_s += time.monotonic() - t0
        if self.summary is not None:
            self.summary.snapshot_rows += written
            self.summary.snapshot_tables[run.table] = [run.rows, max(run.estimate, run.rows), int(run.done)]
        self.state.finish_if_done()
        self._save()

    def close(self) -> None:
        self._beat(stopped=True, phase="stopped")
        self.channel.close()


def _estimate(conn: Any, db: str, table: str, where: str | None) -> int:
    try:
        with conn.cursor() as cur:
            if where:
                cur.execute(f"EXPLAIN SELECT 1 FROM {quote(db)}.{quote(table)} WHERE ({where})")
                names = [d[0].lower() for d in cur.description]
                r = cur.fetchone()
                return int(r[names.index("rows")] or 0) if r else 0
            cur.execute("SELECT TABLE_ROWS FROM information_schema.TABLES WHERE TABLE_SCHEMA=%s AND TABLE_NAME=%s",
                        (db, table))
            r = cur.fetchone()
            return int(r[0] or 0) if r else 0
    except Exception:
        return 0


# -- what the CLI does on the source (kappaflow/cli/snapshot.py) -------------------------------------

def qualify(src: Any, name: str) -> str:
    return ".".join(_split(name, parse_dsn(src.dsn).database))


def _connect(src: Any, what: str) -> Any:
    return connect(parse_dsn(src.dsn, src.resolved_password()), what=what, autocommit=True)


def _validate(conn: Any, src: Any, tables: Sequence[str], where: str | None) -> list[tuple[str, int]]:
    import pymysql

    if not tables:
        raise SourceError("--tables: name at least one table (db.table)", retry=Retry.TERMINAL)
    out = []
    keys = dict(src.key_columns)
    with conn.cursor() as cur:
        for name in tables:
            db, table = _split(name, parse_dsn(src.dsn).database)
            check = check_table(cur, db, table, keys.get(f"{db}.{table}"), source=src.name, duplicates=False)
            if check.problem:
                raise SourceError(f"table {db}.{table}: {check.detail}. Fix: {check.fix}", retry=Retry.TERMINAL)
            if where:
                try:
                    cur.execute("START TRANSACTION READ ONLY")
                    try:
                        cur.execute(f"SELECT 1 FROM {quote(db)}.{quote(table)} WHERE ({where}) LIMIT 0")
                        cur.fetchall()
                    finally:
                        cur.execute("ROLLBACK")
                except pymysql.MySQLError as exc:
                    msg = exc.args[1] if len(exc.args) > 1 else str(exc)
                    raise SourceError(f"--where {where!r} does not run against {db}.{table}: {msg}",
                                      retry=Retry.TERMINAL) from None
            out.append((f"{db}.{table}", _estimate(conn, db, table, where)))
    return out


def cli_validate(src: Any, tables: Sequence[str], where: str | None) -> list[tuple[str, int]]:
    """`kappaflow snapshot`: every table is captured, exists, has a key; ``where`` runs (READ ONLY)."""
    conn = _connect(src, f"checking the snapshot request of source {src.name!r}")
    try:
        checked = _validate(conn, src, tables, where)
    finally:
        conn.close()
    if src.tables:
        captured = {qualify(src, t) for t in src.tables}
        missing = [n for n, _ in checked if n not in captured]
        if missing:
            raise SourceError(f"--tables: {', '.join(missing)} not captured by source {src.name!r} (it captures "
                              f"{', '.join(sorted(captured))}); add it with `kappaflow source add-table "
                              f"{src.name} {missing[0]}`", retry=Retry.TERMINAL)
    return checked


def cli_add_table(src: Any, table: str) -> tuple[str, list[str]]:
    """`source add-table`: check the table; the binlog filter is the source's ``tables`` (saved by the CLI)."""
    if not src.tables:
        raise SourceError(f"source {src.name!r} captures every table of its database already", retry=Retry.TERMINAL)
    conn = _connect(src, f"adding a table to source {src.name!r}")
    try:
        [(name, _est)] = _validate(conn, src, [table], None)
    finally:
        conn.close()
    if name in {qualify(src, t) for t in src.tables}:
        raise SourceError(f"source {src.name!r} captures {name} already", retry=Retry.TERMINAL)
    return name, [f"binlog table filter: + {name}"]


def cli_remove_table(src: Any, table: str) -> tuple[str, list[str]]:
    name = qualify(src, table)
    captured = [qualify(src, t) for t in src.tables]
    if name not in captured:
        raise SourceError(f"source {src.name!r} does not capture {name} (it captures "
                          f"{', '.join(captured) or 'every table'})", retry=Retry.TERMINAL)
    if len(captured) == 1:
        raise SourceError(f"{name} is the only table of source {src.name!r}: remove the source instead",
                          retry=Retry.TERMINAL)
    return name, [f"binlog table filter: - {name}"]
