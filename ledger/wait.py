"""Read-your-writes: wait until a named projection has processed a ledger position.

`append` returns the global position of the last event written; a caller that must show the
user a view including that write calls ``wait_for_projection(dsn, "balances", result.position)``.
Where a projection records its progress is the projections part's business; this module only
needs something that answers "the highest ledger position this projection has processed (where
`position` lives)", the `ProjectionPositions` protocol. Two implementations:

- `LogProjectionPositions`: kappaflow's own setup. Ledger events reach the log on topic
  ``<source>.<stream_type>``, partition murmur2(stream id); projections store the next log offset
  per (projection, target, topic, partition) in ``kappaflow.projection_positions``. The event at
  `position` names its topic and partition; the projection has processed it once the record
  just before its next offset carries a ledger position >= `position`.
- `PostgresProjectionPositions`: a table that stores ledger positions directly
  (``(projection, source, position)``; names configurable), for custom projectors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import psycopg
from psycopg import sql

from kappaflow.errors import ConfigError, UnknownTopicError
from kappaflow.ledger.errors import LedgerUnavailableError, ProjectionTimeoutError
from kappaflow.ledger.logmap import ledger_topic
from kappaflow.ledger.store import Ledger
from kappaflow.log.base import Log
from kappaflow.log.partitioner import partition_for


@runtime_checkable
class ProjectionPositions(Protocol):
    def processed(self, projection: str, position: int) -> int | None:
        """The highest ledger position `projection` has processed among the events ordered with
        `position` (for a partitioned log: its partition), or None if unknown."""


@dataclass
class PostgresProjectionPositions:
    """Reads a positions table: ``max(position)`` over the projection's rows (optionally one source).

    `next_to_read=True` when the table stores the next position to read (resume state) rather
    than the last processed one.
    """

    dsn: str
    schema: str = "kappaflow"
    table: str = "projection_positions"
    source: str | None = None
    projection_column: str = "projection"
    source_column: str = "source"
    position_column: str = "position"
    next_to_read: bool = False
    _conn: psycopg.Connection | None = field(default=None, init=False, repr=False)

    def _query(self) -> sql.Composed:
        q = sql.SQL("select max({pos}) from {tbl} where {proj} = %s").format(
            pos=sql.Identifier(self.position_column), tbl=sql.Identifier(self.schema, self.table),
            proj=sql.Identifier(self.projection_column))
        if self.source is not None:
            q = q + sql.SQL(" and {src} = %s").format(src=sql.Identifier(self.source_column))
        return q

    def connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            try:
                self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
            except psycopg.OperationalError as exc:
                raise LedgerUnavailableError(f"cannot connect to read projection positions: "
                                             f"{str(exc).strip().splitlines()[0]}") from None
        return self._conn

    def processed(self, projection: str, position: int = 0) -> int | None:
        conn = self.connection()
        params: tuple[object, ...] = (projection,) if self.source is None else (projection, self.source)
        try:
            row = conn.execute(self._query(), params).fetchone()
        except psycopg.errors.UndefinedTable:
            raise ConfigError(f"projection positions table {self.schema}.{self.table} does not exist "
                              "(run the projections migrations, or point PostgresProjectionPositions "
                              "at the right table)") from None
        except psycopg.errors.UndefinedColumn as exc:
            raise ConfigError(f"projection positions table {self.schema}.{self.table}: "
                              f"{str(exc).strip().splitlines()[0]}") from None
        if row is None or row[0] is None:
            return None
        value = int(row[0])
        return value - 1 if self.next_to_read else value

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class LogProjectionPositions:
    """Ledger position -> log partition -> the projection's committed offset -> ledger position.

    `views_dsn` holds ``kappaflow.projection_positions`` (projections branch); `log` is the log the
    ledger's events were published to under `source` (connector or `LedgerRelay`).
    """

    def __init__(self, views_dsn: str, log: Log, ledger: Ledger, source: str, *, target: str = "live",
                 schema: str = "kappaflow", table: str = "projection_positions") -> None:
        self.log = log
        self.ledger = ledger
        self.source = source
        self.target = target
        self._positions = PostgresProjectionPositions(views_dsn, schema=schema, table=table)
        self._query = sql.SQL(
            "select next_offset from {} where projection = %s and target = %s and topic = %s "
            "and {} = %s").format(sql.Identifier(schema, table), sql.Identifier("partition"))
        self._where: dict[int, tuple[str, int]] = {}

    def locate(self, position: int) -> tuple[str, int]:
        """(topic, partition) of the ledger event at `position`."""
        where = self._where.get(position)
        if where is None:
            events = self.ledger.read_all(from_position=position, limit=1, decode=False)
            if not events or events[0].position != position:
                raise ConfigError(f"wait_for_projection: ledger position {position} does not exist")
            e = events[0]
            topic = ledger_topic(self.source, e.stream_type)
            where = (topic, partition_for(e.stream_id.encode(), self.log.partitions(topic)))
            self._where = {position: where}
        return where

    def processed(self, projection: str, position: int) -> int | None:
        try:
            topic, partition = self.locate(position)
        except UnknownTopicError:
            return None  # the first event of its stream type has not reached the log yet
        conn = self._positions.connection()
        try:
            row = conn.execute(self._query, (projection, self.target, topic, partition)).fetchone()
        except psycopg.errors.UndefinedTable:
            raise ConfigError("kappaflow.projection_positions does not exist (run the projections "
                              "migrations: kappaflow.migrations.upgrade(dsn, 'projections@head'))") from None
        if row is None or not row[0]:
            return None
        from kappaflow.ledger.relay import record_position

        recs = self.log.read(topic, partition, int(row[0]) - 1, 1)
        return record_position(recs[0]) if recs else None

    def close(self) -> None:
        self._positions.close()


def wait_for_projection(dsn: str | ProjectionPositions, projection_name: str, position: int,
                        timeout: float = 10.0, *, poll_interval: float = 0.05,
                        source: str | None = None) -> int:
    """Block until `projection_name` has processed ledger `position`; returns the position reached.

    `dsn` is the database holding the projection positions table, or any `ProjectionPositions`.
    Raises `ProjectionTimeoutError` (transient) naming the projection, the wanted and the reached
    position after `timeout` seconds.
    """
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        raise ConfigError(f"wait_for_projection position: expected an integer >= 0, got {position!r}")
    if timeout < 0:
        raise ConfigError(f"wait_for_projection timeout: expected seconds >= 0, got {timeout!r}")
    own = isinstance(dsn, str)
    positions: ProjectionPositions = PostgresProjectionPositions(dsn, source=source) if isinstance(dsn, str) \
        else dsn
    deadline = time.monotonic() + timeout
    try:
        while True:
            reached = positions.processed(projection_name, position)
            if reached is not None and reached >= position:
                return reached
            now = time.monotonic()
            if now >= deadline:
                raise ProjectionTimeoutError(projection_name, position, reached, timeout)
            time.sleep(min(poll_interval, deadline - now))
    finally:
        if own and isinstance(positions, PostgresProjectionPositions):
            positions.close()


__all__ = ["LogProjectionPositions", "PostgresProjectionPositions", "ProjectionPositions", "wait_for_projection"]
