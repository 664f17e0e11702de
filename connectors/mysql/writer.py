"""Turning captured changes into log records, batched for ``connectors/writer.CaptureWriter``.

Record layout (the same as every kappaflow connector, and Debezium's):

- topic ``<source>.<db>.<table>`` (compacted, keyed by the primary key);
- key ``{"id": 1}`` (``EventCodec.encode_key``), value the Debezium envelope
  (``EventCodec.encode_value``), headers ``kf.op`` and ``kf.pos`` (the position, see
  ``connectors/base.py``);
- a delete is followed by a tombstone (same key, no value) so compaction drops the key;
- an update that changes the primary key becomes a delete (+ tombstone) of the old key
  and a create of the new one, like Debezium;
- ``TRUNCATE TABLE`` becomes, in every partition of the table's topic, an ``op=t`` marker
  (key ``{}``) followed by a delete carrying the row the log last held and a tombstone for
  every key that partition holds, so consumers see each removed row and the compacted topic
  is empty like the table (``connectors/truncate.py``; the PostgreSQL connector does the same);
- schema records go to ``<source>.__schema`` (compacted, key ``"db.table"``, value
  ``TableSchema.to_dict()`` plus ``table``, ``kf_pos``, ``ts_ms``, ``change`` and ``ddl``; a
  dropped table gets a tombstone), the layout the PostgreSQL connector writes.

Exactly once: the batch builder is given the last position stored in each topic-partition
(``tail_positions``); a record whose position is not above its partition's tail is
already in the log and is skipped. Positions grow along the binlog, so once a record
passes the highest tail no further check is needed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson

from kappaflow.connectors.base import OP_HEADER, POSITION_HEADER, TrustedRecord
from kappaflow.connectors.history import table_topic_config
from kappaflow.connectors.mysql.schema_tracking import TableState
from kappaflow.connectors.mysql.source_info import BinlogPosition
from kappaflow.connectors.offsets import OffsetStore
from kappaflow.connectors.transactions import transaction_records
from kappaflow.connectors.truncate import TRUNCATE_KEY, live_rows, truncate_records
from kappaflow.connectors.writer import Batch, CaptureWriter, FaultHook
from kappaflow.errors import SourceError
from kappaflow.events import ChangeEvent, EventCodec, Op, Position, Snapshot, SourceInfo, TableSchema
from kappaflow.log.base import CleanupPolicy, Log, Record, TopicConfig
from kappaflow.log.partitioner import partition_for

__all__ = ["TRUNCATE_KEY", "ChangeBatcher", "key_of", "make_source", "now_ms"]

_OPS = {o: (OP_HEADER, o.value.encode()) for o in Op}


class ChangeBatcher:
    """Builds the pending batch of a source, skipping what the log already holds, and hands it
    (offset last) to a :class:`CaptureWriter`."""

    def __init__(self, log: Log, *, source: str, codec: EventCodec, partitions: int,
                 tails: dict[tuple[str, int], Position] | None = None, threaded: bool = True,
                 fault: FaultHook | None = None, offsets: OffsetStore | None = None) -> None:
        self.log = log
        self.source = source
        self.codec = codec
        self.partitions = partitions
        self.tails: dict[tuple[str, int], Position] = dict(tails or {})
        self._max_tail: Position | None = max(self.tails.values()) if self.tails else None
        self._topic_parts: dict[str, int] = {}
        self._pending: dict[tuple[str, int | None], list[Record]] = {}
        self._creates: list[tuple[str, TopicConfig]] = []
        self.buffered = 0
        self.skipped = 0
        self.events = 0
        self.records = 0
        self._last: tuple[Any, ...] | None = None
        self._last_position: Position | None = None
        self.offsets = offsets or OffsetStore(log)
        self.writer = CaptureWriter(log, self.offsets, source, threaded=threaded, fault=fault)
        self.schema_topic = f"{source}.__schema"
        self.stored_schemas: dict[str, str] = {}
        # the transaction being written: (file, pos) -> events per table topic, in first-change order
        self._tx_key: tuple[str, int] | None = None
        self.tx_counts: dict[str, int] = {}
        self.transaction_topic: str | None = None  # connectors/transactions.py, when enabled
        self.outbox: Any = None  # connectors/mysql/outbox.MySQLOutbox: its tables' rows are routed there
        # table topics created keeping every version (keep_history, connectors/history.py), not compacted
        self.history_topics: set[str] = set()

    # -- topics ------------------------------------------------------------------------
    def ensure_topic(self, topic: str) -> int:
        n = self._topic_parts.get(topic)
        if n is None:
            existing = self.log.list_topics().get(topic)
            if existing is None:
                cfg = table_topic_config(self.partitions, keep_history=topic in self.history_topics)
                existing = self.log.create_topic(topic, cfg, exist_ok=True)
            n = self._topic_parts[topic] = existing.partitions
        return n

    def load_schemas(self) -> None:
        """Fingerprints of the schemas already on the schema topic (so restarts do not repeat them)."""
        self.log.create_topic(self.schema_topic, TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT),
                              exist_ok=True)
        for rec in self.log.iter_partition(self.schema_topic, 0):
            if rec.key is None:
                continue
            name = orjson.loads(rec.key)
            if rec.value is None:
                self.stored_schemas.pop(name, None)
            else:
                self.stored_schemas[name] = TableSchema.from_dict(orjson.loads(rec.value)).fingerprint()

    # -- duplicates --------------------------------------------------------------------
    def _already_written(self, topic: str, key: bytes | None, pos: Position, partition: int | None) -> bool:
        mt = self._max_tail
        if mt is None:
            return False
        if pos > mt:
            self._max_tail = None  # everything from here on is new
            self.tails.clear()
            return False
        p = partition if partition is not None else partition_for(
            key, self._topic_parts.get(topic) or self.ensure_topic(topic))
        tail = self.tails.get((topic, p))
        return tail is not None and pos <= tail

    @property
    def deduplicating(self) -> bool:
        return self._max_tail is not None

    # -- adding ------------------------------------------------------------------------
    def _add(self, topic: str, partition: int | None, rec: Record) -> None:
        buf = self._pending.get((topic, partition))
        if buf is None:
            if topic not in self._topic_parts:
                self.ensure_topic(topic)
            buf = self._pending[(topic, partition)] = []
        buf.append(rec)
        self.buffered += 1

    def add_event(self, state: TableState, event: ChangeEvent, pos: Position) -> None:
        """One change event (+ its tombstone for deletes)."""
        if self.outbox is not None and state.qualified in self.outbox.tables:
            self.outbox.add_event(self, state, event, pos)
            return
        schema = state.schema
        codec = self.codec
        key = codec.encode_key(event.key, schema) if event.key is not None else None
        if self._max_tail is not None and self._already_written(state.topic, key, pos, None):
            self.skipped += 1
            return
        ph = (POSITION_HEADER, orjson.dumps(pos.to_dict()))
        self._add(state.topic, None, TrustedRecord(key, codec.encode_value(event, schema), (_OPS[event.op], ph)))
        if event.op is Op.DELETE and key is not None:
            self._add(state.topic, None, TrustedRecord(key, None, (_OPS[Op.DELETE], ph)))
        self.events += 1
        self.last_position = pos

    def add_rows(self, state: TableState, op: Op, rows: Sequence[Any], file: str, tpos: int,
                 index: int, gtid: str | None, server_id: int, ts_ms: int, now: int,
                 touched: set[tuple[Any, ...]] | None = None, json_rows: bool = False, thread: int | None = None,
                 query: str | None = None) -> int:
        """The changes of one binlog rows event, encoded on the fast path; returns the next row index.

        ``rows``: mysql-replication's rows (dicts with ``values``/``none_sources``, or
        ``before_*``/``after_*``), or with ``json_rows`` what ``RowDecoder.decode_rows`` gives:
        row images already in JSON form, ``(before, after)`` pairs for an update. Values go
        from mysql-replication's form straight to their JSON form, and the bytes are built from
        pre-serialised pieces around one ``orjson.dumps`` per row image; the result is exactly
        what ``EventCodec.encode_value``/``encode_key`` make of the equivalent ``ChangeEvent``
        (``tests/connectors/mysql/test_mysql_writer.py`` checks it). The binlog is parsed in pure
        Python, so every microsecond per change here is a few percent of the budget.
        ``touched`` collects the JSON-form key tuples (for the watermark snapshot).
        """
        if self.outbox is not None and state.qualified in self.outbox.tables:
            return int(self.outbox.add_rows(self, state, op, rows, file, tpos, index, gtid, server_id, json_rows,
                                            touched))
        if not json_rows:
            rows = _library_rows_to_json(state.json_converter(self.codec.decimal_mode), op, rows)
        topic = state.topic
        keycols = state.key
        dumps = orjson.dumps
        fq = dumps(file)
        g = b"null" if gtid is None else dumps(gtid)
        head, tail = _source_parts(self.codec.version, self.source, state.db, state.table, ts_ms, server_id, g, fq,
                                   tpos, thread, query)
        # Debezium's transaction block: the GTID, else file and position of the transaction's start
        txid = dumps(gtid) if gtid else b'"file=%b,pos=%d"' % (file.encode(), tpos)
        if self._tx_key != (file, tpos):
            self._tx_key = (file, tpos)
            self.tx_counts = {}
        dco = self.tx_counts
        d = dco.get(topic, 0)  # data_collection_order so far (a local while the loop runs)
        ph_head = b'{"kind":"binlog","file":%b,"pos":%d,"row":' % (fq, tpos)
        ph_tail = b',"gtid":%b,"server_id":%d,"snapshot":false}' % (g, server_id)
        buf = self._pending.get((topic, None))
        if buf is None:
            if topic not in self._topic_parts:
                self.ensure_topic(topic)
            buf = self._pending[(topic, None)] = []
        append = buf.append
        single = keycols[0] if len(keycols) == 1 else None
        opb = _OPB[op]
        oph = _OPS[op]
        delete = op is Op.DELETE
        # built once per rows event: the transaction id is the same for every row of it
        value = (b'{"before":%b,"after":%b,"source":%b%d%b%d%b},"transaction":{"id":' + txid.replace(b"%", b"%%")
                 + b',"total_order":%d,"data_collection_order":%d},"op":"%b","ts_ms":%d,"ts_us":%d,"ts_ns":%d}')
        now_us, now_ns = now * 1000, now * 1_000_000
        n = 0
        last = -1  # row index of the last change appended
        for r in rows:
            if op is Op.UPDATE:
                jb, krow = r
                if (jb[single] != krow[single]) if single is not None else any(jb[k] != krow[k] for k in keycols):
                    dco[topic] = d
                    index, n = self._key_change(state, jb, krow, head, tail, ph_head, ph_tail, index, n, append,
                                                now, touched, file, tpos, gtid, server_id, txid)
                    d = dco[topic]
                    continue
                before, after = dumps(jb), dumps(krow)
            else:
                krow = r
                if delete:
                    before, after = dumps(krow), b"null"
                else:
                    before, after = b"null", dumps(krow)
            i = index
            index += 1
            d += 1  # counted when skipped too: the same orders on re-read
            if single is not None:
                kv: tuple[Any, ...] = (krow[single],)
                kb = dumps({single: kv[0]})
            else:
                kv = tuple(krow[k] for k in keycols)
                kb = dumps(dict(zip(keycols, kv, strict=True)))
            if touched is not None:
                touched.add(kv)
            if self._max_tail is not None and self._already_written(
                    topic, kb, BinlogPosition(file, tpos, i, gtid, server_id), None):
                self.skipped += 1
                continue
            ph = (POSITION_HEADER, b"%b%d%b" % (ph_head, i, ph_tail))
            append(TrustedRecord(kb, value % (before, after, head, i, tail, i, ph_tail, i + 1, d, opb, now, now_us,
                                              now_ns),
                                 (oph, ph)))
            n += 1
            if delete:
                append(TrustedRecord(kb, None, (oph, ph)))
                n += 1
            self.events += 1
            last = i
        dco[topic] = d
        if last >= 0:
            self._last = (file, tpos, last, gtid, server_id)
        self.buffered += n
        return index

    def _key_change(self, state: TableState, jb: dict[str, Any], ja: dict[str, Any], head: bytes, tail: bytes,
                    ph_head: bytes, ph_tail: bytes, index: int, n: int, append: Any, now: int,
                    touched: set[tuple[Any, ...]] | None, file: str, tpos: int, gtid: str | None,
                    server_id: int, txid: bytes) -> tuple[int, int]:
        """An update of the primary key: a delete (+ tombstone) of the old key, a create of the new one."""
        dumps = orjson.dumps
        topic = state.topic
        dco = self.tx_counts
        for op, row in ((Op.DELETE, jb), (Op.CREATE, ja)):
            i = index
            index += 1
            d = dco.get(topic, 0) + 1
            dco[topic] = d
            kv = tuple(row[k] for k in state.key)
            kb = dumps(dict(zip(state.key, kv, strict=True)))
            if touched is not None:
                touched.add(kv)
            if self._max_tail is not None and self._already_written(
                    topic, kb, BinlogPosition(file, tpos, i, gtid, server_id), None):
                self.skipped += 1
                continue
            ph = (POSITION_HEADER, b"%b%d%b" % (ph_head, i, ph_tail))
            before, after = (dumps(row), b"null") if op is Op.DELETE else (b"null", dumps(row))
            append(TrustedRecord(kb, b'{"before":%b,"after":%b,"source":%b%d%b%d%b},"transaction":{"id":%b,'
                                     b'"total_order":%d,"data_collection_order":%d},"op":"%b","ts_ms":%d,"ts_us":%d,'
                                     b'"ts_ns":%d}' % (
                                         before, after, head, i, tail, i, ph_tail, txid, i + 1, d, _OPB[op], now,
                                         now * 1000, now * 1_000_000),
                                 (_OPS[op], ph)))
            n += 1
            if op is Op.DELETE:
                append(TrustedRecord(kb, None, (_OPS[op], ph)))
                n += 1
            self.events += 1
            self._last = (file, tpos, i, gtid, server_id)
        return index, n

    def add_transaction(self, file: str, tpos: int, gtid: str | None, server_id: int, begin_ts_ms: int,
                        end_ts_ms: int) -> None:
        """BEGIN/END of the transaction just written on the transaction topic (when enabled and it had events)."""
        topic = self.transaction_topic
        counts, self.tx_counts, self._tx_key = self.tx_counts, {}, None
        if topic is None or not counts:
            return
        tx_id = gtid if gtid else f"file={file},pos={tpos}"
        n = len(self.source) + 1
        total = sum(counts.values())
        begin, end = BinlogPosition(file, tpos, 0, gtid, server_id), BinlogPosition(file, tpos, total, gtid, server_id)
        if self._max_tail is not None and self._already_written(topic, None, begin, 0):
            self.skipped += 2
            return
        for rec in transaction_records(tx_id, begin_ts_ms, end_ts_ms, {t[n:]: c for t, c in counts.items()},
                                       orjson.dumps(begin.to_dict()), orjson.dumps(end.to_dict())):
            self._add(topic, 0, rec)

    @property
    def last_position(self) -> Position | None:
        if self._last is not None:
            self._last_position = BinlogPosition(*self._last)
            self._last = None
        return self._last_position

    @last_position.setter
    def last_position(self, pos: Position | None) -> None:
        self._last = None
        self._last_position = pos

    def add_truncate(self, state: TableState, event: ChangeEvent, pos: Position) -> None:
        """The op=t marker, then a delete (the row as the log last held it) and a tombstone for every
        live key, per partition (``connectors/truncate.py``).

        The caller must have flushed and drained first: the rows are read from the log.
        An outbox table's TRUNCATE is skipped (``connectors/outbox.py``).
        """
        if self.outbox is not None and state.qualified in self.outbox.tables:
            return
        topic = state.topic
        n = self.ensure_topic(topic)
        value = self.codec.encode_value(event, state.schema)
        ph = (POSITION_HEADER, orjson.dumps(pos.to_dict()))
        op_t = _OPS[Op.TRUNCATE]
        for p in range(n):
            if self._max_tail is not None and self._already_written(topic, None, pos, p):
                self.skipped += 1
                continue
            recs = truncate_records(value, live_rows(self.log, topic, p), (op_t, ph), (_OPS[Op.DELETE], ph),
                                    (op_t, ph))
            for rec in recs:
                self._add(topic, p, rec)
        self.events += 1
        self.last_position = pos

    def add_schema(self, qualified: str, schema: TableSchema | None, pos: Position, *, change: str,
                   ddl: list[str] | None = None) -> bool:
        """A schema record when the table's schema differs from the stored one (True if written)."""
        if schema is None:
            if qualified not in self.stored_schemas:
                return False
            self.stored_schemas.pop(qualified, None)
            self._add(self.schema_topic, None, TrustedRecord(orjson.dumps(qualified), None))
            return True
        fp = schema.fingerprint()
        if self.stored_schemas.get(qualified) == fp:
            return False
        value = dict(schema.to_dict())
        value.update({"kf_pos": pos.to_dict(), "table": qualified, "ts_ms": now_ms(), "change": change,
                      "ddl": ";\n".join(ddl) if ddl else None})
        self._add(self.schema_topic, None, TrustedRecord(orjson.dumps(qualified), orjson.dumps(value)))
        self.stored_schemas[qualified] = fp
        return True

    # -- flushing ----------------------------------------------------------------------
    def flush(self, offset: dict[str, Any] | None, token: Any = None, *, transactions: int = 0,
              commit_ts_ms: int | None = None, cut: bool = True) -> None:
        """Hand the pending records (schema records first) and then the offset to the writer
        (``transactions``/``commit_ts_ms``: counted and measured by the writer, ``cut``: the batch ends at
        a transaction boundary; see ``Batch``)."""
        batch = Batch(creates=self._creates, offset=offset, token=token, transactions=transactions,
                      commit_ts_ms=commit_ts_ms, cut=cut)
        schema = self._pending.pop((self.schema_topic, None), None)
        if schema:
            batch.add(self.schema_topic, schema)
        for (topic, partition), recs in self._pending.items():
            batch.add(topic, recs, partition)
        self.records += batch.records
        self._pending = {}
        self._creates = []
        self.buffered = 0
        self.writer.submit(batch)

    def drain(self) -> None:
        self.writer.drain()

    def close(self) -> None:
        self.writer.close()


