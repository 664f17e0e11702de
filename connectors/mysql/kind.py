"""MySQL/MariaDB sources in the source registry (`kappaflow.connectors.registry`): the row-based binlog."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from kappaflow.connectors.outbox import append_only_topics
from kappaflow.connectors.registry import SourceKind

if TYPE_CHECKING:
    from kappaflow.connectors.base import Connector
    from kappaflow.connectors.preflight import TableCheck
    from kappaflow.connectors.writer import FaultHook
    from kappaflow.doctor import Finding
    from kappaflow.log.base import Log
    from kappaflow.metrics.probes import SourceProbe

__all__ = ["KIND"]


def _connector(config: Any, log: Log, *, partitions: int, progress: bool | None, log_kafka: Any,
               fault: FaultHook | None = None) -> Connector:
    from kappaflow.connectors.mysql.connector import MySQLConnector

    return MySQLConnector.from_config(config, log, partitions=partitions, progress=progress, fault=fault)


def _doctor(config: Any) -> Iterator[Finding]:
    from kappaflow.connectors.mysql.preflight import doctor_checks

    return doctor_checks(config)


def _tables(config: Any, duplicates: bool) -> list[TableCheck]:
    from kappaflow.connectors.mysql.preflight import check_source

    return check_source(config, duplicates)


def _release(config: Any, others: Iterable[Any], keep_slot: bool) -> list[str]:
    return ["nothing to drop on the MySQL/MariaDB server: a binlog reader keeps no state there "
            "(binlogs are purged by the server's own expiry)"]


def _probe(config: Any) -> SourceProbe:
    from kappaflow.connectors.mysql.probe import MySQLProbe

    return MySQLProbe(config)


KIND = SourceKind(
    kind="mysql",
    connector=_connector,
    doctor=_doctor,
    tables=_tables,
    release=_release,
    probe=_probe,
    append_only_topics=append_only_topics,
    captured=lambda config: list(config.tables) or ["(all)"],
    fault_hook=True,
)
