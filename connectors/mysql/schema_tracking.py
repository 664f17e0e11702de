"""Which columns a captured table has at each point of the binlog, and the schema-change records.

With ``binlog_row_metadata=FULL`` every ``TableMapEvent`` (one per table per transaction)
carries the table's column names, types, signedness, charsets, ENUM/SET members and primary
key *as they were when the rows were written*. So rows are always decoded with the right
columns, even while catching up across ``ALTER TABLE``; there is no DDL parser and no
schema history to replay. The tracker turns each TableMapEvent into a ``ColumnSpec`` list
(the same normalisation the snapshot applies to ``information_schema``), and when the
resulting ``TableSchema`` differs from the last one it knows, a schema-change record goes to
``<source>.__schema`` with the DDL statements seen for that table since the previous change.

What the binlog cannot say comes from ``information_schema`` (read at start and after each
DDL statement on a captured table): whether a MariaDB LONGTEXT column is JSON (a
``json_valid`` CHECK constraint). While catching up across a DDL that turns a column into
JSON or back, rows in between may be typed by the newer definition; nothing else depends on
the current catalog.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kappaflow.connectors.mysql.types import (
    ColumnSpec,
    Converter,
    binlog_converters,
    binlog_json_converters,
    binlog_zero_defaults,
    snapshot_converters,
    spec_from_information_schema,
    spec_from_table_map,
    table_schema,
)
from kappaflow.errors import SourceError
from kappaflow.events.schema import TableSchema

__all__ = ["SchemaTracker", "TableState", "ddl_tables", "schema_topic"]


def schema_topic(source: str) -> str:
    """The topic holding a source's schema-change records."""
    return f"{source}.__schema"


@dataclass
class TableState:
    """One captured table as currently known: schema plus the per-column converters."""

    db: str
    table: str
    topic: str
    specs: tuple[ColumnSpec, ...]
    key: tuple[str, ...]
    schema: TableSchema = field(init=False)
    binlog_conv: tuple[tuple[str, Converter], ...] = field(init=False)
    snapshot_conv: tuple[tuple[str, Converter], ...] = field(init=False)
    zero_defaults: dict[str, Any] = field(init=False)
    nullable: frozenset[str] = field(init=False)
    _json_plans: dict[str, Any] = field(init=False, default_factory=dict)
    _decoders: dict[str, Any] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.schema = table_schema(self.topic, self.specs, self.key)
        self.binlog_conv = binlog_converters(self.specs)
        self.snapshot_conv = snapshot_converters(self.specs)
        self.zero_defaults = binlog_zero_defaults(self.specs)
        self.nullable = frozenset(s.name for s in self.specs if s.nullable)

    @property
    def qualified(self) -> str:
        return f"{self.db}.{self.table}"

    def convert_binlog_row(self, values: dict[str, Any], none_sources: Mapping[str, str]) -> dict[str, Any]:
        """mysql-replication row values -> model values, in place."""
        for name, conv in self.binlog_conv:
            v = values.get(name)
            if v is not None:
                values[name] = conv(v)
        if self.zero_defaults:
            for name, dflt in self.zero_defaults.items():
                if values.get(name) is None and name in values:
                    src = none_sources.get(name)
                    if src == "empty set" or (src != "null" and name not in self.nullable):
                        values[name] = dflt
        return values

    def row_decoder(self, table_columns: list[Any], mode: str) -> Any:
        """The compiled binlog -> JSON row decoder (``rowdecoder.py``), or None for the library's path."""
        if mode in self._decoders:
            return self._decoders[mode]
        from kappaflow.connectors.mysql.rowdecoder import compile_decoder
        from kappaflow.events.values import make_encoder

        encoders = {c.name: make_encoder(c, mode) for c in self.schema.columns}
        dec = compile_decoder(table_columns, self.specs, mode, encoders)
        self._decoders[mode] = dec
        return dec

    def json_converter(self, mode: str) -> Any:
        """A function turning a mysql-replication row (values, none_sources) into its JSON form, in place."""
        fn = self._json_plans.get(mode)
        if fn is not None:
            return fn
        from kappaflow.events.values import make_encoder

        convs = binlog_json_converters(self.specs, self.schema.columns, mode)
        zero: dict[str, Any] = {}
        for name, dflt in self.zero_defaults.items():
            enc = make_encoder(self.schema.column(name), mode)
            zero[name] = enc(dflt) if enc is not None else dflt
        nullable = self.nullable

        def to_json(values: dict[str, Any], none_sources: Mapping[str, str]) -> dict[str, Any]:
            for name, conv in convs:
                v = values.get(name)
                if v is not None:
                    values[name] = conv(v)
            if zero:
                for name, dflt in zero.items():
                    if values.get(name) is None and name in values:
                        src = none_sources.get(name)
                        if src == "empty set" or (src != "null" and name not in nullable):
                            values[name] = dflt
            return values

        self._json_plans[mode] = to_json
        return to_json

    def convert_snapshot_row(self, values: dict[str, Any]) -> dict[str, Any]:
        for name, conv in self.snapshot_conv:
            v = values[name]
            if v is not None:
                values[name] = conv(v)
        return values


