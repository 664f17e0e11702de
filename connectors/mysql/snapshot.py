"""The MySQL/MariaDB snapshot source: chunked, lock-free watermark snapshot (see ``connector.py``).

Per chunk of ``snapshot_chunk_rows`` rows in key order: select the chunk, read the binlog
position ``H`` (high watermark), stream up to ``H`` through the engine, then write the chunk's
rows as ``op=r`` at ``H`` except those whose key the stream changed meanwhile.
"""

from __future__ import annotations

from typing import Any

from kappaflow.connectors.base import (
    SnapshotSource,
    StopSignal,
)
from kappaflow.connectors.mysql.engine import TRUNCATED, CaptureEngine, quote
from kappaflow.connectors.mysql.offset import MySQLOffset, SnapshotProgress
from kappaflow.connectors.mysql.schema_tracking import TableState
from kappaflow.connectors.mysql.server import (
    master_status,
    source_error,
)
from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.mysql.types import snapshot_select_expr
from kappaflow.connectors.mysql.writer import key_of, make_source, now_ms
from kappaflow.errors import SourceError
from kappaflow.events import ChangeEvent, Op, Snapshot

__all__ = ["MySQLSnapshotSource"]


class MySQLSnapshotSource(SnapshotSource):
    """Chunked, resumable, lock-free snapshot (watermarks; see the module docstring)."""

    def __init__(self, engine: CaptureEngine, *, chunk_rows: int, progress_cb: Any = None,
                 display: Any = None) -> None:
        self.engine = engine
        self.chunk_rows = chunk_rows
        self.progress_cb = progress_cb
        self.display = display  # a SnapshotProgressDisplay (rows, rows/s, ETA per table) or None
        self.rows_written = 0
        self._shown: set[str] = set()

    def execute(self, offset: Any, stop: StopSignal) -> MySQLOffset:
        eng = self.engine
        assert isinstance(offset, MySQLOffset) and offset.snapshot is not None
        prog = offset.snapshot
        eng.touched = {_db_table(t): set() for t in prog.tables[prog.index:]}
        try:
            while not prog.done:
                if stop.is_set():
                    return offset
                if not self._chunk(prog, stop):
                    return offset
            offset.phase = "streaming"
            offset.snapshot = prog
            eng.checkpoint(force_save=True, drain=True)
            return offset
        finally:
            eng.touched = None

    def _chunk(self, prog: SnapshotProgress, stop: StopSignal) -> bool:
        eng = self.engine
        db, table = prog.tables[prog.index].split(".", 1)
        for _attempt in range(20):
            state = eng.tracker.load(eng.ctl, db, table)
            if state is None:  # dropped meanwhile: nothing to read
                self._next_table(prog)
                eng.checkpoint(force_save=True)
                return True
            if not state.key:
                raise SourceError(f"table {db}.{table} has no primary key: add one or set key_columns")
            rows = self._select(state, prog)
            if rows is None:
                continue  # a column vanished under us (DDL): read the catalog again
            again = eng.tracker.load(eng.ctl, db, table)
            if again is None or again.schema.fingerprint() != state.schema.fingerprint():
                continue
            with eng.ctl.cursor() as cur:
                hfile, hpos = master_status(cur)
            if not eng.pump_until(hfile, hpos, stop):
                return False
            self._emit(state, rows, prog, hfile, hpos)
            return True
        raise SourceError(f"snapshot of {db}.{table}: the table's definition kept changing while reading a chunk")

    def _select(self, state: TableState, prog: SnapshotProgress) -> list[dict[str, Any]] | None:
        import pymysql

        eng = self.engine
        names = [s.name for s in state.specs]
        cols = ", ".join(snapshot_select_expr(s, quote(s.name)) for s in state.specs)
        key = list(state.key)
        where, params = "", []
        if prog.last_key is not None:
            last = eng.codec.decode_key(prog.last_key.encode(), state.schema)
            assert last is not None
            to_sql = _key_params(state)
            vals = [to_sql[k](last[k]) for k in key]
            ors = []
            for i in range(len(key)):
                conj = [f"{quote(key[j])} = %s" for j in range(i)] + [f"{quote(key[i])} > %s"]
                ors.append("(" + " AND ".join(conj) + ")")
                params.extend([*vals[:i], vals[i]])
            where = " WHERE " + " OR ".join(ors)
        order = ", ".join(quote(k) for k in key)
        sql = (f"SELECT {cols} FROM {quote(state.db)}.{quote(state.table)}{where} ORDER BY {order} "
               f"LIMIT {int(self.chunk_rows)}")
        try:
            with eng.ctl.cursor() as cur:
                cur.execute("SET SESSION time_zone = '+00:00'")
                cur.execute(sql, params)
                raw = cur.fetchall()
        except pymysql.MySQLError as exc:
            if exc.args and exc.args[0] in (1054, 1146):  # unknown column / table: DDL raced us
                return None
            raise source_error(exc, f"snapshot of {state.qualified}", eng.args.where()) from None
        conv = state.convert_snapshot_row
        return [conv(dict(zip(names, r, strict=True))) for r in raw]

    def _emit(self, state: TableState, rows: list[dict[str, Any]], prog: SnapshotProgress, hfile: str,
              hpos: int) -> None:
        eng = self.engine
        tracker = eng.tracker
        k = (state.db, state.table)
        # the stream has passed every DDL up to H (the catalog was read before H): this is the schema at H
        tracker.states[k] = state
        pos = BinlogPosition(hfile, hpos, prog.rows, None, eng.server.server_id, snapshot=True)
        eng.writer.add_schema(state.qualified, state.schema, pos, change="CREATE", ddl=tracker.take_ddl(*k))
        touched = (eng.touched or {}).get(k, set()) | eng.touched_prev.get(k, set())
        truncated = TRUNCATED in touched
        name, sid = eng.name, eng.server.server_id
        keycols = state.key
        now = now_ms()
        last_done = len(rows) < self.chunk_rows and prog.index == len(prog.tables) - 1
        written = 0
        jrow = eng.codec.encode_row_values
        schema = state.schema
        for i, row in enumerate(rows):
            key = {c: row[c] for c in keycols}
            if truncated:
                continue
            if touched:
                js = jrow(schema, row)
                if tuple(js[c] for c in keycols) in touched:
                    continue  # the stream already wrote a newer state of this row
            pos = BinlogPosition(hfile, hpos, prog.rows, None, sid, snapshot=True)
            prog.rows += 1
            snap = Snapshot.LAST if (last_done and i == len(rows) - 1) else Snapshot.TRUE
            ev = ChangeEvent(Op.READ, key, None, row, make_source(state, name, pos, now, None, snap), now)
            eng.writer.add_event(state, ev, pos)
            written += 1
        self.rows_written += written
        qual = prog.tables[prog.index]
        prog.table_rows[qual] = prog.table_rows.get(qual, 0) + written
        summary = eng.writer.writer.summary
        if summary is not None:  # per-table progress for metrics: [rows, estimated rows, done], once per chunk
            entry = summary.snapshot_tables.get(qual)
            if entry is None:
                entry = summary.snapshot_tables[qual] = [0, self._estimate(state) or 0, 0]
            entry[0] = prog.table_rows[qual]
            entry[2] = int(len(rows) < self.chunk_rows)
        if self.display is not None:
            if qual not in self._shown:
                self._shown.add(qual)
                self.display.add(qual, self._estimate(state), prog.table_rows[qual] - written)
            self.display.advance(qual, written, finished=len(rows) < self.chunk_rows)
        if len(rows) < self.chunk_rows:
            self._next_table(prog)
        else:
            last_key = eng.codec.encode_key(key_of(state, rows[-1]), state.schema)
            assert last_key is not None  # a snapshotted table has key columns (checked before the snapshot)
            prog.last_key = last_key.decode()
        # a new window: keys changed from now on
        if eng.touched is not None:
            eng.touched_prev = eng.touched
            eng.touched = {t: set() for t in eng.touched}
        eng.offset.snapshot = prog
        eng.checkpoint(force_save=True)
        if self.progress_cb is not None:
            self.progress_cb(qual, prog.table_rows.get(qual, 0), prog)

    def _estimate(self, state: TableState) -> int | None:
        """The server's row estimate for the progress bar (information_schema.TABLES.TABLE_ROWS)."""
        try:
            with self.engine.ctl.cursor() as cur:
                cur.execute("SELECT TABLE_ROWS FROM information_schema.TABLES WHERE TABLE_SCHEMA=%s AND "
                            "TABLE_NAME=%s", (state.db, state.table))
                row = cur.fetchone()
            return int(row[0]) if row and row[0] is not None else None
        except Exception:
            return None

    @staticmethod
    def _next_table(prog: SnapshotProgress) -> None:
        prog.index += 1
        prog.last_key = None


def _key_params(state: TableState) -> dict[str, Any]:
    """Key value (model form) -> SQL parameter, per key column."""
    out: dict[str, Any] = {}
    for s in state.specs:
        if s.name not in state.key:
            continue
        if s.kind == "timestamp":
            out[s.name] = lambda v: v.replace(tzinfo=None) if v is not None else None
        elif s.kind == "bit":
            out[s.name] = (lambda v: int(v)) if s.bits == 1 else (lambda v: int.from_bytes(v, "little"))
        elif s.kind == "set":
            out[s.name] = lambda v: ",".join(sorted(v))
        elif s.kind == "bigint" and s.unsigned:
            out[s.name] = int
        else:
            out[s.name] = lambda v: v
    return out


def _db_table(name: str) -> tuple[str, str]:
    """``"db.table"`` -> ``("db", "table")`` (a table name may itself hold dots)."""
    db, table = name.split(".", 1)
    return db, table
