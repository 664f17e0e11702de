"""ledger: per-subject encryption keys for personal data (crypto-shredding)

Revision ID: ledger_0004
Revises: ledger_0003
Create Date: 2026-11-25

Event fields declared personal are stored encrypted (AES-256-GCM, client side) with the key of
their data subject. Forgetting a subject sets its key to NULL and records when: every copy of
its ciphertext -- in the events table, its WAL, the log, backups of either -- becomes
unreadable, while the events themselves (and the hash chain over the stored ciphertext) stay
untouched. The row stays as a tombstone, so a forgotten subject is never given a new key.

This table is the one place the keys live; see the README for what that does and does not
guarantee (a backup of this table taken before a forget still holds the key).

Frozen: a later change is a new revision.
"""

from __future__ import annotations

import os

from alembic import context, op

revision = "ledger_0004"
down_revision = "ledger_0003"
branch_labels = None
depends_on = None


def _schema() -> str:
    attrs = getattr(context.config, "attributes", {}) or {}
    return attrs.get("ledger_schema") or os.environ.get("KAPPAFLOW_LEDGER_SCHEMA") or "kappaflow_ledger"


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _run(sql: str) -> None:
    op.get_bind().connection.driver_connection.execute(sql)  # type: ignore[union-attr]


DDL = """
CREATE TABLE {S}.subject_keys (
    subject      text PRIMARY KEY CHECK (subject <> ''),
    key          bytea CHECK (key IS NULL OR octet_length(key) = 32),
    created_at   timestamptz NOT NULL DEFAULT now(),
    forgotten_at timestamptz,
    CHECK ((key IS NULL) = (forgotten_at IS NOT NULL))
);
"""


def upgrade() -> None:
    _run(DDL.replace("{S}", _quote(_schema())))


def downgrade() -> None:
    _run(f"DROP TABLE {_quote(_schema())}.subject_keys")
