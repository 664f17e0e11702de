"""The PostgreSQL sink, one role per module:

- ``ddl.py``: kappaflow's schema and tables, Spark -> PostgreSQL types, identifiers, migrations;
- ``copy.py``: Arrow <-> the CSV of COPY (in and out);
- ``tables.py``: the connection, a view's table names, staging tables, the positions table;
- ``mirror.py``: the group change table that mirrors of a grouped view read;
- ``groups.py``: grouped views: keyed state, group recompute, the aggregates in SQL;
- ``sink.py``: the sink itself (targets, guarded writes, swap, reads, verify, the lock).

``from kappaflow.projections.sinks.postgres import PostgresSink`` stays the import to use.
"""

from typing import TYPE_CHECKING

from kappaflow.projections.sinks.exports import lazy_exports

if TYPE_CHECKING:
    from kappaflow.projections.sinks.postgres.copy import arrow_from_csv, csv_bytes
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
    from kappaflow.projections.sinks.postgres.sink import TOMBSTONE_RETENTION_S, PostgresSink

# Imported on first use, so that reading the settings (``settings.py``) does not load the sink.
__getattr__ = lazy_exports(__name__, {
    ".settings": ("PostgresSettings",),
    ".copy": ("arrow_from_csv", "csv_bytes"),
    ".ddl": ("KF_SCHEMA", "STATE_KEY", "STATE_TOPIC", "ensure_migrated", "pg_type", "physical_name"),
    ".groups": ("aggregate_sql_of",),
    ".sink": ("TOMBSTONE_RETENTION_S", "PostgresSink"),
})


__all__ = [
    "KF_SCHEMA",
    "STATE_KEY",
    "STATE_TOPIC",
    "TOMBSTONE_RETENTION_S",
    "PostgresSettings",
    "PostgresSink",
    "aggregate_sql_of",
    "arrow_from_csv",
    "csv_bytes",
    "ensure_migrated",
    "pg_type",
    "physical_name",
]
