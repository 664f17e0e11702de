"""Grouped views in PostgreSQL: keyed state (the current contributing row per source key) and the
recompute of the groups a batch touches, in one transaction with the positions.

Recomputing from the state (instead of adding deltas) keeps min/max/collect exact under
retraction; the aggregates are PostgreSQL SQL over the state table (:func:`aggregate_sql_of`),
the same functions the replay computes in Spark.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa
from pyspark.sql.types import BooleanType, DataType, StringType

from kappaflow.errors import ConfigError, SinkError
from kappaflow.projections.api import Aggregate, Avg, CollectList, CollectSet, Count, Max, Min, Sum
from kappaflow.projections.sinks.base import (
    DELETED,
    VERSION,
    Positions,
    Target,
    ViewSchemaMismatch,
    ViewSpec,
    WriteResult,
)
from kappaflow.projections.sinks.postgres.copy import csv_bytes
from kappaflow.projections.sinks.postgres.ddl import KF_SCHEMA, STATE_KEY, STATE_TOPIC, ident, physical_name
from kappaflow.projections.sinks.postgres.mirror import ChangeTable
from kappaflow.projections.sinks.postgres.tables import sink_error


def aggregate_sql_of(agg: Aggregate, dt: DataType | None) -> str:
    """One aggregate of a grouped projection in PostgreSQL over the keyed-state table (identifiers quoted):
    the same result as the Spark aggregate the replay computes (``folds/grouped.py``), for the follow's recompute."""
    if agg.column is None:
        return "count(*)"
    col = '"' + agg.column.replace('"', '""') + '"'
    text = isinstance(dt, StringType)
    coll = f'{col} COLLATE "C"' if text else col
    if isinstance(agg, Count):
        return f"count({col})"
    if isinstance(agg, Sum):
        return f"sum({col})"
    if isinstance(agg, (Min, Max)):
        if isinstance(dt, BooleanType):
            return f"{'bool_and' if isinstance(agg, Min) else 'bool_or'}({col})"
        return f"{agg.func}({coll})"
    if isinstance(agg, Avg):
        return f"(sum({col})::double precision / nullif(count({col}), 0))"
    if isinstance(agg, CollectList):
        return f"coalesce(array_agg({col} ORDER BY {coll}) FILTER (WHERE {col} IS NOT NULL), '{{}}')"
    if isinstance(agg, CollectSet):
        return f"coalesce(array_agg(DISTINCT {coll} ORDER BY {coll}) FILTER (WHERE {col} IS NOT NULL), '{{}}')"
    raise ConfigError(f"unsupported aggregate {agg!r}")


