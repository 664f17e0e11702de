"""The views database as the PostgreSQL sink sees it: one autocommit connection, the names of a
view's tables, introspection, per-connection staging tables and COPY, and the positions table.
The sink (``sink.py``), its grouped state (``groups.py``) and the group change table mirrors read
(``mirror.py``) build on it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from kappaflow.errors import ConfigError, Retry, SinkError
from kappaflow.projections.sinks.base import (
    DELETED,
    VERSION,
    Positions,
    Target,
    TopicPartition,
    ViewSpec,
)
from kappaflow.projections.sinks.postgres.copy import csv_bytes
from kappaflow.projections.sinks.postgres.ddl import (
    KF_SCHEMA,
    POSITIONS,
    ensure_migrated,
    ident,
    pg_type,
    physical_name,
)


def sink_error(what: str, exc: Exception) -> SinkError:
    import psycopg

    transient = isinstance(exc, (psycopg.OperationalError,)) or getattr(exc, "sqlstate", "") in (
        "40001",
        "40P01",
        "55P03",
        "57014",
    )
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return SinkError(f"PostgreSQL sink: {what}: {msg}", retry=Retry.TRANSIENT if transient else Retry.TERMINAL)


class PostgresTables:
    """Connection, names and shared table helpers of the PostgreSQL sink."""

    def __init__(self, dsn: str, *, schema: str = "public", migrate: bool = True) -> None:
        import psycopg

        if not dsn.startswith(("postgresql://", "postgres://")) and "=" not in dsn:
            raise ConfigError("views.postgres.dsn: expected a postgresql://user@host:port/db URL")
        self.dsn = dsn
        self.default_schema = schema
        if migrate:
            ensure_migrated(dsn)
        try:
            self.conn = psycopg.connect(dsn, autocommit=True)
        except psycopg.Error as exc:
            raise sink_error("connecting to the views database", exc) from None
        self._staging: dict[tuple[str, str], str] = {}
        self._pruned: dict[tuple[str, str], float] = {}

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass

    def _schema(self, view: ViewSpec) -> str:
        return view.namespace or self.default_schema

    def _shadow_name(self, view: ViewSpec, label: str) -> str:
        return physical_name(view.name, f"__kf_{label}")

    def _rel(self, view: ViewSpec, name: str) -> Any:
        from psycopg import sql

        return sql.SQL("{}.{}").format(ident(self._schema(view)), ident(name))

    def relation(self, target: Target) -> str:
        """The quoted ``schema.table`` of a target (for messages and ad-hoc SQL)."""
        return f'"{self._schema(target.view)}"."{target.name}"'

    def _table_columns(self, schema: str, table: str) -> list[tuple[str, str, bool]] | None:
        rows = self.conn.execute(
            """
            SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull
            FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped
            ORDER BY a.attnum
            """,
            (schema, table),
        ).fetchall()
        if not rows:
            exists = self.conn.execute(
                "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relname = %s",
                (schema, table),
            ).fetchone()
            return [] if exists else None
        return [(r[0], r[1], r[2]) for r in rows]

    def _primary_key(self, schema: str, table: str) -> list[str]:
        rows = self.conn.execute(
            """
            SELECT a.attname FROM pg_index i
            JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace
            JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord) ON true
            JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum
            WHERE n.nspname = %s AND c.relname = %s AND i.indisprimary ORDER BY k.ord
            """,
            (schema, table),
        ).fetchall()
        return [r[0] for r in rows]

    def _staging_table(self, target: Target) -> str:
        """A temp table shaped like the batch (per connection, emptied at commit)."""
        from psycopg import sql

        key = (self._schema(target.view), target.name)
        name = self._staging.get(key)
        if name is not None:
            return name
        name = f"kf_stg_{len(self._staging)}_{hashlib.sha1(repr(key).encode()).hexdigest()[:8]}"
        cols = [sql.SQL("{} {}").format(ident(c.name), sql.SQL(pg_type(c.type))) for c in target.view.columns]
        cols += [sql.SQL("{} bigint").format(ident(VERSION)), sql.SQL("{} boolean").format(ident(DELETED))]
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS pg_temp.{}").format(ident(name)))
        self.conn.execute(
            sql.SQL("CREATE TEMP TABLE {} ({}) ON COMMIT DELETE ROWS").format(ident(name), sql.SQL(", ").join(cols))
        )
        self._staging[key] = name
        return name

    def _forget_staging(self) -> None:
        """After a failed write: a staging table created in the rolled-back transaction is gone
        (with pg_temp itself, the first time), so the next write must create it again instead of
        failing on it for the life of the connection (a transient lock timeout would otherwise
        turn into a permanent "does not exist")."""
        self._staging.clear()

    def _copy(self, rel: Any, columns: Sequence[str], table: pa.Table) -> None:
        from psycopg import sql

        if table.num_rows == 0:
            return
        data = csv_bytes(table.select(list(columns)))
        stmt = sql.SQL("COPY {} ({}) FROM STDIN WITH (FORMAT csv)").format(
            rel, sql.SQL(", ").join(ident(c) for c in columns)
        )
        with self.conn.cursor() as cur, cur.copy(stmt) as cp:
            cp.write(data)

    def read_positions(self, target: Target) -> dict[TopicPartition, int]:
        rows = self.conn.execute(
            f'SELECT topic, "partition", next_offset FROM "{KF_SCHEMA}"."{POSITIONS}" '
            "WHERE projection = %s AND target = %s",
            (target.view.projection, target.label),
        ).fetchall()
        return {(r[0], int(r[1])): int(r[2]) for r in rows}

    def _store_positions(self, target: Target, positions: Positions) -> None:
        if not positions:
            return
        items = sorted(positions.items())
        with self.conn.cursor() as cur:
            cur.executemany(
                f'INSERT INTO "{KF_SCHEMA}"."{POSITIONS}" AS p (projection, target, topic, "partition", next_offset) '
                'VALUES (%s, %s, %s, %s, %s) ON CONFLICT (projection, target, topic, "partition") DO UPDATE '
                "SET next_offset = GREATEST(p.next_offset, excluded.next_offset), updated_at = now()",
                [(target.view.projection, target.label, t, p, int(o)) for (t, p), o in items],
            )
