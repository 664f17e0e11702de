"""Can each table of a PostgreSQL source be captured? Keys, replica identity, nullability, duplicates.

The rules capture enforces (``slots.load_table``) live here so that `source add` and `doctor`
say the same thing first, and all at once: a keyless table needs key columns *and* a replica
identity that carries them in the WAL, so both fixes are given together.

* every record is keyed: by the primary key, or by ``key_columns`` named in the config;
* the old row of an UPDATE/DELETE must carry the key columns: the replica identity's columns
  (DEFAULT: the primary key, USING INDEX: the index's, FULL: all, NOTHING: none) must cover them;
* configured key columns must be NOT NULL (a NULL key cannot be written) and should be unique:
  duplicates are looked for with one GROUP BY when the table is small enough
  (:data:`~kappaflow.connectors.preflight.DUPLICATE_CHECK_MAX_ROWS`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql
from rich.filesize import decimal

from kappaflow.connectors.postgres import slots
from kappaflow.connectors.preflight import (
    DUPLICATE_CHECK_MAX_ROWS,
    DUPLICATES_MEAN,
    TableCheck,
    key_columns_hint,
)
from kappaflow.doctor import Finding, fail, ok, warn
from kappaflow.doctor import check_tables as table_findings
from kappaflow.errors import KappaflowError

__all__ = ["check_source", "check_tables", "doctor_checks", "key_check"]

_IDENT = {"d": "DEFAULT", "n": "NOTHING", "f": "FULL", "i": "USING INDEX"}


_PLAIN = re.compile(r"[a-z_][a-z0-9_$]*")


def _quoted(conn: psycopg.Connection, *parts: str) -> str:
    """An identifier as a user would type it in SQL: bare when it is plain lower case, quoted otherwise."""
    return ".".join(p if _PLAIN.fullmatch(p) else sql.Identifier(p).as_string(conn) for p in parts)


def _identity_index_columns(conn: psycopg.Connection, oid: int) -> tuple[str, ...]:
    return tuple(r[0] for r in conn.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
        "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s AND i.indisreplident "
        "ORDER BY array_position(i.indkey, a.attnum)", (oid,)).fetchall())


def _unique_not_null_keys(conn: psycopg.Connection, oid: int) -> list[tuple[str, tuple[str, ...]]]:
    """Unique, non-partial, plain-column indexes whose columns are all NOT NULL: ready-made keys."""
    rows = conn.execute(
        "SELECT ci.relname, array_agg(a.attname ORDER BY array_position(i.indkey, a.attnum)), bool_and(a.attnotnull) "
        "FROM pg_index i JOIN pg_class ci ON ci.oid = i.indexrelid "
        "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
        "WHERE i.indrelid = %s AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL "
        "GROUP BY ci.relname, i.indnatts HAVING count(*) = i.indnatts ORDER BY count(*), ci.relname", (oid,)).fetchall()
    return [(str(r[0]), tuple(r[1])) for r in rows if r[2]]


def key_check(conn: psycopg.Connection, oid: int, schema: str, table: str, columns: Sequence[slots.ColumnInfo],
              pk: Sequence[str], ident: str, key_columns: Sequence[str] | None,
              source: str | None = None) -> TableCheck:
    """Key and replica-identity verdict for one table (no data read)."""
    qualified = f"{schema}.{table}"
    qt = _quoted(conn, schema, table)
    names = {c.name for c in columns}
    if key_columns:
        missing = [k for k in key_columns if k not in names]
        if missing:
            return TableCheck(qualified, f"key_columns names column(s) {missing} the table does not have "
                              f"(columns: {', '.join(sorted(names))})",
                              "name existing columns: " + key_columns_hint(source, qualified), problem=True)
        key = tuple(key_columns)
    elif pk:
        return TableCheck(qualified, f"primary key ({', '.join(pk)})")
    else:
        key = ()
    if ident == "d":
        identity: tuple[str, ...] = tuple(pk)
    elif ident == "i":
        identity = _identity_index_columns(conn, oid)
    elif ident == "f":
        identity = tuple(c.name for c in columns)
    else:
        identity = ()
    if not key:
        suggested = _unique_not_null_keys(conn, oid)
        cols = suggested[0][1] if suggested else None
        steps = [key_columns_hint(source, qualified, cols)
                 + (f" -- {', '.join(cols)} is unique and NOT NULL (index {suggested[0][0]})" if cols else "")]
        if not cols or not set(cols) <= set(identity):
            steps.append(f"ALTER TABLE {qt} REPLICA IDENTITY FULL (so UPDATE and DELETE carry the key columns "
                         "in the WAL)")
        return TableCheck(
            qualified, f"no primary key (REPLICA IDENTITY {_IDENT.get(ident, ident)}): kappaflow keys every record",
            f"ALTER TABLE {qt} ADD PRIMARY KEY (...); or both: " + "; and ".join(steps), problem=True)
    problems: list[str] = []
    fixes: list[str] = []
    nullable = [c.name for c in columns if c.name in key and not c.not_null]
    if nullable:
        problems.append(f"key column(s) {', '.join(nullable)} may be NULL (a record key cannot be)")
        fixes += [f"ALTER TABLE {qt} ALTER COLUMN {_quoted(conn, c)} SET NOT NULL" for c in nullable]
    uncovered = [k for k in key if k not in identity]
    if uncovered:
        problems.append(f"REPLICA IDENTITY {_IDENT.get(ident, ident)} does not put key column(s) "
                        f"{', '.join(uncovered)} into the WAL of UPDATE and DELETE")
        fixes.append(f"ALTER TABLE {qt} REPLICA IDENTITY FULL (or USING INDEX a unique index on the key columns)")
    if problems:
        return TableCheck(qualified, "; ".join(problems), "; ".join(fixes), problem=True)
    return TableCheck(qualified, f"key_columns ({', '.join(key)})")


def _duplicates(conn: psycopg.Connection, schema: str, table: str, key: Sequence[str],
                estimated_rows: int) -> TableCheck | None:
    """One GROUP BY over a small table; None when it holds no duplicate key."""
    qualified = f"{schema}.{table}"
    if estimated_rows > DUPLICATE_CHECK_MAX_ROWS:
        return TableCheck(qualified, f"key_columns ({', '.join(key)}); duplicates not checked (~{estimated_rows:,} "
                          f"rows, the check reads tables up to {DUPLICATE_CHECK_MAX_ROWS:,})")
    cols = sql.SQL(", ").join(sql.Identifier(k) for k in key)
    query = sql.SQL("SELECT {cols}, count(*) FROM {t} GROUP BY {cols} HAVING count(*) > 1 "
                    "ORDER BY count(*) DESC LIMIT 3").format(cols=cols, t=sql.Identifier(schema, table))
    with conn.transaction():
        conn.execute("SET LOCAL statement_timeout = '30s'")
        rows = conn.execute(query).fetchall()
    if not rows:
        return None
    examples = "; ".join(", ".join(f"{k}={v!r}" for k, v in zip(key, r[:-1], strict=True)) + f" ({r[-1]} rows)"
                         for r in rows)
    return TableCheck(qualified, f"key columns ({', '.join(key)}) are not unique, e.g. {examples}: {DUPLICATES_MEAN}",
                      "choose key columns that are unique per row (add an identity column if none are)", problem=True)


def check_tables(conn: psycopg.Connection, tables: Sequence[str], key_columns: Mapping[str, Sequence[str]],
                 *, source: str | None = None, duplicates: bool = True) -> list[TableCheck]:
    """A verdict per configured table (every user table when ``tables`` is empty); unknown tables too."""
    from kappaflow.errors import KappaflowError

    names = [slots.split_table_name(t) for t in tables] if tables else slots.all_user_tables(conn)
    keys = {slots.split_table_name(k): list(v) for k, v in key_columns.items()}
    out: list[TableCheck] = []
    for schema, table in names:
        qualified = f"{schema}.{table}"
        try:
            info = slots.describe_table(conn, schema, table)
        except KappaflowError as exc:
            out.append(TableCheck(qualified, str(exc).split(";")[0], "fix the source's tables list", problem=True))
            continue
        check = key_check(conn, info.oid, schema, table, info.columns, info.pk, info.replica_identity,
                          keys.get((schema, table)), source)
        if duplicates and not check.problem and keys.get((schema, table)):
            check = _duplicates(conn, schema, table, keys[(schema, table)], info.estimated_rows) or check
        out.append(check)
    for schema, table in keys:
        if (schema, table) not in set(names):
            out.append(TableCheck(f"{schema}.{table}", "key_columns names a table the source does not capture",
                                  "add it to the tables list or remove its key_columns", problem=True))
    return out


def check_source(src: Any, duplicates: bool = True) -> list[TableCheck]:
    """Every captured table of a PostgreSQL source config, checked on a connection of its own."""
    conn = slots.connect(src.connect_dsn(), what=f"checking the tables of source {src.name!r}")
    try:
        return check_tables(conn, src.tables, src.key_columns, source=src.name, duplicates=duplicates)
    finally:
        conn.close()


def doctor_checks(src: Any) -> Iterator[Finding]:
    """`kappaflow doctor` on a PostgreSQL source: connection, wal_level, replication role, slots, tables."""
    import psycopg

    area = f"source {src.name}"
    try:
        conn = psycopg.connect(src.connect_dsn(), connect_timeout=5, autocommit=True)
    except (psycopg.Error, KappaflowError) as exc:
        yield fail(area, "connect", f"{src.dsn}: {str(exc).strip().splitlines()[0]}",
                    "check host, port, database, user and the password variable")
        return
    with conn:
        version = conn.execute("show server_version").fetchone()
        yield ok(area, "connect", f"PostgreSQL {version[0] if version else '?'}")
        wal = conn.execute("show wal_level").fetchone()
        if wal and wal[0] == "logical":
            yield ok(area, "wal_level", "logical")
        else:
            yield fail(area, "wal_level", f"wal_level={wal[0] if wal else '?'}; logical decoding is off",
                        "ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL")
        row = conn.execute("select rolreplication or rolsuper from pg_roles where rolname = current_user").fetchone()
        if row and row[0]:
            yield ok(area, "replication role", "current role may replicate")
        else:
            yield fail(area, "replication role", "the role lacks REPLICATION",
                        "ALTER ROLE <user> WITH REPLICATION (as a superuser)")
        slots = conn.execute("show max_replication_slots").fetchone()
        used = conn.execute("select count(*) from pg_replication_slots").fetchone()
        if slots and used and int(used[0]) >= int(slots[0]):
            yield warn(area, "slots", f"all {slots[0]} replication slots are in use",
                        "raise max_replication_slots or drop unused slots")
        slot = conn.execute(
            "select active, wal_status, pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn) "
            "from pg_replication_slots where slot_name = %s", (src.slot_name,)).fetchone()
        if slot is None:
            yield ok(area, "slot", f"{src.slot_name} not created yet (capture creates it)")
        elif slot[1] == "lost":
            yield fail(area, "slot", f"{src.slot_name} was invalidated (WAL removed)",
                        f"recover with `kappaflow capture {src.name} --resnapshot` (replaces the slot, "
                        "snapshots again, deletes rows removed meanwhile)")
        elif slot[0]:
            yield ok(area, "slot", f"{src.slot_name} active, {int(slot[2] or 0):,} bytes behind")
        else:
            retained = int(slot[3] or 0)
            yield warn(area, "slot", f"{src.slot_name} inactive (capture not running), retains "
                        f"{decimal(retained)} of WAL until capture resumes",
                        f"run `kappaflow capture {src.name}`, or `kappaflow source remove {src.name}` "
                        "to drop the slot")
    yield from table_findings(src, area)
