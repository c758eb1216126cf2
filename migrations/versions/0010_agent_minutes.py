"""The agent-activity projection: one row per agent and minute, for the console's overview.

``agent_minutes`` counts the tasks each agent started, completed, failed and had cancelled in
each minute, and keeps a histogram of the latencies of those that finished in it: ``latency``,
an integer array of fixed log-scale buckets (``waystation.projections.activity.LATENCY_BOUNDS``,
108 of them; the check keeps every row the same length, since rows are added bucket by bucket).
Counts and buckets are integers summed on upsert, so a rebuild reproduces the rows exactly (G8).
The runner deletes the rows more than a day older than the newest one
(``waystation.projections.activity`` says why, and what the figures cover).

The key leads with the minute: the overview reads the last minutes of every agent, and the
runner deletes by minute. Nothing here touches ``events``: the projection follows the log like
the others, from its checkpoint; on a database with a log already, its runner starts from
position zero (keeping the last day of it).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE agent_minutes (
            minute    timestamptz NOT NULL,
            agent     text        NOT NULL,
            started   bigint      NOT NULL DEFAULT 0,
            completed bigint      NOT NULL DEFAULT 0,
            failed    bigint      NOT NULL DEFAULT 0,
            cancelled bigint      NOT NULL DEFAULT 0,
            latency   integer[]   NOT NULL CHECK (cardinality(latency) = 108),
            PRIMARY KEY (minute, agent)
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE agent_minutes")
    # and its checkpoints: an upgrade after this starts the projection from position zero again
    op.execute(
        "DELETE FROM projection_checkpoints "
        "WHERE name IN ('agent_minutes', 'agent_minutes:rebuild')"
    )
