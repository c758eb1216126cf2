"""The outbox row's deployment, so a worker's relay publishes only its own deployment's rows.

Two queue prefixes sharing one database are two deployments: the relay of one must not publish
(and then delete) the rows of the other, whose messages name queues it does not serve. The
append's statement copies the deployment from its events' metadata (``deployment``, the queue
prefix of the writer), as the pending-calls trigger of 0002 does for calls. Rows written before
this revision keep NULL: any relay may publish them, as every relay did before.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # no index of its own: a relay's claim still walks ``outbox_available`` (rows due now), and
    # every append that publishes would pay for one more index
    op.execute("ALTER TABLE outbox ADD COLUMN deployment text")


def downgrade() -> None:
    op.execute("ALTER TABLE outbox DROP COLUMN deployment")
