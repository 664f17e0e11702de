"""PostgreSQL: lost replication slots and ``kappaflow capture --resnapshot`` (``connectors/resnapshot.py``).

A slot is lost when it is missing (dropped underneath kappaflow), invalidated (``wal_status =
lost``: ``max_slot_wal_keep_size`` was exceeded and the WAL it needed removed), or past the
offset stored in the log (another consumer advanced it). The re-snapshot, in crash-safe steps:

1. :func:`prepare` stores the offset with ``resnapshot = true`` (durable) and only then drops the
   old slot. From here on any run -- plain ``capture`` included -- knows a re-snapshot was asked
   for, and replaces whatever slot it finds (a new one created by a run killed before step 2's
   offset was stored, too);
2. the connector creates a new slot with an exported snapshot (consistent point ``C``, past every
   position in the log) and stores ``phase = snapshot, lsn = C, resnapshot = true``;
3. the usual chunked snapshot (``snapshot.py``) writes every row as ``op=r`` at ``(C, snapshot,
   i)``; a crash resumes it from the next chunk, as for a first snapshot;
4. :func:`delete_vanished` writes a delete and a tombstone, at ``(C, snapshot, i)`` after the
   snapshot's rows, for every key whose latest record is older than ``C`` (the row was deleted
   while the slot was lost); idempotent, since the keys come from the log;
5. the offset switches to streaming at ``C`` (``resnapshot`` cleared) and streaming starts.
"""

from __future__ import annotations

import time

import orjson

from kappaflow.connectors.base import TrustedRecord
from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres.context import PgCapture
from kappaflow.connectors.postgres.offset import PgOffset
from kappaflow.connectors.postgres.replication import lsn_str, redact_dsn
from kappaflow.connectors.postgres.slots import SlotInfo
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.connectors.resnapshot import ResnapshotRequest, stale_keys, vanished_rows
from kappaflow.errors import Retry, SourceError

__all__ = ["delete_vanished", "lost_reason", "prepare"]

_OP_D = ("kf.op", b"d")
_HEADERS_D = (_OP_D,)


def lost_reason(offset: PgOffset | None, slot: SlotInfo | None, slot_name: str) -> str | None:
    """Why the slot can no longer deliver every change after the stored offset (None: it can)."""
    if offset is None or offset.phase == "done":
        return None  # nothing streamed from a slot yet (or initial_only): nothing to lose
    if slot is None:
        return f"replication slot {slot_name!r} is gone (dropped?) but the log holds changes up to " \
               f"{lsn_str(max(offset.lsn, 0))}"
    if slot.invalidated:
        return (f"replication slot {slot_name!r} was invalidated (wal_status={slot.wal_status}): the WAL it "
                "needed was removed (max_slot_wal_keep_size exceeded?)")
    confirmed = slot.confirmed_flush_lsn or 0
    if confirmed > offset.lsn:
        return (f"replication slot {slot_name!r} is at {lsn_str(confirmed)}, past the offset stored in the log "
                f"({lsn_str(max(offset.lsn, 0))}): another consumer advanced it, or the offsets were restored "
                "from an older copy")
    return None


def _inactive(cap: PgCapture, slot: SlotInfo) -> SlotInfo | None:
    """``slot`` once no process uses it (None: it is gone); SourceError (transient) if one keeps it.

    A capture that just stopped (or was killed) keeps its slot active while its walsender exits.
    """
    deadline = time.monotonic() + slots.RELEASE_WAIT_S
    now: SlotInfo | None = slot
    while now is not None and now.active and time.monotonic() < deadline:
        time.sleep(0.1)
        now = slots.slot_info(cap.conn, slot.name)
    if now is not None and now.active:
        raise SourceError(
            f"replication slot {slot.name!r} is in use by another process (PID {now.active_pid}): stop the "
            f"other capture first; the re-snapshot replaces the slot [{redact_dsn(cap.dsn)}]",
            retry=Retry.TRANSIENT)
    return now


def _drop(cap: PgCapture, slot: SlotInfo) -> None:
    if _inactive(cap, slot) is not None:
        slots.drop_slot(cap.conn, slot.name)


