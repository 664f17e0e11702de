"""PostgreSQL views: COPY into staging, one guarded upsert, positions in the same transaction.

Layout in the views database:

- the view: ``"<schema>"."<view>"`` with the projection's columns, the key as primary
  key, and ``_kf_version bigint`` (log position of the row);
- shadows: ``"<schema>"."<view>__kf_<label>"`` while a replay (``shadow``) or a verify
  (``verify``) builds one;
- grouped projections also keep keyed state (the current contributing row per source
  key) in ``"kappaflow"."state__<schema>__<view>"`` so an update that moves a row between
  groups, or a delete, can retract its old contribution (see ``apply_grouped``);
- deleted keys: ``"kappaflow"."deleted__<schema>__<view>"`` holds the key and version of
  every delete that removed (or found absent) a row, so an older upsert arriving after
  the delete has no effect (without it, a deleted row would leave no version behind and
  any older write would bring it back). An entry goes when a newer upsert of its key
  lands, or after ``TOMBSTONE_RETENTION_S`` (24 h, like the Redis sink's tombstones and
  Kafka's ``delete.retention.ms``); a replay starts with none;
- ``kappaflow.projection_positions`` and ``kappaflow.projections`` (Alembic branch
  ``projections``), created on first use.

A write (``write``) is ONE transaction: ``COPY`` the batch into a temporary staging
table, ``INSERT ... SELECT ... ON CONFLICT (key) DO UPDATE ... WHERE excluded._kf_version >
view._kf_version`` (and newer than a recorded delete of the key) for upserts, a
``DELETE ... USING staging`` guarded the same way for deletes plus their record in the
deleted-keys table, then the positions (never moved backwards). A swap renames the shadow over the
live table in one transaction (with a short ``lock_timeout`` and retries so a long reader
never queues everyone else behind the swap); readers see the old table until the commit
and the new one after, never an empty one.

Values travel as CSV written by pyarrow (C++), which PostgreSQL's COPY parses quickly;
binary, array and nested columns are rendered to PostgreSQL text forms first.
"""

from __future__ import annotations

import hashlib
import io
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
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

from kappaflow.errors import ConfigError, Retry, SinkError
from kappaflow.projections.sinks.base import (
    DELETED,
    VERSION,
    Drift,
    Positions,
    Sink,
    SinkConfig,
    Target,
    TopicPartition,
    ViewSchemaMismatch,
    ViewSpec,
    WriteResult,
)
from kappaflow.projections.sinks.errors import SinkStateLostError

KF_SCHEMA = "kappaflow"
POSITIONS = "projection_positions"
MAX_IDENT = 63
STATE_TOPIC = "_kf_topic"
STATE_KEY = "_kf_key"
SWAP_LOCK_TIMEOUT_MS = 2000
SWAP_ATTEMPTS = 30
CHANGES_BASE = "kappaflow: group changes complete since watermark "
TOMBSTONE_RETENTION_S = 86_400
"""How long a delete's version guards its key against older upserts (see the module docstring)."""
TOMBSTONE_PRUNE_EVERY_S = 60.0
DELETED_AT = "_kf_deleted_at"

log = logging.getLogger(__name__)

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


# --- types -------------------------------------------------------------------------------------
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


def _q(name: str) -> Any:
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


# --- CSV rendering -----------------------------------------------------------------------------
def _pg_array_literal(values: list[Any] | None) -> str | None:
    if values is None:
        return None
    parts = []
    for v in values:
        if v is None:
            parts.append("NULL")
            continue
        if isinstance(v, bytes):
            v = "\\x" + v.hex()
        elif isinstance(v, bool):
            v = "true" if v else "false"
        s = str(v)
        parts.append('"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"')
    return "{" + ",".join(parts) + "}"


def _render_for_csv(table: pa.Table) -> pa.Table:
    """Replace columns pyarrow's CSV writer cannot render as PostgreSQL reads them."""
    cols = []
    changed = False
    for i, f in enumerate(table.schema):
        col = table.column(i)
        t = f.type
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            col = pa.array([None if b is None else "\\x" + b.hex() for b in col.to_pylist()], pa.string())
            changed = True
        elif pa.types.is_list(t) or pa.types.is_large_list(t):
            vt = t.value_type
            if pa.types.is_list(vt) or pa.types.is_struct(vt) or pa.types.is_map(vt):
                col = pa.array(
                    [None if v is None else orjson.dumps(v, default=str).decode() for v in col.to_pylist()], pa.string()
                )
            else:
                col = pa.array([_pg_array_literal(v) for v in col.to_pylist()], pa.string())
            changed = True
        elif pa.types.is_struct(t) or pa.types.is_map(t):
            col = pa.array(
                [
                    None if v is None else orjson.dumps(v if not pa.types.is_map(t) else dict(v), default=str).decode()
                    for v in col.to_pylist()
                ],
                pa.string(),
            )
            changed = True
        elif pa.types.is_duration(t):
            col = pa.array(
                [None if v is None else f"{v.total_seconds()} seconds" for v in col.to_pylist()], pa.string()
            )
            changed = True
        cols.append(col)
    if not changed:
        return table
    return pa.Table.from_arrays(cols, names=table.column_names)


def csv_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pacsv.write_csv(_render_for_csv(table), buf, pacsv.WriteOptions(include_header=False))
    return buf.getvalue()


# --- config ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PostgresSinkConfig(SinkConfig):
    dsn: str
    schema: str = "public"
    migrate: bool = True

    def open(self) -> PostgresSink:
        return PostgresSink(self.dsn, schema=self.schema, migrate=self.migrate)


def _sink_error(what: str, exc: Exception) -> SinkError:
    import psycopg

    transient = isinstance(exc, (psycopg.OperationalError,)) or getattr(exc, "sqlstate", "") in (
        "40001",
        "40P01",
        "55P03",
        "57014",
    )
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return SinkError(f"PostgreSQL sink: {what}: {msg}", retry=Retry.TRANSIENT if transient else Retry.TERMINAL)