# DDL statements that may change a captured table; group 'name' is `db`.`t`, db.t or t.
_IDENT = r"(?:`(?:[^`]|``)+`|[A-Za-z0-9_$]+)"
_QNAME = rf"(?P<name>{_IDENT}(?:\s*\.\s*{_IDENT})?)"
_DDL_RE = re.compile(
    rf"^\s*(?:/\*.*?\*/\s*)*(?P<verb>ALTER\s+(?:ONLINE\s+|IGNORE\s+)*TABLE|CREATE\s+(?:OR\s+REPLACE\s+)?"
    rf"(?:TEMPORARY\s+)?TABLE(?:\s+IF\s+NOT\s+EXISTS)?|DROP\s+(?:TEMPORARY\s+)?TABLE(?:\s+IF\s+EXISTS)?|"
    rf"TRUNCATE(?:\s+TABLE)?|RENAME\s+TABLE)\s+{_QNAME}",
    re.IGNORECASE | re.DOTALL,
)
_NAME_LIST_RE = re.compile(rf"{_IDENT}(?:\s*\.\s*{_IDENT})?")


def _unquote(ident: str) -> str:
    ident = ident.strip()
    if ident.startswith("`"):
        return ident[1:-1].replace("``", "`")
    return ident


def _split_name(name: str, default_db: str) -> tuple[str, str]:
    parts = re.findall(_IDENT, name)
    if len(parts) == 2:
        return _unquote(parts[0]), _unquote(parts[1])
    return default_db, _unquote(parts[0])


def ddl_tables(query: str, default_db: str) -> tuple[str, list[tuple[str, str]]] | None:
    """(verb, [(db, table), ...]) for a table DDL statement, else None.

    verb is one of ALTER, CREATE, DROP, TRUNCATE, RENAME. DROP and RENAME may name several
    tables (``DROP TABLE a, b`` / ``RENAME TABLE a TO b, c TO d``: both sides are returned).
    """
    m = _DDL_RE.match(query)
    if m is None:
        return None
    verb = m.group("verb").split()[0].upper()
    if verb in ("DROP", "RENAME"):
        rest = query[m.start("name"):]
        rest = re.split(r"\b(?:RESTRICT|CASCADE)\b", rest, flags=re.IGNORECASE)[0]
        names = [n for n in _NAME_LIST_RE.findall(rest) if n.upper() not in ("TO", "WAIT", "NOWAIT")]
        return verb, [_split_name(n, default_db) for n in names]
    return verb, [_split_name(m.group("name"), default_db)]


