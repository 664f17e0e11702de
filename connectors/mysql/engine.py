"""The engine of one MySQL/MariaDB capture run, which both sources drive.

:class:`CaptureEngine` owns the binlog reader (``binlog.py``), the schema tracker
(``schema_tracking.py``), the record writer (``writer.py``), the offset and the checkpoints:
the commit order of the connector's docstring (``connector.py``) is its ``checkpoint``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, cast

from kappaflow.connectors.base import (
    StopSignal,
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
from kappaflow.connectors.mysql.offset import MySQLOffset
from kappaflow.connectors.mysql.schema_tracking import SchemaTracker, schema_topic
from kappaflow.connectors.mysql.server import (
    ConnectArgs,
    ServerInfo,
    binlog_files,
    connect,
    source_error,
)
from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.mysql.writer import ChangeBatcher, make_source, now_ms
from kappaflow.connectors.offsets import OffsetStore
from kappaflow.connectors.transactions import TRANSACTION_TOPIC_CONFIG, transaction_topic
from kappaflow.connectors.writer import FaultHook
from kappaflow.errors import Retry, SourceError
from kappaflow.events import ChangeEvent, EventCodec, Op
from kappaflow.log.base import Log

__all__ = ["TRUNCATED", "CaptureEngine", "quote"]


TRUNCATED = ("__kf_truncated__",)


def quote(ident: str) -> str:
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
                from kappaflow.connectors.resnapshot import lost_position

                raise lost_position(self.name, f"binlog file {file!r} (resume point {file}:{pos}) is no longer on "
                                    f"the server (it has {files[:1]}..{files[-1:]}: purged) and no GTID set was "
                                    "recorded", self.args.where())
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
        if cls is RowsItem:  # exact class checks (the hot path); cast for the type checker
            self._rows(cast(RowsItem, item))
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
            self._schema(cast(SchemaItem, item))
        elif cls is DdlItem:
            self._ddl(cast(DdlItem, item))
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
                    self.touched.setdefault((db, table), set()).add(TRUNCATED)
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
            # inside a transaction (a huge one, or before a TRUNCATE's tombstones): no new cut
            w.flush(d, transactions=self._txs, commit_ts_ms=self._commit_ts_ms, cut=self._txn is None)
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
