"""Row-based binlog streaming with mysql-replication's ``BinLogStreamReader``.

The reader turns binlog events into a flat stream of items the connector writes to the log:

- ``RowsItem``: the row changes of one rows event of a captured table (as mysql-replication
  decodes them; the writer converts them), with the transaction's position;
- ``DdlItem``: a DDL statement (ALTER/CREATE/DROP/RENAME/TRUNCATE TABLE) on a captured table;
- ``SchemaItem``: a captured table whose columns changed (seen in a TableMapEvent);
- ``CommitItem``: the end of a transaction: the resume point after it (file, next position,
  executed GTID set);
- ``TickItem``: the server's heartbeat while idle (lets the caller flush and check for stop).

Positions: every change carries ``BinlogPosition(file, pos, row, gtid, server_id)`` where
``pos`` is where its transaction starts in ``file`` (the GTID event, or ``BEGIN`` without
GTIDs) and ``row`` its 0-based index among the transaction's row changes. Transactions are
in commit order in the binlog, so positions grow with commit order, and re-reading a
transaction after a crash gives every change the same position again.

Resuming (``StreamStart``): from ``file``/``pos`` (the start of the next transaction) when the
file still exists on the server, otherwise from the executed GTID set (MariaDB
``domain-server-seq`` / MySQL ``uuid:interval``) so a capture survives purged files or a new
primary; with neither it is a clear terminal error (a new snapshot is needed).

Reader options used, and why: ``resume_stream=True`` + ``log_file``/``log_pos`` (exact
file/position start; with MariaDB ``is_mariadb`` must stay False for this: the library's
MariaDB mode can only start from a GTID), ``auto_position`` + ``is_mariadb`` for GTID starts,
``blocking=True`` with ``slave_heartbeat`` (the server sends a heartbeat when idle, so the loop
wakes up to flush and to notice a stop request), ``only_schemas`` (rows of other databases
are not decoded; their transactions' commits still advance the resume point), no
``freeze_schema`` (every TableMapEvent is parsed: that is what keeps ALTER TABLE safe),
``enable_logging=False`` (the library logs every option at INFO otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kappaflow.connectors.mysql.gtid import GtidState
from kappaflow.connectors.mysql.schema_tracking import SchemaTracker, TableState, ddl_tables
from kappaflow.connectors.mysql.server import ConnectArgs, source_error
from kappaflow.connectors.mysql.source_info import binlog_file_sequence
from kappaflow.errors import Retry, SourceError
from kappaflow.events.model import Op

__all__ = ["BinlogReader", "CommitItem", "DdlItem", "RowsItem", "SchemaItem", "StreamStart", "TickItem"]

# MariaDB GTID event flag: the transaction is a single statement without BEGIN/COMMIT (DDL).
_FL_STANDALONE = 0x01


@dataclass(frozen=True, slots=True)
class StreamStart:
    """Where to start reading: the next transaction's ``file``/``pos`` and the executed GTID set."""

    file: str | None
    pos: int | None
    gtid: str = ""


@dataclass(slots=True)
class RowsItem:
    """mysql-replication's rows (dicts with ``values``/``none_sources``, or ``before_*``/``after_*``),
    or with ``json`` the compiled decoder's (JSON-form images; ``(before, after)`` for updates)."""

    state: TableState
    op: Op
    rows: Sequence[dict[str, Any]]
    file: str
    pos: int  # transaction start
    first_row: int  # row index (within the transaction) of rows[0]
    gtid: str | None
    ts_ms: int
    json: bool = False  # rows already in JSON form (rowdecoder.py)
    thread: int | None = None  # the session that wrote the transaction (its BEGIN query event)
    query: str | None = None  # the statement, when the binlog carries it (rows query / annotate events)


@dataclass(slots=True)
class DdlItem:
    query: str
    verb: str
    tables: list[tuple[str, str]]  # captured tables it names
    file: str
    pos: int
    row: int
    gtid: str | None
    ts_ms: int


@dataclass(slots=True)
class SchemaItem:
    state: TableState
    previous: TableState | None
    file: str
    pos: int
    row: int
    gtid: str | None
    ts_ms: int


@dataclass(slots=True)
class CommitItem:
    file: str
    next_pos: int
    gtid: str
    ts_ms: int


@dataclass(slots=True)
class TickItem:
    file: str | None
    next_pos: int | None


Item = RowsItem | DdlItem | SchemaItem | CommitItem | TickItem


