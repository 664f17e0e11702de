"""Streaming source: pgoutput over the replication protocol, in commit order, into the log.

Commit protocol (acknowledge upstream last) — for every batch of transactions:

1. decode the transactions' messages into records (nothing is acknowledged yet;
   a crash here loses only in-memory work: the server re-sends it);
2. the writer appends each topic's records (schema-change records first) — each
   append is durable when it returns (``CaptureWriter`` step 2);
3. the writer appends the offset: ``lsn`` = end LSN of the batch's last complete
   transaction (step 3);
4. the writer publishes that LSN as durable (step 4), and only then
5. a standby status update reports it as *flushed* to the server, which may now
   advance ``confirmed_flush_lsn`` and recycle WAL before it.

After a crash between 2 and 3 the restart re-streams from the previous offset;
records whose position is at or below the last position already in their
topic-partition are skipped (``PgCapture.is_duplicate``), so nothing is written
twice. After a crash between 3 and 5 the server re-sends from its older
confirmed LSN, but streaming starts at the stored offset (START_REPLICATION with
the newer LSN skips transactions committed before it) and the duplicate check
covers the rest.

Idle and filtered tables: when no transaction is in flight and nothing is
pending, the LSN of a keepalive or of kappaflow's own heartbeat message
(``pg_logical_emit_message``, written every ``heartbeat_interval_s``) is stored
as the offset and then acknowledged, so the slot keeps advancing and WAL does
not pile up behind it.

Positions: ``PgPosition(commit_lsn, index)`` where ``index`` counts the events
the transaction produced (a primary-key change produces a delete at ``index``
and a create at ``index + 1``; a delete's tombstone shares the delete's position).
"""

from __future__ import annotations

import struct
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson

from kappaflow.connectors.base import StopSignal, StreamingSource, TrustedRecord
from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres.context import PgCapture
from kappaflow.connectors.postgres.decoder import (
    UNCHANGED,
    LogicalMessage,
    PgOutputDecoder,
    Relation,
    Truncate,
    TypeMessage,
    parse_tuple,
)
from kappaflow.connectors.postgres.offset import PgOffset
from kappaflow.connectors.postgres.replication import (
    KEEPALIVE,
    PG_EPOCH_US,
    XLOGDATA,
    ReplicationConnection,
    lsn_str,
    parse_keepalive,
)
from kappaflow.connectors.postgres.rows import TableCodec
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.connectors.postgres.toast import TOAST_ROW_MIN, load_from_log
from kappaflow.connectors.transactions import transaction_records
from kappaflow.connectors.truncate import live_rows, truncate_records
from kappaflow.errors import SourceError, ValidationError
from kappaflow.log.partitioner import partition_for

__all__ = ["PgStreamingSource"]

_u32 = struct.Struct(">I").unpack_from
_begin = struct.Struct(">QqI").unpack_from
_commit = struct.Struct(">BQQq").unpack_from
_xlog_start = struct.Struct(">Q").unpack_from

_OP_C = ("kf.op", b"c")
_OP_U = ("kf.op", b"u")
_OP_D = ("kf.op", b"d")
_OP_T = ("kf.op", b"t")
_HEADERS_C = (_OP_C,)
_HEADERS_U = (_OP_U,)
_HEADERS_D = (_OP_D,)
_SENT = b"sent:"  # heartbeat content: the capture's wall time (ms) when it wrote the heartbeat
_MISSING: Any = object()


def _times(now_ms: int) -> bytes:
    """The envelope's processing time in Debezium 2.6+'s three units."""
    return b'"ts_ms":%d,"ts_us":%d,"ts_ns":%d' % (now_ms, now_ms * 1000, now_ms * 1_000_000)