def prepare(cap: PgCapture, offset: PgOffset | None, slot: SlotInfo | None, slot_name: str,
            request: ResnapshotRequest | None) -> tuple[PgOffset | None, SlotInfo | None]:
    """Steps 1 (and the restart of step 2) of the module docstring; the connector's ``(offset, slot)``.

    Without ``request`` (a plain ``capture``): only a re-snapshot asked for earlier and not started
    yet (offset ``resnapshot`` outside the snapshot phase) is carried on. With ``request``: a lost
    slot is replaced; a healthy one is refused unless ``request.force``; a re-snapshot already in
    its snapshot phase with a usable slot is resumed.
    """
    source = cap.source
    if offset is not None and offset.resnapshot:
        if offset.phase != "snapshot":  # asked for, slot not replaced yet: whatever slot is there goes
            if slot is not None:
                _drop(cap, slot)
            if request is not None:
                request.started = True
                request.say(f"re-snapshot of {source!r}: continuing the one asked for earlier (new slot "
                            f"{slot_name!r})")
            return offset, None
        if slot is not None and not slot.invalidated and (slot.confirmed_flush_lsn or 0) <= offset.lsn:
            if request is not None:
                request.started = True
                request.say(f"re-snapshot of {source!r}: resuming the one in progress (slot {slot_name!r} at "
                            f"{lsn_str(offset.lsn)})")
            return offset, slot
    if request is None:
        return offset, slot
    if offset is not None and offset.phase == "done":
        raise SourceError(f"source {source!r}: --resnapshot: the source's snapshot_mode is initial_only (a one-off "
                          "snapshot, no slot to lose); to snapshot again, reset the source's offsets",
                          retry=Retry.TERMINAL)
    reason = lost_reason(offset, slot, slot_name)
    if reason is None:
        if request.started:  # this command re-snapshotted already; a retry streams on
            return offset, slot
        if offset is None:
            raise SourceError(
                f"source {source!r}: --resnapshot: nothing was captured yet, so no position can be lost; run "
                f"`kappaflow capture {source}` (a first capture snapshots every table)", retry=Retry.TERMINAL)
        if not request.force:
            state = "" if slot is None else f", wal_status={slot.wal_status}"
            raise SourceError(
                f"source {source!r}: --resnapshot refused: replication slot {slot_name!r} is healthy (confirmed "
                f"{lsn_str((slot.confirmed_flush_lsn or 0) if slot else 0)}{state}; the log holds changes up to "
                f"{lsn_str(max(offset.lsn, 0))}), so no change is lost and `kappaflow capture {source}` resumes "
                "where it stopped. A re-snapshot re-reads every table; add --force to do it anyway",
                retry=Retry.TERMINAL)
        reason = "--force"
    request.started = True
    if offset is None:
        request.say(f"re-snapshot of {source!r}: nothing captured yet, so this is a first snapshot")
        return offset, slot
    if slot is not None and _inactive(cap, slot) is None:  # nothing written while another capture holds it
        slot = None
    # step 1: the request is durable before the old slot goes
    offset.resnapshot = True
    cap.flush(offset)
    cap.require_writer().drain()
    if slot is not None:
        _drop(cap, slot)
    request.say(f"re-snapshot of {source!r} ({reason}): old slot dropped; a new slot {slot_name!r} and a full "
                "snapshot follow")
    return offset, None


def delete_vanished(cap: PgCapture, offset: PgOffset) -> int:
    """Step 4: a delete + tombstone for every key the snapshot did not read; returns how many."""
    snap = offset.snapshot
    assert snap is not None
    c = snap.lsn
    start = PgPosition(c, 0, True)
    writer = cap.require_writer()
    cap.flush(offset)
    writer.drain()  # every snapshot row is in the log before the keys are read from it
    now_ms = int(time.time() * 1000)
    times = b'"ts_ms":%d,"ts_us":%d,"ts_ns":%d' % (now_ms, now_ms * 1000, now_ms * 1_000_000)
    deleted = 0
    for info in cap.tables.values():
        if info.qualified in cap.mappers:
            continue  # append-only tables mapped to records: nothing is deleted there
        tc = cap.codec_for(info, PgPosition(c, snap.next_index, True))
        topic = tc.topic
        nparts = cap.topic_partitions.get(topic) or cap._ensure_topic(topic)
        pfx = tc.source_prefix(now_ms, "true", None, c)
        for p in range(nparts):
            stale = stale_keys(cap.log, topic, p, start)
            if not stale:
                continue
            recs = cap.pending.by_topic.setdefault(topic, [])
            for key, row, unavailable in vanished_rows(cap.log, topic, p, stale):
                idx = snap.next_index
                snap.next_index = idx + 1
                if row is not None:
                    extra = b',"kf_unavailable":' + orjson.dumps(unavailable) if unavailable else b""
                    value = (b'{"before":%s,"after":null,"source":%s%d,"snapshot":true}},"transaction":null,'
                             b'"op":"d",%s,"kf_resnapshot":true%s}' % (orjson.dumps(row), pfx, idx, times, extra))
                    recs.append(TrustedRecord(key, value, _HEADERS_D))
                    deleted += 1
                pos = b'{"kind":"pg","lsn":%d,"index":%d,"snapshot":true}' % (c, idx)
                recs.append(TrustedRecord(key, None, (_OP_D, ("kf.pos", pos))))
                cap.pending.count += 2 if row is not None else 1
            cap.summary.events += len(stale)
            offset.events += len(stale)
            cap.flush(offset)  # one partition at a time: only its keys are held in memory
    writer.drain()
    return deleted
