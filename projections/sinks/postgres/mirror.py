"""The group change table of a grouped view: the last watermark at which each group was
recomputed (deleted groups included). Mirrors of the view (its search or Redis copy) read it to
find what changed since their position, in one snapshot with the view's positions."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from kappaflow.errors import SinkError
from kappaflow.projections.sinks.base import (
    VERSION,
    Target,
    TopicPartition,
    ViewSpec,
)
from kappaflow.projections.sinks.errors import SinkStateLostError
from kappaflow.projections.sinks.postgres.ddl import KF_SCHEMA, ident, pg_type, physical_name
from kappaflow.projections.sinks.postgres.tables import PostgresTables, sink_error

CHANGES_BASE = "kappaflow: group changes complete since watermark "


class ChangeTable(PostgresTables):
    """The group change table (see the module docstring)."""

    def changes_table(self, target: Target) -> str:
        """Grouped views: the last watermark at which each group was recomputed (deleted groups
        included), which mirrors of the view (search, Redis) read to find what changed."""
        base = f"groups__{self._schema(target.view)}__{target.view.name}"
        return physical_name(base, "" if not target.shadow else "__" + target.name.rsplit("__kf_", 1)[-1])

    def _changes_rel(self, target: Target) -> Any:
        from psycopg import sql

        return sql.SQL("{}.{}").format(ident(KF_SCHEMA), ident(self.changes_table(target)))

    def _create_changes(self, view: ViewSpec, target: Target, group: Mapping[str, Any]) -> None:
        """The group change table (see ``changes_table``): group key (primary key) -> version."""
        from psycopg import sql

        key_cols = [
            sql.SQL("{} {} NOT NULL").format(ident(g), sql.SQL(pg_type(view.column(g).type))) for g in group["group_by"]
        ]
        rel = self._changes_rel(target)
        tag = f"{self.changes_table(target)}{time.time_ns()}"
        pk_name = "kf_pk_" + hashlib.sha1(f"gc{tag}".encode()).hexdigest()[:16]
        ix_name = "kf_ix_" + hashlib.sha1(f"gv{tag}".encode()).hexdigest()[:16]
        self.conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident(KF_SCHEMA)))
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(rel))
        self.conn.execute(
            sql.SQL("CREATE TABLE {} ({}, {} bigint NOT NULL, CONSTRAINT {} PRIMARY KEY ({}))").format(
                rel,
                sql.SQL(", ").join(key_cols),
                ident(VERSION),
                ident(pk_name),
                sql.SQL(", ").join(ident(g) for g in group["group_by"]),
            )
        )
        self.conn.execute(sql.SQL("CREATE INDEX {} ON {} ({})").format(ident(ix_name), rel, ident(VERSION)))

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
                        vrel, sql.SQL(", ").join(sql.SQL("v.{}").format(ident(k)) for k in keys)
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
                    on = sql.SQL(" AND ").join(sql.SQL("v.{k} = c.{k}").format(k=ident(k)) for k in keys)
                    stmt = sql.SQL("SELECT v.* FROM {c} c JOIN {v} v ON {on} WHERE c.{ver} > %s").format(
                        c=crel, v=vrel, on=on, ver=ident(VERSION)
                    )
                    params = (since,)
                    rows = self.conn.execute(
                        sql.SQL(
                            "SELECT {ks} FROM {c} c WHERE c.{ver} > %s AND NOT EXISTS (SELECT 1 FROM {v} v WHERE {on})"
                        ).format(
                            ks=sql.SQL(", ").join(sql.SQL("c.{}").format(ident(k)) for k in keys),
                            c=crel,
                            v=vrel,
                            on=on,
                            ver=ident(VERSION),
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
            raise sink_error(f"reading {self.relation(target)} for its mirrors", exc) from None
        return positions, gone
