"""Server checks, catalog reads, publication and replication-slot management.

Everything here runs on a plain (non-replication) connection. Every identifier
taken from configuration is quoted with ``psycopg.sql.Identifier``; nothing is
spliced into SQL text. Each failure a user can fix is reported as a
:class:`~kappaflow.errors.SourceError` that says what to do.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from kappaflow.connectors.postgres.replication import redact_dsn
from kappaflow.connectors.postgres.types import SESSION_OPTIONS, TypeInfo
from kappaflow.errors import ConfigError, Retry, SourceError

__all__ = [
    "RELEASE_WAIT_S",
    "ColumnInfo",
    "ServerInfo",
    "SlotInfo",
    "TableInfo",
    "TypeCatalog",
    "check_server",
    "connect",
    "describe_table",
    "drop_slot",
    "emit_heartbeat",
    "ensure_publication",
    "load_table",
    "publication_tables",
    "release",
    "resolve_tables",
    "slot_info",
    "split_table_name",
]

HEARTBEAT_PREFIX = "kappaflow_heartbeat"


def connect(dsn: str, *, autocommit: bool = True, what: str = "connecting") -> psycopg.Connection:
    """A plain connection with the session settings the value converters rely on."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"source dsn: not a valid libpq connection string or URL ({exc})") from None
    extra = params.get("options") or ""
    params["options"] = f"{extra} {SESSION_OPTIONS}".strip()
    params.setdefault("connect_timeout", "10")
    params.setdefault("application_name", "kappaflow")
    try:
        return psycopg.connect(make_conninfo("", **params), autocommit=autocommit)
    except psycopg.OperationalError as exc:
        from kappaflow.connectors.postgres.replication import _classify

        raise _classify(str(exc), getattr(exc, "sqlstate", None), what, dsn) from None


@dataclass(frozen=True, slots=True)
class ServerInfo:
    version: int  # server_version_num
    wal_level: str
    can_replicate: bool
    database: str
    user: str


def check_server(conn: psycopg.Connection, dsn: str, *, need_replication: bool = True) -> ServerInfo:
    """Check wal_level=logical and the REPLICATION attribute, with instructions when missing."""
    row = conn.execute(
        "SELECT current_setting('server_version_num')::int, current_setting('wal_level'), "
        "(SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user), "
        "current_database(), current_user"
    ).fetchone()
    assert row is not None
    info = ServerInfo(int(row[0]), str(row[1]), bool(row[2]), str(row[3]), str(row[4]))
    where = redact_dsn(dsn)
    if info.version < 140000:
        raise SourceError(f"PostgreSQL {info.version // 10000} at {where} is too old: kappaflow needs 14 or later "
                          "(pgoutput logical messages)", retry=Retry.TERMINAL)
    if need_replication and info.wal_level != "logical":
        raise SourceError(
            f"PostgreSQL at {where} has wal_level = {info.wal_level}; logical decoding needs wal_level = logical. "
            "Run ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL",
            retry=Retry.TERMINAL,
        )
    if need_replication and not info.can_replicate:
        raise SourceError(
            f"role {info.user!r} at {where} lacks the REPLICATION attribute needed for logical replication: "
            f"ALTER ROLE {info.user} WITH REPLICATION (as a superuser)",
            retry=Retry.TERMINAL,
        )
    return info


# -- tables ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ColumnInfo:
    name: str
    type_oid: int
    typmod: int
    not_null: bool
    storage: str  # pg_attribute.attstorage: 'p' plain, 'e' external, 'm' main, 'x' extended
    type_name: str  # format_type(), e.g. "numeric(12,2)", "character varying(20)"


@dataclass(frozen=True, slots=True)
class TableInfo:
    schema: str
    name: str
    oid: int
    columns: tuple[ColumnInfo, ...]
    key: tuple[str, ...]
    key_from_config: bool
    replica_identity: str  # 'd', 'n', 'f', 'i'
    estimated_rows: int = 0

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    def column(self, name: str) -> ColumnInfo | None:
        for c in self.columns:
            if c.name == name:
                return c
        return None


