"""Record mappers: an append-only table's rows become log records of the mapper's choosing.

The PostgreSQL connector normally writes one Debezium change event per row change to
``<source>.<schema>.<table>``. A :class:`RecordMapper` attached to a captured table
replaces that: each row *inserted* into the table (snapshot or stream) is handed to
:meth:`RecordMapper.map_insert` in PostgreSQL's text output form (what pgoutput and
``COPY`` send, with the connector's session settings: TimeZone UTC, DateStyle ISO,
bytea as hex), so the mapper converts only what it needs, once. It names the topic,
the record and its **order**
(an integer that increases strictly along the table's commit order, e.g. the ledger's
global position). Everything else stays the connector's: snapshot, streaming, offsets,
acknowledging upstream only after the records are durable.

Exactly-once with a mapper (the argument of ``connectors/base.py`` with ``order`` in the
place of the source position): the connector appends a topic-partition's records in
commit order, so the records present are a prefix; on restart it reads the last record
of every partition of the mapper's topics (:meth:`RecordMapper.owns_topic`) and takes
its order (:meth:`RecordMapper.order_of`); a row whose order is at or below its
partition's tail is already in the log and is skipped. Mapped records need no position
header of kappaflow's own, so they can be byte-identical to what another producer (the
ledger relay) writes.

Mapped tables are append-only by contract: an UPDATE, DELETE or TRUNCATE on one stops
the capture with a terminal :class:`SourceError` (it cannot be mapped without
rewriting history downstream), naming the table and the WAL position.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kappaflow.errors import Retry, SourceError
from kappaflow.log.base import CleanupPolicy, LogRecord, Record

if TYPE_CHECKING:
    from kappaflow.connectors.postgres.slots import TableInfo
    from kappaflow.connectors.postgres.source_info import PgPosition

__all__ = ["MappedRecord", "RecordMapper"]


@dataclass(frozen=True, slots=True)
class MappedRecord:
    topic: str
    record: Record
    order: int  # strictly increasing along the table's commit order


class RecordMapper(abc.ABC):
    """Maps the rows inserted into one append-only table to log records."""

    #: cleanup policy of the topics the mapper's records create (event topics: DELETE)
    cleanup_policy: CleanupPolicy = CleanupPolicy.DELETE
    #: its topics keep every record for ever (on Kafka retention.ms/retention.bytes -1, else the
    #: broker's default retention deletes them after 7 days): a ledger's streams, whose every event counts
    keep_history: bool = False
    #: appended to the error raised when a mapped row is updated, deleted or truncated
    immutable_hint: str = ""

    @abc.abstractmethod
    def map_insert(self, row: Mapping[str, bytes | None], where: str) -> MappedRecord:
        """The record for one inserted row: column name -> text output bytes (None: NULL).

        ``where`` names the row's place for error messages ("WAL 0/16B3748", "snapshot of ...").
        """

    def map_insert_at(self, row: Mapping[str, bytes | None], where: str,
                      position: PgPosition | None) -> MappedRecord:
        """:meth:`map_insert` with the row's source position (None: not known), for mappers whose
        order is the source position (the outbox router, ``connectors/postgres/outbox.py``)."""
        return self.map_insert(row, where)

    def bind_table(self, info: TableInfo) -> None:
        """Called at capture start with the mapped table's catalog entry (to check its columns)."""
        return None

    def skip_change(self, table: str, op: str, where: str) -> bool:
        """True: an UPDATE, DELETE or TRUNCATE of the mapped table is skipped rather than refused
        (:meth:`refuse`); a mapper may raise its own error instead."""
        return False

    @abc.abstractmethod
    def owns_topic(self, topic: str) -> bool:
        """True for topics this mapper writes (their tails are read on start)."""

    @abc.abstractmethod
    def order_of(self, rec: LogRecord) -> int | None:
        """The order a record written by this mapper carries (None: not one of ours)."""

    def refuse(self, table: str, op: str, where: str) -> SourceError:
        hint = f" {self.immutable_hint}" if self.immutable_hint else ""
        return SourceError(f"table {table}: {op} at {where}, but the table is captured as append-only "
                           f"(its inserted rows are mapped to records; changing them cannot be mapped).{hint}",
                           retry=Retry.TERMINAL)
