"""The join state of a followed view: the current row of every table of the join, in PostgreSQL.

One table per (view target, table of the join) in the ``kappaflow`` schema of the views
database: ``k`` (canonical key text, primary key), ``kb`` (the record key, so a view row can be
deleted by key), ``p`` (log partition), ``ver`` (offset of the change that made the row),
``row`` (the kept columns as JSON text, written and read by Spark with the same options) and
one indexed ``fk<j>`` column per lookup whose foreign key is in this table, one indexed
``nfk<j>`` column (the parent's key text) per nested collection of this table's rows. A follow
batch (``apply``) runs inside the transaction that also writes the view rows and the positions:

1. COPY the batch's latest change per (table, key) into a temp staging table;
1b. (nested collections) the parents the batch's child rows belong to BEFORE the change go to the
   ``__tp`` table ("pending"): a moved or deleted child must leave its old parent's document,
   and after step 2 nothing else remembers that parent. Pending keys are emptied at the start of a
   batch once the store has written everything the state folded (``carry_pending`` False), and
   kept while the state is ahead of the store (a crash between the state's commit and the store's
   write: the re-run must rewrite those old parents too);
2. delete / upsert the state rows (guarded by ``ver``: re-applying a change is a no-op);
3. affected driving keys = the driving keys of the batch + the driving rows that reach a
   changed looked-up row through their chain of foreign keys, under the NEW state (fan-out,
   found through the ``fk<j>`` indexes) + the parents of the batch's child rows under the new
   state + the pending keys;
4. read the joined rows of the affected keys (a driving key whose row is gone comes back
   with a NULL driving row: the view row is deleted), with each nested collection's child rows
   as a JSON array (through the ``nfk<j>`` index; sorted by the Spark stage).
Steps 1 and 4 are one COPY each (CSV written and read by pyarrow: no Python object per row or
value on the driver), the others a fixed number of statements per batch, whatever its size.
A crash anywhere rolls all of it back together with the view rows and positions.
"""

from __future__ import annotations

import hashlib
import io
import time
from typing import Any

import pyarrow as pa

from kappaflow.projections.joins.plan import JoinPlan, TopicState
from kappaflow.projections.sinks.base import Target
from kappaflow.projections.sinks.postgres.copy import arrow_from_csv, csv_bytes

KF_SCHEMA = "kappaflow"
_MAX_IDENT = 63


def _q(name: str) -> Any:
    from psycopg import sql

    return sql.Identifier(name)


def _table_name(base: str, index: int | str) -> str:
    suffix = f"__t{index}"
    name = base + suffix
    if len(name.encode()) <= _MAX_IDENT:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    keep = _MAX_IDENT - len(suffix.encode()) - 9
    return base.encode()[:keep].decode(errors="ignore") + "_" + digest + suffix


def base_for_target(schema: str, target: Target) -> str:
    """Table name base of the state kept in a PostgreSQL sink's transaction: per (schema, target table)."""
    return f"join__{schema}__{target.name}"


