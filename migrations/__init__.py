"""Alembic migrations for kappaflow's own tables (projection positions, ledger).

Independent branches share one version table: `projections` and `ledger`.
Run `upgrade(dsn, "projections@head")` for one part or `upgrade(dsn)` for all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VERSION_SCHEMA = "kappaflow"
VERSION_TABLE = "alembic_version"


def sqlalchemy_url(dsn: str) -> str:
    """A libpq URL as a SQLAlchemy URL for psycopg 3."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if dsn.startswith(prefix):
            return "postgresql+psycopg://" + dsn[len(prefix):]
    raise ValueError("migrations: expected a postgresql:// URL")


def alembic_config(dsn: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent))
    cfg.set_main_option("version_locations", str(Path(__file__).parent / "versions"))
    cfg.set_main_option("path_separator", "os")
    cfg.attributes["dsn"] = dsn
    return cfg


def upgrade(dsn: str, target: str = "heads") -> None:
    """Bring kappaflow's tables to `target` (idempotent; safe to call on every start)."""
    from alembic import command

    command.upgrade(alembic_config(dsn), target)


def current(dsn: str) -> set[str]:
    """Revision ids applied to the database at `dsn`."""
    import sqlalchemy as sa

    engine = sa.create_engine(sqlalchemy_url(dsn))
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table(VERSION_TABLE, schema=VERSION_SCHEMA):
                return set()
            rows = conn.execute(sa.text(f'select version_num from "{VERSION_SCHEMA}"."{VERSION_TABLE}"'))
            return {r[0] for r in rows}
    finally:
        engine.dispose()
