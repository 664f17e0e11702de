"""PostgreSQL sources in the source registry (`kappaflow.connectors.registry`): WAL through a slot."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
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
    from kappaflow.connectors.postgres.connector import PostgresConnector

    return PostgresConnector(config, log, partitions=partitions, progress=progress, fault=fault)


def _status(config: Any, log: Log) -> dict[str, Any]:
    from kappaflow.connectors.postgres.connector import postgres_status

    return postgres_status(config, log)


def _doctor(config: Any) -> Iterator[Finding]:
    from kappaflow.connectors.postgres.preflight import doctor_checks

    return doctor_checks(config)


def _tables(config: Any, duplicates: bool) -> list[TableCheck]:
    from kappaflow.connectors.postgres.preflight import check_source

    return check_source(config, duplicates)


def _release(config: Any, others: Iterable[Any], keep_slot: bool) -> list[str]:
    from kappaflow.connectors.postgres.slots import release

    return release(config, others, keep_slot)


def _probe(config: Any) -> SourceProbe:
    from kappaflow.connectors.postgres.probe import PostgresProbe

    return PostgresProbe(config)


def transaction_topic(config: Any, log: Log, topics: Mapping[str, Any]) -> set[str]:
    """The transaction metadata topic (``connectors/transactions.py``) is append-only; the table topics compact."""
    return {f"{config.name}.transaction"}


KIND = SourceKind(
    kind="postgres",
    connector=_connector,
    status=_status,
    doctor=_doctor,
    tables=_tables,
    release=_release,
    probe=_probe,
    append_only_topics=append_only_topics,
    captured=lambda config: list(config.tables) or ["(all)"],
    postgres_slot=True,
    fault_hook=True,
)
