"""The PostgreSQL sink, one role per module:

- ``ddl.py``: kappaflow's schema and tables, Spark -> PostgreSQL types, identifiers, migrations;
- ``copy.py``: Arrow -> the CSV that COPY reads;
- ``tables.py``: the connection, a view's table names, staging tables, the positions table;
- ``mirror.py``: the group change table that mirrors of a grouped view read;
- ``groups.py``: grouped views: keyed state, group recompute, the aggregates in SQL;
- ``sink.py``: the sink itself (targets, guarded writes, swap, reads, verify, the lock).

``from kappaflow.projections.sinks.postgres import PostgresSink`` stays the import to use.
"""

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
from kappaflow.projections.sinks.postgres.sink import (
    TOMBSTONE_RETENTION_S,
    PostgresSink,
    PostgresSinkConfig,
)

__all__ = [
    "KF_SCHEMA",
    "STATE_KEY",
    "STATE_TOPIC",
    "TOMBSTONE_RETENTION_S",
    "PostgresSink",
    "PostgresSinkConfig",
    "aggregate_sql_of",
    "csv_bytes",
    "ensure_migrated",
    "pg_type",
    "physical_name",
]
