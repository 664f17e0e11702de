"""Read-your-writes: wait until a named projection has processed a ledger position.

`append` returns the global position of the last event written; a caller that must show the
user a view including that write calls::

    wait_for_projection(views_dsn, "balances", result.position)

`views_dsn` is the database holding the views and kappaflow's ``kappaflow.projection_positions``
(created by the projections migrations, written by every PostgreSQL-backed projection in the
same transaction as its view rows). That table stores log offsets, not ledger positions, so the
wait also needs the log the ledger source publishes to, the source's name and the ledger (to
find which topic partition the event at `position` went to): pass them (``log=``, ``source=``,
``ledger=``), or let them come from the project's configuration (``kappaflow.toml`` in the
working folder, or ``config=PATH``): its ledger source (``source=`` picks one when there are
several) and its ``[log]``.

What answers "the highest ledger position this projection has processed" is the
`ProjectionPositions` protocol; any implementation can be passed instead of a DSN:

- `LogProjectionPositions`: kappaflow's own setup, what the DSN form builds. Ledger events reach
  the log on topic ``<source>.<stream_type>``, partition murmur2(stream id); the event at
  `position` names its topic and partition; the projection has processed it once the record
  just before its next offset there carries a ledger position >= `position`.
- `PostgresProjectionPositions`: a table of the caller's own that stores ledger positions
  directly (``(projection, source, position)``; names configurable), for custom projectors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

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
    """Reads a custom projector's positions table, one that stores LEDGER positions:
    ``max(position)`` over the projection's rows (optionally one source). Not for kappaflow's
    own ``kappaflow.projection_positions`` (log offsets): that is `LogProjectionPositions`.

    `next_to_read=True` when the table stores the next position to read (resume state) rather
    than the last processed one.
    """

    dsn: str
    table: str
    schema: str = "public"
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
                              "(point PostgresProjectionPositions at your projector's table)") from None
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
        self._owned: list[Any] = []  # what `from_project` opened and `close` closes
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

    @classmethod
    def from_project(cls, views_dsn: str, *, log: Log | None = None, ledger: Ledger | None = None,
                     source: str | None = None, target: str = "live",
                     config: str | Path | None = None) -> LogProjectionPositions:
        """The log, ledger and source name the caller did not pass, from the project configuration
        (its ledger source, or the one named `source`; its ``[log]``). Closes what it opened."""
        opened: list[Any] = []
        if log is None or ledger is None or source is None:
            from kappaflow.config import LedgerSourceConfig, Settings

            settings = Settings.load(config)
            ledgers = {n: s for n, s in settings.sources.items() if isinstance(s, LedgerSourceConfig)}
            if source is None:
                if len(ledgers) != 1:
                    found = ", ".join(sorted(ledgers)) or "none"
                    raise ConfigError(f"wait_for_projection: expected one ledger source in the configuration "
                                      f"(found: {found}); pass source=NAME")
                source = next(iter(ledgers))
            src = ledgers.get(source)
            if ledger is None:
                if src is None:
                    raise ConfigError(f"wait_for_projection: no ledger source {source!r} in the configuration; "
                                      "pass ledger=Ledger(...)")
                ledger = Ledger(src.connect_dsn(), schema=src.schema_name, pool_size=1)
                opened.append(ledger)
            if log is None:
                log = settings.open_log(read_only=True)
                opened.append(log)
        assert log is not None and ledger is not None and source is not None
        out = cls(views_dsn, log, ledger, source, target=target)
        out._owned = opened
        return out

    def close(self) -> None:
        self._positions.close()
        owned, self._owned = self._owned, []
        for thing in owned:
            thing.close()


def wait_for_projection(dsn: str | ProjectionPositions, projection_name: str, position: int,
                        timeout: float = 10.0, *, poll_interval: float = 0.05, source: str | None = None,
                        log: Log | None = None, ledger: Ledger | None = None, target: str = "live",
                        config: str | Path | None = None) -> int:
    """Block until `projection_name` has processed ledger `position`; returns the position reached.

    `dsn` is the views database holding ``kappaflow.projection_positions`` (see the module
    docstring for `log`, `ledger`, `source` and `config`), or any `ProjectionPositions`.
    Raises `ProjectionTimeoutError` (transient) naming the projection, the wanted and the reached
    position after `timeout` seconds.
    """
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        raise ConfigError(f"wait_for_projection position: expected an integer >= 0, got {position!r}")
    if timeout < 0:
        raise ConfigError(f"wait_for_projection timeout: expected seconds >= 0, got {timeout!r}")
    own = isinstance(dsn, str)
    positions: ProjectionPositions = LogProjectionPositions.from_project(
        dsn, log=log, ledger=ledger, source=source, target=target, config=config) if isinstance(dsn, str) else dsn
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
        if own and isinstance(positions, LogProjectionPositions):
            positions.close()


__all__ = ["LogProjectionPositions", "PostgresProjectionPositions", "ProjectionPositions", "wait_for_projection"]