_OPB = {o: o.value.encode() for o in Op}


def _library_rows_to_json(to_json: Any, op: Op, rows: Sequence[dict[str, Any]]) -> list[Any]:
    """mysql-replication's rows -> what ``RowDecoder.decode_rows`` gives (JSON-form images; pairs for updates)."""
    if op is Op.UPDATE:
        return [(to_json(r["before_values"], r.get("before_none_sources")),
                 to_json(r["after_values"], r.get("after_none_sources"))) for r in rows]
    return [to_json(r["values"], r.get("none_sources")) for r in rows]


def _source_parts(version: str, source: str, db: str, table: str, ts_ms: int, server_id: int, gtid: bytes,
                  file: bytes, pos: int, thread: int | None = None, query: str | None = None) -> tuple[bytes, bytes]:
    """The binlog source block around the two row numbers (``kappaflow.connectors.mysql.source_info``)."""
    d = orjson.dumps
    head = (b'{"version":%b,"connector":"mysql","name":%b,"ts_ms":%d,"snapshot":"false","db":%b,"sequence":null,'
            b'"ts_us":%d,"ts_ns":%d,"table":%b,"server_id":%d,"gtid":%b,"file":%b,"pos":%d,"row":' % (
                d(version), d(source), ts_ms, d(db), ts_ms * 1000, ts_ms * 1_000_000, d(table), server_id, gtid,
                file, pos))
    tail = b',"thread":%b,"query":%b,"txId":%b,"kf_pos":{"kind":"binlog","file":%b,"pos":%d,"row":' % (
        b"null" if thread is None else b"%d" % thread, d(query), gtid, file, pos)
    return head, tail


def make_source(state: TableState, source: str, pos: BinlogPosition, ts_ms: int, tx_id: str | None,
                snapshot: Snapshot = Snapshot.FALSE) -> SourceInfo:
    return SourceInfo("mysql", source, state.db, None, state.table, pos, ts_ms, tx_id, snapshot)


def key_of(state: TableState, row: dict[str, Any]) -> dict[str, Any]:
    try:
        return {k: row[k] for k in state.key}
    except KeyError as exc:
        raise SourceError(f"table {state.qualified}: key column {exc.args[0]!r} missing from a row "
                          f"(key: {list(state.key)})") from None


def now_ms() -> int:
    return int(time.time() * 1000)
