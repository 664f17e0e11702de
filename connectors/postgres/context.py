"""State shared by the PostgreSQL snapshot and streaming sources of one capture run.

Holds the catalog connection, the per-table codecs, the schema topic, the batch
being built, the writer, and the duplicate filter derived from the log's tail
positions (see ``kappaflow.connectors.base`` for the exactly-once argument).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson
import psycopg

from kappaflow.connectors.base import CaptureSummary, TrustedRecord, tail_positions
from kappaflow.connectors.offsets import OffsetStore
from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres.offset import PgOffset
from kappaflow.connectors.postgres.rows import TableCodec
from kappaflow.connectors.postgres.slots import TableInfo, TypeCatalog
from kappaflow.connectors.writer import Batch, CaptureWriter, FaultHook
from kappaflow.errors import SourceError
from kappaflow.events import EventCodec, PgPosition, TableSchema
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
                 writer_threaded: bool = True, fault: FaultHook | None = None) -> None:
        self.source = source
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
            t.qualified: t for t in slots.resolve_tables(self.conn, tables, key_columns)
        }
        self.codecs: dict[str, TableCodec] = {}
        self.topic_cfg = TopicConfig(partitions=partitions, cleanup_policy=CleanupPolicy.COMPACT)
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

    # -- startup -------------------------------------------------------------------------
    def prepare_log(self) -> None:
        """Create topics, load stored schemas and the tail positions (before the writer starts)."""
        log = self.log
        self._existing = log.list_topics()
        if self.schema_topic not in self._existing:
            log.create_topic(self.schema_topic, TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.COMPACT),
                             exist_ok=True)
        for info in self.tables.values():
            self._ensure_topic(self.topic_of(info))
        for rec in log.iter_partition(self.schema_topic, 0):
            if rec.key is None:
                continue
            name = orjson.loads(rec.key)
            if rec.value is None:
                self.stored_schemas.pop(name, None)
            else:
                self.stored_schemas[name] = TableSchema.from_dict(orjson.loads(rec.value)).fingerprint()
        tails = tail_positions(log, [self.topic_of(t) for t in self.tables.values()])
        self.tails = {k: p.sort_key() for k, p in tails.items() if isinstance(p, PgPosition)}
        self.max_tail = max(self.tails.values()) if self.tails else None
        self.writer = CaptureWriter(log, self.offsets, self.source, threaded=self._writer_threaded,
                                    fault=self.fault)

    def topic_of(self, info: TableInfo) -> str:
        return f"{self.source}.{info.schema}.{info.name}"

    def _ensure_topic(self, topic: str) -> int:
        """Partition count of a table topic; created (compacted) when missing, else used as it is."""
        n = self.topic_partitions.get(topic)
        if n is None:
            cfg = self._existing.get(topic) or self.log.create_topic(topic, self.topic_cfg, exist_ok=True)
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
            info = slots.load_table(self.conn, schema, name, keys)
            self.tables[qualified] = info
            topic = self.topic_of(info)
            existing = self._existing.get(topic)
            if existing is None:  # created by the writer thread, before this batch's records
                self.pending.creates.append((topic, self.topic_cfg))
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

    # -- flushing ------------------------------------------------------------------------------
    def flush(self, offset: PgOffset | None, token: Any = None) -> None:
        """Hand the pending records (schema first) and the offset to the writer."""
        assert self.writer is not None
        p = self.pending
        batch = Batch(creates=p.creates, offset=None if offset is None else offset.to_dict(), token=token)
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