class PgStreamingSource(StreamingSource):
    def __init__(self, cap: PgCapture, repl: ReplicationConnection, *, slot: str, publication: str,
                 heartbeat_interval_s: float = 10.0, status_interval_s: float = 1.0,
                 batch_records: int = 20_000, linger_s: float = 0.05, xmin_fetch_interval_s: float = 0.0) -> None:
        self.cap = cap
        self.xmin_fetch_interval_s = xmin_fetch_interval_s
        self.xmin: int | None = None  # the slot's xmin as last read (source.xmin), None when not read
        self.repl = repl
        self.slot = slot
        self.publication = publication
        self.heartbeat_interval_s = heartbeat_interval_s
        self.status_interval_s = status_interval_s
        self.batch_records = batch_records
        self.linger_s = linger_s
        self.decoder = PgOutputDecoder()
        self.rels: dict[int, TableCodec | None] = {}
        self.acked = 0
        self.heartbeat_prefix = f"{slots.HEARTBEAT_PREFIX}:{slot}"
        # transaction state
        self.in_tx = False
        self.tx_lsn = 0
        self.tx_ts_ms = 0
        self.tx_xid = 0
        self.tx_id = b""
        self.index = 0
        self.dco: dict[str, int] = {}
        self.prefixes: dict[int, tuple[bytes, bytes, bytes]] = {}
        self.tx_last_commit = 0  # commit LSN of the transaction before this one (Debezium's sequence)
        self.dedup = False
        self.complete_end = 0  # end LSN of the last complete transaction in the pending batch
        self.complete_txs = 0  # transactions completed in the pending batch, and the last one's commit time
        self.complete_ts_ms: int | None = None
        self.duplicates = 0
        self.events = 0  # events emitted since the last flush (added to the offset and summary there)
        self._where_lsn = -1  # mapped tables: the transaction named in error messages
        self._where = ""
        # on-demand snapshots (ondemand.py): the driver, and every Relation message met (add-table)
        self.ondemand: Any = None
        self.relations: dict[int, Relation] = {}

    # -- main loop ------------------------------------------------------------------------------
    def execute(self, offset: Any, stop: StopSignal, *, until_caught_up: bool = False) -> PgOffset:
        assert isinstance(offset, PgOffset)
        cap = self.cap
        writer = cap.require_writer()
        self.offset = offset
        self.acked = offset.lsn
        self.repl.start(self.slot, offset.lsn, [self.publication])
        marker: bytes | None = None
        if until_caught_up:
            nonce = uuid.uuid4().hex
            marker = f"caughtup:{nonce}".encode()
            slots.emit_heartbeat(cap.conn, self.slot, marker.decode())
        self.caught_up = False
        self.reply_now = False
        now = time.monotonic()
        next_status = now + self.status_interval_s
        next_heartbeat = now + self.heartbeat_interval_s
        next_xmin = now if self.xmin_fetch_interval_s > 0 else float("inf")
        last_idle_save = 0.0
        self.idle_candidate = 0
        summary = cap.summary
        summary.phase = "streaming"
        process = self._process
        while not stop.is_set():
            msgs = self.repl.read_many(0.1 if cap.pending or writer.pending else 0.5, 8192)
            if msgs:
                process(msgs, int(time.time() * 1000), marker)
            writer.check()
            now = time.monotonic()
            if self.ondemand is not None:
                self.ondemand.tick(now)
            pending = cap.pending
            if pending and not self.in_tx:
                if (pending.count >= self.batch_records or not msgs
                        or now - pending.started >= self.linger_s or self.caught_up):
                    self._flush()
            elif self.in_tx and pending.count >= 4 * self.batch_records:
                self._flush(partial=True)  # huge transaction: write what we have, ack nothing yet
            durable = writer.durable_token
            if durable is not None and durable > self.acked:
                self.acked = durable
                self.repl.send_status(durable)
                next_status = now + self.status_interval_s
                summary.position = summary.acknowledged = lsn_str(durable)  # live, for progress lines
            elif now >= next_status or self.reply_now:
                self.repl.send_status(self.acked)
                next_status = now + self.status_interval_s
            self.reply_now = False
            if (self.idle_candidate > self.acked and not self.in_tx and not cap.pending and writer.pending == 0
                    and now - last_idle_save >= min(1.0, self.heartbeat_interval_s)):
                last_idle_save = now
                self.offset.lsn = max(self.offset.lsn, self.idle_candidate)
                cap.flush(self.offset, token=self.idle_candidate, cut=not self.in_tx)
            if now >= next_heartbeat:
                # the send time rides along: its round trip is the source lag when idle (_other)
                slots.emit_heartbeat(cap.conn, self.slot, _SENT.decode() + str(int(time.time() * 1000)))
                next_heartbeat = now + self.heartbeat_interval_s
            if now >= next_xmin:  # used by the transactions that begin from now on
                self.xmin = slots.slot_xmin(cap.conn, self.slot)
                next_xmin = now + self.xmin_fetch_interval_s
            if self.caught_up and not self.in_tx and not cap.pending:
                writer.drain()
                durable = writer.durable_token
                if durable is not None and durable > self.acked:
                    self.acked = durable
                self.repl.send_status(self.acked)
                stop.set("caught up")
        # clean stop: write what was decoded; a partial transaction's records are covered by the
        # duplicate check when the server re-sends the transaction, and the offset names the
        # last complete one
        if cap.pending:
            self._flush()
        writer.drain()
        durable = writer.durable_token
        if durable is not None and durable > self.acked:
            self.acked = durable
        try:
            self.repl.send_status(self.acked)
        except SourceError:
            pass
        summary.duplicates_skipped += self.duplicates
        summary.acknowledged = lsn_str(self.acked)
        return self.offset

    def _flush(self, partial: bool = False) -> None:
        cap = self.cap
        self._count_events()
        if partial:
            # offset still names the previous complete transaction; the duplicate check
            # covers the part written now if we crash before this transaction completes
            cap.flush(self.offset, token=None, cut=False)
            return
        token = self.complete_end or None
        cap.flush(self.offset, token=token, transactions=self.complete_txs, commit_ts_ms=self.complete_ts_ms,
                  cut=not self.in_tx)  # a clean stop inside a transaction writes its part, no cut
        self.complete_end = 0
        self.complete_txs = 0
        self.complete_ts_ms = None

    def _count_events(self) -> None:
        if self.events:
            self.cap.summary.events += self.events
            self.offset.events += self.events
            self.events = 0

    # -- messages ----------------------------------------------------------------------------------
    def _process(self, msgs: list[bytes], now_ms: int, marker: bytes | None) -> None:
        """The hot loop: Begin/Commit and plain Insert/Update handled inline, with locals.

        Same behaviour as calling :meth:`_handle` per message (which handles everything
        else); the transaction counters live in locals and are written back before any
        other method runs.
        """
        rels = self.rels
        cap = self.cap
        pending = cap.pending
        by_topic = pending.by_topic
        index = self.index
        events = self.events
        count = 0
        tx_lsn = self.tx_lsn
        tx_id = self.tx_id
        dedup = self.dedup
        dco = self.dco
        prefixes = self.prefixes
        times = _times(now_ms)
        for m in msgs:
            if m[0] == XLOGDATA:
                tag = m[25]
                if tag == 73 or tag == 85:  # 'I' / 'U' with only a new tuple
                    tc = rels.get(_u32(m, 26)[0], _MISSING)
                    if tc is None:
                        continue
                    r = None
                    if tc is not _MISSING and m[30] == 78 and tc.mapper is None:
                        try:
                            r = tc.fast_json(m, 31)
                        except Exception:
                            r = None
                    if r is not None and r[2] == len(m):
                        after, key, _end, big = r
                        state = tc.toast_state
                        if state is not None:
                            if big and len(m) >= TOAST_ROW_MIN:
                                tc.remember_all(key, tc.fast(m, 31)[0])
                            elif state and tag == 85:
                                state.pop(key, None)
                        idx = index
                        index += 1
                        topic = tc.topic
                        d = dco.get(topic, 0) + 1  # counted when skipped too: the same orders on re-read
                        dco[topic] = d
                        if dedup and cap.is_duplicate(topic, key, (tx_lsn, 1, idx)):
                            self.duplicates += 1
                            continue
                        prefix = prefixes.get(tc.relid)
                        if prefix is None:
                            prefix = self._prefix(tc)
                        cl = _xlog_start(m, 1)[0]
                        value = (b'{"before":null,"after":%s,"source":%s%d%s%d%s%d,"snapshot":false}},"transaction":'
                                 b'{"id":"%s","total_order":%d,"data_collection_order":%d},"op":"%s",%s}' % (
                                     after, prefix[0], cl, prefix[1], cl, prefix[2], idx, tx_id, idx + 1, d,
                                     b"c" if tag == 73 else b"u", times))
                        headers = _HEADERS_C if tag == 73 else _HEADERS_U
                        recs = by_topic.get(topic)
                        if recs is None:
                            recs = by_topic[topic] = []
                        recs.append(TrustedRecord(key, value, headers))
                        count += 1
                        events += 1
                        continue
                elif tag == 66:  # 'B'
                    self._begin_tx(m)
                    index = 0
                    tx_lsn, tx_id, dco, prefixes, dedup = self.tx_lsn, self.tx_id, self.dco, self.prefixes, self.dedup
                    continue
                elif tag == 67:  # 'C'
                    self._commit_tx(m)
                    if pending.count + count >= self.batch_records:  # a full batch: hand it over now
                        self.index = index
                        self.events = events
                        pending.count += count
                        count = 0
                        self._flush()
                        events = self.events
                        pending = cap.pending
                        by_topic = pending.by_topic
                    continue
            # everything else: write the counters back, take the general path, reload
            self.index = index
            self.events = events
            pending.count += count
            count = 0
            self._handle(m, now_ms, marker)
            index = self.index
            events = self.events
            pending = cap.pending
            by_topic = pending.by_topic
            tx_lsn = self.tx_lsn
            tx_id = self.tx_id
            dedup = self.dedup
            dco = self.dco
            prefixes = self.prefixes
        self.index = index
        self.events = events
        pending.count += count

    def _handle(self, m: bytes, now_ms: int, marker: bytes | None) -> None:
        if m[0] != XLOGDATA:
            if m[0] == KEEPALIVE:
                wal_end, reply = parse_keepalive(m)
                if not self.in_tx:
                    self.idle_candidate = max(self.idle_candidate, wal_end)
                if reply:
                    self.reply_now = True  # the server wants a status update now (wal_sender_timeout)
            return
        tag = m[25]
        if tag == 73:  # 'I'
            self._insert(m, now_ms)
        elif tag == 85:  # 'U'
            self._update(m, now_ms)
        elif tag == 68:  # 'D'
            self._delete(m, now_ms)
        elif tag == 66:  # 'B'
            self._begin_tx(m)
        elif tag == 67:  # 'C'
            self._commit_tx(m)
        else:
            self._other(m, marker)

    def _begin_tx(self, m: bytes) -> None:
        """A Begin message: the transaction's position, id and per-transaction counters."""
        final_lsn, ts, xid = _begin(m, 26)
        self.in_tx = True
        self.tx_lsn = final_lsn
        self.tx_ts_ms = (ts + PG_EPOCH_US) // 1000
        self.tx_xid = xid
        self.tx_id = b"%d:%d" % (xid, final_lsn)
        self.tx_last_commit = self.offset.last_commit_lsn or 0
        self.index = 0
        self.dco = {}
        self.prefixes = {}
        self.dedup = not self.cap.past_duplicates((final_lsn, 1, 0))

    def _commit_tx(self, m: bytes) -> None:
        """A Commit message: the offset moves past the transaction (flushed later, in batches)."""
        _flags, commit_lsn, end_lsn, ts = _commit(m, 26)
        if self.cap.transaction_topic is not None and self.dco:
            self._transaction_records((ts + PG_EPOCH_US) // 1000)
        self.in_tx = False
        off = self.offset
        off.lsn = end_lsn
        off.last_commit_lsn = commit_lsn
        self.complete_end = end_lsn
        self.complete_txs += 1
        self.complete_ts_ms = (ts + PG_EPOCH_US) // 1000

    def _transaction_records(self, commit_ts_ms: int) -> None:
        """BEGIN/END on the transaction topic (``connectors/transactions.py``), at the commit LSN."""
        cap = self.cap
        topic = cap.transaction_topic
        assert topic is not None
        tx_id = self.tx_id.decode()
        if self.dedup and cap.is_duplicate(topic, orjson.dumps({"id": tx_id}), (self.tx_lsn, 1, 0)):
            self.duplicates += 2
            return
        n = len(cap.source) + 1
        counts = {t[n:]: c for t, c in self.dco.items()}
        pos = b'{"kind":"pg","lsn":%d,"index":%%d,"snapshot":false}' % self.tx_lsn
        recs = cap.pending.by_topic.get(topic)
        if recs is None:
            recs = cap.pending.by_topic[topic] = []
        recs.extend(transaction_records(tx_id, self.tx_ts_ms, commit_ts_ms, counts, pos % 0,
                                        pos % sum(counts.values())))
        cap.pending.count += 2

    def _other(self, m: bytes, marker: bytes | None) -> None:
        start = _xlog_start(m, 1)[0]
        msg = self.decoder.decode(m[25:], start)
        if isinstance(msg, Relation):
            self._relation(msg)
        elif isinstance(msg, TypeMessage):
            self.cap.types.invalidate(msg.oid)
        elif isinstance(msg, Truncate):
            self._truncate(msg, start)
        elif isinstance(msg, LogicalMessage) and msg.prefix == self.heartbeat_prefix and not msg.transactional:
            if not self.in_tx:
                self.idle_candidate = max(self.idle_candidate, msg.lsn)
                if msg.content.startswith(_SENT) and not self.cap.pending and self.cap.require_writer().pending == 0:
                    try:
                        sent = int(msg.content[len(_SENT):])
                    except ValueError:
                        sent = None
                    if sent is not None:  # idle: nothing decoded waits for the log
                        self.cap.summary.source_lag_ms = max(0.0, time.time() * 1000 - sent)
            if marker is not None and msg.content == marker:
                self.caught_up = True
        elif (isinstance(msg, LogicalMessage) and self.ondemand is not None and not msg.transactional
              and msg.prefix == self.ondemand.prefix):
            if not self.in_tx:  # like a heartbeat: the slot may advance past it when idle
                self.idle_candidate = max(self.idle_candidate, msg.lsn)
            self.ondemand.on_message(msg)
        elif isinstance(msg, LogicalMessage) and (mapper := self.cap.mappers.get(f"message:{msg.prefix}")):
            self._outbox_message(mapper, msg)
        # Origin messages and other applications' logical messages carry nothing kappaflow needs

    def _outbox_message(self, mapper: Any, msg: LogicalMessage) -> None:
        """A ``pg_logical_emit_message`` routed as an outbox event (``connectors/postgres/outbox.py``):
        a transactional one at its transaction's position, a non-transactional one at its own LSN."""
        if msg.transactional and self.in_tx:
            pos = PgPosition(self.tx_lsn, self.index)
            self.index += 1
        else:
            pos = PgPosition(msg.lsn, 0)
        if self.cap.emit_record(mapper, mapper.map_message(msg.content, pos, f"WAL {lsn_str(pos.lsn)}")):
            self.events += 1
        else:
            self.duplicates += 1

    def _relation(self, rel: Relation) -> None:
        cap = self.cap
        self.relations[rel.relid] = rel
        info = cap.table_info(rel.namespace, rel.name)
        if info is None:
            self.rels[rel.relid] = None  # published but not captured
            return
        tc = cap.codecs.get(info.qualified)
        if tc is None or not tc.same_shape(rel.columns):
            tc = TableCodec.from_relation(rel.columns, info=info, relid=rel.relid,
                                          replica_identity=rel.replica_identity, source=cap.source, db=cap.db,
                                          codec=cap.codec, lookup=cap.types,
                                          native_of=cap.types.format_type)
            cap.install_codec(tc, PgPosition(self.tx_lsn if self.in_tx else self.offset.lsn, self.index))
        tc.replica_identity = rel.replica_identity
        tc.ident_idx = tuple(i for i, c in enumerate(rel.columns) if c.key)
        self.rels[rel.relid] = tc
        self.prefixes.pop(rel.relid, None)

    def _codec(self, m: bytes) -> TableCodec | None:
        relid = _u32(m, 26)[0]
        try:
            return self.rels[relid]
        except KeyError:
            raise ValidationError(f"pgoutput row message for relation {relid} before its Relation message "
                                  f"(at WAL position {lsn_str(_xlog_start(m, 1)[0])})") from None

    def _prefix(self, tc: TableCodec) -> tuple[bytes, bytes, bytes]:
        p = self.prefixes.get(tc.relid)
        if p is None:
            p = self.prefixes[tc.relid] = tc.source_parts(self.tx_ts_ms, "false", self.tx_xid, self.tx_lsn,
                                                          self.tx_last_commit, self.xmin)
        return p

    def _tuple(self, m: bytes, pos: int, what: str) -> tuple[tuple[Any, ...], int]:
        try:
            return parse_tuple(m, pos)
        except Exception:
            self.decoder.decode(m[25:], _xlog_start(m, 1)[0])  # raises the precise ValidationError
            raise

    def _emit(self, tc: TableCodec, key: bytes, op: bytes, header: tuple[str, bytes], before: bytes,
              after: bytes, unavailable: list[str] | None, now_ms: int, change_lsn: int) -> None:
        idx = self.index
        self.index = idx + 1
        topic = tc.topic
        dco = self.dco.get(topic, 0) + 1  # counted when skipped too: the same orders on re-read
        self.dco[topic] = dco
        if self.dedup and self.cap.is_duplicate(topic, key, (self.tx_lsn, 1, idx)):
            self.duplicates += 1
            return
        a, b, c = self.prefixes.get(tc.relid) or self._prefix(tc)
        value = (b'{"before":%s,"after":%s,"source":%s%d%s%d%s%d,"snapshot":false}},"transaction":{"id":"%s",'
                 b'"total_order":%d,"data_collection_order":%d},"op":"%s",%s' % (
                     before, after, a, change_lsn, b, change_lsn, c, idx, self.tx_id, idx + 1, dco, op,
                     _times(now_ms)))
        if unavailable:
            value += b',"kf_unavailable":' + orjson.dumps(unavailable)
        value += b"}"
        pending = self.cap.pending
        recs = pending.by_topic.get(topic)
        if recs is None:
            recs = pending.by_topic[topic] = []
        recs.append(TrustedRecord(key, value, (header,)))
        if op == b"d":
            # the tombstone has no value to hold its position: it goes in the kf.pos header
            pos = b'{"kind":"pg","lsn":%d,"index":%d,"snapshot":false}' % (self.tx_lsn, idx)
            recs.append(TrustedRecord(key, None, (header, ("kf.pos", pos))))
            pending.count += 2
        else:
            pending.count += 1
        self.events += 1

    # -- fast paths: generated per-table parsers; anything unusual goes to the *_slow twins ------------
    def _fast_new_row(self, m: bytes, now_ms: int, what: str,
                      slow: Callable[[bytes, int], None]) -> tuple[TableCodec, Any, bool] | None:
        """(codec, row, has large values) of an Insert/Update carrying only a new tuple, parsed
        by the table's generated parser; None when the message was handled otherwise: table not
        captured, a record mapper (`_mapped`), or anything unusual (`slow`)."""
        tc = self.rels.get(_u32(m, 26)[0], _MISSING)
        if tc is None:
            return None
        if tc is not _MISSING and tc.mapper is not None:
            self._mapped(m, tc, what)
            return None
        r = None
        if tc is not _MISSING and m[30] == 78:
            try:
                r = tc.fast(m, 31)
            except Exception:
                r = None
        if r is None or r[1] != len(m):
            slow(m, now_ms)
            return None
        return tc, r[0], r[2]

    def _insert(self, m: bytes, now_ms: int) -> None:
        fast = self._fast_new_row(m, now_ms, "INSERT", self._insert_slow)
        if fast is None:
            return
        tc, js, big = fast
        key = tc.key_of(js)
        if big and len(m) >= TOAST_ROW_MIN:
            tc.remember_all(key, js)
        self._emit(tc, key, b"c", _OP_C, b"null", orjson.dumps(js), None, now_ms, _xlog_start(m, 1)[0])

    def _update(self, m: bytes, now_ms: int) -> None:
        fast = self._fast_new_row(m, now_ms, "UPDATE", self._update_slow)
        if fast is None:
            return
        tc, js, big = fast
        key = tc.key_of(js)
        state = tc.toast_state
        if big and len(m) >= TOAST_ROW_MIN:
            tc.remember_all(key, js)
        elif state:
            state.pop(key, None)
        self._emit(tc, key, b"u", _OP_U, b"null", orjson.dumps(js), None, now_ms, _xlog_start(m, 1)[0])

    def _insert_slow(self, m: bytes, now_ms: int) -> None:
        tc = self._codec(m)
        if tc is None:
            return
        if m[30] != 78:
            self.decoder.decode(m[25:], _xlog_start(m, 1)[0])
        raw, _end = self._tuple(m, 31, "new")
        js = tc.json_row(raw)
        key = tc.key_of(js)
        if tc.toast_state is not None:
            tc.remember(key, js, raw)
        self._emit(tc, key, b"c", _OP_C, b"null", orjson.dumps(js), None, now_ms, _xlog_start(m, 1)[0])

    def _update_slow(self, m: bytes, now_ms: int) -> None:
        tc = self._codec(m)
        if tc is None:
            return
        kind = m[30]
        old_raw = None
        if kind == 75 or kind == 79:  # 'K' / 'O'
            old_raw, pos = self._tuple(m, 31, "old")
            kind2 = m[pos]
            if kind2 != 78:
                self.decoder.decode(m[25:], _xlog_start(m, 1)[0])
            new_raw, _end = self._tuple(m, pos + 1, "new")
        elif kind == 78:
            new_raw, _end = self._tuple(m, 31, "new")
        else:
            self.decoder.decode(m[25:], _xlog_start(m, 1)[0])
            raise ValidationError("unreachable: malformed Update message")  # pragma: no cover
        js = tc.json_row(new_raw)
        old_js = None
        before = b"null"
        if old_raw is not None:
            old_js = tc.json_row(old_raw)
            if kind == 75:  # key columns only: the rest is unknown (absent), not NULL
                names = tc.names
                old_js = {names[i]: old_js[names[i]] for i in tc.ident_idx}
        missing: list[str] | None = None
        if UNCHANGED in new_raw:
            new_key = self._key_or_none(tc, js)
            old_key = tc.key_of(old_js) if old_js is not None and self._has_key(tc, old_js) else new_key
            if old_key is None:
                raise SourceError(f"table {tc.qualified}: an UPDATE carries no key column values")
            if (old_js is None and tc.toast_state is not None and not tc.toast_state_loaded
                    and old_key not in tc.toast_state):
                self._load_toast_state(tc)
            missing = tc.fill_unchanged(js, new_raw, old_key, old_js) or None
        key = tc.key_of(js)
        if old_js is not None:
            if self._has_key(tc, old_js):
                old_key = tc.key_of(old_js)
                if old_key != key:
                    # primary key changed: delete (+ tombstone) of the old key, create of the new one
                    if tc.toast_state is not None:
                        tc.toast_state.pop(old_key, None)
                        tc.remember(key, js, new_raw)
                    cl = _xlog_start(m, 1)[0]
                    self._emit(tc, old_key, b"d", _OP_D, orjson.dumps(old_js), b"null", None, now_ms, cl)
                    self._emit(tc, key, b"c", _OP_C, b"null", orjson.dumps(js), missing, now_ms, cl)
                    return
            before = orjson.dumps(old_js)
        if tc.toast_state is not None:
            tc.remember(key, js, new_raw)
        self._emit(tc, key, b"u", _OP_U, before, orjson.dumps(js), missing, now_ms, _xlog_start(m, 1)[0])

    @staticmethod
    def _has_key(tc: TableCodec, row: dict[str, Any]) -> bool:
        return all(k in row and row[k] is not None for k in tc.key)

    def _key_or_none(self, tc: TableCodec, row: dict[str, Any]) -> bytes | None:
        return tc.key_of(row) if self._has_key(tc, row) else None

    def _delete(self, m: bytes, now_ms: int) -> None:
        tc = self._codec(m)
        if tc is None:
            return
        if tc.mapper is not None:
            self._mapped(m, tc, "DELETE")
            return
        kind = m[30]
        if kind != 75 and kind != 79:
            self.decoder.decode(m[25:], _xlog_start(m, 1)[0])
        old_raw, _end = self._tuple(m, 31, "old")
        old_js = tc.json_row(old_raw)
        if kind == 75:
            names = tc.names
            old_js = {names[i]: old_js[names[i]] for i in tc.ident_idx}
        if not self._has_key(tc, old_js):
            raise SourceError(
                f"table {tc.qualified}: a DELETE's old row lacks the key column(s) {list(tc.key)} "
                f"(REPLICA IDENTITY {tc.replica_identity!r} sends {sorted(old_js)}): set REPLICA IDENTITY FULL "
                "or key the table by its replica identity columns")
        key = tc.key_of(old_js)
        if tc.toast_state is not None:
            tc.toast_state.pop(key, None)
        self._emit(tc, key, b"d", _OP_D, orjson.dumps(old_js), b"null", None, now_ms, _xlog_start(m, 1)[0])

    # -- append-only tables with a RecordMapper (mapping.py) ------------------------------------------
    def _mapped(self, m: bytes, tc: TableCodec, op: str) -> None:
        """An inserted row becomes the mapper's record; an UPDATE or DELETE stops the capture."""
        if self._where_lsn != self.tx_lsn:  # once per transaction, not per row
            self._where_lsn, self._where = self.tx_lsn, f"WAL {lsn_str(self.tx_lsn)}"
        where = self._where
        if op != "INSERT":
            if tc.mapper.skip_change(tc.qualified, op, where):  # an outbox table's DELETEs (outbox.py)
                return
            raise tc.mapper.refuse(tc.qualified, op, where)
        if m[30] != 78:
            self.decoder.decode(m[25:], _xlog_start(m, 1)[0])  # raises the precise error
        raw, _end = self._tuple(m, 31, "new")
        idx = self.index
        self.index = idx + 1
        if self.cap.emit_mapped(tc, dict(zip(tc.names, raw, strict=True)), where, PgPosition(self.tx_lsn, idx)):
            self.events += 1
        else:
            self.duplicates += 1

    # -- TRUNCATE ------------------------------------------------------------------------------------
    def _truncate(self, msg: Truncate, change_lsn: int) -> None:
        """op=t marker in every partition, then a delete (the row as the log last held it) and a
        tombstone for every key the topic holds (``connectors/truncate.py``).

        The marker tells consumers "everything before this in this partition is gone"; the
        deletes carry the removed rows to consumers keyed by other columns; the tombstones make
        the compacted topic empty like the table. A partition's records go in one append
        (all-or-nothing per partition), so the duplicate check stays exact; partitions are
        flushed one at a time, so only one partition's rows are held in memory.
        """
        cap = self.cap
        codecs = [tc for relid in msg.relids if (tc := self.rels.get(relid)) is not None]
        if not codecs:
            return
        for tc in codecs:
            if tc.mapper is not None and not tc.mapper.skip_change(tc.qualified, "TRUNCATE",
                                                                   f"WAL {lsn_str(self.tx_lsn)}"):
                raise tc.mapper.refuse(tc.qualified, "TRUNCATE", f"WAL {lsn_str(self.tx_lsn)}")
        codecs = [tc for tc in codecs if tc.mapper is None]  # an outbox table's TRUNCATE is skipped
        if not codecs:
            return
        # everything before the truncate must be in the log before its keys are scanned
        self._count_events()
        cap.flush(self.offset, token=None, cut=not self.in_tx)
        writer = cap.require_writer()
        writer.drain()
        now_ms = int(time.time() * 1000)
        for tc in codecs:
            idx = self.index
            self.index = idx + 1
            sort_key = (self.tx_lsn, 1, idx)
            topic = tc.topic
            nparts = cap.topic_partitions.get(topic) or cap._ensure_topic(topic)
            dco = self.dco.get(topic, 0) + 1
            self.dco[topic] = dco
            a, b, c = self._prefix(tc)
            value = (b'{"before":null,"after":null,"source":%s%d%s%d%s%d,"snapshot":false}},"transaction":'
                     b'{"id":"%s","total_order":%d,"data_collection_order":%d},"op":"t",%s}' % (
                         a, change_lsn, b, change_lsn, c, idx, self.tx_id, idx + 1, dco, _times(now_ms)))
            pos = (("kf.pos", b'{"kind":"pg","lsn":%d,"index":%d,"snapshot":false}' % (self.tx_lsn, idx)),)
            for p in range(nparts):
                tail = cap.tails.get((topic, p))
                if self.dedup and tail is not None and sort_key <= tail:
                    self.duplicates += 1
                    continue
                live = {k: v for k, v in live_rows(cap.log, topic, p).items() if partition_for(k, nparts) == p}
                recs = truncate_records(value, live, (_OP_T, *pos), (_OP_D, *pos), (_OP_T, *pos))
                cap.pending.truncates.append((topic, p, recs))
                cap.pending.count += len(recs)
                cap.flush(self.offset, token=None, cut=not self.in_tx)
            if tc.toast_state is not None:
                tc.toast_state.clear()
            self.events += 1
        # later changes of this transaction must land after the tombstones: next batch
        self._count_events()
        cap.flush(self.offset, token=None, cut=not self.in_tx)

    # -- TOAST state rebuilt from the log ------------------------------------------------------------
    def _load_toast_state(self, tc: TableCodec) -> None:
        """Fill the keyed state of ``tc`` from the last values its topic holds (once per run).

        Needed after a restart: an UPDATE that leaves a TOASTed value unchanged does not
        carry it, and the value is in the log (every earlier change is durable there).
        """
        cap = self.cap
        # the log must hold everything decoded so far, or older values would overwrite newer ones
        if cap.pending:
            self._flush(partial=self.in_tx)
        cap.require_writer().drain()
        nparts = cap.topic_partitions.get(tc.topic) or cap._ensure_topic(tc.topic)
        load_from_log(tc, cap.log, tc.topic, nparts)
