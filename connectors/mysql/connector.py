"""The MySQL/MariaDB connector: chunked watermark snapshot + row-based binlog streaming.

Anatomy (``connectors/base.py``): :class:`MySQLOffset` (offset context),
:class:`MySQLSnapshotSource`, :class:`MySQLStreamingSource`, :class:`MySQLConnector`.
Both sources drive one :class:`CaptureEngine`, which owns the binlog reader, the schema
tracker and the record writer.

Commit order (one checkpoint; each step is tested in ``tests/connectors/mysql``):

1. the records of the batch -- change events, their tombstones, schema-change records --
   are appended to their topics; each append is durable when it returns;
2. the offset record (:class:`MySQLOffset`: the binlog file/position of the next
   transaction not yet fully written, the executed GTID set, snapshot progress) is
   appended to the offsets topic;
3. acknowledgement: MySQL has no server-side acknowledgement (the server keeps binlog
   files by age/size, not by consumer), so step 2 *is* the acknowledgement; nothing
   before it is treated as done.

A crash between 1 and 2 re-reads from the previous offset; records whose position is not
above the last one stored in their topic-partition are skipped (``tail_positions``), so
the log never holds a change twice and never misses one.

Snapshot: the lock-free watermark method (DBLog / Debezium's incremental snapshot), not a
global read lock. Streaming starts first, at the binlog position read when the snapshot
begins. Then, per chunk of ``snapshot_chunk_rows`` rows in primary-key order:
``SELECT ... WHERE pk > last ORDER BY pk LIMIT n``; read the binlog position ``H`` (high
watermark); stream up to ``H`` (those changes are written as usual); write the chunk's rows
as ``op=r`` at position ``H`` (snapshot) *except* the rows whose key changed in the stream
since the previous chunk (and the one before, a margin for transactions binlogged but not
yet visible): for those the stream already wrote a newer state. No lock is taken, no
privilege beyond SELECT is needed, and progress (table, last key) is in the offset, so a
crash resumes with the next chunk. Snapshot positions ``(H, snapshot, n)`` order before any
streaming position at or after ``H``, so positions grow along the log.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

from kappaflow.connectors.base import (
    CaptureSummary,
    Connector,
    SnapshotSource,
    StopSignal,
    StreamingSource,
    tail_positions,
)
from kappaflow.connectors.mysql.binlog import (
    BinlogReader,
    CommitItem,
    DdlItem,
    Item,
    RowsItem,
    SchemaItem,
    StreamStart,
    TickItem,
)
from kappaflow.connectors.mysql.offset import MySQLOffset, SnapshotProgress
from kappaflow.connectors.mysql.preflight import check_tables
from kappaflow.connectors.mysql.schema_tracking import SchemaTracker, TableState, schema_topic
from kappaflow.connectors.mysql.server import (
    ConnectArgs,
    ServerInfo,
    binlog_files,
    check_server,
    connect,
    current_gtid,
    master_status,
    parse_dsn,
    source_error,
)
from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.mysql.types import snapshot_select_expr
from kappaflow.connectors.mysql.writer import ChangeBatcher, key_of, make_source, now_ms
from kappaflow.connectors.offsets import OffsetStore
from kappaflow.connectors.preflight import require_capturable
from kappaflow.connectors.transactions import TRANSACTION_TOPIC_CONFIG, transaction_topic
from kappaflow.connectors.writer import FaultHook
from kappaflow.errors import ConfigError, Retry, SourceError
from kappaflow.events import ChangeEvent, EventCodec, Op, Snapshot
from kappaflow.log.base import Log

__all__ = ["CaptureEngine", "MySQLConnector", "MySQLSnapshotSource", "MySQLStreamingSource"]


_TRUNCATED = ("__kf_truncated__",)


def _quote(ident: str) -> str:
    return "`" + ident.replace("`", "``") + "`"


class CaptureEngine:
    """Shared state of one capture run: reader, tracker, writer, offset and checkpoints."""

    def __init__(self, *, name: str, log: Log, args: ConnectArgs, server: ServerInfo, tracker: SchemaTracker,
                 offset: MySQLOffset, codec: EventCodec, partitions: int, replica_server_id: int,
                 batch_records: int = 20_000, flush_interval_s: float = 0.5, heartbeat_s: float = 1.0,
                 offsets: OffsetStore | None = None, threaded: bool = True, fault: FaultHook | None = None,
                 fast_rows: bool = True, transaction_metadata: bool = False) -> None:
        self.name = name
        self.log = log
        self.args = args
        self.server = server
        self.tracker = tracker
        self.offset = offset
        self.codec = codec
        self.replica_server_id = replica_server_id
        self.fast_rows = fast_rows
        self.batch_records = batch_records
        self.flush_interval_s = flush_interval_s
        self.heartbeat_s = heartbeat_s
        self.offsets = offsets or OffsetStore(log)
        topics = [tracker.topic(db, t) for db, t in sorted(tracker.tables)] + [schema_topic(name)]
        tx_topic = transaction_topic(name) if transaction_metadata else None
        if tx_topic is not None:  # Debezium's transaction metadata (connectors/transactions.py)
            log.create_topic(tx_topic, TRANSACTION_TOPIC_CONFIG, exist_ok=True)
            topics.append(tx_topic)
        self.writer = ChangeBatcher(log, source=name, codec=codec, partitions=partitions,
                                    tails=tail_positions(log, topics), threaded=threaded, fault=fault,
                                    offsets=self.offsets)
        if tx_topic is not None:
            self.writer.transaction_topic = tx_topic
            self.writer.ensure_topic(tx_topic)
        self.writer.load_schemas()
        self.reader: BinlogReader | None = None
        self._items: Iterator[Item] | None = None
        self._ctl: Any = None
        # resume point: after the last transaction completely handed to the writer
        self.resume = (offset.file, offset.pos, offset.gtid)
        self._txn: tuple[str, int] | None = None
        self._txn_index = 0
        self._txn_gtid: str | None = None
        self._txn_ts = 0
        self._last_flush = time.monotonic()
        self._last_save = time.monotonic()
        self._saved = offset.to_dict()
        self._events_base = offset.events
        self._txs = 0  # transactions since the last hand-over and the last one's commit time (metrics)
        self._commit_ts_ms: int | None = None
        # watermark snapshot: keys changed in the stream, per table, in this window and the previous one
        self.touched: dict[tuple[str, str], set[tuple[Any, ...]]] | None = None
        self.touched_prev: dict[tuple[str, str], set[tuple[Any, ...]]] = {}

    # -- connections -------------------------------------------------------------------
    @property
    def ctl(self) -> Any:
        """A plain connection for catalog queries (autocommit)."""
        if self._ctl is None:
            self._ctl = connect(self.args, what="catalog connection", autocommit=True)
        return self._ctl

    def refresh_hints(self, db: str, table: str) -> None:
        try:
            self.tracker.refresh_hints(self.ctl, db, table)
        except Exception:  # best effort: JSON-ness of MariaDB LONGTEXT columns only
            self._ctl = None

    def close(self) -> None:
        self.writer.close()
        if self.reader is not None:
            self.reader.close()
        self._items = None
        if self._ctl is not None:
            try:
                self._ctl.close()
            except Exception:
                pass
            self._ctl = None

    # -- the stream --------------------------------------------------------------------
    def _open_reader(self) -> Iterator[Item]:
        file, pos, gtid = self.resume
        use_gtid = False
        try:
            files = binlog_files(self.ctl)
        except Exception as exc:
            raise source_error(exc, "list binary logs", self.args.where()) from None
        if file not in files:
            if not gtid:
                raise SourceError(
                    f"source {self.name!r}: binlog file {file!r} (resume point {file}:{pos}) is no longer on the "
                    f"server (it has {files[:1]}..{files[-1:]}) and no GTID set was recorded; take a new snapshot "
                    "(snapshot_mode=always re-snapshots and streams from the current position)")
            use_gtid = True
        self.reader = BinlogReader(self.args, server_id=self.replica_server_id, flavor=self.server.flavor,
                                   tracker=self.tracker, start=StreamStart(file, pos, gtid),
                                   heartbeat_s=self.heartbeat_s, use_gtid=use_gtid, ctl_refresh=self.refresh_hints,
                                   decimal_mode=self.codec.decimal_mode if self.fast_rows else None)
        return self.reader.items()

    def next_item(self) -> Item:
        if self._items is None:
            self._items = self._open_reader()
        try:
            return next(self._items)
        except StopIteration:
            self._items = None
            raise SourceError(f"source {self.name!r}: the binlog stream ended (server closed the connection)",
                              retry=Retry.TRANSIENT) from None

    def reached(self, file: str, pos: int) -> bool:
        if self.reader is None:
            if self._items is None:
                self._items = self._open_reader()
            assert self.reader is not None
        return self.reader.reached(file, pos)

    # -- processing ----------------------------------------------------------------------
    def _index(self, file: str, pos: int) -> int:
        if self._txn != (file, pos):
            self._txn = (file, pos)
            self._txn_index = 0
        i = self._txn_index
        self._txn_index = i + 1
        return i

    def process(self, item: Item) -> None:
        cls = item.__class__
        if cls is RowsItem:
            self._rows(item)
        elif cls is CommitItem:
            assert isinstance(item, CommitItem)
            self.resume = (item.file, item.next_pos, item.gtid)
            if self._txn is not None and self.writer.tx_counts:
                self.writer.add_transaction(*self._txn, self._txn_gtid, self.server.server_id, self._txn_ts,
                                            item.ts_ms)
            self._txn = None
            self._txs += 1
            self._commit_ts_ms = item.ts_ms
            if self.writer.buffered >= self.batch_records or \
                    time.monotonic() - self._last_flush >= self.flush_interval_s:
                self.checkpoint()
        elif cls is SchemaItem:
            self._schema(item)
        elif cls is DdlItem:
            self._ddl(item)
        elif cls is TickItem:
            # the server's heartbeat: the capture is at the end of the binlog, nothing is waiting
            summary = self.writer.writer.summary
            if summary is not None and not self.writer.buffered and self.writer.writer.pending == 0:
                summary.source_lag_ms = 0.0
            if self.writer.buffered or time.monotonic() - self._last_save >= self.heartbeat_s:
                self.checkpoint()

    def _rows(self, item: RowsItem) -> None:
        state = item.state
        if not state.key:
            raise SourceError(f"table {state.qualified} has no primary key: add one or set key_columns "
                              f"(kappaflow source add ... --key-columns {state.qualified}=col,...)")
        file, tpos = item.file, item.pos
        if self._txn != (file, tpos):
            self._txn = (file, tpos)
            self._txn_index = 0
            self._txn_gtid, self._txn_ts = item.gtid, item.ts_ms
        touched = self.touched.get((state.db, state.table)) if self.touched is not None else None
        self._txn_index = self.writer.add_rows(state, item.op, item.rows, file, tpos, self._txn_index, item.gtid,
                                               self.server.server_id, item.ts_ms, now_ms(), touched, item.json,
                                               item.thread, item.query)
        if self.writer.buffered >= self.batch_records:
            self.checkpoint()

    def _schema(self, item: SchemaItem) -> None:
        state = item.state
        ddl = self.tracker.take_ddl(state.db, state.table)
        pos = BinlogPosition(item.file, item.pos, self._txn_index if self._txn == (item.file, item.pos) else 0,
                             item.gtid, self.server.server_id)
        self.writer.add_schema(state.qualified, state.schema, pos, change="CREATE" if item.previous is None
                               else "ALTER", ddl=ddl)

    def _ddl(self, item: DdlItem) -> None:
        for db, table in item.tables:
            if item.verb == "TRUNCATE":
                state = self.tracker.states.get((db, table))
                if state is None:
                    state = self.tracker.load(self.ctl, db, table)
                    if state is None:
                        continue
                    self.tracker.states[(db, table)] = state
                pos = BinlogPosition(item.file, item.pos, self._index(item.file, item.pos), item.gtid,
                                     self.server.server_id)
                ev = ChangeEvent(Op.TRUNCATE, None, None, None, make_source(state, self.name, pos, item.ts_ms,
                                                                            item.gtid), now_ms())
                self.checkpoint()  # the keys to tombstone are read from the log: it must hold everything before
                self.writer.drain()
                self.writer.add_truncate(state, ev, pos)
                if self.touched is not None:
                    self.touched.setdefault((db, table), set()).add(_TRUNCATED)
            elif item.verb in ("DROP", "RENAME"):
                pos = BinlogPosition(item.file, item.pos, self._txn_index if self._txn == (item.file, item.pos)
                                     else 0, item.gtid, self.server.server_id)
                self.tracker.forget(db, table)
                self.writer.add_schema(f"{db}.{table}", None, pos, change="DROP")
            else:
                self.tracker.note_ddl(db, table, item.query)

    # -- checkpoints ---------------------------------------------------------------------
    def checkpoint(self, *, force_save: bool = False, drain: bool = False) -> None:
        """Hand the batch to the writer thread, which performs steps 1-3 of the commit order."""
        w = self.writer
        file, pos, gtid = self.resume
        o = self.offset
        o.file, o.pos, o.gtid = file, pos, gtid
        o.events = self._events_base + w.events
        if w.last_position is not None:
            o.last_position = w.last_position.to_dict()
        d = o.to_dict()
        if w.buffered or force_save or d != self._saved:
            w.flush(d, transactions=self._txs, commit_ts_ms=self._commit_ts_ms)
            self._txs, self._commit_ts_ms = 0, None
            self._saved = d
            self._last_save = time.monotonic()
        if drain:
            w.drain()
        self._last_flush = time.monotonic()

    def pump_until(self, file: str, pos: int, stop: StopSignal) -> bool:
        """Process the stream until everything before ``file``/``pos`` is handled; False if stopped."""
        while not self.reached(file, pos):
            if stop.is_set():
                return False
            self.process(self.next_item())
        return True


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
        eng.touched = {tuple(t.split(".", 1)): set() for t in prog.tables[prog.index:]}
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
        cols = ", ".join(snapshot_select_expr(s, _quote(s.name)) for s in state.specs)
        key = list(state.key)
        where, params = "", []
        if prog.last_key is not None:
            last = eng.codec.decode_key(prog.last_key.encode(), state.schema)
            assert last is not None
            to_sql = _key_params(state)
            vals = [to_sql[k](last[k]) for k in key]
            ors = []
            for i in range(len(key)):
                conj = [f"{_quote(key[j])} = %s" for j in range(i)] + [f"{_quote(key[i])} > %s"]
                ors.append("(" + " AND ".join(conj) + ")")
                params.extend([*vals[:i], vals[i]])
            where = " WHERE " + " OR ".join(ors)
        order = ", ".join(_quote(k) for k in key)
        sql = (f"SELECT {cols} FROM {_quote(state.db)}.{_quote(state.table)}{where} ORDER BY {order} "
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
        truncated = _TRUNCATED in touched
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
            prog.last_key = eng.codec.encode_key(key_of(state, rows[-1]), state.schema).decode()  # type: ignore[union-attr]
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


class MySQLStreamingSource(StreamingSource):
    """Streams the binlog into the log until stopped (or caught up with the server)."""

    def __init__(self, engine: CaptureEngine) -> None:
        self.engine = engine

    def execute(self, offset: Any, stop: StopSignal, *, until_caught_up: bool = False) -> MySQLOffset:
        eng = self.engine
        target: tuple[str, int] | None = None
        if until_caught_up:
            with eng.ctl.cursor() as cur:
                target = master_status(cur)
        while not stop.is_set():
            if target is not None and eng.reached(*target) and eng._txn is None:
                break
            eng.process(eng.next_item())
        eng.checkpoint(force_save=True, drain=True)
        return eng.offset


class MySQLConnector(Connector):
    """Capture one MySQL/MariaDB source into the log (see the module docstring)."""

    def __init__(self, *, name: str, log: Log, dsn: str, password: str | None = None,
                 tables: list[str] | None = None, key_columns: dict[str, list[str]] | None = None,
                 server_id: int = 5401, snapshot_mode: str = "initial", snapshot_chunk_rows: int = 10_000,
                 heartbeat_interval_s: float = 10.0, decimal_mode: str = "string", partitions: int | None = None,
                 batch_records: int = 20_000, flush_interval_s: float = 0.5, progress_cb: Any = None,
                 threaded_writer: bool = True, fault: FaultHook | None = None, progress: bool | None = False,
                 provide_transaction_metadata: bool = False) -> None:
        self.name = name
        self.provide_transaction_metadata = provide_transaction_metadata
        self.log = log
        self.args = parse_dsn(dsn, password)
        self.table_names = list(tables or [])
        self.key_columns = dict(key_columns or {})
        self.server_id = server_id
        if snapshot_mode not in ("initial", "never", "always", "initial_only"):
            raise ConfigError(f"sources.{name}.snapshot_mode: expected initial, never, always or initial_only, "
                              f"got {snapshot_mode!r}")
        self.snapshot_mode = snapshot_mode
        self.chunk_rows = snapshot_chunk_rows
        self.heartbeat_s = min(float(heartbeat_interval_s), 1.0)
        self.save_interval_s = float(heartbeat_interval_s)
        self.codec = EventCodec(decimal_mode)
        self.partitions = partitions
        self.batch_records = batch_records
        self.flush_interval_s = flush_interval_s
        self.progress_cb = progress_cb
        self.threaded_writer = threaded_writer
        self.fault = fault
        self.progress = progress  # snapshot progress bar on stderr (None: when stderr is a terminal)
        self.summary = CaptureSummary(source=name, connector="mysql")

    @classmethod
    def from_config(cls, cfg: Any, log: Log, **options: Any) -> MySQLConnector:
        """From a ``kappaflow.config.MySQLSourceConfig`` (+ options such as ``partitions``)."""
        return cls(name=cfg.name, log=log, dsn=cfg.dsn, password=cfg.resolved_password(), tables=list(cfg.tables),
                   key_columns=dict(cfg.key_columns), server_id=cfg.server_id,
                   snapshot_mode=getattr(cfg.snapshot_mode, "value", cfg.snapshot_mode),
                   snapshot_chunk_rows=cfg.snapshot_chunk_rows, heartbeat_interval_s=cfg.heartbeat_interval_s,
                   decimal_mode=cfg.decimal_mode,
                   provide_transaction_metadata=getattr(cfg, "provide_transaction_metadata", False), **options)

    def live_summary(self) -> CaptureSummary | None:
        """This run's summary with the writer's running counts and the binlog position (progress lines)."""
        engine = getattr(self, "engine", None)
        s = self.summary
        if engine is None or s.phase == "stopped":
            return s
        o = engine.offset
        return dataclasses.replace(s, events=engine.writer.events, records=engine.writer.records,
                                   position=f"{o.file}:{o.pos}", per_topic=dict(engine.writer.writer.per_topic))

    # -- setup -------------------------------------------------------------------------
    def _resolve_tables(self, conn: Any, strict: bool = True) -> list[tuple[str, str]]:
        """The configured tables as (db, table); ``strict``: each must exist (first start only:
        later a table may have been dropped, and streaming must still pass its DROP)."""
        names = self.table_names
        with conn.cursor() as cur:
            if not names:
                if not self.args.database:
                    raise ConfigError(f"sources.{self.name}.tables: empty, and the DSN names no database; list "
                                      "the tables as db.table")
                cur.execute("SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA=%s AND "
                            "TABLE_TYPE='BASE TABLE' ORDER BY TABLE_NAME", (self.args.database,))
                return [(self.args.database, r[0]) for r in cur.fetchall()]
            out = []
            for t in names:
                db, sep, table = t.partition(".")
                if not sep:
                    if not self.args.database:
                        raise ConfigError(f"sources.{self.name}.tables: {t!r} has no database; write db.table")
                    db, table = self.args.database, t
                cur.execute("SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA=%s AND TABLE_NAME=%s",
                            (db, table))
                if cur.fetchone() is None and strict:
                    raise ConfigError(f"sources.{self.name}.tables: table {db}.{table} does not exist on "
                                      f"{self.args.where()} (or the user cannot see it)")
                out.append((db, table))
            return out

    def run(self, stop: StopSignal | None = None, *, until_caught_up: bool = False) -> CaptureSummary:
        stop = stop or StopSignal()
        summary = self.summary = CaptureSummary(source=self.name, connector="mysql")  # this run's
        started = time.monotonic()
        offsets = OffsetStore(self.log)
        stored = offsets.load(self.name)
        conn = connect(self.args, what="connect", autocommit=True)
        try:
            server = check_server(conn, self.args.where())
            tables = self._resolve_tables(conn, strict=stored is None)
            if stored is None:  # every table's key, all at once, before the snapshot reads any of them
                require_capturable(self.name, check_tables(conn, tables, self.key_columns, source=self.name,
                                                           duplicates=False))
            files = binlog_files(conn)
        finally:
            conn.close()
        tracker = SchemaTracker(self.name, tables, self.key_columns)
        offset = MySQLOffset.from_dict(stored) if stored is not None else None
        if offset is not None and offset.flavor != server.flavor:
            raise SourceError(f"source {self.name!r}: the stored offset is for a {offset.flavor} server, this is "
                              f"{server.flavor}; reset the source to capture a different server")
        mode = self.snapshot_mode
        qualified = [f"{db}.{t}" for db, t in tables]
        if offset is None:
            offset = MySQLOffset(server.flavor, server.binlog_file, server.binlog_pos, server.gtid_executed,
                                 phase="streaming", stream_start={"file": server.binlog_file,
                                                                  "pos": server.binlog_pos,
                                                                  "gtid": server.gtid_executed})
            if mode != "never":
                offset.phase = "snapshot"
                offset.snapshot = SnapshotProgress(qualified)
        elif mode == "always" and offset.phase != "snapshot":
            offset.phase = "snapshot"
            offset.snapshot = SnapshotProgress(qualified)
            if offset.file not in files:  # the old resume point is purged: stream from now, the snapshot covers it
                offset.file, offset.pos, offset.gtid = server.binlog_file, server.binlog_pos, server.gtid_executed
                offset.stream_start = {"file": server.binlog_file, "pos": server.binlog_pos,
                                       "gtid": server.gtid_executed}
        partitions = self.partitions
        if partitions is None:
            partitions = 4
        engine = CaptureEngine(name=self.name, log=self.log, args=self.args, server=server, tracker=tracker,
                               offset=offset, codec=self.codec, partitions=partitions,
                               replica_server_id=self.server_id, batch_records=self.batch_records,
                               flush_interval_s=self.flush_interval_s, heartbeat_s=self.heartbeat_s,
                               offsets=offsets, threaded=self.threaded_writer, fault=self.fault,
                               transaction_metadata=self.provide_transaction_metadata)
        engine.writer.writer.summary = summary  # transactions and source lag, counted per batch
        for db, t in tables:
            engine.writer.ensure_topic(tracker.topic(db, t))
            engine.refresh_hints(db, t)  # what the binlog cannot tell (MariaDB JSON columns)
        self.engine = engine
        try:
            if offset.phase == "snapshot":
                from kappaflow.connectors.postgres.snapshot import SnapshotProgressDisplay

                summary.phase = "snapshot"
                with SnapshotProgressDisplay(self.progress) as display:
                    snap = MySQLSnapshotSource(engine, chunk_rows=self.chunk_rows, progress_cb=self.progress_cb,
                                               display=display)
                    offset = snap.execute(offset, stop)
                summary.snapshot_rows += snap.rows_written
                if offset.phase == "streaming" and mode == "initial_only":
                    offset.phase = "done"
                    engine.checkpoint(force_save=True, drain=True)
            if offset.phase == "streaming" and not stop.is_set():
                summary.phase = "streaming"
                MySQLStreamingSource(engine).execute(offset, stop, until_caught_up=until_caught_up)
            else:
                engine.checkpoint(drain=True)
        finally:
            engine.close()
            w = engine.writer
            summary.events += w.events
            summary.records += w.records
            summary.duplicates_skipped += w.skipped
            for k, v in w.writer.per_topic.items():
                summary.per_topic[k] = summary.per_topic.get(k, 0) + v
            summary.position = f"{offset.file}:{offset.pos}" + (f" gtid {offset.gtid}" if offset.gtid else "")
            summary.acknowledged = summary.position
            summary.phase = "stopped"
            summary.stopped_reason = stop.reason or ("caught up" if until_caught_up else "")
            summary.elapsed_s = time.monotonic() - started
        return summary

    def status(self) -> dict[str, Any]:
        """Stored offset, the server's binlog position, lag in bytes (same file), topic end offsets.

        Works on a read-only log (a running capture holds the embedded log's writer lock).
        """
        from kappaflow.connectors.offsets import OFFSETS_TOPIC

        topics = self.log.list_topics()
        stored = OffsetStore(self.log).load(self.name) if OFFSETS_TOPIC in topics else None
        out: dict[str, Any] = {"source": self.name, "connector": "mysql", "offset": stored,
                               "events_captured": 0 if stored is None else stored.get("events", 0),
                               "topics": {t: sum(self.log.end_offsets(t).values()) for t in topics
                                          if t.startswith(f"{self.name}.")}}
        try:
            conn = connect(self.args, what="status", autocommit=True)
            try:
                with conn.cursor() as cur:
                    file, pos = master_status(cur)
                out["server"] = {"file": file, "pos": pos, "gtid": current_gtid(conn, "mariadb" if "mariadb" in
                                                                                    conn.get_server_info().lower()
                                                                                    else "mysql")}
            finally:
                conn.close()
            if stored is not None and stored.get("file") == file:
                out["lag_bytes"] = max(0, pos - int(stored.get("pos", 0)))
        except SourceError as exc:
            out["server_error"] = str(exc)
        return out