class SchemaTracker:
    """Known schemas of the captured tables, and the schema-change records to emit."""

    def __init__(self, source: str, tables: Iterable[tuple[str, str]],
                 key_columns: Mapping[str, list[str]] | None = None) -> None:
        self.source = source
        self.tables = set(tables)
        self.key_columns = {k: tuple(v) for k, v in (key_columns or {}).items()}
        self.states: dict[tuple[str, str], TableState] = {}
        self.json_hints: dict[tuple[str, str], frozenset[str]] = {}
        self._by_raw: dict[tuple[Any, ...], TableState] = {}
        self.pending_ddl: dict[tuple[str, str], list[str]] = {}

    def topic(self, db: str, table: str) -> str:
        return f"{self.source}.{db}.{table}"

    def captured(self, db: str, table: str) -> bool:
        return (db, table) in self.tables

    # -- information_schema ----------------------------------------------------------
    def load(self, conn: Any, db: str, table: str) -> TableState | None:
        """Read a table's definition from information_schema (None: the table does not exist)."""
        import pymysql.cursors

        with conn.cursor(pymysql.cursors.DictCursor) as cur:
            cur.execute(
                "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE, IS_NULLABLE, NUMERIC_PRECISION, NUMERIC_SCALE, "
                "DATETIME_PRECISION, CHARACTER_OCTET_LENGTH FROM information_schema.COLUMNS "
                "WHERE TABLE_SCHEMA=%s AND TABLE_NAME=%s ORDER BY ORDINAL_POSITION", (db, table))
            cols = cur.fetchall()
            if not cols:
                return None
            cur.execute(
                "SELECT COLUMN_NAME FROM information_schema.KEY_COLUMN_USAGE WHERE TABLE_SCHEMA=%s AND "
                "TABLE_NAME=%s AND CONSTRAINT_NAME='PRIMARY' ORDER BY ORDINAL_POSITION", (db, table))
            pk = tuple(r["COLUMN_NAME"] for r in cur.fetchall())
            hints = self._json_columns(cur, db, table)
        self.json_hints[(db, table)] = hints
        specs = tuple(spec_from_information_schema(r, hints) for r in cols)
        state = TableState(db, table, self.topic(db, table), specs, self._key(db, table, pk, specs))
        return state

    def _json_columns(self, cur: Any, db: str, table: str) -> frozenset[str]:
        try:
            cur.execute(
                "SELECT CHECK_CLAUSE FROM information_schema.CHECK_CONSTRAINTS WHERE CONSTRAINT_SCHEMA=%s AND "
                "TABLE_NAME=%s", (db, table))
        except Exception:  # MySQL < 8.0.16 has no CHECK_CONSTRAINTS; its JSON is a real type anyway
            return frozenset()
        out = set()
        for r in cur.fetchall():
            m = re.fullmatch(r"\s*json_valid\(\s*`((?:[^`]|``)+)`\s*\)\s*", str(r["CHECK_CLAUSE"]), re.IGNORECASE)
            if m:
                out.add(m.group(1).replace("``", "`"))
        return frozenset(out)

    def refresh_hints(self, conn: Any, db: str, table: str) -> None:
        import pymysql.cursors

        with conn.cursor(pymysql.cursors.DictCursor) as cur:
            self.json_hints[(db, table)] = self._json_columns(cur, db, table)

    def _key(self, db: str, table: str, pk: tuple[str, ...], specs: Iterable[ColumnSpec]) -> tuple[str, ...]:
        override = self.key_columns.get(f"{db}.{table}")
        if override:
            names = {s.name for s in specs}
            missing = [k for k in override if k not in names]
            if missing:
                raise SourceError(f"key_columns[{db}.{table!s}]: column(s) {missing} not in the table "
                                  f"(columns: {sorted(names)})")
            return override
        return pk

    # -- binlog -----------------------------------------------------------------------
    def from_table_map(self, ev: Any) -> TableState:
        """The TableState for a TableMapEvent of a captured table (cached by its raw metadata)."""
        db, table = ev.schema, ev.table
        cols = ev.columns
        nullbits = ev.null_bitmask
        hints = self.json_hints.get((db, table), frozenset())
        raw = (db, table, bytes(nullbits), hints, tuple(
            (c.name, c.type, c.unsigned, c.is_primary, getattr(c, "character_set_name", None),
             getattr(c, "precision", None), getattr(c, "decimals", None), getattr(c, "fsp", None),
             getattr(c, "bits", None), getattr(c, "max_length", None),
             tuple(c.enum_values or ()), tuple(c.set_values or ())) for c in cols))
        state = self._by_raw.get(raw)
        if state is not None:
            return state
        if any(c.name is None for c in cols):
            raise SourceError(f"table {db}.{table}: the binlog carries no column names; set "
                              "binlog_row_metadata=FULL on the server (MySQL >= 8.0.14, MariaDB >= 10.5)")
        specs = tuple(
            spec_from_table_map(c, bool(nullbits[i // 8] & (1 << (i % 8))), c.name in hints)
            for i, c in enumerate(cols))
        pk = tuple(c.name for c in cols if c.is_primary)
        pk_list = getattr(ev, "optional_metadata", None)
        if pk_list is not None and pk_list.simple_primary_key_list:
            pk = tuple(cols[i].name for i in pk_list.simple_primary_key_list)
        state = TableState(db, table, self.topic(db, table), specs, self._key(db, table, pk, specs))
        self._by_raw[raw] = state
        if len(self._by_raw) > 4096:
            self._by_raw.clear()
        return state

    def observe(self, state: TableState) -> TableState | None:
        """Record ``state`` as current; return the previous state when the schema changed (else None).

        The first sighting of a table returns None too unless it replaced a known state.
        """
        k = (state.db, state.table)
        prev = self.states.get(k)
        if prev is not None and prev.schema.fingerprint() == state.schema.fingerprint():
            return None
        self.states[k] = state
        return prev if prev is not None else None

    def is_new(self, state: TableState) -> bool:
        return (state.db, state.table) not in self.states

    def note_ddl(self, db: str, table: str, ddl: str) -> None:
        self.pending_ddl.setdefault((db, table), []).append(ddl)

    def take_ddl(self, db: str, table: str) -> list[str]:
        return self.pending_ddl.pop((db, table), [])

    def forget(self, db: str, table: str) -> None:
        self.states.pop((db, table), None)
