"""ledger: aggregate snapshots (outside the hash chain)

Revision ID: ledger_0003
Revises: ledger_0002
Create Date: 2026-11-25

One row per (stream, fold): the fold's state as of ``stream_version``, made by fold version
``fold_version``. A cache, not history: rows are replaced as streams grow, may be deleted at
any time (loads then fold from the first event), and are never read by ``verify``. ``checksum``
(sha256 over the row's identity and state text, computed by the client) lets a load tell a
damaged row from a good one and fall back to a full fold.

Frozen: a later change is a new revision.
"""

from __future__ import annotations

import os

from alembic import context, op

revision = "ledger_0003"
down_revision = "ledger_0002"
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
CREATE TABLE {S}.snapshots (
    stream_id      text NOT NULL,
    fold           text NOT NULL,
    stream_version bigint NOT NULL CHECK (stream_version > 0),
    fold_version   integer NOT NULL,
    state          text NOT NULL,
    checksum       bytea NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream_id, fold)
);
"""


def upgrade() -> None:
    _run(DDL.replace("{S}", _quote(_schema())))


def downgrade() -> None:
    _run(f"DROP TABLE {_quote(_schema())}.snapshots")