def split_table_name(name: str) -> tuple[str, str]:
    """ "schema.table" -> (schema, table); a bare name means schema public."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"tables: expected 'schema.table', got {name!r}")
    schema, dot, table = name.partition(".")
    if not dot:
        return "public", name
    if not schema or not table:
        raise ConfigError(f"tables: expected 'schema.table', got {name!r}")
    return schema, table


@dataclass(frozen=True, slots=True)
class TableCatalog:
    """What the catalog says about one table, before any key rule is applied."""

    schema: str
    name: str
    oid: int
    columns: tuple[ColumnInfo, ...]
    pk: tuple[str, ...]
    replica_identity: str  # 'd', 'n', 'f', 'i'
    estimated_rows: int


def describe_table(conn: psycopg.Connection, schema: str, table: str) -> TableCatalog:
    """Columns, primary key and replica identity of one table; SourceError naming the known tables if missing."""
    row = conn.execute(
        "SELECT c.oid, c.relreplident, c.reltuples::bigint FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')",
        (schema, table),
    ).fetchone()
    if row is None:
        known = [r[0] for r in conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relkind IN ('r', 'p') ORDER BY 1 LIMIT 20", (schema,)).fetchall()]
        hint = f"tables in schema {schema!r}: {', '.join(known)}" if known else f"schema {schema!r} has no tables"
        raise SourceError(f"unknown table {schema}.{table} in database {conn.info.dbname!r} ({hint}); "
                          "fix the source's tables list", retry=Retry.TERMINAL)
    oid, ident, reltuples = int(row[0]), str(row[1]), int(row[2])
    cols = tuple(
        ColumnInfo(r[0], int(r[1]), int(r[2]), bool(r[3]), str(r[4]), str(r[5]))
        for r in conn.execute(
            "SELECT a.attname, a.atttypid, a.atttypmod, a.attnotnull, a.attstorage, "
            "format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
            "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '' "
            "ORDER BY a.attnum",
            (oid,),
        ).fetchall()
    )
    pk = tuple(
        r[0] for r in conn.execute(
            "SELECT a.attname FROM pg_index i "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
            "WHERE i.indrelid = %s AND i.indisprimary ORDER BY array_position(i.indkey, a.attnum)",
            (oid,),
        ).fetchall()
    )
    return TableCatalog(schema, table, oid, cols, pk, ident, max(reltuples, 0))


def load_table(conn: psycopg.Connection, schema: str, table: str,
               key_columns: Sequence[str] | None = None, *, source: str | None = None) -> TableInfo:
    """Columns, key and replica identity of one table; SourceError when it cannot be captured.

    The key rules (``preflight.key_check``) are the ones `source add` and `doctor` apply, so every
    problem of a table, and every fix, is said at once.
    """
    from kappaflow.connectors.postgres.preflight import key_check

    cat = describe_table(conn, schema, table)
    qualified = f"{schema}.{table}"
    if key_columns:
        names = {c.name for c in cat.columns}
        missing = [k for k in key_columns if k not in names]
        if missing:
            raise ConfigError(f"key_columns[{qualified!r}]: no column(s) {missing} in {qualified} "
                              f"(columns: {', '.join(sorted(names))})")
    check = key_check(conn, cat.oid, schema, table, cat.columns, cat.pk, cat.replica_identity, key_columns, source)
    if check.problem:
        raise SourceError(f"table {qualified} cannot be captured: {check.detail}. Fix: {check.fix}",
                          retry=Retry.TERMINAL)
    key = tuple(key_columns) if key_columns else cat.pk
    return TableInfo(schema, table, cat.oid, cat.columns, key, bool(key_columns), cat.replica_identity,
                     cat.estimated_rows)


def publication_tables(conn: psycopg.Connection, publication: str) -> list[tuple[str, str]]:
    return [(r[0], r[1]) for r in conn.execute(
        "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s ORDER BY 1, 2",
        (publication,)).fetchall()]


def all_user_tables(conn: psycopg.Connection) -> list[tuple[str, str]]:
    return [(r[0], r[1]) for r in conn.execute(
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition "
        "AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%%' "
        "ORDER BY 1, 2").fetchall()]


def resolve_tables(conn: psycopg.Connection, tables: Sequence[str],
                   key_columns: Mapping[str, Sequence[str]], *, source: str | None = None) -> list[TableInfo]:
    """The configured tables (or every user table when empty), validated and with their keys."""
    names = [split_table_name(t) for t in tables] if tables else all_user_tables(conn)
    keys = {split_table_name(k): list(v) for k, v in key_columns.items()}
    known = set(names)
    for schema, table in keys:
        if (schema, table) not in known:
            raise ConfigError(f"key_columns: table {schema}.{table} is not among the captured tables")
    infos: list[TableInfo] = []
    problems: list[str] = []
    for s, t in names:
        try:
            infos.append(load_table(conn, s, t, keys.get((s, t)), source=source))
        except SourceError as exc:  # say every table that cannot be captured, not just the first
            if exc.retry is not Retry.TERMINAL:
                raise
            problems.append(str(exc))
    if len(problems) == 1:
        raise SourceError(problems[0], retry=Retry.TERMINAL)
    if problems:
        raise SourceError(f"{len(problems)} tables cannot be captured:\n  " + "\n  ".join(problems),
                          retry=Retry.TERMINAL)
    return infos


# -- types ---------------------------------------------------------------------------------

class TypeCatalog:
    """Cached pg_type lookups for user types (enums, domains, user arrays)."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn
        self._cache: dict[int, TypeInfo | None] = {}
        self._names: dict[tuple[int, int], str | None] = {}

    def __call__(self, oid: int) -> TypeInfo | None:
        if oid in self._cache:
            return self._cache[oid]
        row = self._conn.execute(
            "SELECT t.oid, n.nspname || '.' || t.typname, t.typtype, "
            "CASE WHEN t.typcategory = 'A' THEN t.typelem ELSE 0 END, t.typbasetype, t.typtypmod, "
            "ARRAY(SELECT e.enumlabel::text FROM pg_enum e WHERE e.enumtypid = t.oid ORDER BY e.enumsortorder) "
            "FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace WHERE t.oid = %s",
            (oid,),
        ).fetchone()
        info = None
        if row is not None:
            info = TypeInfo(int(row[0]), str(row[1]), str(row[2]), int(row[3]), int(row[4]), int(row[5]),
                            tuple(row[6] or ()))
        self._cache[oid] = info
        return info

    def format_type(self, oid: int, typmod: int) -> str | None:
        """The server's name of a type with its modifier (``numeric(8,2)``), as the catalog spells
        a column's type; cached (a Relation message re-read after an ALTER asks once per shape)."""
        k = (oid, typmod)
        if k not in self._names:
            row = self._conn.execute("SELECT format_type(%s, %s)", (oid, typmod)).fetchone()
            self._names[k] = str(row[0]) if row is not None and row[0] is not None else None
        return self._names[k]

    def invalidate(self, oid: int | None = None) -> None:
        if oid is None:
            self._cache.clear()
        else:
            self._cache.pop(oid, None)


