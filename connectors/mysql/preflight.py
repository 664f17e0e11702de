"""Can each table of a MySQL/MariaDB source be captured? Existence, key, key-column nullability, duplicates.

Capture needs a key for every table (the primary key or configured ``key_columns``) and refuses
a keyless one when it reaches it in the snapshot; `source add`, `doctor` and the start of capture
run these checks first, over every table at once. A FULL row image carries whole rows, so unlike
PostgreSQL there is no replica identity to set.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from kappaflow.connectors.preflight import (
    DUPLICATE_CHECK_MAX_ROWS,
    DUPLICATES_MEAN,
    TableCheck,
    key_columns_hint,
)
from kappaflow.doctor import Finding, fail, ok
from kappaflow.doctor import check_tables as table_findings

__all__ = ["check_source", "check_tables", "doctor_checks", "split_names"]


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def split_names(tables: Sequence[str], default_db: str | None) -> list[tuple[str, str]]:
    """``db.table`` (or a bare ``table`` in the DSN's database) -> (db, table)."""
    out = []
    for t in tables:
        db, sep, table = t.partition(".")
        out.append((db, table) if sep else (default_db or "", t))
    return out


def _duplicates(cur: Any, db: str, table: str, key: Sequence[str], estimated: int) -> TableCheck | None:
    qualified = f"{db}.{table}"
    if estimated > DUPLICATE_CHECK_MAX_ROWS:
        return TableCheck(qualified, f"key_columns ({', '.join(key)}); duplicates not checked (~{estimated:,} rows, "
                          f"the check reads tables up to {DUPLICATE_CHECK_MAX_ROWS:,})")
    cols = ", ".join(_q(k) for k in key)
    cur.execute(f"SELECT {cols}, COUNT(*) FROM {_q(db)}.{_q(table)} GROUP BY {cols} HAVING COUNT(*) > 1 "
                "ORDER BY COUNT(*) DESC LIMIT 3")
    rows = cur.fetchall()
    if not rows:
        return None
    examples = "; ".join(", ".join(f"{k}={v!r}" for k, v in zip(key, r[:-1], strict=True)) + f" ({r[-1]} rows)"
                         for r in rows)
    return TableCheck(qualified, f"key columns ({', '.join(key)}) are not unique, e.g. {examples}: {DUPLICATES_MEAN}",
                      "choose key columns that are unique per row (add an AUTO_INCREMENT id if none are)",
                      problem=True)


def check_table(cur: Any, db: str, table: str, key_columns: Sequence[str] | None, *, source: str | None = None,
                duplicates: bool = True) -> TableCheck:
    qualified = f"{db}.{table}"
    cur.execute("SELECT COLUMN_NAME, IS_NULLABLE, COLUMN_TYPE, COLUMN_KEY FROM information_schema.COLUMNS "
                "WHERE TABLE_SCHEMA=%s AND TABLE_NAME=%s ORDER BY ORDINAL_POSITION", (db, table))
    cols = {str(r[0]): (str(r[1]) == "YES", str(r[2])) for r in cur.fetchall()}
    if not cols:
        return TableCheck(qualified, f"table {qualified} does not exist (or the user cannot see it)",
                          "fix the source's tables list", problem=True)
    cur.execute("SELECT COLUMN_NAME FROM information_schema.KEY_COLUMN_USAGE WHERE TABLE_SCHEMA=%s AND "
                "TABLE_NAME=%s AND CONSTRAINT_NAME='PRIMARY' ORDER BY ORDINAL_POSITION", (db, table))
    pk = [str(r[0]) for r in cur.fetchall()]
    if not key_columns:
        if pk:
            return TableCheck(qualified, f"primary key ({', '.join(pk)})")
        cur.execute(
            "SELECT s.INDEX_NAME, GROUP_CONCAT(s.COLUMN_NAME ORDER BY s.SEQ_IN_INDEX), MAX(c.IS_NULLABLE = 'YES') "
            "FROM information_schema.STATISTICS s JOIN information_schema.COLUMNS c ON c.TABLE_SCHEMA = "
            "s.TABLE_SCHEMA AND c.TABLE_NAME = s.TABLE_NAME AND c.COLUMN_NAME = s.COLUMN_NAME "
            "WHERE s.TABLE_SCHEMA=%s AND s.TABLE_NAME=%s AND s.NON_UNIQUE = 0 GROUP BY s.INDEX_NAME "
            "ORDER BY COUNT(*), s.INDEX_NAME", (db, table))
        ready = [(str(r[0]), str(r[1]).split(",")) for r in cur.fetchall() if not int(r[2] or 0)]
        cols_hint = ready[0][1] if ready else None
        note = f" -- {', '.join(cols_hint)} is unique and NOT NULL (index {ready[0][0]})" if cols_hint else ""
        return TableCheck(qualified, "no primary key: kappaflow keys every record",
                          f"ALTER TABLE {_q(db)}.{_q(table)} ADD PRIMARY KEY (...); or name key columns: "
                          + key_columns_hint(source, qualified, cols_hint) + note, problem=True)
    missing = [k for k in key_columns if k not in cols]
    if missing:
        return TableCheck(qualified, f"key_columns names column(s) {missing} the table does not have "
                          f"(columns: {', '.join(cols)})", "name existing columns: "
                          + key_columns_hint(source, qualified), problem=True)
    nullable = [k for k in key_columns if cols[k][0]]
    if nullable:
        return TableCheck(qualified, f"key column(s) {', '.join(nullable)} may be NULL (a record key cannot be)",
                          "; ".join(f"ALTER TABLE {_q(db)}.{_q(table)} MODIFY {_q(k)} {cols[k][1]} NOT NULL"
                                    for k in nullable), problem=True)
    if duplicates:
        cur.execute("SELECT TABLE_ROWS FROM information_schema.TABLES WHERE TABLE_SCHEMA=%s AND TABLE_NAME=%s",
                    (db, table))
        row = cur.fetchone()
        found = _duplicates(cur, db, table, key_columns, int(row[0] or 0) if row else 0)
        if found is not None:
            return found
    return TableCheck(qualified, f"key_columns ({', '.join(key_columns)})")


def check_tables(conn: Any, tables: Sequence[tuple[str, str]], key_columns: Mapping[str, Sequence[str]], *,
                 source: str | None = None, duplicates: bool = True) -> list[TableCheck]:
    """A verdict per table (``tables`` resolved to (db, table)); key_columns of uncaptured tables too."""
    out = []
    with conn.cursor() as cur:
        for db, table in tables:
            out.append(check_table(cur, db, table, key_columns.get(f"{db}.{table}"), source=source,
                                   duplicates=duplicates))
    known = {f"{db}.{t}" for db, t in tables}
    for name in key_columns:
        if name not in known:
            out.append(TableCheck(name, "key_columns names a table the source does not capture",
                                  "add it to the tables list or remove its key_columns", problem=True))
    return out


def check_source(src: Any, duplicates: bool = True) -> list[TableCheck]:
    """Every captured table of a MySQL source config (all base tables of its database when it names none)."""
    from kappaflow.connectors.mysql.server import connect, parse_dsn

    args = parse_dsn(src.dsn, src.resolved_password())
    conn = connect(args, what=f"checking the tables of source {src.name!r}")
    try:
        if src.tables:
            names = split_names(src.tables, args.database)
        else:
            with conn.cursor() as cur:
                cur.execute("SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA=%s AND "
                            "TABLE_TYPE='BASE TABLE' ORDER BY TABLE_NAME", (args.database,))
                names = [(args.database or "", str(r[0])) for r in cur.fetchall()]
        return check_tables(conn, names, src.key_columns, source=src.name, duplicates=duplicates)
    finally:
        conn.close()


def doctor_checks(src: Any) -> Iterator[Finding]:
    """`kappaflow doctor` on a MySQL/MariaDB source: connection, binlog settings, privileges, tables."""
    import pymysql

    area = f"source {src.name}"
    parts = urlsplit(src.connect_dsn())
    try:
        conn = pymysql.connect(host=parts.hostname or "127.0.0.1", port=parts.port or 3306,
                               user=parts.username or "root", password=parts.password or "",
                               connect_timeout=5)
    except pymysql.MySQLError as exc:
        yield fail(area, "connect", f"{src.dsn}: {exc}", "check host, port, user and the password variable")
        return
    try:
        with conn.cursor() as cur:
            cur.execute("select version(), @@log_bin, @@binlog_format, @@binlog_row_image")
            version, log_bin, fmt, image = cur.fetchone()
            yield ok(area, "connect", f"server {version}")
            # Capture needs column names in row events; servers before MySQL 8.0.14 / MariaDB 10.5 lack it.
            cur.execute("show global variables like 'binlog_row_metadata'")
            row = cur.fetchone()
            metadata = row[1] if row else "(not supported by this server version)"
            expected = {"log_bin": (log_bin, 1, "--log-bin"), "binlog_format": (fmt, "ROW", "--binlog-format=ROW"),
                        "binlog_row_image": (image, "FULL", "--binlog-row-image=FULL"),
                        "binlog_row_metadata": (metadata, "FULL", "--binlog-row-metadata=FULL (MySQL >= 8.0.14, "
                                                "MariaDB >= 10.5)")}
            for name, (value, want, flag) in expected.items():
                if str(value).upper() == str(want):
                    yield ok(area, name, str(value))
                else:
                    yield fail(area, name, f"{name}={value}, kappaflow needs {want}",
                                f"start the server with {flag} (or SET GLOBAL {name}='{want}' where allowed)")
            cur.execute("show grants")
            grants = " ".join(str(r[0]) for r in cur.fetchall()).upper()
            if "ALL PRIVILEGES ON *.*" in grants or ("REPLICATION SLAVE" in grants and (
                    "REPLICATION CLIENT" in grants or "BINLOG MONITOR" in grants)):
                yield ok(area, "privileges", "replication privileges granted")
            else:
                yield fail(area, "privileges", "missing REPLICATION SLAVE / REPLICATION CLIENT",
                            "GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO <user>")
    finally:
        conn.close()
    yield from table_findings(src, area)
