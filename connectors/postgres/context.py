"""State shared by the PostgreSQL snapshot and streaming sources of one capture run.

Holds the catalog connection, the per-table codecs, the schema topic, the batch
being built, the writer, and the duplicate filter derived from the log's tail
positions (see ``kappaflow.connectors.base`` for the exactly-once argument).
Tables with a record mapper (``mapping.py``) keep their own tails: the mapper's
order of the last record in each partition of its topics.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import psycopg

from kappaflow.connectors.base import CaptureSummary, TrustedRecord, tail_positions
from kappaflow.connectors.history import check_existing_topics, history_tables, table_topic_config
from kappaflow.connectors.offsets import OffsetStore, find_last
from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres.mapping import MappedRecord, RecordMapper
from kappaflow.connectors.postgres.offset import PgOffset
from kappaflow.connectors.postgres.rows import TableCodec
from kappaflow.connectors.postgres.slots import TableInfo, TypeCatalog
from kappaflow.connectors.postgres.source_info import PgPosition
from kappaflow.connectors.transactions import TRANSACTION_TOPIC_CONFIG, transaction_topic
from kappaflow.connectors.writer import Batch, CaptureWriter, FaultHook
from kappaflow.errors import SourceError
from kappaflow.events import EventCodec, TableSchema
from kappaflow.log.base import CleanupPolicy, Log, Record, TopicConfig
from kappaflow.log.partitioner import partition_for

__all__ = ["PgCapture", "schema_topic"]


def schema_topic(source: str) -> str:
    return f"{source}.__schema"


class PendingBatch:
    """Records accumulated since the last flush, grouped per topic in arrival order."""

    __slots__ = ("by_topic", "count", "creates", "schema", "started", "truncates")

    def __init__(self) -> None:
        self.by_topic: dict[str, list[Record]] = {}
        self.schema: list[Record] = []
        self.creates: list[tuple[str, TopicConfig]] = []
        self.truncates: list[tuple[str, int, list[Record]]] = []
        self.count = 0
        self.started = time.monotonic()

    def __bool__(self) -> bool:
        return bool(self.count or self.schema or self.creates or self.truncates)


class PgCapture:
    """One capture run's shared state (not thread-safe: used by the capture thread only)."""

    def __init__(self, *, source: str, dsn: str, log: Log, tables: Sequence[str],
                 key_columns: dict[str, list[str]], partitions: int, decimal_mode: str = "string",
                 writer_threaded: bool = True, fault: FaultHook | None = None,
                 mappers: Mapping[str, RecordMapper] | None = None, transaction_metadata: bool = False,
                 keep_history: Sequence[str] = ()) -> None:
        self.source = source
        # Debezium's transaction metadata topic (connectors/transactions.py), or None
        self.transaction_topic: str | None = transaction_topic(source) if transaction_metadata else None
        self.dsn = dsn
        self.log = log
        self.partitions = partitions
        self.codec = EventCodec(decimal_mode)
        self.conn: psycopg.Connection = slots.connect(dsn, what=f"connecting to source {source!r}")
        self.types = TypeCatalog(self.conn)
        self.db = self.conn.info.dbname
        self.server = slots.check_server(self.conn, dsn)
        self.table_config = list(tables)
        self.key_columns = dict(key_columns)
        self.tables: dict[str, TableInfo] = {
            t.qualified: t for t in slots.resolve_tables(self.conn, tables, key_columns, source=source)
        }
        self.codecs: dict[str, TableCodec] = {}
        # "schema.table" -> mapper: those tables' rows become the mapper's records (mapping.py)
        self.mappers: dict[str, RecordMapper] = dict(mappers or {})
        # "message:<prefix>" keys map pg_logical_emit_message messages (connectors/postgres/outbox.py)
        unknown = sorted(k for k in set(self.mappers) - set(self.tables) if not k.startswith("message:"))
        if unknown:
            raise SourceError(f"record mapper(s) for {unknown}, which are not among the captured tables "
                              f"{sorted(self.tables)}")
        try:
            # tables whose topics keep every version (connectors/history.py)
            self.keep_history = history_tables(
                source, [".".join(slots.split_table_name(t)) for t in keep_history], self.tables)
            for qualified, mapper in self.mappers.items():
                if qualified in self.tables:
                    mapper.bind_table(self.tables[qualified])  # an outbox checks its columns here
        except Exception:
            self.conn.close()
            raise
        self.mapped_tails: dict[tuple[str, int], int] = {}  # (topic, partition) -> last order in the log
        self.mapped_max_tail: int | None = None  # orders above it need no duplicate check
        self.topic_cfg = table_topic_config(partitions, keep_history=False)
        self.history_cfg = table_topic_config(partitions, keep_history=True)
        self.topic_partitions: dict[str, int] = {}
        self.offsets = OffsetStore(log)
        self.schema_topic = schema_topic(source)
        self.stored_schemas: dict[str, str] = {}  # qualified table -> fingerprint on the schema topic
        self.tails: dict[tuple[str, int], tuple[int, int, int]] = {}
        self.max_tail: tuple[int, int, int] | None = None
        self.summary = CaptureSummary(source=source, connector="postgresql")
        self.pending = PendingBatch()
        self.fault = fault
        self._writer_threaded = writer_threaded
        self.writer: CaptureWriter | None = None
        self._existing: dict[str, TopicConfig] = {}
        # called with the pending batch just before it goes to the writer (on-demand snapshot windows)
        self.before_flush: Any = None

    # -- startup -------------------------------------------------------------------------
    def prepare_log(self) -> None:
        """Create topics, load stored schemas and the tail positions (before the writer starts)."""
        log = self.log
        self._existing = log.list_topics()
        unmapped = [info for info in self.tables.values() if info.qualified not in self.mappers]
        check_existing_topics(self.source, self._existing,
                              {t.qualified: self.topic_of(t) for t in unmapped if t.qualified in self.keep_history})
        # a source whose tables are all mapped writes no change events, hence no schemas
        with_schemas = bool(unmapped) or not self.table_config
        if with_schemas and self.schema_topic not in self._existing:
            log.create_topic(self.schema_topic, TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT),
                             exist_ok=True)
        for info in unmapped:
            self._ensure_topic(self.topic_of(info), self.topic_config_for(info.qualified))
        tx = self.transaction_topic
        if tx is not None:
            cfg = self._existing.get(tx) or log.create_topic(tx, TRANSACTION_TOPIC_CONFIG, exist_ok=True)
            self.topic_partitions[tx] = cfg.partitions
        for rec in log.iter_partition(self.schema_topic, 0) if with_schemas else ():
            if rec.key is None:
                continue
            name = orjson.loads(rec.key)
            if rec.value is None:
                self.stored_schemas.pop(name, None)
            else:
                self.stored_schemas[name] = TableSchema.from_dict(orjson.loads(rec.value)).fingerprint()
        tails = tail_positions(log, [self.topic_of(t) for t in unmapped] + ([tx] if tx is not None else []))
        self.tails = {k: p.sort_key() for k, p in tails.items() if isinstance(p, PgPosition)}
        self.max_tail = max(self.tails.values()) if self.tails else None
        loaded: list[Any] = []  # mappers sharing one router own the same topics: read their tails once
        for mapper in self.mappers.values():
            owner = getattr(mapper, "router", mapper)
            if not any(owner is o for o in loaded):
                loaded.append(owner)
                self._load_mapped_tails(mapper)
        self.writer = CaptureWriter(log, self.offsets, self.source, threaded=self._writer_threaded,
                                    fault=self.fault)
        self.writer.summary = self.summary
        self.summary.per_topic = self.writer.per_topic  # live counts for metrics (copied at the end)

    def _load_mapped_tails(self, mapper: RecordMapper) -> None:
        """The order of the last mapped record in every partition of the mapper's topics."""
        for topic, cfg in self._existing.items():
            if not mapper.owns_topic(topic):
                continue
            self.topic_partitions[topic] = cfg.partitions
            for p in range(cfg.partitions):
                rec = find_last(self.log, topic, p, lambda r: mapper.order_of(r) is not None)
                if rec is not None:
                    order = mapper.order_of(rec)
                    assert order is not None
                    self.mapped_tails[(topic, p)] = order
        self.mapped_max_tail = max(self.mapped_tails.values()) if self.mapped_tails else None

    def topic_of(self, info: TableInfo) -> str:
        return f"{self.source}.{info.schema}.{info.name}"

    def topic_config_for(self, qualified: str) -> TopicConfig:
        """A new topic's config for table ``qualified``: compacted, or keeping history (keep_history)."""
        return self.history_cfg if qualified in self.keep_history else self.topic_cfg

    def _ensure_topic(self, topic: str, config: TopicConfig | None = None) -> int:
        """Partition count of a table topic; created (compacted, or keeping history when ``config``
        says so) when missing, else used as it is (``prepare_log`` checked the keep_history ones)."""
        n = self.topic_partitions.get(topic)
        if n is None:
            cfg = self._existing.get(topic) or self.log.create_topic(topic, config or self.topic_cfg, exist_ok=True)
            n = self.topic_partitions[topic] = cfg.partitions
        return n

    def load_offset(self) -> PgOffset | None:
        d = self.offsets.load(self.source)
        return None if d is None else PgOffset.from_dict(d)

    # -- tables ----------------------------------------------------------------------------
    def table_info(self, schema: str, name: str) -> TableInfo | None:
        """Catalog info of a captured table; with an all-tables source, new tables are added."""
        qualified = f"{schema}.{name}"
        info = self.tables.get(qualified)
        if info is None and not self.table_config:
            keys = self.key_columns.get(qualified)
            info = slots.load_table(self.conn, schema, name, keys, source=self.source)
            self.tables[qualified] = info
            topic = self.topic_of(info)
            existing = self._existing.get(topic)
            if existing is None:  # created by the writer thread, before this batch's records
                self.pending.creates.append((topic, self.topic_config_for(qualified)))
            self.topic_partitions[topic] = existing.partitions if existing else self.partitions
        return info

    def codec_for(self, info: TableInfo, position: PgPosition) -> TableCodec:
        tc = self.codecs.get(info.qualified)
        if tc is None:
            tc = TableCodec.from_table_info(info, source=self.source, db=self.db, codec=self.codec,
                                            lookup=self.types)
            self.install_codec(tc, position)
        return tc

    def install_codec(self, tc: TableCodec, position: PgPosition) -> None:
        """Use ``tc`` for its table from now on; write a schema record if the shape is new."""
        mapper = self.mappers.get(tc.qualified)
        if mapper is not None:  # no change events, so no schema record and no TOAST state
            tc.mapper = mapper
            tc.toast_state = None
            self.codecs[tc.qualified] = tc
            return
        old = self.codecs.get(tc.qualified)
        if old is not None and old.toast_state is not None and tc.toast_state is not None:
            tc.toast_state = old.toast_state
            tc.toast_state_loaded = old.toast_state_loaded
        self.codecs[tc.qualified] = tc
        fp = tc.schema.fingerprint()
        if self.stored_schemas.get(tc.qualified) != fp:
            value = dict(tc.schema.to_dict())
            value["kf_pos"] = position.to_dict()
            value["table"] = tc.qualified
            value["ts_ms"] = int(time.time() * 1000)
            self.pending.schema.append(TrustedRecord(orjson.dumps(tc.qualified), orjson.dumps(value)))
            self.stored_schemas[tc.qualified] = fp

    # -- duplicates --------------------------------------------------------------------------
    def is_duplicate(self, topic: str, key: bytes | None, sort_key: tuple[int, int, int]) -> bool:
        """True when this topic-partition already holds a record at or after ``sort_key``."""
        n = self.topic_partitions.get(topic) or self._ensure_topic(topic)
        tail = self.tails.get((topic, partition_for(key, n)))
        return tail is not None and sort_key <= tail

    def past_duplicates(self, sort_key: tuple[int, int, int]) -> bool:
        """True once positions are beyond every tail (no duplicate checks needed any more)."""
        return self.max_tail is None or sort_key > self.max_tail

    # -- mapped tables ---------------------------------------------------------------------------
    def emit_mapped(self, tc: TableCodec, row: Mapping[str, bytes | None], where: str,
                    position: PgPosition | None = None) -> bool:
        """Add the mapper's record for an inserted row (text values); False when the log already holds it."""
        return self.emit_record(tc.mapper, tc.mapper.map_insert_at(row, where, position))

    def emit_record(self, mapper: RecordMapper, m: MappedRecord) -> bool:
        """Add a mapped record (``mapper`` made it); False when the log already holds it."""
        topic = m.topic
        n = self.topic_partitions.get(topic)
        if n is None:
            existing = self._existing.get(topic)
            if existing is None:  # created by the writer thread, before this batch's records
                cfg = (self.history_cfg if mapper.keep_history
                       else TopicConfig(partitions=self.partitions, cleanup_policy=mapper.cleanup_policy))
                self.pending.creates.append((topic, cfg))
            n = self.topic_partitions[topic] = existing.partitions if existing else self.partitions
        where_to = (topic, partition_for(m.record.key, n))
        if self.mapped_max_tail is not None and m.order <= self.mapped_max_tail:
            tail = self.mapped_tails.get(where_to)
            if tail is not None and m.order <= tail:
                return False
        # tails move with what this run writes: a resumed snapshot reads rows committed after
        # the slot's consistent point, which the stream then delivers again
        self.mapped_tails[where_to] = m.order
        if self.mapped_max_tail is None or m.order > self.mapped_max_tail:
            self.mapped_max_tail = m.order
        pending = self.pending
        recs = pending.by_topic.get(topic)
        if recs is None:
            recs = pending.by_topic[topic] = []
        recs.append(m.record)
        pending.count += 1
        return True

    # -- flushing ------------------------------------------------------------------------------
    def flush(self, offset: PgOffset | None, token: Any = None, *, transactions: int = 0,
              commit_ts_ms: int | None = None, cut: bool = True) -> None:
        """Hand the pending records (schema first) and the offset to the writer.

        ``transactions`` / ``commit_ts_ms``: the source transactions the batch completes and the
        commit time of its last one (counted and measured by the writer once durable). ``cut``: the
        batch ends at a transaction boundary (``Batch.cut``)."""
        assert self.writer is not None
        p = self.pending
        if self.before_flush is not None:
            self.before_flush(p)
        batch = Batch(creates=p.creates, offset=None if offset is None else offset.to_dict(), token=token,
                      transactions=transactions, commit_ts_ms=commit_ts_ms, cut=cut)
        batch.add(self.schema_topic, p.schema)
        for topic, recs in p.by_topic.items():
            batch.add(topic, recs)
        for topic, partition, recs in p.truncates:
            batch.add(topic, recs, partition)
        self.summary.records += batch.records
        self.pending = PendingBatch()
        self.writer.submit(batch)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        try:
            self.conn.close()
        except Exception:
            pass

    def require_writer(self) -> CaptureWriter:
        if self.writer is None:
            raise SourceError("capture context used before prepare_log()")
        return self.writer
