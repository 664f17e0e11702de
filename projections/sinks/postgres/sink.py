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
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

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
    ViewColumn,
    ViewSchemaMismatch,
    ViewSpec,
    WriteResult,
    evolution,
    evolution_mismatch,
)
from kappaflow.projections.sinks.postgres.copy import csv_bytes
from kappaflow.projections.sinks.postgres.ddl import (
    DELETED_AT,
    KF_SCHEMA,
    MAX_IDENT,
    POSITIONS,
    ident,
    pg_type,
    physical_name,
)
from kappaflow.projections.sinks.postgres.groups import GroupedState
from kappaflow.projections.sinks.postgres.mirror import CHANGES_BASE
from kappaflow.projections.sinks.postgres.settings import PostgresSettings
from kappaflow.projections.sinks.postgres.tables import sink_error

SWAP_LOCK_TIMEOUT_MS = 2000
SWAP_ATTEMPTS = 30
TOMBSTONE_RETENTION_S = 86_400
"""How long a delete's version guards its key against older upserts (see the module docstring)."""
TOMBSTONE_PRUNE_EVERY_S = 60.0

log = logging.getLogger(__name__)


def _spark_of_pg(pg: str, view: ViewSpec, name: str) -> Any:
    """The Spark type a view table column of PostgreSQL type `pg` was made from (``pg_type`` read
    backwards): the view's own column type when it makes the same PostgreSQL type, else the numeric
    types ``widens`` knows (and arrays of them); anything else a type no view column widens from."""
    import re

    from pyspark.sql import types as T

    try:
        mine = view.column(name).type
        if pg_type(mine) == pg:
            return mine
    except KeyError:
        pass
    if pg.endswith("[]"):
        return T.ArrayType(_spark_of_pg(pg[:-2], view, ""))
    m = re.fullmatch(r"numeric\((\d+),(-?\d+)\)", pg)
    if m:
        return T.DecimalType(int(m.group(1)), int(m.group(2)))
    for t in (T.ShortType(), T.IntegerType(), T.LongType(), T.FloatType(), T.DoubleType(), T.BooleanType(),
              T.StringType(), T.BinaryType(), T.DateType(), T.TimestampNTZType(), T.TimestampType()):
        if pg_type(t) == pg:
            return t
    return T.NullType()  # e.g. jsonb the view no longer makes: nothing widens from it


