"""The PostgreSQL sink, one role per module:

- ``ddl.py``: kappaflow's schema and tables, Spark -> PostgreSQL types, identifiers, migrations;
- ``copy.py``: Arrow -> the CSV that COPY reads;
- ``tables.py``: the connection, a view's table names, staging tables, the positions table;
- ``mirror.py``: the group change table that mirrors of a grouped view read;
- ``groups.py``: grouped views: keyed state, group recompute, the aggregates in SQL;
- ``sink.py``: the sink itself (targets, guarded writes, swap, reads, verify, the lock).

``from kappaflow.projections.sinks.postgres import PostgresSink`` stays the import to use.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kappaflow.projections.sinks.postgres.copy import csv_bytes
    from kappaflow.projections.sinks.postgres.ddl import (
        KF_SCHEMA,
        STATE_KEY,
        STATE_TOPIC,
        ensure_migrated,
        pg_type,
        physical_name,
    )
    from kappaflow.projections.sinks.postgres.groups import aggregate_sql_of
    from kappaflow.projections.sinks.postgres.settings import PostgresSettings
    from kappaflow.projections.sinks.postgres.sink import TOMBSTONE_RETENTION_S, PostgresSink, PostgresSinkConfig

# Imported on first use, so that reading the settings (``settings.py``) does not load the sink.
_EXPORTS = {
    "PostgresSettings": "kappaflow.projections.sinks.postgres.settings",
    "csv_bytes": "kappaflow.projections.sinks.postgres.copy",
    "KF_SCHEMA": "kappaflow.projections.sinks.postgres.ddl",
    "STATE_KEY": "kappaflow.projections.sinks.postgres.ddl",
    "STATE_TOPIC": "kappaflow.projections.sinks.postgres.ddl",
    "ensure_migrated": "kappaflow.projections.sinks.postgres.ddl",
    "pg_type": "kappaflow.projections.sinks.postgres.ddl",
    "physical_name": "kappaflow.projections.sinks.postgres.ddl",
    "aggregate_sql_of": "kappaflow.projections.sinks.postgres.groups",
    "TOMBSTONE_RETENTION_S": "kappaflow.projections.sinks.postgres.sink",
    "PostgresSink": "kappaflow.projections.sinks.postgres.sink",
    "PostgresSinkConfig": "kappaflow.projections.sinks.postgres.sink",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "KF_SCHEMA",
    "STATE_KEY",
    "STATE_TOPIC",
    "TOMBSTONE_RETENTION_S",
    "PostgresSettings",
    "PostgresSink",
    "PostgresSinkConfig",
    "aggregate_sql_of",
    "csv_bytes",
    "ensure_migrated",
    "pg_type",
    "physical_name",
]