class BinlogReader:
    """Iterates the binlog from a start point, yielding ``Item``s for the captured tables."""

    def __init__(self, args: ConnectArgs, *, server_id: int, flavor: str, tracker: SchemaTracker,
                 start: StreamStart, heartbeat_s: float = 1.0, blocking: bool = True,
                 use_gtid: bool = False, ctl_refresh: Callable[[str, str], None] | None = None,
                 decimal_mode: str | None = None) -> None:
        self.args = args
        self.server_id = server_id
        self.flavor = flavor
        self.tracker = tracker
        self.start = start
        self.heartbeat_s = heartbeat_s
        self.blocking = blocking
        self.use_gtid = use_gtid
        self.ctl_refresh = ctl_refresh
        self.decimal_mode = decimal_mode  # set: decode rows straight to JSON form where possible
        self.gtid = GtidState(flavor, start.gtid)
        # where the reader is: the end of the last event read (= the next event's start)
        self.file: str | None = start.file
        self.next_pos: int | None = start.pos
        # the end of the last event read, whatever it was (for "have we reached position X")
        self.seen_file: str | None = start.file
        self.seen_pos: int = start.pos or 0
        self._reader: Any = None
        self._schemas = sorted({db for db, _ in tracker.tables})

    # -- lifecycle -----------------------------------------------------------------
    def _open(self) -> Any:
        from pymysqlreplication import BinLogStreamReader

        kwargs: dict[str, Any] = dict(
            connection_settings=self.args.replication_settings(),
            server_id=self.server_id,
            blocking=self.blocking,
            only_schemas=self._schemas or None,
            slave_heartbeat=self.heartbeat_s if self.blocking else None,
            enable_logging=False,
        )
        if self.use_gtid:
            kwargs.update(auto_position=str(self.gtid) or None, is_mariadb=self.flavor == "mariadb")
        else:
            kwargs.update(resume_stream=True, log_file=self.start.file, log_pos=self.start.pos)
        return BinLogStreamReader(**kwargs)

    def close(self) -> None:
        if self._reader is not None:
            try:
                self._reader.close()
            except Exception:
                pass
            self._reader = None

    # -- iteration ---------------------------------------------------------------------
    def items(self) -> Iterator[Item]:
        """Yield items until the server has nothing more (non-blocking) or forever (blocking)."""
        import pymysql
        from pymysqlreplication.event import (
            GtidEvent,
            HeartbeatLogEvent,
            MariadbAnnotateRowsEvent,
            MariadbGtidEvent,
            QueryEvent,
            RotateEvent,
            RowsQueryLogEvent,
            XidEvent,
        )
        from pymysqlreplication.row_event import DeleteRowsEvent, TableMapEvent, UpdateRowsEvent, WriteRowsEvent

        self._reader = reader = self._open()
        tracker = self.tracker
        captured = tracker.tables
        table_states: dict[int, TableState] = {}
        decoders: dict[int, Any] = {}
        in_txn = False  # inside BEGIN ... COMMIT/XID
        txn_pos: int | None = None
        txn_gtid: str | None = None
        standalone = False
        thread: int | None = None
        query: str | None = None
        row = 0
        file = self.file or ""
        op_insert, op_update, op_delete = Op.CREATE, Op.UPDATE, Op.DELETE
        try:
            for ev in reader:
                cls = ev.__class__
                end = ev.packet.log_pos
                if end:
                    self.seen_pos = end
                if cls is WriteRowsEvent or cls is UpdateRowsEvent or cls is DeleteRowsEvent:
                    state = table_states.get(ev.table_id)
                    if state is None:
                        continue  # not a captured table
                    if txn_pos is None:  # rows without BEGIN/GTID seen (started mid-way): use the event's own start
                        txn_pos = end - ev.event_size
                    dec = decoders.get(ev.table_id)
                    rows = dec.decode_rows(ev, cls is UpdateRowsEvent) if dec is not None else None
                    is_json = rows is not None
                    if rows is None:
                        rows = ev.rows
                    if rows:
                        op = op_insert if cls is WriteRowsEvent else op_update if cls is UpdateRowsEvent else op_delete
                        yield RowsItem(state, op, rows, file, txn_pos, row, txn_gtid, ev.timestamp * 1000, is_json,
                                       thread, query)
                        row += len(rows)
                elif cls is TableMapEvent:
                    if (ev.schema, ev.table) not in captured:
                        table_states.pop(ev.table_id, None)
                        continue
                    state = tracker.from_table_map(ev)
                    table_states[ev.table_id] = state
                    if self.decimal_mode is not None:
                        decoders[ev.table_id] = state.row_decoder(ev.columns, self.decimal_mode)
                    known = tracker.states.get((state.db, state.table))
                    if known is not state and (known is None or
                                               known.schema.fingerprint() != state.schema.fingerprint()):
                        tracker.states[(state.db, state.table)] = state
                        if txn_pos is None:
                            txn_pos = end - ev.event_size
                        yield SchemaItem(state, known, file, txn_pos, row, txn_gtid, ev.timestamp * 1000)
                    elif known is not state:
                        tracker.states[(state.db, state.table)] = state
                elif cls is XidEvent:
                    yield from self._commit(txn_gtid, file, end, ev.timestamp * 1000)
                    in_txn, txn_pos, txn_gtid, row, standalone = False, None, None, 0, False
                    thread = query = None
                elif cls is RowsQueryLogEvent or cls is MariadbAnnotateRowsEvent:
                    q = ev.query if cls is RowsQueryLogEvent else ev.sql_statement
                    query = q.decode("utf-8", "replace") if isinstance(q, bytes) else q
                elif cls is MariadbGtidEvent or cls is GtidEvent:
                    txn_pos = end - ev.event_size
                    txn_gtid = ev.gtid
                    row = 0
                    standalone = cls is MariadbGtidEvent and bool(ev.flags & _FL_STANDALONE)
                    in_txn = False
                elif cls is QueryEvent:
                    q = ev.query if isinstance(ev.query, str) else ev.query.decode("utf-8", "replace")
                    head = q.lstrip()[:6].upper()
                    if head == "BEGIN" or head.startswith("XA "):
                        in_txn = True
                        thread = getattr(ev, "slave_proxy_id", None)
                        if txn_pos is None:
                            txn_pos = end - ev.event_size
                        continue
                    if head == "COMMIT":
                        yield from self._commit(txn_gtid, file, end, ev.timestamp * 1000)
                        in_txn, txn_pos, txn_gtid, row, standalone = False, None, None, 0, False
                        thread = query = None
                        continue
                    if txn_pos is None:
                        txn_pos = end - ev.event_size
                    schema = ev.schema.decode() if isinstance(ev.schema, bytes) else str(ev.schema or "")
                    ddl = ddl_tables(q, schema)
                    if ddl is not None:
                        verb, names = ddl
                        hit = [n for n in names if n in captured]
                        if hit:
                            for db, table in hit:
                                if self.ctl_refresh is not None and verb in ("ALTER", "CREATE"):
                                    self.ctl_refresh(db, table)
                            yield DdlItem(q, verb, hit, file, txn_pos, row, txn_gtid, ev.timestamp * 1000)
                            row += 1
                    if not in_txn or standalone:  # DDL and other single statements end their transaction
                        yield from self._commit(txn_gtid, file, end, ev.timestamp * 1000)
                        in_txn, txn_pos, txn_gtid, row, standalone = False, None, None, 0, False
                elif cls is RotateEvent:
                    file = ev.next_binlog
                    self.seen_file = file
                    self.seen_pos = ev.position
                    if txn_pos is None:
                        self.file, self.next_pos = file, ev.position
                    table_states.clear()
                    decoders.clear()
                elif cls is HeartbeatLogEvent:
                    yield TickItem(self.file, self.next_pos)
        except pymysql.MySQLError as exc:
            raise self._error(exc) from None
        finally:
            self.close()

    def _commit(self, gtid: str | None, file: str, end: int, ts_ms: int) -> Iterator[CommitItem]:
        if gtid:
            self.gtid.add(gtid)
        self.file = file
        self.next_pos = end
        yield CommitItem(file, end, str(self.gtid), ts_ms)

    def _error(self, exc: BaseException) -> SourceError:
        code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
        msg = exc.args[1] if code is not None and len(exc.args) > 1 else str(exc)
        where = self.args.where()
        if code == 1227 or (isinstance(msg, str) and "REPLICATION SLAVE" in msg.upper()):
            return SourceError(f"binlog stream {where}: missing privilege REPLICATION SLAVE: {msg}; run as an admin: "
                               f"GRANT REPLICATION SLAVE ON *.* TO '{self.args.user}'@'%'", retry=Retry.TERMINAL)
        if code == 1236:  # ER_MASTER_FATAL_ERROR_READING_BINLOG: purged file, unknown GTID, bad position
            from kappaflow.connectors.resnapshot import lost_position

            return lost_position(self.tracker.source, f"the server cannot continue the binlog stream from "
                                 f"{self.describe_start()}: {msg} (the binlog files or GTIDs it needs were purged)",
                                 where)
        return source_error(exc, "binlog stream", where)

    def reached(self, file: str, pos: int) -> bool:
        """Has the reader read everything before ``file``/``pos``?"""
        if self.seen_file is None:
            return False
        return (binlog_file_sequence(self.seen_file)[0], self.seen_pos) >= (binlog_file_sequence(file)[0], pos)

    def describe_start(self) -> str:
        if self.use_gtid:
            return f"GTID set {str(self.gtid)!r}"
        return f"{self.start.file}:{self.start.pos}"


def now_ms() -> int:
    return int(time.time() * 1000)