class GroupedState(ChangeTable):
    """Keyed state and group recompute (see the module docstring)."""

    def state_table(self, target: Target) -> str:
        base = f"state__{self._schema(target.view)}__{target.view.name}"
        return physical_name(base, "" if not target.shadow else "__" + target.name.rsplit("__kf_", 1)[-1])

    def _state_rel(self, target: Target) -> Any:
        from psycopg import sql

        return sql.SQL("{}.{}").format(ident(KF_SCHEMA), ident(self.state_table(target)))

    def _create_state(self, view: ViewSpec, target: Target, group: Mapping[str, Any]) -> None:
        from psycopg import sql

        cols = [
            sql.SQL("{} text NOT NULL").format(ident(STATE_TOPIC)),
            sql.SQL("{} bytea NOT NULL").format(ident(STATE_KEY)),
            sql.SQL("{} bigint NOT NULL").format(ident(VERSION)),
        ]
        for c in group["state_columns"]:
            cols.append(sql.SQL("{} {}").format(ident(c["name"]), sql.SQL(c["pg_type"])))
        pk_name = "kf_pk_" + hashlib.sha1(f"st{target.name}{time.time_ns()}".encode()).hexdigest()[:16]
        ix_name = "kf_ix_" + hashlib.sha1(f"ix{target.name}{time.time_ns()}".encode()).hexdigest()[:16]
        rel = self._state_rel(target)
        self.conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident(KF_SCHEMA)))
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(rel))
        self.conn.execute(
            sql.SQL("CREATE TABLE {} ({}, CONSTRAINT {} PRIMARY KEY ({}, {}))").format(
                rel, sql.SQL(", ").join(cols), ident(pk_name), ident(STATE_TOPIC), ident(STATE_KEY)
            )
        )
        self.conn.execute(
            sql.SQL("CREATE INDEX {} ON {} ({})").format(
                ident(ix_name), rel, sql.SQL(", ").join(ident(g) for g in group["group_by"])
            )
        )
        self._create_changes(view, target, group)

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
            self._state_rel(target), sql.SQL(", ").join(ident(c) for c in cols)
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
            raise sink_error(f"loading keyed state for {target.view.name!r}", exc) from None
        return n

    def aggregate_sql(self, target: Target, where_groups: Any | None = None) -> Any:
        """``SELECT group cols, aggregates FROM state [WHERE group in affected] GROUP BY ...``."""
        from psycopg import sql

        group = target.view.options["group"]
        parts = [ident(g) for g in group["group_by"]]
        for a in group["aggregates"]:
            parts.append(sql.SQL("({})::{} AS {}").format(sql.SQL(a["sql"]), sql.SQL(a["pg_type"]), ident(a["name"])))
        where: Any = sql.SQL("")
        if where_groups is not None:
            where = sql.SQL(" WHERE ({}) IN (SELECT {} FROM {})").format(
                sql.SQL(", ").join(ident(g) for g in group["group_by"]),
                sql.SQL(", ").join(ident(g) for g in group["group_by"]),
                where_groups,
            )
        nonnull = sql.SQL(" AND ").join(sql.SQL("{} IS NOT NULL").format(ident(g)) for g in group["group_by"])
        if where_groups is not None:
            where = sql.SQL("{} AND {}").format(where, nonnull)
        else:
            where = sql.SQL(" WHERE {}").format(nonnull)
        return sql.SQL("SELECT {} FROM {}{} GROUP BY {}").format(
            sql.SQL(", ").join(parts),
            self._state_rel(target),
            where,
            sql.SQL(", ").join(ident(g) for g in group["group_by"]),
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
                        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS pg_temp.{}").format(ident(stg)))
                        self.conn.execute(
                            sql.SQL("CREATE TEMP TABLE {} (LIKE {} ) ON COMMIT DELETE ROWS").format(ident(stg), srel)
                        )
                        self.conn.execute(
                            sql.SQL("ALTER TABLE pg_temp.{} ADD COLUMN {} boolean").format(ident(stg), ident(DELETED))
                        )
                        for c in [STATE_TOPIC, STATE_KEY, VERSION]:
                            self.conn.execute(
                                sql.SQL("ALTER TABLE pg_temp.{} ALTER COLUMN {} DROP NOT NULL").format(
                                    ident(stg), ident(c)
                                )
                            )
                        self._staging[key] = stg
                    self._copy(
                        sql.SQL("pg_temp.{}").format(ident(stg)), [*stcols, DELETED], changes.select([*stcols, DELETED])
                    )
                    g = sql.SQL(", ").join(ident(c) for c in gcols)
                    affected = f"kf_aff_{hashlib.sha1(repr(key).encode()).hexdigest()[:8]}"
                    # newest row per source key that is newer than the state
                    self.conn.execute(
                        sql.SQL(
                            "CREATE TEMP TABLE {aff} ON COMMIT DROP AS "
                            "SELECT {sg} FROM {st} s JOIN pg_temp.{stg} c USING ({t}, {k}) WHERE c.{v} > s.{v} "
                            "UNION SELECT {g} FROM pg_temp.{stg} WHERE NOT {d}"
                        ).format(
                            aff=ident(affected),
                            g=g,
                            sg=sql.SQL(", ").join(sql.SQL("s.{}").format(ident(c)) for c in gcols),
                            st=srel,
                            stg=ident(stg),
                            t=ident(STATE_TOPIC),
                            k=ident(STATE_KEY),
                            v=ident(VERSION),
                            d=ident(DELETED),
                        )
                    )
                    latest = sql.SQL(
                        "SELECT DISTINCT ON ({t}, {k}) * FROM pg_temp.{stg} ORDER BY {t}, {k}, {v} DESC"
                    ).format(t=ident(STATE_TOPIC), k=ident(STATE_KEY), stg=ident(stg), v=ident(VERSION))
                    self.conn.execute(
                        sql.SQL(
                            "DELETE FROM {st} s USING ({latest}) c WHERE c.{d} AND s.{t} = c.{t} AND s.{k} = c.{k} "
                            "AND c.{v} > s.{v}"
                        ).format(
                            st=srel, latest=latest, d=ident(DELETED), t=ident(STATE_TOPIC), k=ident(STATE_KEY),
                            v=ident(VERSION),
                        )
                    )
                    sets = sql.SQL(", ").join(
                        sql.SQL("{c} = excluded.{c}").format(c=ident(c)) for c in [VERSION, *scols]
                    )
                    self.conn.execute(
                        sql.SQL(
                            "INSERT INTO {st} AS s ({cols}) SELECT {cols} FROM ({latest}) c WHERE NOT c.{d} "
                            "ON CONFLICT ({t}, {k}) DO UPDATE SET {sets} WHERE excluded.{v} > s.{v}"
                        ).format(
                            st=srel,
                            cols=sql.SQL(", ").join(ident(c) for c in stcols),
                            latest=latest,
                            d=ident(DELETED),
                            t=ident(STATE_TOPIC),
                            k=ident(STATE_KEY),
                            sets=sets,
                            v=ident(VERSION),
                        )
                    )
                    gone = self.conn.execute(
                        # (both sides qualified: an unqualified name in the subquery would resolve to
                        # the outer row when ambiguous, deleting every group, not only the affected)
                        sql.SQL("DELETE FROM {vr} v WHERE ({vg}) IN (SELECT {ag} FROM pg_temp.{aff} a)").format(
                            vr=vrel,
                            vg=sql.SQL(", ").join(sql.SQL("v.{}").format(ident(c)) for c in gcols),
                            ag=sql.SQL(", ").join(sql.SQL("a.{}").format(ident(c)) for c in gcols),
                            aff=ident(affected),
                        )
                    ).rowcount
                    outcols = [*gcols, *[a["name"] for a in group["aggregates"]]]
                    ins = self.conn.execute(
                        sql.SQL("INSERT INTO {vr} ({cols}, {v}) SELECT a.*, %s::bigint FROM ({agg}) a").format(
                            vr=vrel,
                            cols=sql.SQL(", ").join(ident(c) for c in outcols),
                            v=ident(VERSION),
                            agg=self.aggregate_sql(target, sql.SQL("pg_temp.{}").format(ident(affected))),
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
                            v=ident(VERSION),
                            aff=ident(affected),
                            nn=sql.SQL(" AND ").join(sql.SQL("{} IS NOT NULL").format(ident(c)) for c in gcols),
                        ),
                        (version,),
                    )
                if positions:
                    self._store_positions(target, positions)
        except BaseException as exc:
            self._forget_staging()
            if isinstance(exc, SinkError) or not isinstance(exc, Exception):
                raise
            raise sink_error(f"applying {changes.num_rows} keyed changes to {self.relation(target)}", exc) from None
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
                        cols=sql.SQL(", ").join(ident(c) for c in outcols),
                        v=ident(VERSION),
                        agg=self.aggregate_sql(target),
                    ),
                    (version,),
                ).rowcount
        except Exception as exc:
            raise sink_error(f"aggregating keyed state into {self.relation(target)}", exc) from None
        return max(n, 0)


__all__ = ["GroupedState", "aggregate_sql_of"]
