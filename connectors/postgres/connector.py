"""The PostgreSQL connector: publication + slot, snapshot, then streaming, offsets in the log.

Decision table at start (``snapshot_mode`` x stored offset x slot):

==============  ==================  =========================================================
offset          slot                what happens
==============  ==================  =========================================================
none            any                 (re)create the slot; ``initial``/``always``: snapshot with
                                    the slot's exported snapshot, then stream from its
                                    consistent point; ``never``: stream from the new slot
snapshot phase  present             resume the snapshot from the next chunk (fresh snapshot),
                                    then stream from the original consistent point
streaming       present             ``always``: re-snapshot (positions at the stored LSN),
                                    then stream; otherwise stream from the stored LSN
any             missing, lost or    SourceError (changes were lost with the slot) naming
                past the offset     ``kappaflow capture NAME --resnapshot``; with it (or with
                                    ``always`` and a missing slot): a new slot, a full snapshot,
                                    then deletes for keys the snapshot did not read
                                    (``resnapshot.py``)
==============  ==================  =========================================================

``initial_only`` needs no slot: one snapshot in a plain REPEATABLE READ transaction,
recorded as done, nothing streamed.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

import psycopg

from kappaflow.config import PostgresSourceConfig, SnapshotMode
from kappaflow.connectors.base import CaptureSummary, Connector, StopSignal
from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres.context import PgCapture, schema_topic
from kappaflow.connectors.postgres.mapping import RecordMapper
from kappaflow.connectors.postgres.offset import PgOffset, SnapshotProgress
from kappaflow.connectors.postgres.outbox import outbox_mappers
from kappaflow.connectors.postgres.replication import ReplicationConnection, _classify, lsn_str, redact_dsn
from kappaflow.connectors.postgres.resnapshot import delete_vanished, lost_reason, prepare
from kappaflow.connectors.postgres.snapshot import PgSnapshotSource
from kappaflow.connectors.postgres.streaming import PgStreamingSource
from kappaflow.connectors.resnapshot import ResnapshotRequest, lost_position
from kappaflow.connectors.writer import FaultHook
from kappaflow.errors import SourceError
from kappaflow.log.base import Log

__all__ = ["PostgresConnector", "postgres_status"]


# GIL hand-over interval while capturing (CPython's default is 5 ms).
CAPTURE_SWITCH_INTERVAL_S = 0.0005


@contextlib.contextmanager
def gc_tuned_for_capture() -> Iterator[None]:
    """Fewer cyclic-GC passes and a shorter GIL switch interval while capturing.

    The hot path allocates a dict, a tuple and a record per change, none of them in
    cycles; with default thresholds the collector runs every 700 allocations and its
    full passes walk every record waiting in the batches (~20% of capture CPU).

    The writer thread releases the GIL around every SQLite step (and for large CRCs) and
    must get it back from the decoding thread, which holds it almost all the time: with
    the default 5 ms switch interval each of the ~40 hand-backs of a 20k-record batch waits
    up to 5 ms, so the writer falls behind and the decoder stalls on the full queue
    (measured: ~100k -> ~120k changes/s with 0.5 ms, same CPU).
    """
    old = gc.get_threshold()
    old_switch = sys.getswitchinterval()
    gc.set_threshold(100_000, 50, 100)
    sys.setswitchinterval(min(old_switch, CAPTURE_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        gc.set_threshold(*old)
        sys.setswitchinterval(old_switch)


class PostgresConnector(Connector):
    """Capture one PostgreSQL source into ``log``.

    ``partitions``: partition count for new table topics (default 4; existing topics keep
    theirs). ``progress``: snapshot progress bar (None: only when stderr is a TTY).
    ``fault``: test hook called with the writer's step names (see ``connectors/writer.py``).
    ``mappers``: "schema.table" -> :class:`RecordMapper` for append-only tables whose inserted
    rows become the mapper's records instead of change events (the ledger source uses this).
    ``resnapshot``: ``kappaflow capture --resnapshot`` (``resnapshot.py``); set by the CLI.
    """

    resnapshot: ResnapshotRequest | None = None

    def __init__(self, config: PostgresSourceConfig, log: Log, *, partitions: int = 4,
                 progress: bool | None = None, batch_records: int = 20_000, linger_s: float = 0.05,
                 status_interval_s: float = 1.0, writer_threaded: bool = True,
                 fault: FaultHook | None = None, mappers: Mapping[str, RecordMapper] | None = None) -> None:
        self.config = config
        self.name = config.name
        self.log = log
        self.partitions = partitions
        self.progress = progress
        self.batch_records = batch_records
        self.linger_s = linger_s
        self.status_interval_s = status_interval_s
        self.writer_threaded = writer_threaded
        self.fault = fault
        # an outbox (connectors/postgres/outbox.py) maps its tables' rows and its logical messages
        self.mappers = {**outbox_mappers(config), **(mappers or {})}
        self.summary: CaptureSummary | None = None

    def run(self, stop: StopSignal | None = None, *, until_caught_up: bool = False) -> CaptureSummary:
        with gc_tuned_for_capture():
            try:
                return self._run(stop, until_caught_up=until_caught_up)
            except psycopg.OperationalError as exc:  # the catalog/heartbeat connection broke mid-run
                raise _classify(str(exc), getattr(exc, "sqlstate", None), f"source {self.name!r}",
                                self.config.dsn) from None

    def _run(self, stop: StopSignal | None, *, until_caught_up: bool) -> CaptureSummary:
        stop = stop or StopSignal()
        cfg = self.config
        dsn = cfg.connect_dsn()
        started = time.monotonic()
        cap = PgCapture(source=cfg.name, dsn=dsn, log=self.log, tables=cfg.tables, key_columns=cfg.key_columns,
                        partitions=self.partitions, decimal_mode=cfg.decimal_mode,
                        writer_threaded=self.writer_threaded, fault=self.fault, mappers=self.mappers,
                        transaction_metadata=getattr(cfg, "provide_transaction_metadata", False),
                        keep_history=getattr(cfg, "keep_history", ()))
        self.summary = cap.summary
        repl: ReplicationConnection | None = None
        failed = False
        try:
            slot_name, pub = cfg.slot_name, cfg.publication_name
            mode = cfg.snapshot_mode
            cap.prepare_log()
            offset = cap.load_offset()
            if mode is SnapshotMode.INITIAL_ONLY and self.resnapshot is None:
                return self._initial_only(cap, offset, stop, started)
            slots.ensure_publication(cap.conn, pub, list(cap.tables.values()) if cfg.tables else None)
            slot = slots.slot_info(cap.conn, slot_name)
            offset, slot = prepare(cap, offset, slot, slot_name, self.resnapshot)
            resnapshotting = (offset is not None and offset.resnapshot) or self.resnapshot is not None
            if resnapshotting and mode in (SnapshotMode.NEVER, SnapshotMode.INITIAL_ONLY):
                mode = SnapshotMode.INITIAL  # a re-snapshot snapshots, whatever the mode
            snapshot_name: str | None = None
            if offset is not None and offset.phase != "done" and slot is None and mode is not SnapshotMode.ALWAYS \
                    and not offset.resnapshot:
                raise lost_position(cfg.name, lost_reason(offset, slot, slot_name) or "replication slot lost",
                                    redact_dsn(dsn))
            if offset is None and slot is not None and mode is SnapshotMode.NEVER:
                # no snapshot wanted: stream from wherever the existing slot stands
                slots.check_slot_usable(slot, cap.db, dsn, source=cfg.name)
                offset = PgOffset(slot=slot_name, lsn=slot.confirmed_flush_lsn or 0, phase="streaming")
                cap.flush(offset)
            elif offset is None or slot is None or offset.phase == "done":
                if slot is not None:
                    slots.check_slot_usable(slot, cap.db, dsn, source=cfg.name)
                    slots.drop_slot(cap.conn, slot_name)  # no offset depends on it: start clean
                repl = ReplicationConnection(dsn, application_name=f"kappaflow-{cfg.name}")
                created = repl.create_slot(slot_name, export_snapshot=mode is not SnapshotMode.NEVER)
                if mode is SnapshotMode.NEVER:
                    offset = PgOffset(slot=slot_name, lsn=created.consistent_lsn, phase="streaming")
                else:
                    c = created.consistent_lsn
                    # a new slot's snapshot over a log that holds records: delete what it does not read
                    offset = PgOffset(slot=slot_name, lsn=c, phase="snapshot", snapshot=SnapshotProgress(lsn=c),
                                      events=offset.events if offset is not None else 0,
                                      resnapshot=offset is not None)
                    snapshot_name = created.snapshot_name
                cap.flush(offset)  # remember the slot's consistent point before anything else
            else:
                slots.check_slot_usable(slot, cap.db, dsn, source=cfg.name)
                confirmed = slot.confirmed_flush_lsn or 0
                if confirmed > offset.lsn:
                    raise lost_position(cfg.name, lost_reason(offset, slot, slot_name) or "slot ahead of the log",
                                        redact_dsn(dsn))
                if offset.phase == "streaming" and mode is SnapshotMode.ALWAYS:
                    offset.phase = "snapshot"
                    offset.snapshot = SnapshotProgress(lsn=offset.lsn)
            if offset.phase == "snapshot":
                cap.summary.phase = "snapshot"
                PgSnapshotSource(cap, chunk_rows=cfg.snapshot_chunk_rows, progress=self.progress,
                                 snapshot_name=snapshot_name).execute(offset, stop)
                assert offset.snapshot is not None
                if not offset.snapshot.completed:
                    return self._finish(cap, offset, stop, started)
                if offset.resnapshot:  # rows deleted while the position was lost (resnapshot.py, step 4)
                    delete_vanished(cap, offset)
                    offset.resnapshot = False
                offset.phase = "streaming"
                offset.lsn = offset.snapshot.lsn
                cap.flush(offset)
            if stop.is_set():
                return self._finish(cap, offset, stop, started)
            if repl is None:
                repl = ReplicationConnection(dsn, application_name=f"kappaflow-{cfg.name}")
            stream = PgStreamingSource(cap, repl, slot=slot_name, publication=pub,
                                       heartbeat_interval_s=cfg.heartbeat_interval_s,
                                       status_interval_s=self.status_interval_s, batch_records=self.batch_records,
                                       linger_s=self.linger_s,
                                       xmin_fetch_interval_s=getattr(cfg, "xmin_fetch_interval_s", 0.0))
            stream.offset = offset
            if not self.mappers:  # on-demand snapshots and add/remove-table requests (ondemand.py)
                from kappaflow.connectors.ondemand import OnDemandState, channel_for
                from kappaflow.connectors.postgres.ondemand import PgOnDemand

                stream.ondemand = PgOnDemand(stream, OnDemandState.from_dict(offset.ondemand), channel_for(self.log),
                                             chunk_rows=cfg.snapshot_chunk_rows, slot=slot_name)
            try:
                stream.execute(offset, stop, until_caught_up=until_caught_up)
            finally:
                if stream.ondemand is not None:
                    stream.ondemand.close()
            return self._finish(cap, offset, stop, started)
        except BaseException:
            failed = True
            raise
        finally:
            if repl is not None:
                repl.close()
            if failed and cap.writer is not None:
                try:  # keep what is durable; the writer never writes an offset past its data
                    cap.writer.drain(timeout=30)
                except BaseException:
                    pass
            cap.close()

    def _initial_only(self, cap: PgCapture, offset: PgOffset | None, stop: StopSignal,
                      started: float) -> CaptureSummary:
        if offset is not None and offset.phase == "done":
            cap.summary.stopped_reason = "initial_only snapshot already complete"
            return self._finish(cap, offset, stop, started)
        if offset is None or offset.snapshot is None:
            offset = PgOffset(slot="", lsn=-1, phase="snapshot", snapshot=SnapshotProgress(lsn=-1))
        elif offset.phase != "snapshot":
            offset.phase = "snapshot"
            offset.snapshot = SnapshotProgress(lsn=-1)
        cap.summary.phase = "snapshot"
        PgSnapshotSource(cap, chunk_rows=self.config.snapshot_chunk_rows, progress=self.progress).execute(offset, stop)
        assert offset.snapshot is not None
        if offset.snapshot.completed:
            offset.phase = "done"
            cap.flush(offset)
            stop.set("initial_only snapshot complete")
        return self._finish(cap, offset, stop, started)

    def _finish(self, cap: PgCapture, offset: PgOffset, stop: StopSignal, started: float) -> CaptureSummary:
        writer = cap.require_writer()
        writer.drain()
        s = cap.summary
        s.phase = "stopped"
        s.position = lsn_str(max(offset.lsn, 0))
        s.stopped_reason = s.stopped_reason or stop.reason or "done"
        s.elapsed_s = time.monotonic() - started
        s.per_topic = dict(writer.per_topic)
        return s

    def status(self) -> dict[str, Any]:
        return postgres_status(self.config, self.log)


def postgres_status(config: PostgresSourceConfig, log: Log) -> dict[str, Any]:
    """Slot lag, confirmed LSN, stored offset, events captured and topic end offsets.

    Only reads: ``log`` may be a read-only embedded log (a running capture holds the writer lock).
    """
    from kappaflow.connectors.offsets import OFFSETS_TOPIC, OffsetStore

    out: dict[str, Any] = {"source": config.name, "kind": "postgres", "dsn": redact_dsn(config.dsn),
                           "slot": config.slot_name, "publication": config.publication_name}
    topics_now = log.list_topics()
    stored = OffsetStore(log).load(config.name) if OFFSETS_TOPIC in topics_now else None
    offset = PgOffset.from_dict(stored) if stored else None
    out["offset"] = None if offset is None else {
        "phase": offset.phase, "lsn": lsn_str(max(offset.lsn, 0)), "events": offset.events,
        "snapshot_rows": sum(t.rows for t in offset.snapshot.tables.values()) if offset.snapshot else 0,
    }
    out["events_captured"] = 0 if offset is None else offset.events
    try:
        conn = slots.connect(config.connect_dsn(), what="reading source status")
    except SourceError as exc:
        out["error"] = str(exc)
        conn = None
    if conn is not None:
        try:
            info = slots.slot_info(conn, config.slot_name)
            out["slot_state"] = None if info is None else {
                "active": info.active, "active_pid": info.active_pid,
                "confirmed_flush_lsn": None if info.confirmed_flush_lsn is None else lsn_str(info.confirmed_flush_lsn),
                "restart_lsn": None if info.restart_lsn is None else lsn_str(info.restart_lsn),
                "wal_status": info.wal_status, "lag_bytes": info.lag_bytes,
                "current_lsn": lsn_str(info.current_lsn),
            }
            out["lag_bytes"] = None if info is None else info.lag_bytes
            out["confirmed_flush_lsn"] = out["slot_state"]["confirmed_flush_lsn"] if info else None
        finally:
            conn.close()
    topics = {}
    prefix = f"{config.name}."
    for name in sorted(topics_now):
        if name.startswith(prefix) and name != schema_topic(config.name):
            topics[name] = sum(log.end_offsets(name).values())
    out["topics"] = topics
    return out