class PostgresSink(Sink):
    """Views as PostgreSQL tables (see the module docstring)."""

    kind = "postgres"

    def __init__(self, dsn: str, *, schema: str = "public", migrate: bool = True) -> None:
        import psycopg

        if not dsn.startswith(("postgresql://", "postgres://")) and "=" not in dsn:
            raise ConfigError("views.postgres_dsn: expected a postgresql://user@host:port/db URL")
        self.dsn = dsn
        self.default_schema = schema
        if migrate:
            ensure_migrated(dsn)
        try:
            self.conn = psycopg.connect(dsn, autocommit=True)
        except psycopg.Error as exc:
            raise _sink_error("connecting to the views database", exc) from None
        self._staging: dict[tuple[str, str], str] = {}
        self._pruned: dict[tuple[str, str], float] = {}

    def config(self) -> PostgresSinkConfig:
        return PostgresSinkConfig(self.dsn, self.default_schema)

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass

    # --- names ----------------------------------------------------------------------------
    def _schema(self, view: ViewSpec) -> str:
        return view.namespace or self.default_schema

    def _shadow_name(self, view: ViewSpec, label: str) -> str:
        return physical_name(view.name, f"__kf_{label}")

    def state_table(self, target: Target) -> str:
        base = f"state__{self._schema(target.view)}__{target.view.name}"
        return physical_name(base, "" if not target.shadow else "__" + target.name.rsplit("__kf_", 1)[-1])

    def changes_table(self, target: Target) -> str:
        """Grouped views: the last watermark at which each group was recomputed (deleted groups
        included), which mirrors of the view (search, Redis) read to find what changed."""
        base = f"groups__{self._schema(target.view)}__{target.view.name}"
        return physical_name(base, "" if not target.shadow else "__" + target.name.rsplit("__kf_", 1)[-1])

    def deleted_table(self, target: Target) -> str:
        """The deleted keys of a target: key columns, the delete's version and when it was recorded."""
        base = f"deleted__{self._schema(target.view)}__{target.view.name}"
        return physical_name(base, "" if not target.shadow else "__" + target.name.rsplit("__kf_", 1)[-1])

    def _deleted_rel(self, target: Target) -> Any:
        from psycopg import sql

        return sql.SQL("{}.{}").format(_q(KF_SCHEMA), _q(self.deleted_table(target)))

    def _changes_rel(self, target: Target) -> Any:
        from psycopg import sql

        return sql.SQL("{}.{}").format(_q(KF_SCHEMA), _q(self.changes_table(target)))

    def _rel(self, view: ViewSpec, name: str) -> Any:
        from psycopg import sql

        return sql.SQL("{}.{}").format(_q(self._schema(view)), _q(name))

    def _state_rel(self, target: Target) -> Any:
        from psycopg import sql

        return sql.SQL("{}.{}").format(_q(KF_SCHEMA), _q(self.state_table(target)))

    def relation(self, target: Target) -> str:
        """The quoted ``schema.table`` of a target (for messages and ad-hoc SQL)."""
        return f'"{self._schema(target.view)}"."{target.name}"'

    # --- DDL ------------------------------------------------------------------------------
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

    def _create_table(self, view: ViewSpec, name: str) -> None:
        from psycopg import sql

        cols = [
            sql.SQL("{} {}{}").format(
                _q(c.name), sql.SQL(pg_type(c.type)), sql.SQL(" NOT NULL" if c.name in view.key else "")
            )
            for c in view.columns
        ]
        cols.append(sql.SQL("{} bigint NOT NULL").format(_q(VERSION)))
        pk_name = "kf_pk_" + hashlib.sha1(f"{name}{time.time_ns()}".encode()).hexdigest()[:16]
        cols.append(
            sql.SQL("CONSTRAINT {} PRIMARY KEY ({})").format(_q(pk_name), sql.SQL(", ").join(_q(k) for k in view.key))
        )
        self.conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_q(self._schema(view))))
        self.conn.execute(sql.SQL("CREATE TABLE {} ({})").format(self._rel(view, name), sql.SQL(", ").join(cols)))
        target = Target(view, name, shadow=name != view.name)
        self._create_deleted(view, target)
        group = view.options.get("group")
        if group:
            self._create_state(view, target, group)

    def _create_deleted(self, view: ViewSpec, target: Target) -> None:
        """The deleted-keys table of `target` (see ``deleted_table``)."""
        from psycopg import sql

        key_cols = [sql.SQL("{} {} NOT NULL").format(_q(k), sql.SQL(pg_type(view.column(k).type))) for k in view.key]
        rel = self._deleted_rel(target)
        tag = f"{self.deleted_table(target)}{time.time_ns()}"
        pk_name = "kf_pk_" + hashlib.sha1(f"dk{tag}".encode()).hexdigest()[:16]
        ix_name = "kf_ix_" + hashlib.sha1(f"da{tag}".encode()).hexdigest()[:16]
        self.conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_q(KF_SCHEMA)))
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(rel))
        self.conn.execute(
            sql.SQL(
                "CREATE TABLE {} ({}, {} bigint NOT NULL, {} timestamptz NOT NULL DEFAULT now(), "
                "CONSTRAINT {} PRIMARY KEY ({}))"
            ).format(
                rel,
                sql.SQL(", ").join(key_cols),
                _q(VERSION),
                _q(DELETED_AT),
                _q(pk_name),
                sql.SQL(", ").join(_q(k) for k in view.key),
            )
        )
        self.conn.execute(sql.SQL("CREATE INDEX {} ON {} ({})").format(_q(ix_name), rel, _q(DELETED_AT)))

    def check_schema(self, view: ViewSpec, table: str | None = None) -> None:
        """Raise ViewSchemaMismatch naming every difference between `table` and `view`."""
        schema = self._schema(view)
        table = table or view.name
        have = self._table_columns(schema, table)
        if have is None:
            raise ViewSchemaMismatch(f'view table "{schema}"."{table}" does not exist')
        have_types = {n: t for n, t, _ in have}
        problems = []
        for c in view.columns:
            want = pg_type(c.type)
            got = have_types.get(c.name)
            if got is None:
                problems.append(f"column {c.name!r} is missing (projection makes {want})")
            elif got != want:
                problems.append(f"column {c.name!r} is {got} in the table, the projection makes {want}")
        if VERSION not in have_types:
            problems.append(f"column {VERSION!r} is missing (is this a kappaflow view?)")
        extra = [n for n in have_types if n not in view.column_names and n != VERSION]
        if extra:
            problems.append(f"column(s) {extra} are not produced by the projection")
        pk = self._primary_key(schema, table)
        if list(view.key) != pk:
            problems.append(f"primary key is {pk}, the projection's key is {list(view.key)}")
        if problems:
            raise ViewSchemaMismatch(
                f'view table "{schema}"."{table}" does not match projection {view.projection!r}: '
                + "; ".join(problems)
                + ". Rebuild it with `kappaflow replay` (the new table is built beside the old one and swapped in)."
            )

    # --- targets --------------------------------------------------------------------------
    def live(self, view: ViewSpec) -> Target | None:
        if self._table_columns(self._schema(view), view.name) is None:
            return None
        return Target(view, view.name)

    def ensure(self, view: ViewSpec) -> Target:
        if len(view.name.encode()) > MAX_IDENT:
            raise ConfigError(f"view name {view.name!r}: PostgreSQL allows at most {MAX_IDENT} bytes")
        try:
            if self._table_columns(self._schema(view), view.name) is None:
                with self.conn.transaction():
                    self._create_table(view, view.name)
            else:
                self.check_schema(view)
                live = Target(view, view.name)
                if self._table_columns(KF_SCHEMA, self.deleted_table(live)) is None:
                    with self.conn.transaction():  # a view built before deleted keys were kept
                        self._create_deleted(view, live)
                if view.options.get("group"):
                    live = Target(view, view.name)
                    self._check_state(live)
                    if self._table_columns(KF_SCHEMA, self.changes_table(live)) is None:
                        with self.conn.transaction():  # a view built before group changes were kept
                            self._create_changes(view, live, view.options["group"])
        except ViewSchemaMismatch:
            raise
        except Exception as exc:
            if isinstance(exc, (SinkError, ConfigError)):
                raise
            raise _sink_error(f"creating view {view.name!r}", exc) from None
        return Target(view, view.name)

    def begin_shadow(self, view: ViewSpec, label: str = "shadow") -> Target:
        if len(view.name.encode()) > MAX_IDENT:
            raise ConfigError(f"view name {view.name!r}: PostgreSQL allows at most {MAX_IDENT} bytes")
        target = Target(view, self._shadow_name(view, label), shadow=True)
        try:
            with self.conn.transaction():
                self._drop(target)
                self._create_table(view, target.name)
        except Exception as exc:
            raise _sink_error(f"creating shadow table for view {view.name!r}", exc) from None
        return target

    def _drop(self, target: Target) -> None:
        from psycopg import sql

        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._rel(target.view, target.name)))
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._state_rel(target)))
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._changes_rel(target)))
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._deleted_rel(target)))
        self.conn.execute(
            f'DELETE FROM "{KF_SCHEMA}"."{POSITIONS}" WHERE projection = %s AND target = %s',
            (target.view.projection, target.label),
        )

    def drop(self, target: Target) -> None:
        try:
            with self.conn.transaction():
                self._drop(target)
        except Exception as exc:
            raise _sink_error(f"dropping {self.relation(target)}", exc) from None

    def swap(self, shadow: Target) -> Target:
        """Rename the shadow over the live table in one transaction (retrying on lock timeouts)."""
        import psycopg
        from psycopg import sql

        if not shadow.shadow:
            raise SinkError(f"swap: {shadow.name!r} is not a shadow target")
        view = shadow.view
        live = Target(view, view.name)
        last: Exception | None = None
        for attempt in range(SWAP_ATTEMPTS):
            try:
                with self.conn.transaction():
                    self.conn.execute(f"SET LOCAL lock_timeout = {SWAP_LOCK_TIMEOUT_MS}")
                    self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._rel(view, view.name)))
                    self.conn.execute(
                        sql.SQL("ALTER TABLE {} RENAME TO {}").format(self._rel(view, shadow.name), _q(view.name))
                    )
                    self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._deleted_rel(live)))
                    self.conn.execute(
                        sql.SQL("ALTER TABLE IF EXISTS {} RENAME TO {}").format(
                            self._deleted_rel(shadow), _q(self.deleted_table(live))
                        )
                    )
                    if view.options.get("group"):
                        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._state_rel(live)))
                        self.conn.execute(
                            sql.SQL("ALTER TABLE {} RENAME TO {}").format(
                                self._state_rel(shadow), _q(self.state_table(live))
                            )
                        )
                        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._changes_rel(live)))
                        self.conn.execute(
                            sql.SQL("ALTER TABLE {} RENAME TO {}").format(
                                self._changes_rel(shadow), _q(self.changes_table(live))
                            )
                        )
                        # The new change table knows only the groups changed after the build: record
                        # from which watermark on it is complete (see ``read_for_mirror``).
                        row = self.conn.execute(
                            f'SELECT coalesce(sum(next_offset), 0) FROM "{KF_SCHEMA}"."{POSITIONS}" '
                            "WHERE projection = %s AND target = %s",
                            (view.projection, shadow.label),
                        ).fetchone()
                        self.conn.execute(
                            sql.SQL("COMMENT ON TABLE {} IS {}").format(
                                self._changes_rel(live), sql.Literal(f"{CHANGES_BASE}{int(row[0]) if row else 0}")
                            )
                        )
                    self.conn.execute(
                        f'DELETE FROM "{KF_SCHEMA}"."{POSITIONS}" WHERE projection = %s AND target = %s',
                        (view.projection, "live"),
                    )
                    self.conn.execute(
                        f'UPDATE "{KF_SCHEMA}"."{POSITIONS}" SET target = %s, updated_at = now() '
                        "WHERE projection = %s AND target = %s",
                        ("live", view.projection, shadow.label),
                    )
                self._staging.clear()
                return live
            except psycopg.errors.LockNotAvailable as exc:
                last = exc
                time.sleep(min(0.05 * (attempt + 1), 0.5))
            except Exception as exc:
                raise _sink_error(f"swapping in the rebuilt view {view.name!r}", exc) from None
        raise SinkError(
            f"swapping in the rebuilt view {view.name!r}: the live table stayed locked by readers for "
            f"{SWAP_ATTEMPTS} attempts ({last}); the shadow {shadow.name!r} is kept, retry the replay",
            retry=Retry.TRANSIENT,
        )

    # --- writes ---------------------------------------------------------------------------
    def _staging_table(self, target: Target) -> str:
        """A temp table shaped like the batch (per connection, emptied at commit)."""
        from psycopg import sql

        key = (self._schema(target.view), target.name)
        name = self._staging.get(key)
        if name is not None:
            return name
        name = f"kf_stg_{len(self._staging)}_{hashlib.sha1(repr(key).encode()).hexdigest()[:8]}"
        cols = [sql.SQL("{} {}").format(_q(c.name), sql.SQL(pg_type(c.type))) for c in target.view.columns]
        cols += [sql.SQL("{} bigint").format(_q(VERSION)), sql.SQL("{} boolean").format(_q(DELETED))]
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS pg_temp.{}").format(_q(name)))
        self.conn.execute(
            sql.SQL("CREATE TEMP TABLE {} ({}) ON COMMIT DELETE ROWS").format(_q(name), sql.SQL(", ").join(cols))
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
            rel, sql.SQL(", ").join(_q(c) for c in columns)
        )
        with self.conn.cursor() as cur, cur.copy(stmt) as cp:
            cp.write(data)

    def _check_batch(self, target: Target, batch: pa.Table) -> pa.Table:
        want = (*target.view.column_names, VERSION, DELETED)
        missing = [c for c in want if c not in batch.column_names]
        if missing:
            raise SinkError(f"batch for view {target.view.name!r} lacks column(s) {missing}")
        return batch.select(list(want))

    def write(self, target: Target, batch: pa.Table, positions: Positions | None = None) -> WriteResult:
        from psycopg import sql

        batch = self._check_batch(target, batch)
        view = target.view
        rel = self._rel(view, target.name)
        keys = [_q(k) for k in view.key]
        allcols = [*list(view.column_names), VERSION]
        res = WriteResult()
        try:
            with self.conn.transaction():
                if batch.num_rows:
                    stg = self._staging_table(target)
                    self._copy(sql.SQL("pg_temp.{}").format(_q(stg)), [*list(allcols), DELETED], batch)
                    # Latest row per key within the batch (a batch may carry a key twice).
                    latest = sql.SQL("SELECT DISTINCT ON ({k}) * FROM pg_temp.{s} ORDER BY {k}, {v} DESC").format(
                        k=sql.SQL(", ").join(keys), s=_q(stg), v=_q(VERSION)
                    )
                    sets = [sql.SQL("{c} = excluded.{c}").format(c=_q(c)) for c in allcols if c not in view.key]
                    drel = self._deleted_rel(target)
                    # Deleted keys guard only when there are any (the common batch pays one probe).
                    guarded = self.conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(drel)).fetchone()
                    fields = {
                        "rel": rel,
                        "drel": drel,
                        "cols": sql.SQL(", ").join(_q(c) for c in allcols),
                        "latest": latest,
                        "d": _q(DELETED),
                        "k": sql.SQL(", ").join(keys),
                        "sk": sql.SQL(", ").join(sql.SQL("s.{}").format(k) for k in keys),
                        "sets": sql.SQL(", ").join(sets),
                        "v": _q(VERSION),
                        "at": _q(DELETED_AT),
                        "vmatch": sql.SQL(" AND ").join(sql.SQL("v.{k} = s.{k}").format(k=k) for k in keys),
                        "tmatch": sql.SQL(" AND ").join(sql.SQL("t.{k} = s.{k}").format(k=k) for k in keys),
                    }
                    not_deleted = (
                        sql.SQL(" AND NOT EXISTS (SELECT 1 FROM {drel} t WHERE {tmatch} AND t.{v} >= s.{v})").format(
                            **fields
                        )
                        if guarded and guarded[0]
                        else sql.SQL("")
                    )
                    up = self.conn.execute(
                        sql.SQL(
                            "INSERT INTO {rel} AS v ({cols}) SELECT {cols} FROM ({latest}) s WHERE NOT s.{d}{nd} "
                            "ON CONFLICT ({k}) DO UPDATE SET {sets} WHERE excluded.{v} > v.{v}"
                        ).format(nd=not_deleted, **fields)
                    )
                    res.upserted = max(up.rowcount, 0)
                    if guarded and guarded[0] and res.upserted:
                        # a newer upsert supersedes the key's delete: it guards no more
                        self.conn.execute(
                            sql.SQL(
                                "DELETE FROM {drel} t USING ({latest}) s WHERE NOT s.{d} AND {tmatch} AND s.{v} > t.{v}"
                            ).format(**fields)
                        )
                    if pc.any(batch.column(DELETED)).as_py():
                        dl = self.conn.execute(
                            sql.SQL(
                                "DELETE FROM {rel} AS v USING ({latest}) s WHERE s.{d} AND {vmatch} AND s.{v} > v.{v}"
                            ).format(**fields)
                        )
                        res.deleted = max(dl.rowcount, 0)
                        # Record each delete that is not stale (no row of its key at or above its version
                        # is left), so an older upsert arriving later cannot bring the row back.
                        self.conn.execute(
                            sql.SQL(
                                "INSERT INTO {drel} AS t ({k}, {v}) SELECT {sk}, s.{v} FROM ({latest}) s "
                                "WHERE s.{d} AND NOT EXISTS (SELECT 1 FROM {rel} v WHERE {vmatch}) "
                                "ON CONFLICT ({k}) DO UPDATE SET {v} = excluded.{v}, {at} = now() "
                                "WHERE excluded.{v} > t.{v}"
                            ).format(**fields)
                        )
                    res.skipped = batch.num_rows - res.upserted - res.deleted
                if positions:
                    self._store_positions(target, positions)
        except BaseException as exc:
            self._forget_staging()
            if isinstance(exc, SinkError) or not isinstance(exc, Exception):
                raise
            raise _sink_error(f"writing {batch.num_rows} rows to {self.relation(target)}", exc) from None
        self._prune_deleted(target)
        return res

    def _prune_deleted(self, target: Target) -> None:
        """Forget deleted keys older than ``TOMBSTONE_RETENTION_S`` (at most once a minute per target)."""
        from psycopg import sql

        key = (self._schema(target.view), target.name)
        now = time.monotonic()
        if now - self._pruned.get(key, -TOMBSTONE_PRUNE_EVERY_S) < TOMBSTONE_PRUNE_EVERY_S:
            return
        self._pruned[key] = now
        try:
            self.conn.execute(
                sql.SQL("DELETE FROM {} WHERE {} < now() - make_interval(secs => %s)").format(
                    self._deleted_rel(target), _q(DELETED_AT)
                ),
                (TOMBSTONE_RETENTION_S,),
            )
        except Exception as exc:  # housekeeping: the next write tries again
            log.warning("pruning the deleted keys of %s failed: %s", self.relation(target), exc)

    def load(self, target: Target, batches: Iterable[pa.Table | pa.RecordBatch]) -> int:
        """COPY straight into a fresh shadow, in one transaction and one COPY: keys are
        unique by construction (one row per key from the replay's aggregation); a duplicate
        fails the build loudly (primary key) instead of being merged silently."""
        from psycopg import sql

        if not target.shadow:
            return super().load(target, batches)
        cols = [*list(target.view.column_names), VERSION]
        stmt = sql.SQL("COPY {} ({}) FROM STDIN WITH (FORMAT csv)").format(
            self._rel(target.view, target.name), sql.SQL(", ").join(_q(c) for c in cols)
        )
        n = 0
        try:
            with self.conn.transaction(), self.conn.cursor() as cur, cur.copy(stmt) as cp:
                for b in batches:
                    t = b if isinstance(b, pa.Table) else pa.Table.from_batches([b])
                    if not t.num_rows:
                        continue
                    t = self._check_batch(target, t)
                    if pc.any(t.column(DELETED)).as_py():
                        raise SinkError(f"load into {target.name!r}: a bulk load cannot carry deletes")
                    cp.write(csv_bytes(t.select(cols)))
                    n += t.num_rows
        except SinkError:
            raise
        except Exception as exc:
            raise _sink_error(f"loading rows into {self.relation(target)}", exc) from None
        return n

    # --- reads ----------------------------------------------------------------------------
    def fetch(self, target: Target, keys: Sequence[tuple[Any, ...]]) -> dict[tuple[Any, ...], dict[str, Any]]:
        from psycopg import sql
        from psycopg.rows import dict_row

        view = target.view
        if not keys:
            return {}
        key_types = [pg_type(view.column(k).type) for k in view.key]
        arrays = [[k[i] for k in keys] for i in range(len(view.key))]
        unnest = sql.SQL(", ").join(sql.SQL("%s::{}[]").format(sql.SQL(t)) for t in key_types)
        names = sql.SQL(", ").join(sql.Identifier(f"k{i}") for i in range(len(view.key)))
        match = sql.SQL(" AND ").join(
            sql.SQL("v.{} = u.{}").format(_q(k), sql.Identifier(f"k{i}")) for i, k in enumerate(view.key)
        )
        stmt = sql.SQL("SELECT v.* FROM {rel} v JOIN unnest({u}) AS u({n}) ON {m}").format(
            rel=self._rel(view, target.name), u=unnest, n=names, m=match
        )
        try:
            with self.conn.cursor(row_factory=dict_row) as cur:
                rows = cur.execute(stmt, arrays).fetchall()
        except Exception as exc:
            raise _sink_error(f"reading {len(keys)} keys from {self.relation(target)}", exc) from None
        return {tuple(r[k] for k in view.key): r for r in rows}

    def scan(self, target: Target) -> Iterator[dict[str, Any]]:
        from psycopg import sql
        from psycopg.rows import dict_row

        view = target.view
        stmt = sql.SQL("SELECT * FROM {} ORDER BY {}").format(
            self._rel(view, target.name), sql.SQL(", ").join(_q(k) for k in view.key)
        )
        with self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(stmt)
            yield from cur

    def count(self, target: Target) -> int:
        from psycopg import sql

        row = self.conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(self._rel(target.view, target.name))
        ).fetchone()
        return int(row[0]) if row else 0

    # --- positions ------------------------------------------------------------------------
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

    def store_positions(self, target: Target, positions: Positions) -> None:
        try:
            with self.conn.transaction():
                self._store_positions(target, positions)
        except Exception as exc:
            raise _sink_error("storing positions", exc) from None

    # --- grouped aggregates: keyed state + recompute of affected groups -----------------------
    def _create_state(self, view: ViewSpec, target: Target, group: Mapping[str, Any]) -> None:
        from psycopg import sql

        cols = [
            sql.SQL("{} text NOT NULL").format(_q(STATE_TOPIC)),
            sql.SQL("{} bytea NOT NULL").format(_q(STATE_KEY)),
            sql.SQL("{} bigint NOT NULL").format(_q(VERSION)),
        ]
        for c in group["state_columns"]:
            cols.append(sql.SQL("{} {}").format(_q(c["name"]), sql.SQL(c["pg_type"])))
        pk_name = "kf_pk_" + hashlib.sha1(f"st{target.name}{time.time_ns()}".encode()).hexdigest()[:16]
        ix_name = "kf_ix_" + hashlib.sha1(f"ix{target.name}{time.time_ns()}".encode()).hexdigest()[:16]
        rel = self._state_rel(target)
        self.conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_q(KF_SCHEMA)))
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(rel))
        self.conn.execute(
            sql.SQL("CREATE TABLE {} ({}, CONSTRAINT {} PRIMARY KEY ({}, {}))").format(
                rel, sql.SQL(", ").join(cols), _q(pk_name), _q(STATE_TOPIC), _q(STATE_KEY)
            )
        )
        self.conn.execute(
            sql.SQL("CREATE INDEX {} ON {} ({})").format(
                _q(ix_name), rel, sql.SQL(", ").join(_q(g) for g in group["group_by"])
            )
        )
        self._create_changes(view, target, group)

    def _create_changes(self, view: ViewSpec, target: Target, group: Mapping[str, Any]) -> None:
        """The group change table (see ``changes_table``): group key (primary key) -> version."""
        from psycopg import sql

        key_cols = [
            sql.SQL("{} {} NOT NULL").format(_q(g), sql.SQL(pg_type(view.column(g).type))) for g in group["group_by"]
        ]
        rel = self._changes_rel(target)
        tag = f"{self.changes_table(target)}{time.time_ns()}"
        pk_name = "kf_pk_" + hashlib.sha1(f"gc{tag}".encode()).hexdigest()[:16]
        ix_name = "kf_ix_" + hashlib.sha1(f"gv{tag}".encode()).hexdigest()[:16]
        self.conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_q(KF_SCHEMA)))
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(rel))
        self.conn.execute(
            sql.SQL("CREATE TABLE {} ({}, {} bigint NOT NULL, CONSTRAINT {} PRIMARY KEY ({}))").format(
                rel,
                sql.SQL(", ").join(key_cols),
                _q(VERSION),
                _q(pk_name),
                sql.SQL(", ").join(_q(g) for g in group["group_by"]),
            )
        )
        self.conn.execute(sql.SQL("CREATE INDEX {} ON {} ({})").format(_q(ix_name), rel, _q(VERSION)))

    def _check_state(self, target: Target) -> None:
        group = target.view.options["group"]
        have = self._table_columns(KF_SCHEMA, self.state_table(target))
        want = [(c["name"], c["pg_type"]) for c in group["state_columns"]]
        got = [(n, t) for n, t, _ in (have or []) if n not in (STATE_TOPIC, STATE_KEY, VERSION)]
        if have is None or got != want:
            raise ViewSchemaMismatch(
                f'the keyed state of view {target.view.name!r} ("{KF_SCHEMA}"."{self.state_table(target)}") '
                f"does not match the projection (has {got if have is not None else 'no table'}, needs {want}). "
                "Rebuild it with `kappaflow replay`."
            )

    def load_state(self, target: Target, batches: Iterable[pa.Table | pa.RecordBatch]) -> int:
        """COPY state rows (``_kf_topic, _kf_key, _kf_version`` + state columns) into a fresh shadow."""
        from psycopg import sql

        group = target.view.options["group"]
        cols = [STATE_TOPIC, STATE_KEY, VERSION] + [c["name"] for c in group["state_columns"]]
        stmt = sql.SQL("COPY {} ({}) FROM STDIN WITH (FORMAT csv)").format(
            self._state_rel(target), sql.SQL(", ").join(_q(c) for c in cols)
        )
        n = 0
        try:
            with self.conn.transaction(), self.conn.cursor() as cur, cur.copy(stmt) as cp:
                for b in batches:
                    t = b if isinstance(b, pa.Table) else pa.Table.from_batches([b])
                    if t.num_rows:
                        cp.write(csv_bytes(t.select(cols)))
                        n += t.num_rows
        except Exception as exc:
            raise _sink_error(f"loading keyed state for {target.view.name!r}", exc) from None
        return n

    def aggregate_sql(self, target: Target, where_groups: Any | None = None) -> Any:
        """``SELECT group cols, aggregates FROM state [WHERE group in affected] GROUP BY ...``."""
        from psycopg import sql

        group = target.view.options["group"]
        parts = [_q(g) for g in group["group_by"]]
        for a in group["aggregates"]:
            parts.append(sql.SQL("({})::{} AS {}").format(sql.SQL(a["sql"]), sql.SQL(a["pg_type"]), _q(a["name"])))
        where: Any = sql.SQL("")
        if where_groups is not None:
            where = sql.SQL(" WHERE ({}) IN (SELECT {} FROM {})").format(
                sql.SQL(", ").join(_q(g) for g in group["group_by"]),
                sql.SQL(", ").join(_q(g) for g in group["group_by"]),
                where_groups,
            )
        nonnull = sql.SQL(" AND ").join(sql.SQL("{} IS NOT NULL").format(_q(g)) for g in group["group_by"])
        if where_groups is not None:
            where = sql.SQL("{} AND {}").format(where, nonnull)
        else:
            where = sql.SQL(" WHERE {}").format(nonnull)
        return sql.SQL("SELECT {} FROM {}{} GROUP BY {}").format(
            sql.SQL(", ").join(parts),
            self._state_rel(target),
            where,
            sql.SQL(", ").join(_q(g) for g in group["group_by"]),
        )

    def apply_grouped(
        self, target: Target, changes: pa.Table, version: int, positions: Positions | None
    ) -> WriteResult:
        """Apply keyed-state changes and recompute the groups they touch, in ONE transaction.

        `changes`: one row per changed source key: ``_kf_topic, _kf_key, _kf_version,
        _kf_deleted`` + state columns (the source row after derive/filter; a row that
        left the filter is a delete). Steps:

        1. COPY into staging; keep the newest row per source key (guard: version);
        2. affected groups = old groups of the changed keys (from the state) + new groups;
        3. delete / upsert the state rows (guarded by version);
        4. delete the view rows of the affected groups, re-insert them aggregated from the
           state (groups that became empty simply stay deleted), version = `version`;
        5. store positions;
        6. record every affected group with `version` in the group change table, which
           mirrors of the view (search/Redis sinks of the same projection) read.
        Recomputing from the state (instead of adding deltas) keeps min/max/collect exact
        under retraction, and costs O(rows of the affected groups).
        """
        from psycopg import sql

        group = target.view.options["group"]
        gcols = list(group["group_by"])
        scols = [c["name"] for c in group["state_columns"]]
        stcols = [STATE_TOPIC, STATE_KEY, VERSION, *scols]
        srel = self._state_rel(target)
        vrel = self._rel(target.view, target.name)
        res = WriteResult()
        key = (self._schema(target.view), "state:" + target.name)
        try:
            with self.conn.transaction():
                if changes.num_rows:
                    stg = self._staging.get(key)
                    if stg is None:
                        stg = f"kf_sst_{len(self._staging)}_{hashlib.sha1(repr(key).encode()).hexdigest()[:8]}"
                        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS pg_temp.{}").format(_q(stg)))
                        self.conn.execute(
                            sql.SQL("CREATE TEMP TABLE {} (LIKE {} ) ON COMMIT DELETE ROWS").format(_q(stg), srel)
                        )
                        self.conn.execute(
                            sql.SQL("ALTER TABLE pg_temp.{} ADD COLUMN {} boolean").format(_q(stg), _q(DELETED))
                        )
                        for c in [STATE_TOPIC, STATE_KEY, VERSION]:
                            self.conn.execute(
                                sql.SQL("ALTER TABLE pg_temp.{} ALTER COLUMN {} DROP NOT NULL").format(_q(stg), _q(c))
                            )
                        self._staging[key] = stg
                    self._copy(
                        sql.SQL("pg_temp.{}").format(_q(stg)), [*stcols, DELETED], changes.select([*stcols, DELETED])
                    )
                    g = sql.SQL(", ").join(_q(c) for c in gcols)
                    affected = f"kf_aff_{hashlib.sha1(repr(key).encode()).hexdigest()[:8]}"
                    # newest row per source key that is newer than the state
                    self.conn.execute(
                        sql.SQL(
                            "CREATE TEMP TABLE {aff} ON COMMIT DROP AS "
                            "SELECT {sg} FROM {st} s JOIN pg_temp.{stg} c USING ({t}, {k}) WHERE c.{v} > s.{v} "
                            "UNION SELECT {g} FROM pg_temp.{stg} WHERE NOT {d}"
                        ).format(
                            aff=_q(affected),
                            g=g,
                            sg=sql.SQL(", ").join(sql.SQL("s.{}").format(_q(c)) for c in gcols),
                            st=srel,
                            stg=_q(stg),
                            t=_q(STATE_TOPIC),
                            k=_q(STATE_KEY),
                            v=_q(VERSION),
                            d=_q(DELETED),
                        )
                    )
                    latest = sql.SQL(
                        "SELECT DISTINCT ON ({t}, {k}) * FROM pg_temp.{stg} ORDER BY {t}, {k}, {v} DESC"
                    ).format(t=_q(STATE_TOPIC), k=_q(STATE_KEY), stg=_q(stg), v=_q(VERSION))
                    self.conn.execute(
                        sql.SQL(
                            "DELETE FROM {st} s USING ({latest}) c WHERE c.{d} AND s.{t} = c.{t} AND s.{k} = c.{k} "
                            "AND c.{v} > s.{v}"
                        ).format(
                            st=srel, latest=latest, d=_q(DELETED), t=_q(STATE_TOPIC), k=_q(STATE_KEY), v=_q(VERSION)
                        )
                    )
                    sets = sql.SQL(", ").join(sql.SQL("{c} = excluded.{c}").format(c=_q(c)) for c in [VERSION, *scols])
                    self.conn.execute(
                        sql.SQL(
                            "INSERT INTO {st} AS s ({cols}) SELECT {cols} FROM ({latest}) c WHERE NOT c.{d} "
                            "ON CONFLICT ({t}, {k}) DO UPDATE SET {sets} WHERE excluded.{v} > s.{v}"
                        ).format(
                            st=srel,
                            cols=sql.SQL(", ").join(_q(c) for c in stcols),
                            latest=latest,
                            d=_q(DELETED),
                            t=_q(STATE_TOPIC),
                            k=_q(STATE_KEY),
                            sets=sets,
                            v=_q(VERSION),
                        )
                    )
                    gone = self.conn.execute(
                        # (both sides qualified: an unqualified name in the subquery would resolve to
                        # the outer row when ambiguous, deleting every group, not only the affected)
                        sql.SQL("DELETE FROM {vr} v WHERE ({vg}) IN (SELECT {ag} FROM pg_temp.{aff} a)").format(
                            vr=vrel,
                            vg=sql.SQL(", ").join(sql.SQL("v.{}").format(_q(c)) for c in gcols),
                            ag=sql.SQL(", ").join(sql.SQL("a.{}").format(_q(c)) for c in gcols),
                            aff=_q(affected),
                        )
                    ).rowcount
                    outcols = [*gcols, *[a["name"] for a in group["aggregates"]]]
                    ins = self.conn.execute(
                        sql.SQL("INSERT INTO {vr} ({cols}, {v}) SELECT a.*, %s::bigint FROM ({agg}) a").format(
                            vr=vrel,
                            cols=sql.SQL(", ").join(_q(c) for c in outcols),
                            v=_q(VERSION),
                            agg=self.aggregate_sql(target, sql.SQL("pg_temp.{}").format(_q(affected))),
                        ),
                        (version,),
                    ).rowcount
                    res.upserted = max(ins, 0)
                    res.deleted = max(gone - ins, 0)
                    # 6. every affected group (recomputed or gone) at this version, for mirrors
                    self.conn.execute(
                        sql.SQL(
                            "INSERT INTO {ch} AS c ({g}, {v}) SELECT DISTINCT {g}, %s::bigint FROM pg_temp.{aff} "
                            "WHERE {nn} ON CONFLICT ({g}) DO UPDATE SET {v} = GREATEST(c.{v}, excluded.{v})"
                        ).format(
                            ch=self._changes_rel(target),
                            g=g,
                            v=_q(VERSION),
                            aff=_q(affected),
                            nn=sql.SQL(" AND ").join(sql.SQL("{} IS NOT NULL").format(_q(c)) for c in gcols),
                        ),
                        (version,),
                    )
                if positions:
                    self._store_positions(target, positions)
        except BaseException as exc:
            self._forget_staging()
            if isinstance(exc, SinkError) or not isinstance(exc, Exception):
                raise
            raise _sink_error(f"applying {changes.num_rows} keyed changes to {self.relation(target)}", exc) from None
        return res

    def rebuild_groups(self, target: Target, version: int) -> int:
        """Fill an empty view from its keyed state (replay: after ``load_state``)."""
        from psycopg import sql

        group = target.view.options["group"]
        outcols = [*group["group_by"], *[a["name"] for a in group["aggregates"]]]
        try:
            with self.conn.transaction():
                n = self.conn.execute(
                    sql.SQL("INSERT INTO {vr} ({cols}, {v}) SELECT a.*, %s::bigint FROM ({agg}) a").format(
                        vr=self._rel(target.view, target.name),
                        cols=sql.SQL(", ").join(_q(c) for c in outcols),
                        v=_q(VERSION),
                        agg=self.aggregate_sql(target),
                    ),
                    (version,),
                ).rowcount
        except Exception as exc:
            raise _sink_error(f"aggregating keyed state into {self.relation(target)}", exc) from None
        return max(n, 0)

    def _changes_base(self, crel: Any) -> int | None:
        """The watermark from which the group change table is complete (set by ``swap``);
        None for a view created empty (complete from the start) or built before it was kept."""
        row = self.conn.execute(
            "SELECT obj_description(to_regclass(%s), 'pg_class')", (crel.as_string(self.conn),)
        ).fetchone()
        text = row[0] if row else None
        if not text or not text.startswith(CHANGES_BASE):
            return None
        return int(text[len(CHANGES_BASE):])

    def read_for_mirror(
        self,
        target: Target,
        since: int | None,
        consume: Callable[[list[dict[str, Any]]], None],
        chunk: int = 5000,
    ) -> tuple[dict[TopicPartition, int], list[tuple[Any, ...]]]:
        """Rows of a grouped view for a mirror (a search/Redis copy of it), read in ONE snapshot
        together with the view's positions: every row (``since`` None), or the rows of the groups
        recomputed at a version above `since` (group change table). Rows (columns +
        ``_kf_version``) go to `consume` in chunks; returns (positions, keys of changed groups
        that no longer exist). Raises ``SinkStateLostError`` when the view was rebuilt after
        `since` (its change table starts at the rebuild): the mirror must be copied again."""
        from psycopg import sql
        from psycopg.rows import dict_row

        view = target.view
        keys = list(view.key)
        vrel = self._rel(view, target.name)
        gone: list[tuple[Any, ...]] = []
        failed: list[BaseException] = []
        try:
            with self.conn.transaction():
                self.conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                positions = self.read_positions(target)
                if since is None:
                    stmt = sql.SQL("SELECT v.* FROM {} v ORDER BY {}").format(
                        vrel, sql.SQL(", ").join(sql.SQL("v.{}").format(_q(k)) for k in keys)
                    )
                    params: tuple[Any, ...] = ()
                else:
                    crel = self._changes_rel(target)
                    base = self._changes_base(crel)
                    if base is not None and since < base:
                        # The view was rebuilt (swapped in) after the mirror's position: its change
                        # table does not know what changed in between, groups gone included.
                        raise SinkStateLostError(
                            f"{self.relation(target)} was rebuilt at watermark {base}, after its mirror's "
                            f"position (watermark {since}): the mirror must be copied from it again"
                        )
                    on = sql.SQL(" AND ").join(sql.SQL("v.{k} = c.{k}").format(k=_q(k)) for k in keys)
                    stmt = sql.SQL("SELECT v.* FROM {c} c JOIN {v} v ON {on} WHERE c.{ver} > %s").format(
                        c=crel, v=vrel, on=on, ver=_q(VERSION)
                    )
                    params = (since,)
                    rows = self.conn.execute(
                        sql.SQL(
                            "SELECT {ks} FROM {c} c WHERE c.{ver} > %s AND NOT EXISTS (SELECT 1 FROM {v} v WHERE {on})"
                        ).format(
                            ks=sql.SQL(", ").join(sql.SQL("c.{}").format(_q(k)) for k in keys),
                            c=crel,
                            v=vrel,
                            on=on,
                            ver=_q(VERSION),
                        ),
                        params,
                    ).fetchall()
                    gone = [tuple(r) for r in rows]
                name = f"kf_mirror_{hashlib.sha1(target.name.encode()).hexdigest()[:8]}"
                with self.conn.cursor(name=name, row_factory=dict_row) as cur:
                    cur.execute(stmt, params)
                    while True:
                        part = cur.fetchmany(chunk)
                        if not part:
                            break
                        try:
                            consume(part)
                        except BaseException as exc:  # the mirror's own failure: not a PostgreSQL one
                            failed.append(exc)
                            raise
        except BaseException as exc:
            if (failed and exc is failed[0]) or isinstance(exc, SinkError) or not isinstance(exc, Exception):
                raise
            raise _sink_error(f"reading {self.relation(target)} for its mirrors", exc) from None
        return positions, gone

    # --- verify -------------------------------------------------------------------------------
    def diff(
        self, live: Target, expected: Target, limit: int = 100
    ) -> tuple[dict[TopicPartition, int], int, list[Drift]]:
        """Rows of `live` that differ from `expected` (values only, not versions), read in ONE
        snapshot together with the live positions: (positions, drift count, first `limit`)."""
        from psycopg import sql

        view = live.view
        lrel, erel = self._rel(view, live.name), self._rel(view, expected.name)
        keys = list(view.key)
        vals = [c for c in view.column_names if c not in keys]
        on = sql.SQL(" AND ").join(sql.SQL("l.{k} = e.{k}").format(k=_q(k)) for k in keys)
        lk = sql.SQL("l.{}").format(_q(keys[0]))
        ek = sql.SQL("e.{}").format(_q(keys[0]))
        differs = sql.SQL("({}) IS DISTINCT FROM ({})").format(
            sql.SQL(", ").join([sql.SQL("l.{}").format(_q(c)) for c in vals] + [sql.SQL("NULL")]),
            sql.SQL(", ").join([sql.SQL("e.{}").format(_q(c)) for c in vals] + [sql.SQL("NULL")]),
        )
        base = sql.SQL("FROM {l} l FULL JOIN {e} e ON {on} WHERE {lk} IS NULL OR {ek} IS NULL OR {d}").format(
            l=lrel, e=erel, on=on, lk=lk, ek=ek, d=differs
        )
        try:
            with self.conn.transaction():
                self.conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                positions = self.read_positions(live)
                count_row = self.conn.execute(sql.SQL("SELECT count(*) ") + base).fetchone()
                rows = self.conn.execute(
                    sql.SQL("SELECT to_jsonb(l), to_jsonb(e) ") + base + sql.SQL(" LIMIT {}").format(sql.Literal(limit))
                ).fetchall()
        except Exception as exc:
            raise _sink_error(f"comparing {self.relation(live)} with {self.relation(expected)}", exc) from None
        out = []
        for lrow, erow in rows:
            src = lrow if lrow is not None else erow
            key = tuple(src[k] for k in keys)
            kind = "missing" if lrow is None else "unexpected" if erow is None else "changed"
            for r in (lrow, erow):
                if r is not None:
                    r.pop(VERSION, None)
            out.append(Drift(key, kind, lrow, erow))
        return positions, int(count_row[0]) if count_row else 0, out

    # --- advisory lock: one writer (follow or replay) per projection -------------------------
    def try_lock(self, projection: str) -> bool:
        row = self.conn.execute(
            "SELECT pg_try_advisory_lock(hashtextextended(%s, 7270604))", ("kappaflow.projection:" + projection,)
        ).fetchone()
        return bool(row and row[0])

    def unlock(self, projection: str) -> None:
        self.conn.execute(
            "SELECT pg_advisory_unlock(hashtextextended(%s, 7270604))", ("kappaflow.projection:" + projection,)
        )

    def holds_lock(self, projection: str) -> bool:
        try:
            row = self.conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid() "
                "AND ((classid::bigint << 32) | objid::bigint) = hashtextextended(%s, 7270604)",
                ("kappaflow.projection:" + projection,),
            ).fetchone()
        except Exception:  # the session is gone, and its lock with it
            return False
        return bool(row and row[0])

    def is_locked(self, projection: str) -> bool:
        # Advisory locks belong to a database: a projection of the same name in another database of
        # the server is another projection.
        row = self.conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
            "database = (SELECT oid FROM pg_database WHERE datname = current_database()) AND "
            "((classid::bigint << 32) | objid::bigint) = hashtextextended(%s, 7270604)",
            ("kappaflow.projection:" + projection,),
        ).fetchone()
        return bool(row and row[0])


__all__ = [
    "PostgresSink",
    "PostgresSinkConfig",
    "csv_bytes",
    "ensure_migrated",
    "pg_type",
    "physical_name",
]
