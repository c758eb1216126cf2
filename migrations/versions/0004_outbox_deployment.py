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
    op.execute("ALTER TABLE outbox ADD COLUMN deployment text")
    op.execute("CREATE INDEX outbox_deployment_available ON outbox (deployment, available_at)")


def downgrade() -> None:
    op.execute("DROP INDEX outbox_deployment_available")
    op.execute("ALTER TABLE outbox DROP COLUMN deployment")
