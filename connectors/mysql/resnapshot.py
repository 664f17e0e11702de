"""MySQL/MariaDB: purged binlog positions and ``kappaflow capture --resnapshot`` (``connectors/resnapshot.py``).

The position is lost when the binlog file of the stored resume point is no longer on the server
and the GTID set cannot lead back into the remaining files (the server answers error 1236). The
re-snapshot, in crash-safe steps:

1. :func:`prepare` points the offset at the server's current binlog position ``S`` (streaming
   restarts there), starts a full snapshot, and records ``resnapshot = S``; the connector stores it
   before reading anything. From then on any run -- plain ``capture`` included -- resumes it;
2. the usual watermark snapshot (``snapshot.py``) reads every table in chunks while streaming from
   ``S`` goes on; a crash resumes from the next chunk;
3. :class:`ResnapshotSource` then streams up to a fresh high watermark ``H`` and, for every key
   whose latest record in its topic is older than ``S`` (neither a chunk read it nor the stream
   changed it: the row was deleted while the position was lost), writes a delete (the row as the
   log last held it) and a tombstone at ``(H, snapshot, n)``: after everything streamed before
   ``H``, before everything streamed from it. Idempotent: the keys come from the log;
4. the offset switches to streaming (``resnapshot`` cleared).
"""

from __future__ import annotations

from typing import Any

import orjson

from kappaflow.connectors.base import OP_HEADER, POSITION_HEADER, StopSignal, TrustedRecord, tail_positions
from kappaflow.connectors.mysql.engine import CaptureEngine
from kappaflow.connectors.mysql.offset import MySQLOffset, SnapshotProgress
from kappaflow.connectors.mysql.server import ServerInfo, master_status
from kappaflow.connectors.mysql.snapshot import MySQLSnapshotSource, _db_table
from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.mysql.writer import now_ms
from kappaflow.connectors.resnapshot import ResnapshotRequest, delete_value, last_values, stale_keys
from kappaflow.errors import Retry, SourceError

__all__ = ["ResnapshotSource", "delete_vanished", "prepare"]

_OP_D = (OP_HEADER, b"d")


def prepare(source: str, offset: MySQLOffset | None, server: ServerInfo, files: list[str], tables: list[str],
            request: ResnapshotRequest | None) -> MySQLOffset | None:
    """Step 1 of the module docstring; the offset the connector runs with.

    Without ``request`` (a plain ``capture``) the offset is left as it is (a re-snapshot in progress
    resumes through its ``resnapshot`` field). With it: a purged resume point is replaced; a resume
    point still on the server is refused unless ``request.force``; one in progress is resumed.
    """
    if offset is not None and offset.resnapshot is not None and offset.phase == "snapshot":
        if request is not None:
            request.started = True
            request.say(f"re-snapshot of {source!r}: resuming the one in progress (streaming from "
                        f"{offset.resnapshot.get('file')}:{offset.resnapshot.get('pos')})")
        return offset
    if request is None:
        return offset
    if offset is not None and offset.phase == "done":
        raise SourceError(f"source {source!r}: --resnapshot: the source's snapshot_mode is initial_only (a one-off "
                          "snapshot, no binlog position to lose); to snapshot again, reset the source's offsets",
                          retry=Retry.TERMINAL)
    if offset is None or offset.file in files:
        if request.started:  # this command re-snapshotted already; a retry streams on
            return offset
        if offset is None:
            raise SourceError(
                f"source {source!r}: --resnapshot: nothing was captured yet, so no position can be lost; run "
                f"`kappaflow capture {source}` (a first capture snapshots every table)", retry=Retry.TERMINAL)
        if not request.force:
            raise SourceError(
                f"source {source!r}: --resnapshot refused: the resume point {offset.file}:{offset.pos} is still in "
                f"the server's binary logs ({files[0]}..{files[-1]}), so no change is lost and `kappaflow capture "
                f"{source}` resumes where it stopped. A re-snapshot re-reads every table; add --force to do it "
                "anyway", retry=Retry.TERMINAL)
        reason = "--force"
    else:
        reason = f"binlog file {offset.file!r} of the resume point was purged"
    request.started = True
    start = {"file": server.binlog_file, "pos": server.binlog_pos, "gtid": server.gtid_executed}
    offset.file, offset.pos, offset.gtid = server.binlog_file, server.binlog_pos, server.gtid_executed
    offset.stream_start = dict(start)
    offset.phase = "snapshot"
    offset.snapshot = SnapshotProgress(list(tables))
    offset.resnapshot = dict(start)
    request.say(f"re-snapshot of {source!r} ({reason}): streaming from {start['file']}:{start['pos']} with a full "
                "snapshot")
    return offset


