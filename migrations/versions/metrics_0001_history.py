"""metrics: a small, bounded history of selected metrics for the status page

Revision ID: metrics_0001
Revises:
Create Date: 2026-11-26

``kappaflow.metric_history`` holds one row per (series, slot): every long-running process writes
its samples into a ring of slots (``slot = sample time // interval mod slots``), so a series never
has more rows than its retention needs, whatever runs for how long, and nothing has to delete old
rows. ``series`` is the metric name with its labels (``name{label="value",...}``).
"""

from __future__ import annotations

from alembic import op

revision = "metrics_0001"
down_revision = None
branch_labels = ("metrics",)
depends_on = None


def upgrade() -> None:
    op.execute('CREATE SCHEMA IF NOT EXISTS "kappaflow"')
    op.execute(
        """
        CREATE TABLE IF NOT EXISTS "kappaflow"."metric_history" (
            series  text NOT NULL,
            slot    integer NOT NULL,
            ts      timestamptz NOT NULL,
            value   double precision NOT NULL,
            PRIMARY KEY (series, slot)
        )
        """
    )


def downgrade() -> None:
    op.execute('DROP TABLE IF EXISTS "kappaflow"."metric_history"')
