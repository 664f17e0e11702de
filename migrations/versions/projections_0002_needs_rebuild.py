"""projections: a projection whose view needs a rebuild says so, and why

Revision ID: projections_0002
Revises: projections_0001
Create Date: 2026-11-25

``kappaflow.projections.needs_rebuild`` holds why a projection's view must be rebuilt before it
can be followed again (e.g. a source table gained a column a latest-row view would have to
show): a follower that meets such a change stops and records it here, so ``kappaflow status``
reports the projection as "needs rebuild" instead of following; a replay clears it.
"""

from __future__ import annotations

from alembic import op

revision = "projections_0002"
down_revision = "projections_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute('ALTER TABLE "kappaflow"."projections" ADD COLUMN IF NOT EXISTS needs_rebuild text')


def downgrade() -> None:
    op.execute('ALTER TABLE "kappaflow"."projections" DROP COLUMN IF EXISTS needs_rebuild')
