"""Where the ledger lives: its PostgreSQL schema, quoted table names, installation.

The tables are created by the Alembic branch ``ledger`` (``migrations/versions/ledger_*``);
`install` runs it with the schema name handed over as an Alembic config attribute.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from kappaflow.errors import ConfigError

DEFAULT_SCHEMA = "kappaflow_ledger"
MIGRATION_TARGET = "ledger@head"


def check_schema_name(schema: str) -> str:
    if not isinstance(schema, str) or not schema or len(schema.encode()) > 63 or "\x00" in schema:
        raise ConfigError(f"ledger schema: expected a PostgreSQL identifier of 1..63 bytes, got {schema!r}")
    return schema


@dataclass(frozen=True, slots=True)
class LedgerTables:
    """Quoted identifiers of the ledger's tables and function in one schema."""

    schema: str

    def __post_init__(self) -> None:
        check_schema_name(self.schema)

    def table(self, name: str) -> sql.Identifier:
        return sql.Identifier(self.schema, name)

    @property
    def events(self) -> sql.Identifier:
        return sql.Identifier(self.schema, "events")

    @property
    def streams(self) -> sql.Identifier:
        return sql.Identifier(self.schema, "streams")

    @property
    def idempotency_keys(self) -> sql.Identifier:
        return sql.Identifier(self.schema, "idempotency_keys")

    @property
    def append_fn(self) -> sql.Identifier:
        return sql.Identifier(self.schema, "append")


def install(dsn: str, schema: str = DEFAULT_SCHEMA) -> None:
    """Create or upgrade the ledger tables in `schema` (idempotent; safe on every start).

    One database holds one Alembic-managed ledger: the version table records the branch,
    not the schema, so a second schema in the same database is refused.
    """
    check_schema_name(schema)
    from alembic import command

    from kappaflow.migrations import alembic_config

    cfg = alembic_config(dsn)
    cfg.attributes["ledger_schema"] = schema
    command.upgrade(cfg, MIGRATION_TARGET)
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("select to_regclass(%s)", (sql.Identifier(schema, "events").as_string(conn),)).fetchone()
    if row is None or row[0] is None:
        raise ConfigError(
            f"ledger schema {schema!r}: the ledger migrations are already applied in this database for "
            "another schema; use that schema or a separate database"
        )
