"""projections: registry of projections and consumed log positions per view target

Revision ID: projections_0001
Revises:
Create Date: 2026-11-22

Tables live in the ``kappaflow`` schema of the views database, next to the views, so a
micro-batch and the positions it consumed commit in ONE transaction.

- ``kappaflow.projections``: one row per projection with a live view (name, view table,
  key, columns, definition fingerprint, generation; the generation changes at every
  replay swap so a follower's Spark checkpoint from before a rebuild is never reused).
- ``kappaflow.projection_positions``: next log offset to read per (projection, target,
  topic, partition). ``target`` is ``'live'`` or the name of a shadow table being built.
"""

from __future__ import annotations

from alembic import op

revision = "projections_0001"
down_revision = None
branch_labels = ("projections",)
depends_on = None


def upgrade() -> None:
    op.execute('CREATE SCHEMA IF NOT EXISTS "kappaflow"')
    op.execute(
        """
        CREATE TABLE IF NOT EXISTS "kappaflow"."projections" (
            name           text PRIMARY KEY,
            kind           text NOT NULL,
            view_schema    text NOT NULL,
            view_table     text NOT NULL,
            key_columns    text[] NOT NULL,
            columns        jsonb NOT NULL,
            topics         text[] NOT NULL,
            class_path     text,
            fingerprint    text NOT NULL,
            generation     bigint NOT NULL DEFAULT 1,
            state_table    text,
            created_at     timestamptz NOT NULL DEFAULT now(),
            replayed_at    timestamptz,
            updated_at     timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        """
        CREATE TABLE IF NOT EXISTS "kappaflow"."projection_positions" (
            projection   text NOT NULL,
            target       text NOT NULL,
            topic        text NOT NULL,
            "partition"  integer NOT NULL,
            next_offset  bigint NOT NULL CHECK (next_offset >= 0),
            updated_at   timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (projection, target, topic, "partition")
        )
        """
    )


def downgrade() -> None:
    op.execute('DROP TABLE IF EXISTS "kappaflow"."projection_positions"')
    op.execute('DROP TABLE IF EXISTS "kappaflow"."projections"')
