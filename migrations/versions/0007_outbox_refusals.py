"""What the broker said to each outbox row: how often it refused the row's message, and why.

A refused publish (a full queue that rejects publishes, a nack) is retried with backoff by the
relays; the count decides the backoff, and when to give up and dead-letter the message instead
(``waystation.runtime.outbox``). Rows written before this revision start at no refusal.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE outbox ADD COLUMN refusals integer NOT NULL DEFAULT 0, "
        "ADD COLUMN last_refusal text"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE outbox DROP COLUMN refusals, DROP COLUMN last_refusal")