class ResnapshotSource(MySQLSnapshotSource):
    """The watermark snapshot, then the deletes of step 3, then streaming (module docstring)."""

    def execute(self, offset: Any, stop: StopSignal) -> MySQLOffset:
        eng = self.engine
        assert isinstance(offset, MySQLOffset) and offset.snapshot is not None
        prog = offset.snapshot
        eng.touched = {_db_table(t): set() for t in prog.tables[prog.index:]}
        try:
            while not prog.done:
                if stop.is_set() or not self._chunk(prog, stop):
                    return offset
        finally:
            eng.touched = None
        if offset.resnapshot is not None:
            if not delete_vanished(eng, offset, stop):
                return offset
            offset.resnapshot = None
        offset.phase = "streaming"
        offset.snapshot = prog
        eng.checkpoint(force_save=True, drain=True)
        return offset


def delete_vanished(eng: CaptureEngine, offset: MySQLOffset, stop: StopSignal) -> bool:
    """Step 3: a delete + tombstone for every key older than the re-snapshot; False when stopped first."""
    assert offset.resnapshot is not None and offset.snapshot is not None
    start = BinlogPosition(str(offset.resnapshot["file"]), int(offset.resnapshot["pos"]), 0, None, None,
                           snapshot=True)
    with eng.ctl.cursor() as cur:
        hfile, hpos = master_status(cur)
    if not eng.pump_until(hfile, hpos, stop):
        return False
    eng.checkpoint(force_save=True, drain=True)  # the log holds everything before H
    prog = offset.snapshot
    topics = [eng.tracker.topic(*_db_table(t)) for t in prog.tables]
    row = prog.rows
    for tail in tail_positions(eng.log, topics).values():  # a crashed run may have used rows at this H
        if isinstance(tail, BinlogPosition) and tail.snapshot and (tail.file, tail.pos) == (hfile, hpos):
            row = max(row, tail.row + 1)
    sid = eng.server.server_id
    ts = now_ms()
    writer = eng.writer
    for topic in topics:
        if topic not in eng.log.list_topics():
            continue
        for p in range(writer.ensure_topic(topic)):
            stale = stale_keys(eng.log, topic, p, start)
            for key, last in last_values(eng.log, topic, p, stale):
                pos = BinlogPosition(hfile, hpos, row, None, sid, snapshot=True)
                row += 1
                ph = (POSITION_HEADER, orjson.dumps(pos.to_dict()))
                value = delete_value(last, pos, ts, {"file": hfile, "pos": hpos, "row": pos.row, "gtid": None,
                                                     "server_id": sid, "thread": None, "query": None,
                                                     "txId": None})
                if value is not None:
                    writer._add(topic, None, TrustedRecord(key, value, (_OP_D, ph)))
                writer._add(topic, None, TrustedRecord(key, None, (_OP_D, ph)))
                writer.events += 1
                writer.last_position = pos
            if stale:
                prog.rows = row
                eng.checkpoint(force_save=True)  # one partition at a time: only its keys are held in memory
    eng.checkpoint(force_save=True, drain=True)
    return True
