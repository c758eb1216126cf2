"""Asynchronous projections: their checkpoints, the paused-tasks and agent-statistics tables,
and a notification on every append so runners wake without polling.

A projection's rows and its checkpoint change in one transaction (see
projections/postgres/feed.py). The checkpoint is a position in the log's commit order,
``(tx_id, global_position)``.
``agent_stats.pause_microseconds`` is an integer so that a rebuild, which sums the same pauses
in other batches, reproduces it exactly (a float sum would depend on the order).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE projection_checkpoints (
            name            text        PRIMARY KEY,
            tx_id           xid8        NOT NULL DEFAULT '0',
            global_position bigint      NOT NULL DEFAULT 0,
            events          bigint      NOT NULL DEFAULT 0,
            updated_at      timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        """
        CREATE TABLE paused_tasks (
            task_id           text        PRIMARY KEY,
            agent             text        NOT NULL,
            pause             integer     NOT NULL,
            calls_expected    integer     NOT NULL,
            calls_recorded    integer     NOT NULL,
            earliest_deadline timestamptz,
            paused_since      timestamptz NOT NULL,
            status            text        NOT NULL,
            deadlines         jsonb       NOT NULL
        )
        """
    )
    op.execute("CREATE INDEX paused_tasks_agent ON paused_tasks (agent, paused_since)")
    op.execute(
        """
        CREATE TABLE agent_stats (
            agent              text   PRIMARY KEY,
            completed          bigint NOT NULL DEFAULT 0,
            failed             bigint NOT NULL DEFAULT 0,
            cancelled          bigint NOT NULL DEFAULT 0,
            paused_now         bigint NOT NULL DEFAULT 0,
            timeouts           bigint NOT NULL DEFAULT 0,
            pauses_resumed     bigint NOT NULL DEFAULT 0,
            pause_microseconds bigint NOT NULL DEFAULT 0
        )
        """
    )
    op.execute(
        """
        CREATE FUNCTION events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            -- delivered at commit; identical notifications of one transaction fold into one
            PERFORM pg_notify('waystation_events', '');
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        """
        CREATE TRIGGER events_notify AFTER INSERT ON events
            FOR EACH STATEMENT EXECUTE FUNCTION events_notify()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER events_notify ON events")
    op.execute("DROP FUNCTION events_notify()")
    op.execute("DROP TABLE agent_stats")
    op.execute("DROP TABLE paused_tasks")
    op.execute("DROP TABLE projection_checkpoints")