class JoinState:
    """The join state tables of one view target (named from `base`) on one psycopg connection."""

    def __init__(self, conn: Any, base: str, jp: JoinPlan) -> None:
        self.conn = conn
        self.base = base
        self.jp = jp
        self.carry_pending = False  # keep the pending parents of earlier batches (see step 1b)

    def table(self, ts: TopicState | int) -> str:
        return _table_name(self.base, ts if isinstance(ts, int) else ts.index)

    def rel(self, ts: TopicState | int) -> Any:
        from psycopg import sql

        return sql.SQL("{}.{}").format(_q(KF_SCHEMA), _q(self.table(ts)))

    def pending(self) -> Any:
        """The pending parents table (step 1b; only with nested collections)."""
        from psycopg import sql

        return sql.SQL("{}.{}").format(_q(KF_SCHEMA), _q(_table_name(self.base, "p")))

    def _all(self) -> list[Any]:
        """Every table of the state."""
        return [self.rel(ts) for ts in self.jp.topics] + ([self.pending()] if self.jp.nested else [])

    # --- DDL ---------------------------------------------------------------------------------
    def exists(self) -> bool:
        names = [self.table(ts) for ts in self.jp.topics] + ([_table_name(self.base, "p")] if self.jp.nested else [])
        row = self.conn.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = ANY(%s) AND c.relkind = 'r'",
            (KF_SCHEMA, names),
        ).fetchone()
        return bool(row and row[0] == len(names))

    def create(self) -> None:
        """(Re)create empty state tables (drops leftovers of an interrupted build)."""
        from psycopg import sql

        self.conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_q(KF_SCHEMA)))
        for ts in self.jp.topics:
            rel = self.rel(ts)
            self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(rel))
            cols: list[Any] = [sql.SQL("k text PRIMARY KEY"), sql.SQL("kb bytea"), sql.SQL("p integer"),
                    sql.SQL("ver bigint NOT NULL"), sql.SQL("row text")]
            fks = [f"fk{j}" for j in ts.children] + [f"nfk{j}" for j in ts.nested]
            cols += [sql.SQL("{} text").format(_q(c)) for c in fks]
            self.conn.execute(sql.SQL("CREATE TABLE {} ({})").format(rel, sql.SQL(", ").join(cols)))
            for c in fks:
                ix = "kf_jx_" + hashlib.sha1(f"{self.table(ts)}{c}{time.time_ns()}".encode()).hexdigest()[:16]
                self.conn.execute(sql.SQL("CREATE INDEX {} ON {} ({})").format(_q(ix), rel, _q(c)))
        if self.jp.nested:
            self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self.pending()))
            self.conn.execute(sql.SQL("CREATE TABLE {} (k text PRIMARY KEY, kb bytea)").format(self.pending()))

    def drop(self) -> None:
        from psycopg import sql

        for rel in self._all():
            self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(rel))

    def replace(self, other: JoinState) -> None:
        """Make `other`'s tables (a rebuilt shadow's) this target's: drop these, rename those.
        Run inside the transaction of the view swap."""
        from psycopg import sql

        names = [self.table(ts) for ts in self.jp.topics] + ([_table_name(self.base, "p")] if self.jp.nested else [])
        for mine, theirs, name in zip(self._all(), other._all(), names, strict=True):
            self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(mine))
            self.conn.execute(sql.SQL("ALTER TABLE IF EXISTS {} RENAME TO {}").format(theirs, _q(name)))

    def truncate(self) -> None:
        from psycopg import sql

        for rel in self._all():
            self.conn.execute(sql.SQL("TRUNCATE {}").format(rel))

    # --- load (replay) -----------------------------------------------------------------------
    def load(self, ts: TopicState, rows: pa.Table) -> int:
        """COPY state rows (``k, kb, p, ver, row, fk<j>...``) into an empty table."""

        cols = ["k", "kb", "p", "ver", "row", *[f"fk{j}" for j in ts.children], *[f"nfk{j}" for j in ts.nested]]
        self._copy_in(self.rel(ts), cols, rows)
        return rows.num_rows

    def _copy_in(self, rel: Any, cols: list[str], rows: pa.Table) -> None:
        """COPY `cols` of `rows` into `rel` as CSV written by pyarrow (no Python object per value;
        ``kb`` may come as binary or as bytea text ``\\x<hex>``, see ``stage.kb_text``)."""
        from psycopg import sql

        stmt = sql.SQL("COPY {} ({}) FROM STDIN WITH (FORMAT csv)").format(rel, sql.SQL(", ").join(_q(c) for c in cols))
        if not rows.num_rows:
            return
        with self.conn.cursor() as cur, cur.copy(stmt) as cp:
            cp.write(csv_bytes(rows.select(cols)))

    # --- apply (follow) ----------------------------------------------------------------------
    def apply(self, changes: pa.Table) -> pa.Table:
        """Steps 1-4 of the module docstring: `changes` has ``ti, k, kb, p, off, deleted, row,
        fk0..fk<n-1>, nfk0..nfk<m-1>``; returns ``k, kb`` (the record key as hex text), ``p, r0``
        (driving row text), ``r<i+1>`` per lookup i and ``n<j>`` (a JSON array of child row texts, NULL
        for none) per nested collection j. Both directions are COPY in CSV, read and written by pyarrow."""
        from psycopg import sql

        jp = self.jp
        n = len(jp.lookups)
        fkcols = [f"fk{j}" for j in range(n)] + [f"nfk{j}" for j in range(len(jp.nested))]
        stg, aff = "kf_join_stg", "kf_join_aff"
        fkdefs = sql.SQL("").join(sql.SQL(", {} text").format(_q(c)) for c in fkcols)
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS pg_temp.{}").format(_q(stg)))
        self.conn.execute(
            sql.SQL("CREATE TEMP TABLE {} (ti integer, k text, kb bytea, p integer, off bigint, deleted boolean, "
                    "row text{}) ON COMMIT DROP").format(_q(stg), fkdefs)
        )
        self.conn.execute(sql.SQL("DROP TABLE IF EXISTS pg_temp.{}").format(_q(aff)))
        self.conn.execute(
            sql.SQL("CREATE TEMP TABLE {} (k text PRIMARY KEY, kb bytea) ON COMMIT DROP").format(_q(aff))
        )
        cols = ["ti", "k", "kb", "p", "off", "deleted", "row", *fkcols]
        self._copy_in(sql.SQL("pg_temp.{}").format(_q(stg)), cols, changes)
        self.conn.execute(sql.SQL("ANALYZE pg_temp.{}").format(_q(stg)))
        # 1b. nested collections: the parents of the batch's child rows before the change are pending
        if jp.nested:
            if not self.carry_pending:
                self.conn.execute(sql.SQL("TRUNCATE {}").format(self.pending()))
            for np_ in jp.nested:
                self.conn.execute(
                    sql.SQL(
                        "INSERT INTO {pend} (k, kb) SELECT DISTINCT d.k, d.kb FROM {child} s JOIN {drv} d "
                        "ON d.k = s.{nfk} WHERE s.k IN (SELECT k FROM pg_temp.{stg} WHERE ti = {ti}) "
                        "ON CONFLICT (k) DO NOTHING"
                    ).format(pend=self.pending(), child=self.rel(np_.topic_index), drv=self.rel(0),
                             nfk=_q(f"nfk{np_.index}"), stg=_q(stg), ti=sql.Literal(np_.topic_index))
                )
        # 2. the state: newest change per (table, key), guarded by the offset
        for ts in jp.topics:
            rel = self.rel(ts)
            latest = sql.SQL(
                "SELECT DISTINCT ON (k) * FROM pg_temp.{} WHERE ti = {} ORDER BY k, off DESC"
            ).format(_q(stg), sql.Literal(ts.index))
            self.conn.execute(
                sql.SQL("DELETE FROM {} s USING ({}) c WHERE c.deleted AND s.k = c.k AND c.off > s.ver").format(
                    rel, latest
                )
            )
            fks = [f"fk{j}" for j in ts.children] + [f"nfk{j}" for j in ts.nested]
            own = ["kb", "p", "ver", "row", *fks]
            src = ["kb", "p", "off", "row", *fks]
            self.conn.execute(
                sql.SQL(
                    "INSERT INTO {rel} AS s (k, {own}) SELECT k, {src} FROM ({latest}) c WHERE NOT c.deleted "
                    "ON CONFLICT (k) DO UPDATE SET {sets} WHERE excluded.ver > s.ver"
                ).format(
                    rel=rel,
                    own=sql.SQL(", ").join(_q(c) for c in own),
                    src=sql.SQL(", ").join(_q(c) for c in src),
                    latest=latest,
                    sets=sql.SQL(", ").join(sql.SQL("{c} = excluded.{c}").format(c=_q(c)) for c in own),
                )
            )
        # 3. affected driving keys: the batch's own, then fan-out from every changed looked-up row
        self.conn.execute(
            sql.SQL(
                "INSERT INTO pg_temp.{aff} (k, kb) SELECT DISTINCT ON (k) k, kb FROM pg_temp.{stg} WHERE ti = 0 "
                "ORDER BY k, off DESC"
            ).format(aff=_q(aff), stg=_q(stg))
        )
        for lp in jp.lookups:
            path = self._path(lp.index)
            joins: list[Any] = []
            prev = sql.SQL("d")
            for step in path[:-1]:
                a = sql.SQL(f"a{step}")
                joins.append(
                    sql.SQL("JOIN {} {a} ON {a}.k = {prev}.{fk}").format(
                        self.rel(jp.lookups[step].topic_index), a=a, prev=prev, fk=_q(f"fk{step}")
                    )
                )
                prev = a
            self.conn.execute(
                sql.SQL(
                    "INSERT INTO pg_temp.{aff} (k, kb) SELECT d.k, d.kb FROM {drv} d {joins} "
                    "WHERE {prev}.{fk} IN (SELECT k FROM pg_temp.{stg} WHERE ti = {ti}) ON CONFLICT (k) DO NOTHING"
                ).format(
                    aff=_q(aff), drv=self.rel(0), joins=sql.SQL(" ").join(joins), prev=prev,
                    fk=_q(f"fk{lp.index}"), stg=_q(stg), ti=sql.Literal(lp.topic_index),
                )
            )
        for np_ in jp.nested:  # the children's parents now, and the pending ones (their parents before)
            self.conn.execute(
                sql.SQL(
                    "INSERT INTO pg_temp.{aff} (k, kb) SELECT DISTINCT d.k, d.kb FROM {child} s JOIN {drv} d "
                    "ON d.k = s.{nfk} WHERE s.k IN (SELECT k FROM pg_temp.{stg} WHERE ti = {ti}) "
                    "ON CONFLICT (k) DO NOTHING"
                ).format(aff=_q(aff), child=self.rel(np_.topic_index), drv=self.rel(0),
                         nfk=_q(f"nfk{np_.index}"), stg=_q(stg), ti=sql.Literal(np_.topic_index))
            )
        if jp.nested:
            self.conn.execute(
                sql.SQL("INSERT INTO pg_temp.{} (k, kb) SELECT k, kb FROM {} ON CONFLICT (k) DO NOTHING").format(
                    _q(aff), self.pending())
            )
        # 4. the joined rows of the affected keys (current state)
        sel: list[Any] = [sql.SQL("a.k"), sql.SQL("encode(a.kb, 'hex')"), sql.SQL("d.p"), sql.SQL("d.row AS r0")]
        joins = []
        for lp in jp.lookups:
            alias = sql.SQL(f"l{lp.index}")
            parent = sql.SQL("d") if lp.parent is None else sql.SQL(f"l{lp.parent}")
            joins.append(
                sql.SQL("LEFT JOIN {} {a} ON {a}.k = {p}.{fk}").format(
                    self.rel(lp.topic_index), a=alias, p=parent, fk=_q(f"fk{lp.index}")
                )
            )
            sel.append(sql.SQL("{}.row AS {}").format(alias, _q(f"r{lp.index + 1}")))
        for np_ in jp.nested:
            sel.append(sql.SQL(
                "(SELECT json_agg(c.row::json)::text FROM {} c WHERE c.{} = a.k AND d.k IS NOT NULL) AS {}"
            ).format(self.rel(np_.topic_index), _q(f"nfk{np_.index}"), _q(f"n{np_.index}")))
        query = sql.SQL("SELECT {} FROM pg_temp.{} a LEFT JOIN {} d ON d.k = a.k {}").format(
            sql.SQL(", ").join(sel), _q(aff), self.rel(0), sql.SQL(" ").join(joins)
        )
        buf = io.BytesIO()
        with self.conn.cursor() as cur, cur.copy(sql.SQL("COPY ({}) TO STDOUT WITH (FORMAT csv)").format(query)) as cp:
            for chunk in cp:
                buf.write(chunk)
        names = ["k", "kb", "p", "r0", *[f"r{i + 1}" for i in range(n)], *[f"n{j}" for j in range(len(jp.nested))]]
        types = {name: pa.int32() if name == "p" else pa.string() for name in names}
        return arrow_from_csv(buf.getvalue(), types)

    def _path(self, index: int) -> list[int]:
        """Lookup indexes from the driving table to lookup `index` (it last)."""
        out = [index]
        parent = self.jp.lookups[index].parent
        while parent is not None:
            out.append(parent)
            parent = self.jp.lookups[parent].parent
        return list(reversed(out))




