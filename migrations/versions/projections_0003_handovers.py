"""projections: a rebuilt view offered to the live follower (replay while following)

Revision ID: projections_0003
Revises: projections_0002
Create Date: 2026-11-29

``kappaflow.handovers`` holds one row per (projection, sink) while ``kappaflow replay`` hands a
shadow it built to the follower that holds the projection's lock (``projections/handover.py``):
the replay offers it (``ready``), the follower claims it (``taking``), catches it up and swaps it
in under its own lock, then reports ``swapped`` (or ``refused`` with the reason).
"""

from __future__ import annotations

from alembic import op

revision = "projections_0003"
down_revision = "projections_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE IF NOT EXISTS "kappaflow"."handovers" (
            projection text NOT NULL,
            sink text NOT NULL,
            shadow text NOT NULL,
            fingerprint text NOT NULL,
            view jsonb NOT NULL,
            state text NOT NULL,
            message text,
            generation bigint,
            offered_at timestamptz NOT NULL DEFAULT now(),
            updated_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (projection, sink)
        )
        """
    )


def downgrade() -> None:
    op.execute('DROP TABLE IF EXISTS "kappaflow"."handovers"')