class PostgresSink(GroupedState, Sink):
    """Views as PostgreSQL tables (see the module docstring)."""

    kind = "postgres"
    positions_with_rows = True

    def grouped_state(self) -> PostgresSink:
        """PostgreSQL keeps a grouped view's keyed state (``load_state``, ``apply_grouped``, ``read_for_mirror``)."""
        return self

    def state_connection(self) -> Any:
        """The sink's connection: state written in its transaction commits with the view rows and positions."""
        return self.conn

    @classmethod
    def from_settings(cls, settings: PostgresSettings, **kwargs: Any) -> PostgresSink:
        """From ``[views.postgres]`` (``dsn``, ``password_env``); the sink registry's opener."""
        return cls(settings.connect_dsn(), **kwargs)

    def config(self) -> SinkConfig:
        # the DSN as connected (its password resolved here: an executor has no password_env)
        return SinkConfig(self.kind, PostgresSettings(dsn=self.dsn), {"schema": self.default_schema})

    # --- names ----------------------------------------------------------------------------
    def deleted_table(self, target: Target) -> str:
        """The deleted keys of a target: key columns, the delete's version and when it was recorded."""
        base = f"deleted__{self._schema(target.view)}__{target.view.name}"
        return physical_name(base, "" if not target.shadow else "__" + target.name.rsplit("__kf_", 1)[-1])

    def _deleted_rel(self, target: Target) -> Any:
        from psycopg import sql

        return sql.SQL("{}.{}").format(ident(KF_SCHEMA), ident(self.deleted_table(target)))

    # --- DDL ------------------------------------------------------------------------------
    def _create_table(self, view: ViewSpec, name: str) -> None:
        from psycopg import sql

        cols = [
            sql.SQL("{} {}{}").format(
                ident(c.name), sql.SQL(pg_type(c.type)), sql.SQL(" NOT NULL" if c.name in view.key else "")
            )
            for c in view.columns
        ]
        cols.append(sql.SQL("{} bigint NOT NULL").format(ident(VERSION)))
        pk_name = "kf_pk_" + hashlib.sha1(f"{name}{time.time_ns()}".encode()).hexdigest()[:16]
        cols.append(
            sql.SQL("CONSTRAINT {} PRIMARY KEY ({})").format(
                ident(pk_name), sql.SQL(", ").join(ident(k) for k in view.key)
            )
        )
        self.conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident(self._schema(view))))
        self.conn.execute(sql.SQL("CREATE TABLE {} ({})").format(self._rel(view, name), sql.SQL(", ").join(cols)))
        target = Target(view, name, shadow=name != view.name)
        self._create_deleted(view, target)
        group = view.options.get("group")
        if group:
            self._create_state(view, target, group)

    def _create_deleted(self, view: ViewSpec, target: Target) -> None:
        """The deleted-keys table of `target` (see ``deleted_table``)."""
        from psycopg import sql

        key_cols = [sql.SQL("{} {} NOT NULL").format(ident(k), sql.SQL(pg_type(view.column(k).type))) for k in view.key]
        rel = self._deleted_rel(target)
        tag = f"{self.deleted_table(target)}{time.time_ns()}"
        pk_name = "kf_pk_" + hashlib.sha1(f"dk{tag}".encode()).hexdigest()[:16]
        ix_name = "kf_ix_" + hashlib.sha1(f"da{tag}".encode()).hexdigest()[:16]
        self.conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident(KF_SCHEMA)))
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(rel))
        self.conn.execute(
            sql.SQL(
                "CREATE TABLE {} ({}, {} bigint NOT NULL, {} timestamptz NOT NULL DEFAULT now(), "
                "CONSTRAINT {} PRIMARY KEY ({}))"
            ).format(
                rel,
                sql.SQL(", ").join(key_cols),
                ident(VERSION),
                ident(DELETED_AT),
                ident(pk_name),
                sql.SQL(", ").join(ident(k) for k in view.key),
            )
        )
        self.conn.execute(sql.SQL("CREATE INDEX {} ON {} ({})").format(ident(ix_name), rel, ident(DELETED_AT)))

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
            raise sink_error(f"creating view {view.name!r}", exc) from None
        return Target(view, view.name)

    def evolve(self, view: ViewSpec) -> Target:
        """``ALTER TABLE`` the live table to `view`: ``ADD COLUMN`` for the columns it lacks, ``ALTER
        COLUMN ... TYPE`` for widened ones (a widened key column also in the deleted-keys table), in
        ONE transaction with a short ``lock_timeout`` retried like a swap (the statement needs an
        exclusive lock: a long reader must not queue every other reader behind it). Adding a column
        is a catalog change; widening one rewrites the table. Rows and positions stay."""
        import psycopg
        from psycopg import sql

        schema = self._schema(view)
        have = self._table_columns(schema, view.name)
        if have is None:
            raise ViewSchemaMismatch(f'view table "{schema}"."{view.name}" does not exist')
        stored = [ViewColumn(n, _spark_of_pg(t, view, n)) for n, t, _ in have if n != VERSION]
        evo = evolution(stored, self._primary_key(schema, view.name), view)
        where = f'view table "{schema}"."{view.name}"'
        if evo.problems:
            raise evolution_mismatch(where, view, evo)
        live = Target(view, view.name)
        if evo.empty:
            return live
        actions = [sql.SQL("ADD COLUMN IF NOT EXISTS {} {}").format(ident(c.name), sql.SQL(pg_type(c.type)))
                   for c in evo.added]
        actions += [sql.SQL("ALTER COLUMN {} TYPE {}").format(ident(n.name), sql.SQL(pg_type(n.type)))
                    for _, n in evo.widened]
        keys = [sql.SQL("ALTER COLUMN {} TYPE {}").format(ident(n.name), sql.SQL(pg_type(n.type)))
                for _, n in evo.widened if n.name in view.key]
        last: Exception | None = None
        for attempt in range(SWAP_ATTEMPTS):
            try:
                with self.conn.transaction():
                    self.conn.execute(f"SET LOCAL lock_timeout = {SWAP_LOCK_TIMEOUT_MS}")
                    self.conn.execute(sql.SQL("ALTER TABLE {} {}").format(self._rel(view, view.name),
                                                                          sql.SQL(", ").join(actions)))
                    if keys and self._table_columns(KF_SCHEMA, self.deleted_table(live)) is not None:
                        self.conn.execute(sql.SQL("ALTER TABLE {} {}").format(self._deleted_rel(live),
                                                                              sql.SQL(", ").join(keys)))
                self._staging.clear()  # the staging tables have the old columns: made again on the next write
                log.info("PostgreSQL sink: %s: %s", where, evo.describe())
                return live
            except psycopg.errors.LockNotAvailable as exc:
                last = exc
                time.sleep(min(0.05 * (attempt + 1), 0.5))
            except Exception as exc:
                self._staging.clear()
                raise sink_error(f"evolving {where} ({evo.describe()})", exc) from None
        raise SinkError(f"evolving {where}: the table stayed locked by readers for {SWAP_ATTEMPTS} attempts "
                        f"({last})", retry=Retry.TRANSIENT)

    def begin_shadow(self, view: ViewSpec, label: str = "shadow") -> Target:
        if len(view.name.encode()) > MAX_IDENT:
            raise ConfigError(f"view name {view.name!r}: PostgreSQL allows at most {MAX_IDENT} bytes")
        target = Target(view, self._shadow_name(view, label), shadow=True)
        try:
            with self.conn.transaction():
                self._drop(target)
                self._create_table(view, target.name)
        except Exception as exc:
            raise sink_error(f"creating shadow table for view {view.name!r}", exc) from None
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
            raise sink_error(f"dropping {self.relation(target)}", exc) from None

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
                        sql.SQL("ALTER TABLE {} RENAME TO {}").format(self._rel(view, shadow.name), ident(view.name))
                    )
                    self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._deleted_rel(live)))
                    self.conn.execute(
                        sql.SQL("ALTER TABLE IF EXISTS {} RENAME TO {}").format(
                            self._deleted_rel(shadow), ident(self.deleted_table(live))
                        )
                    )
                    if view.options.get("group"):
                        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._state_rel(live)))
                        self.conn.execute(
                            sql.SQL("ALTER TABLE {} RENAME TO {}").format(
                                self._state_rel(shadow), ident(self.state_table(live))
                            )
                        )
                        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._changes_rel(live)))
                        self.conn.execute(
                            sql.SQL("ALTER TABLE {} RENAME TO {}").format(
                                self._changes_rel(shadow), ident(self.changes_table(live))
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
                raise sink_error(f"swapping in the rebuilt view {view.name!r}", exc) from None
        raise SinkError(
            f"swapping in the rebuilt view {view.name!r}: the live table stayed locked by readers for "
            f"{SWAP_ATTEMPTS} attempts ({last}); the shadow {shadow.name!r} is kept, retry the replay",
            retry=Retry.TRANSIENT,
        )

    # --- writes ---------------------------------------------------------------------------
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
        keys = [ident(k) for k in view.key]
        allcols = [*list(view.column_names), VERSION]
        res = WriteResult()
        try:
            with self.conn.transaction():
                if batch.num_rows:
                    stg = self._staging_table(target)
                    self._copy(sql.SQL("pg_temp.{}").format(ident(stg)), [*list(allcols), DELETED], batch)
                    # Latest row per key within the batch (a batch may carry a key twice).
                    latest = sql.SQL("SELECT DISTINCT ON ({k}) * FROM pg_temp.{s} ORDER BY {k}, {v} DESC").format(
                        k=sql.SQL(", ").join(keys), s=ident(stg), v=ident(VERSION)
                    )
                    sets = [sql.SQL("{c} = excluded.{c}").format(c=ident(c)) for c in allcols if c not in view.key]
                    drel = self._deleted_rel(target)
                    # Deleted keys guard only when there are any (the common batch pays one probe).
                    guarded = self.conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(drel)).fetchone()
                    fields = {
                        "rel": rel,
                        "drel": drel,
                        "cols": sql.SQL(", ").join(ident(c) for c in allcols),
                        "latest": latest,
                        "d": ident(DELETED),
                        "k": sql.SQL(", ").join(keys),
                        "sk": sql.SQL(", ").join(sql.SQL("s.{}").format(k) for k in keys),
                        "sets": sql.SQL(", ").join(sets),
                        "v": ident(VERSION),
                        "at": ident(DELETED_AT),
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
            raise sink_error(f"writing {batch.num_rows} rows to {self.relation(target)}", exc) from None
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
                    self._deleted_rel(target), ident(DELETED_AT)
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
            self._rel(target.view, target.name), sql.SQL(", ").join(ident(c) for c in cols)
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
            raise sink_error(f"loading rows into {self.relation(target)}", exc) from None
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
            sql.SQL("v.{} = u.{}").format(ident(k), sql.Identifier(f"k{i}")) for i, k in enumerate(view.key)
        )
        # Never prepared (prepare=False): a statement psycopg prepared on this connection fails with "cached
        # plan must not change result type" once the table gained or widened a column (``evolve``).
        cols = sql.SQL(", ").join(sql.SQL("v.{}").format(ident(c)) for c in (*view.column_names, VERSION))
        stmt = sql.SQL("SELECT {cols} FROM {rel} v JOIN unnest({u}) AS u({n}) ON {m}").format(
            cols=cols, rel=self._rel(view, target.name), u=unnest, n=names, m=match
        )
        try:
            with self.conn.cursor(row_factory=dict_row) as cur:
                rows = cur.execute(stmt, arrays, prepare=False).fetchall()
        except Exception as exc:
            raise sink_error(f"reading {len(keys)} keys from {self.relation(target)}", exc) from None
        return {tuple(r[k] for k in view.key): r for r in rows}

    def scan(self, target: Target) -> Iterator[dict[str, Any]]:
        from psycopg import sql
        from psycopg.rows import dict_row

        view = target.view
        stmt = sql.SQL("SELECT {} FROM {} ORDER BY {}").format(
            sql.SQL(", ").join(ident(c) for c in (*view.column_names, VERSION)),
            self._rel(view, target.name), sql.SQL(", ").join(ident(k) for k in view.key)
        )
        with self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(stmt, prepare=False)  # see fetch
            yield from cur

    def count(self, target: Target) -> int:
        from psycopg import sql

        row = self.conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(self._rel(target.view, target.name))
        ).fetchone()
        return int(row[0]) if row else 0

    # --- positions ------------------------------------------------------------------------
    def store_positions(self, target: Target, positions: Positions) -> None:
        try:
            with self.conn.transaction():
                self._store_positions(target, positions)
        except Exception as exc:
            raise sink_error("storing positions", exc) from None

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
        on = sql.SQL(" AND ").join(sql.SQL("l.{k} = e.{k}").format(k=ident(k)) for k in keys)
        lk = sql.SQL("l.{}").format(ident(keys[0]))
        ek = sql.SQL("e.{}").format(ident(keys[0]))
        differs = sql.SQL("({}) IS DISTINCT FROM ({})").format(
            sql.SQL(", ").join([sql.SQL("l.{}").format(ident(c)) for c in vals] + [sql.SQL("NULL")]),
            sql.SQL(", ").join([sql.SQL("e.{}").format(ident(c)) for c in vals] + [sql.SQL("NULL")]),
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
            raise sink_error(f"comparing {self.relation(live)} with {self.relation(expected)}", exc) from None
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


__all__ = ["TOMBSTONE_RETENTION_S", "PostgresSink"]
