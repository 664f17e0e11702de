"""PostgreSQL names and types: kappaflow's schema and tables, Spark -> PostgreSQL types,
identifiers within the 63-byte limit, and the Alembic migration of kappaflow's own tables."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DayTimeIntervalType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from kappaflow.errors import ConfigError, SinkError

KF_SCHEMA = "kappaflow"  # kappaflow's own tables: positions, registry, keyed state, deleted keys
POSITIONS = "projection_positions"
MAX_IDENT = 63  # PostgreSQL's identifier limit in bytes
STATE_TOPIC = "_kf_topic"  # keyed state: the source topic and key of a contributing row
STATE_KEY = "_kf_key"
DELETED_AT = "_kf_deleted_at"  # deleted-keys table: when the delete was recorded

_MIGRATED: set[str] = set()
_MIGRATE_LOCK = threading.Lock()


def ensure_migrated(dsn: str) -> None:
    """Apply the ``projections`` Alembic branch once per process and database."""
    with _MIGRATE_LOCK:
        if dsn in _MIGRATED:
            return
        from kappaflow.migrations import upgrade

        try:
            upgrade(dsn, "projections@head")
        except Exception as exc:
            raise SinkError(f"creating kappaflow's tables (migration 'projections@head') failed: {exc}") from exc
        _MIGRATED.add(dsn)


def pg_type(dt: DataType) -> str:
    """PostgreSQL type for a Spark type, spelled like ``format_type()`` prints it."""
    if isinstance(dt, BooleanType):
        return "boolean"
    if isinstance(dt, (ByteType, ShortType)):
        return "smallint"
    if isinstance(dt, IntegerType):
        return "integer"
    if isinstance(dt, LongType):
        return "bigint"
    if isinstance(dt, FloatType):
        return "real"
    if isinstance(dt, DoubleType):
        return "double precision"
    if isinstance(dt, DecimalType):
        return f"numeric({dt.precision},{dt.scale})"
    if isinstance(dt, StringType):
        return "text"
    if isinstance(dt, BinaryType):
        return "bytea"
    if isinstance(dt, DateType):
        return "date"
    if isinstance(dt, TimestampNTZType):
        return "timestamp without time zone"
    if isinstance(dt, TimestampType):
        return "timestamp with time zone"
    if isinstance(dt, DayTimeIntervalType):
        return "interval"
    if isinstance(dt, ArrayType):
        inner = dt.elementType
        if isinstance(inner, (ArrayType, MapType, StructType)):
            return "jsonb"
        return pg_type(inner) + "[]"
    if isinstance(dt, (MapType, StructType)):
        return "jsonb"
    raise ConfigError(f"no PostgreSQL type for Spark type {dt.simpleString()!r}")


def ident(name: str) -> Any:
    from psycopg import sql

    return sql.Identifier(name)


def physical_name(base: str, suffix: str) -> str:
    """``base + suffix`` within PostgreSQL's 63-byte identifier limit (hash-shortened)."""
    name = base + suffix
    if len(name.encode()) <= MAX_IDENT:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    keep = MAX_IDENT - len(suffix.encode()) - 9
    return base.encode()[:keep].decode(errors="ignore") + "_" + digest + suffix


__all__ = [
    "KF_SCHEMA",
    "MAX_IDENT",
    "POSITIONS",
    "STATE_KEY",
    "STATE_TOPIC",
    "ensure_migrated",
    "ident",
    "pg_type",
    "physical_name",
]
