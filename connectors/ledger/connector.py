"""The ledger source: the PostgreSQL connector with a record mapper on ``<schema>.events``.

No dual write: the application appends to the ledger (one ACID transaction) and this
connector derives the log from the WAL. It is the PostgreSQL connector unchanged —
publication, replication slot, consistent snapshot, streaming, offsets in the log,
acknowledging the slot only after the records are durable — with one difference: rows of
the events table do not become change events. `LedgerRecordMapper` turns each inserted
row into the record `kappaflow.ledger.logmap.to_log_record` defines:

- topic ``<source>.<stream_type>`` (cleanup policy DELETE: compaction would keep only the
  last event of each stream),
- key = the stream id (UTF-8), so a stream's events stay in one partition, in order,
- value = the domain event as JSON, headers ``kf.ledger.position`` / ``kf.ledger.event_type``
  (and ``kf.ledger.tag`` per tag), timestamp = the recording time; personal fields sealed as
  stored, or the forgotten marker once their subject is forgotten (`kappaflow.ledger.personal`).

Byte for byte what `kappaflow.ledger.LedgerRelay` (the fallback where ``wal_level`` is not
``logical``) writes, so a log started by the relay can be continued by the connector at any
time (its snapshot skips what the log holds). The other way round needs a clean stop of the
connector first: the relay resumes after the highest position in the log, which after a
crash of the connector may be ahead of a partition that missed its last batch.

Exactly-once in effect, from positions: the ledger's global position is dense and in commit
order, hence in WAL commit order, and it is the events table's primary key, so the snapshot
reads events in position order too. The position is the mapper's *order*
(``connectors/postgres/mapping.py``): on restart the connector reads the last position in
every partition of the source's topics and skips any event at or below it. A kill -9 at any
step leaves every event in the log exactly once after the restart.

Group commit: ledger appends commit with ``synchronous_commit = off`` and flush afterwards;
logical decoding only sends flushed WAL, and the slot's exported snapshot is built from
decoded (flushed) WAL, so the connector never publishes an event a server crash could
still take back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from kappaflow.config import LedgerSourceConfig
from kappaflow.connectors.base import CaptureSummary, Connector, StopSignal
from kappaflow.connectors.offsets import find_last
from kappaflow.connectors.postgres import slots
from kappaflow.connectors.postgres.connector import PostgresConnector, postgres_status
from kappaflow.connectors.postgres.mapping import MappedRecord, RecordMapper
from kappaflow.errors import Retry, SourceError, ValidationError
from kappaflow.ledger.logmap import LogRedactor, text_row_record
from kappaflow.ledger.personal import ForgottenSubjects, KeyStore
from kappaflow.ledger.relay import record_position
from kappaflow.log.base import Log, LogRecord

__all__ = ["LedgerConnector", "LedgerRecordMapper", "ledger_status"]


class LedgerRecordMapper(RecordMapper):
    """Events-table rows -> ledger event records (order = global position)."""

    keep_history = True  # every event of a stream counts: no retention limit on Kafka either
    immutable_hint = ("Ledger events are immutable (a trigger refuses changes): someone altered the events "
                      "table with superuser rights. Run `kappaflow ledger verify` to find the damage.")

    def __init__(self, source: str, redactor: LogRedactor | None = None) -> None:
        self.source = source
        self._prefix = source + "."
        self._schema_topic = source + ".__schema"
        self.redactor = redactor  # the forgotten marker instead of sealed personal data, once forgotten

    def map_insert(self, row: Mapping[str, bytes | None], where: str) -> MappedRecord:
        try:
            topic, record, position = text_row_record(self.source, row)
        except ValidationError as exc:
            raise ValidationError(f"{where}: {exc}") from None
        if self.redactor is not None:
            record = self.redactor.redact(record)
        return MappedRecord(topic, record, position)

    def owns_topic(self, topic: str) -> bool:
        return topic.startswith(self._prefix) and topic != self._schema_topic

    def order_of(self, rec: LogRecord) -> int | None:
        return record_position(rec)


class LedgerConnector(Connector):
    """Capture a ledger into ``log``; options as for `PostgresConnector` (partitions, progress,
    batch_records, linger_s, writer_threaded, fault)."""

    def __init__(self, config: LedgerSourceConfig, log: Log, *, partitions: int = 4,
                 progress: bool | None = None, **options: Any) -> None:
        self.config = config
        self.name = config.name
        self.log = log
        keys = KeyStore.connect(config.connect_dsn(), config.schema_name)
        self.mapper = LedgerRecordMapper(config.name, LogRedactor(ForgottenSubjects(keys)))
        self.postgres = PostgresConnector(config.postgres_config(), log, partitions=partitions, progress=progress,
                                          mappers={config.events_table: self.mapper}, **options)

    @property
    def summary(self) -> CaptureSummary | None:
        return self.postgres.summary

    def run(self, stop: StopSignal | None = None, *, until_caught_up: bool = False) -> CaptureSummary:
        check_installed(self.config)
        summary = self.postgres.run(stop, until_caught_up=until_caught_up)
        summary.connector = "ledger"
        return summary

    def status(self) -> dict[str, Any]:
        return ledger_status(self.config, self.log)


def check_installed(config: LedgerSourceConfig) -> None:
    """A clear error when the ledger's tables are not in the source database."""
    conn = slots.connect(config.connect_dsn(), what=f"connecting to ledger source {config.name!r}")
    try:
        row = conn.execute("SELECT to_regclass(%s)", (sql.Identifier(config.schema_name, "events").as_string(conn),)
                           ).fetchone()
    finally:
        conn.close()
    if row is None or row[0] is None:
        raise SourceError(f"ledger source {config.name!r}: no ledger in schema {config.schema_name!r} of this "
                          "database (table events is missing); install it with `kappaflow ledger install` or "
                          "set schema_name", retry=Retry.TERMINAL)


def ledger_status(config: LedgerSourceConfig, log: Log) -> dict[str, Any]:
    """The PostgreSQL source status plus the ledger's head and the highest position in the log.

    Only reads (``log`` may be a read-only embedded log).
    """
    out = postgres_status(config.postgres_config(), log)
    out["kind"] = "ledger"
    out["schema"] = config.schema_name
    mapper = LedgerRecordMapper(config.name)
    in_log = 0
    for topic, cfg in log.list_topics().items():
        if mapper.owns_topic(topic):
            for p in range(cfg.partitions):
                rec = find_last(log, topic, p, lambda r: record_position(r) is not None)
                if rec is not None:
                    in_log = max(in_log, record_position(rec) or 0)
    out["log_position"] = in_log
    if "error" not in out:
        try:
            conn = slots.connect(config.connect_dsn(), what="reading the ledger head")
            try:
                row = conn.execute(sql.SQL("SELECT coalesce(max(position), 0) FROM {}").format(
                    sql.Identifier(config.schema_name, "events"))).fetchone()
            finally:
                conn.close()
            head = int(row[0]) if row else 0
            out["ledger_head_position"] = head
            out["lag_events"] = max(0, head - in_log)
        except Exception as exc:  # a status report never fails on one missing figure
            out["error"] = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return out
