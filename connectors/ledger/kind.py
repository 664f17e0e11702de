"""Ledger sources in the source registry (`kappaflow.connectors.registry`): a ledger's events table from the WAL.

A ledger is captured like a PostgreSQL source whose only table is ``<schema>.events``; its hooks are
the PostgreSQL ones on `LedgerSourceConfig.postgres_config()`, plus the ledger's own status and the
fix `doctor` gives when the ledger is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kappaflow.connectors.postgres.kind import KIND as POSTGRES
from kappaflow.connectors.registry import SourceKind

if TYPE_CHECKING:
    from kappaflow.connectors.base import Connector
    from kappaflow.connectors.writer import FaultHook
    from kappaflow.doctor import Finding
    from kappaflow.log.base import Log

__all__ = ["KIND"]


def _connector(config: Any, log: Log, *, partitions: int, progress: bool | None, log_kafka: Any,
               fault: FaultHook | None = None) -> Connector:
    from kappaflow.connectors.ledger.connector import LedgerConnector

    return LedgerConnector(config, log, partitions=partitions, progress=progress, fault=fault)


def _status(config: Any, log: Log) -> dict[str, Any]:
    from kappaflow.connectors.ledger.connector import ledger_status

    return ledger_status(config, log)


def _doctor(config: Any) -> Iterator[Finding]:
    """The PostgreSQL checks; a missing events table is a ledger not installed there."""
    from kappaflow.doctor import Finding, Status

    for f in POSTGRES.doctor(config.postgres_config()):
        if f.check == f"table {config.events_table}" and f.status is Status.FAIL and "unknown table" in f.detail:
            f = Finding(f.area, f.check, f.status, f.detail, "install the ledger there: kappaflow ledger install "
                        f"(its schema is {config.schema_name!r}; --ledger-schema when adding the source)")
        yield f


def _append_only(config: Any, log: Log, topics: Mapping[str, Any]) -> set[str]:
    """One topic per stream type, append-only (a stream's every event counts); only ``__schema`` compacts."""
    prefix = f"{config.name}."
    return {t for t in topics if t.startswith(prefix) and t != f"{config.name}.__schema"}


KIND = SourceKind(
    kind="ledger",
    connector=_connector,
    status=_status,
    doctor=_doctor,
    release=POSTGRES.release,
    probe=POSTGRES.probe,
    append_only_topics=_append_only,
    captured=lambda config: [config.events_table],
    postgres_slot=True,
    fault_hook=True,
)