# -- publication -----------------------------------------------------------------------------

def ensure_publication(conn: psycopg.Connection, name: str, tables: Iterable[TableInfo] | None) -> bool:
    """Create the publication, or make an existing one publish at least ``tables``.

    ``tables=None`` means FOR ALL TABLES. New publications publish partitioned tables'
    changes under the partitioned table's name (publish_via_partition_root), which is the
    name the source lists and the topic is named after. An existing publication that already covers
    the tables is left alone (it may be managed by an admin, or shared); changes of
    tables it publishes but the source does not capture are skipped while streaming.
    Returns True when something changed.
    """
    pub = sql.Identifier(name)
    row = conn.execute("SELECT puballtables FROM pg_publication WHERE pubname = %s", (name,)).fetchone()
    try:
        if tables is None:
            if row is not None and row[0]:
                return False
            if row is not None:
                conn.execute(sql.SQL("DROP PUBLICATION {}").format(pub))
            conn.execute(sql.SQL("CREATE PUBLICATION {} FOR ALL TABLES WITH (publish_via_partition_root = true)")
                         .format(pub))
            return True
        wanted = sorted((t.schema, t.name) for t in tables)
        targets = sql.SQL(", ").join(sql.Identifier(s, t) for s, t in wanted)
        if row is None:
            conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH (publish_via_partition_root = true)")
                         .format(pub, targets))
            return True
        if row[0]:
            return False  # FOR ALL TABLES covers them
        missing = sorted(set(wanted) - set(publication_tables(conn, name)))
        if not missing:
            return False
        add = sql.SQL(", ").join(sql.Identifier(s, t) for s, t in missing)
        conn.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(pub, add))
        return True
    except psycopg.errors.InsufficientPrivilege as exc:
        raise SourceError(
            f"cannot create/alter publication {name!r}: {str(exc).strip()}. FOR TABLE needs ownership of the "
            "tables, FOR ALL TABLES a superuser; or have an admin create it and set `publication` in the config",
            retry=Retry.TERMINAL,
        ) from None


def drop_publication(conn: psycopg.Connection, name: str) -> None:
    conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(name)))


# -- slots -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SlotInfo:
    name: str
    plugin: str | None
    database: str | None
    active: bool
    active_pid: int | None
    confirmed_flush_lsn: int | None
    restart_lsn: int | None
    wal_status: str | None  # reserved | extended | unreserved | lost
    lag_bytes: int | None  # pg_current_wal_insert_lsn() - confirmed_flush_lsn
    current_lsn: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def invalidated(self) -> bool:
        return self.wal_status == "lost" or (self.restart_lsn is None and self.confirmed_flush_lsn is not None)


