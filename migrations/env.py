"""Alembic environment: online migrations against the DSN handed in by `kappaflow.migrations`."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from kappaflow.migrations import VERSION_SCHEMA, VERSION_TABLE, sqlalchemy_url

config = context.config
dsn = config.attributes.get("dsn")
if not dsn:
    raise RuntimeError("kappaflow migrations need a DSN: use kappaflow.migrations.upgrade(dsn)")

engine = sa.create_engine(sqlalchemy_url(dsn), poolclass=sa.pool.NullPool)
with engine.connect() as connection:
    connection.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{VERSION_SCHEMA}"'))
    # Serialise concurrent upgrades (several processes starting at once).
    connection.execute(sa.text("select pg_advisory_xact_lock(7270601)"))
    context.configure(connection=connection, version_table=VERSION_TABLE,
                      version_table_schema=VERSION_SCHEMA, transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
engine.dispose()