# --- state beside a store without a shared transaction (search, Redis) ------------------------------
CATALOG = "join_builds"


class BuildCatalog:
    """Which join state belongs to which build of a document store, and up to where it is folded.

    ``kappaflow.join_builds`` (sink kind, view, build) -> the state tables' name base and the
    positions the state has folded (``[[topic, partition, next offset], ...]``), updated in the
    state's transaction. A store without a transaction shared with PostgreSQL gets its rows and
    positions written AFTER the state commits, so the state is never behind the store's positions
    unless something lost it (a restored backup): ``behind`` tells, and the view is rebuilt."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def _rel(self) -> Any:
        from psycopg import sql

        return sql.SQL("{}.{}").format(_q(KF_SCHEMA), _q(CATALOG))

    def ensure(self) -> None:
        from psycopg import sql

        with self.conn.transaction():  # concurrent first uses: one creates, the others wait for it
            self.conn.execute("SELECT pg_advisory_xact_lock(hashtext('kappaflow.join_builds'))")
            self.conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_q(KF_SCHEMA)))
            self.conn.execute(sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (sink text NOT NULL, view text NOT NULL, build text NOT NULL, "
                "base text NOT NULL, positions jsonb NOT NULL DEFAULT '[]', PRIMARY KEY (sink, view, build))"
            ).format(self._rel()))

    def get(self, sink: str, view: str, build: str) -> tuple[str, dict[tuple[str, int], int]] | None:
        from psycopg import sql

        row = self.conn.execute(
            sql.SQL("SELECT base, positions FROM {} WHERE sink = %s AND view = %s AND build = %s").format(self._rel()),
            (sink, view, build),
        ).fetchone()
        if row is None:
            return None
        return row[0], {(t, int(p)): int(o) for t, p, o in row[1]}

    def register(self, sink: str, view: str, build: str) -> str:
        """The state base of a new build (positions empty); an entry left for the build is reset."""
        from psycopg import sql

        base = f"join__{sink}__{view}__{build}"
        self.conn.execute(
            sql.SQL("INSERT INTO {} (sink, view, build, base) VALUES (%s, %s, %s, %s) ON CONFLICT (sink, view, build) "
                    "DO UPDATE SET base = excluded.base, positions = '[]'").format(self._rel()),
            (sink, view, build, base),
        )
        return base

    def set_positions(self, sink: str, view: str, build: str, positions: dict[tuple[str, int], int]) -> None:
        from psycopg import sql
        from psycopg.types.json import Jsonb

        value = Jsonb([[t, p, o] for (t, p), o in sorted(positions.items())])
        self.conn.execute(
            sql.SQL("UPDATE {} SET positions = %s WHERE sink = %s AND view = %s AND build = %s").format(self._rel()),
            (value, sink, view, build),
        )

    def entries(self, sink: str, view: str) -> list[tuple[str, str]]:
        from psycopg import sql

        return [(r[0], r[1]) for r in self.conn.execute(
            sql.SQL("SELECT build, base FROM {} WHERE sink = %s AND view = %s ORDER BY build").format(self._rel()),
            (sink, view),
        ).fetchall()]

    def forget(self, sink: str, view: str, build: str) -> None:
        from psycopg import sql

        self.conn.execute(
            sql.SQL("DELETE FROM {} WHERE sink = %s AND view = %s AND build = %s").format(self._rel()),
            (sink, view, build),
        )


def behind(state: dict[tuple[str, int], int], store: dict[tuple[str, int], int]) -> list[str]:
    """Partitions where the store's positions are past what the state has folded ("topic[p]: a < b")."""
    return [f"{t}[{p}]: state {state.get((t, p), 0)} < view {o}" for (t, p), o in sorted(store.items())
            if o > state.get((t, p), 0)]


__all__ = ["CATALOG", "BuildCatalog", "JoinState", "base_for_target", "behind"]