def _lsn_or_none(v: object) -> int | None:
    if v is None:
        return None
    hi, _, lo = str(v).partition("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def slot_info(conn: psycopg.Connection, name: str) -> SlotInfo | None:
    row = conn.execute(
        "SELECT slot_name, plugin, database, active, active_pid, confirmed_flush_lsn::text, restart_lsn::text, "
        "wal_status, (pg_current_wal_insert_lsn() - confirmed_flush_lsn)::bigint, pg_current_wal_insert_lsn()::text "
        "FROM pg_replication_slots WHERE slot_name = %s",
        (name,),
    ).fetchone()
    if row is None:
        return None
    return SlotInfo(
        name=row[0], plugin=row[1], database=row[2], active=bool(row[3]), active_pid=row[4],
        confirmed_flush_lsn=_lsn_or_none(row[5]), restart_lsn=_lsn_or_none(row[6]), wal_status=row[7],
        lag_bytes=None if row[8] is None else int(row[8]), current_lsn=_lsn_or_none(row[9]) or 0,
    )


def check_slot_usable(info: SlotInfo, dbname: str, dsn: str, *, source: str | None = None) -> None:
    where = redact_dsn(dsn)
    if info.plugin != "pgoutput":
        raise SourceError(f"replication slot {info.name!r} uses plugin {info.plugin!r}, not pgoutput: "
                          "choose another slot name (source config `slot`) or drop it", retry=Retry.TERMINAL)
    if info.database != dbname:
        raise SourceError(f"replication slot {info.name!r} belongs to database {info.database!r}, not "
                          f"{dbname!r}: choose another slot name", retry=Retry.TERMINAL)
    if info.invalidated:
        from kappaflow.connectors.resnapshot import lost_position

        raise lost_position(source or "SOURCE", f"replication slot {info.name!r} was invalidated (wal_status="
                            f"{info.wal_status}): the WAL it needed was removed (max_slot_wal_keep_size exceeded?)",
                            where)
    if info.active:
        raise SourceError(
            f"replication slot {info.name!r} is in use by another process (PID {info.active_pid}): stop the "
            f"other capture (or use a different slot name) and retry [{where}]",
            retry=Retry.TRANSIENT,
        )


def drop_slot(conn: psycopg.Connection, name: str) -> bool:
    row = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (name,)).fetchone()
    if row is None:
        return False
    if row[0] is not None:
        raise SourceError(f"replication slot {name!r} is in use by PID {row[0]}: stop that capture first",
                          retry=Retry.TRANSIENT)
    conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
    return True


def emit_heartbeat(conn: psycopg.Connection, slot: str, content: str = "") -> int:
    """Write a non-transactional logical message; decoding it lets the slot advance when idle."""
    row = conn.execute("SELECT pg_logical_emit_message(false, %s, %s)::text",
                       (f"{HEARTBEAT_PREFIX}:{slot}", content)).fetchone()
    assert row is not None
    return _lsn_or_none(row[0]) or 0


def slot_xmin(conn: psycopg.Connection, slot: str) -> int | None:
    """The slot's catalog xmin (what Debezium's ``xmin.fetch.interval.ms`` reads into ``source.xmin``)."""
    row = conn.execute("SELECT catalog_xmin::text FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,)).fetchone()
    return int(row[0]) if row is not None and row[0] is not None else None


def current_lsn(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    return _lsn_or_none(row[0]) or 0


RELEASE_WAIT_S = 5.0  # how long an active slot may take to become free before `source remove` refuses


def release(src: Any, others: Iterable[Any], keep: bool) -> list[str]:
    """`kappaflow source remove`: drop the source's slot and (unless configured or shared) its publication.

    Why: an inactive logical replication slot retains WAL without limit; a source removed from the
    configuration without dropping its slot fills the database server's disk. One line per thing
    for the user; ``others``: the remaining sources (a publication one of them uses is kept).
    Raises SourceError when the server cannot be reached or the slot is in use (a capture runs).
    """
    slot, pub = src.slot_name, src.publication_name
    if keep:
        return [f"replication slot {slot!r} and publication {pub!r} kept (--keep-slot): the slot retains WAL "
                f"until it is dropped: SELECT pg_drop_replication_slot('{slot}')"]
    conn = connect(src.connect_dsn(), what=f"dropping the replication slot of source {src.name!r}")
    out: list[str] = []
    try:
        # A capture that just stopped leaves its slot active for a moment while its walsender exits;
        # a running one holds it for good, and drop_slot then says to stop it first.
        deadline = time.monotonic() + RELEASE_WAIT_S
        while time.monotonic() < deadline and conn.execute(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active", (slot,)).fetchone():
            time.sleep(0.1)
        out.append(f"replication slot {slot!r} " + ("dropped" if drop_slot(conn, slot) else "did not exist"))
        shared = [o.name for o in others if getattr(o, "publication_name", None) == pub]
        if src.publication is not None:
            out.append(f"publication {pub!r} kept: it is configured explicitly (it may be shared); drop it with "
                       f"DROP PUBLICATION {pub} when nothing uses it")
        elif shared:
            out.append(f"publication {pub!r} kept: source(s) {', '.join(shared)} use it too")
        else:
            existed = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (pub,)).fetchone()
            drop_publication(conn, pub)
            out.append(f"publication {pub!r} " + ("dropped" if existed else "did not exist"))
    finally:
        conn.close()
    return out
