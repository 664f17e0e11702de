"""The MySQL/MariaDB connector: chunked watermark snapshot + row-based binlog streaming.

Anatomy (``connectors/base.py``), one module each, as the PostgreSQL connector:
:class:`MySQLOffset` (``offset.py``, the offset context), :class:`MySQLSnapshotSource`
(``snapshot.py``), :class:`MySQLStreamingSource` (``streaming.py``), :class:`MySQLConnector`
(here: wiring and the run). Both sources drive one :class:`CaptureEngine` (``engine.py``), which
owns the binlog reader (``binlog.py``), the schema tracker and the record writer.

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

Lost position: a resume point whose binlog file and GTIDs were purged stops the capture with an
error naming ``kappaflow capture NAME --resnapshot``, which streams from the current position,
snapshots every table and deletes the keys nobody read again (``resnapshot.py``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kappaflow.connectors.base import (
    CaptureSummary,
    Connector,
    StopSignal,
)
from kappaflow.connectors.history import check_existing_topics, history_tables
from kappaflow.connectors.mysql.engine import CaptureEngine
from kappaflow.connectors.mysql.offset import MySQLOffset, SnapshotProgress
from kappaflow.connectors.mysql.outbox import attach_outbox
from kappaflow.connectors.mysql.preflight import check_tables
from kappaflow.connectors.mysql.resnapshot import ResnapshotSource, prepare
from kappaflow.connectors.mysql.schema_tracking import SchemaTracker
from kappaflow.connectors.mysql.server import (
    binlog_files,
    check_server,
    connect,
    current_gtid,
    master_status,
    parse_dsn,
)
from kappaflow.connectors.mysql.snapshot import MySQLSnapshotSource
from kappaflow.connectors.mysql.streaming import MySQLStreamingSource
from kappaflow.connectors.offsets import OffsetStore
from kappaflow.connectors.preflight import require_capturable
from kappaflow.connectors.resnapshot import ResnapshotRequest
from kappaflow.connectors.writer import FaultHook
from kappaflow.errors import ConfigError, SourceError
from kappaflow.events import EventCodec
from kappaflow.log.base import Log

__all__ = ["CaptureEngine", "MySQLConnector", "MySQLSnapshotSource", "MySQLStreamingSource"]


class MySQLConnector(Connector):
    """Capture one MySQL/MariaDB source into the log (see the module docstring).

    ``resnapshot``: ``kappaflow capture --resnapshot`` (``resnapshot.py``); set by the CLI.
    """

    resnapshot: ResnapshotRequest | None = None

    def __init__(self, *, name: str, log: Log, dsn: str, password: str | None = None,
                 tables: list[str] | None = None, key_columns: dict[str, list[str]] | None = None,
                 server_id: int = 5401, snapshot_mode: str = "initial", snapshot_chunk_rows: int = 10_000,
                 heartbeat_interval_s: float = 10.0, decimal_mode: str = "string", partitions: int | None = None,
                 batch_records: int = 20_000, flush_interval_s: float = 0.5, progress_cb: Any = None,
                 threaded_writer: bool = True, fault: FaultHook | None = None, progress: bool | None = False,
                 provide_transaction_metadata: bool = False, keep_history: list[str] | None = None) -> None:
        self.name = name
        self.keep_history = list(keep_history or [])  # tables whose topics keep every version (connectors/history.py)
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
        self.outbox_config: Any = None  # the source config, when it has outbox tables (connectors/outbox.py)

    @classmethod
    def from_config(cls, cfg: Any, log: Log, **options: Any) -> MySQLConnector:
        """From a ``kappaflow.config.MySQLSourceConfig`` (+ options such as ``partitions``)."""
        connector = cls(name=cfg.name, log=log, dsn=cfg.dsn, password=cfg.resolved_password(),
                        tables=list(cfg.tables), key_columns=dict(cfg.key_columns), server_id=cfg.server_id,
                        snapshot_mode=getattr(cfg.snapshot_mode, "value", cfg.snapshot_mode),
                        snapshot_chunk_rows=cfg.snapshot_chunk_rows, heartbeat_interval_s=cfg.heartbeat_interval_s,
                        decimal_mode=cfg.decimal_mode,
                        provide_transaction_metadata=getattr(cfg, "provide_transaction_metadata", False),
                        keep_history=list(getattr(cfg, "keep_history", [])), **options)
        if getattr(cfg, "outbox", None) is not None:
            connector.outbox_config = cfg
        return connector

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
    def _history_topics(self, tracker: SchemaTracker, qualified: list[str]) -> dict[str, str]:
        """keep_history table -> its topic, each among the captured tables and its existing topic
        able to keep every version (``connectors/history.py``); ConfigError otherwise."""
        names = []
        for t in self.keep_history:
            if "." not in t:  # like `tables`: a bare name is in the DSN's database
                if not self.args.database:
                    raise ConfigError(f"sources.{self.name}.keep_history: {t!r} has no database; write db.table")
                t = f"{self.args.database}.{t}"
            names.append(t)
        listed = history_tables(self.name, names, qualified)
        topics = {t: tracker.topic(*t.split(".", 1)) for t in sorted(listed)}
        check_existing_topics(self.name, self.log.list_topics(), topics)
        return topics

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
        offset = prepare(self.name, offset, server, files, qualified, self.resnapshot)
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
                offset.resnapshot = dict(offset.stream_start)  # and deletes what it does not read again
        history = self._history_topics(tracker, qualified)
        partitions = self.partitions
        if partitions is None:
            partitions = 4
        engine = CaptureEngine(name=self.name, log=self.log, args=self.args, server=server, tracker=tracker,
                               offset=offset, codec=self.codec, partitions=partitions,
                               replica_server_id=self.server_id, batch_records=self.batch_records,
                               flush_interval_s=self.flush_interval_s, heartbeat_s=self.heartbeat_s,
                               offsets=offsets, threaded=self.threaded_writer, fault=self.fault,
                               transaction_metadata=self.provide_transaction_metadata)
        engine.writer.history_topics = set(history.values())
        engine.writer.writer.summary = summary  # transactions and source lag, counted per batch
        if self.outbox_config is not None:
            try:  # checks the outbox tables' columns: a bad config stops here, before anything is read
                attach_outbox(engine, self.outbox_config, self.args.database, tables)
            except BaseException:
                engine.close()
                raise
        for db, t in tables:
            if engine.writer.outbox is None or f"{db}.{t}" not in engine.writer.outbox.tables:
                engine.writer.ensure_topic(tracker.topic(db, t))  # an outbox table's rows go to event topics
            engine.refresh_hints(db, t)  # what the binlog cannot tell (MariaDB JSON columns)
        self.engine = engine
        try:
            if offset.resnapshot is not None and offset.phase == "snapshot":
                engine.checkpoint(force_save=True, drain=True)  # the re-snapshot is durable before it reads
            if offset.phase == "snapshot":
                from kappaflow.connectors.postgres.snapshot import SnapshotProgressDisplay

                summary.phase = "snapshot"
                with SnapshotProgressDisplay(self.progress) as display:
                    source_cls = ResnapshotSource if offset.resnapshot is not None else MySQLSnapshotSource
                    snap = source_cls(engine, chunk_rows=self.chunk_rows, progress_cb=self.progress_cb,
                                      display=display)
                    offset = snap.execute(offset, stop)
                summary.snapshot_rows += snap.rows_written
                if offset.phase == "streaming" and mode == "initial_only":
                    offset.phase = "done"
                    engine.checkpoint(force_save=True, drain=True)
            if offset.phase == "streaming" and not stop.is_set():
                summary.phase = "streaming"
                from kappaflow.connectors.mysql.ondemand import MySQLOnDemand
                from kappaflow.connectors.ondemand import OnDemandState, channel_for

                stream = MySQLStreamingSource(engine)
                stream.ondemand = MySQLOnDemand(engine, OnDemandState.from_dict(offset.ondemand),
                                                channel_for(self.log), chunk_rows=self.chunk_rows, summary=summary)
                try:
                    stream.execute(offset, stop, until_caught_up=until_caught_up)
                finally:
                    stream.ondemand.close()
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
