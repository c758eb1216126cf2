"""Pending calls: an inline projection of the calls paused tasks wait for, with deadlines.

The sweeper finds expired calls here (G6). A statement-level trigger on ``events`` keeps it in
step with the log inside the appending statement itself, so it can never disagree with the log:
a pause adds its calls, a claim (reply or timeout) removes one, an extension moves a deadline,
and a terminal event removes the task's remaining calls. Each call keeps the deployment (queue
prefix) of the worker that paused it, so a sweeper only takes its own deployment's calls.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


FOLLOW_EVENTS = """
        CREATE FUNCTION pending_calls_follow_events() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            a record;
        BEGIN
            -- one pass in append order, touching the table only for the events that concern it
            -- (most appends are a claim and a result: one DELETE by primary key)
            FOR a IN SELECT stream_id, event_type, data, metadata FROM appended
                     ORDER BY stream_version LOOP
                CASE a.event_type
                WHEN 'TaskPaused' THEN
                    INSERT INTO pending_calls (subtask_id, task_id, agent, deadline_at, deployment)
                    SELECT c->>'subtask_id', a.stream_id, c->>'agent',
                           to_timestamp((c->>'deadline_at')::float8),
                           coalesce(a.metadata->>'deployment', '')
                    FROM jsonb_array_elements(a.data->'calls') AS c
                    ON CONFLICT (subtask_id) DO NOTHING;
                WHEN 'SubtaskClaimed' THEN
                    DELETE FROM pending_calls WHERE subtask_id = a.data->>'subtask_id';
                WHEN 'DeadlineExtended' THEN
                    UPDATE pending_calls
                    SET deadline_at = to_timestamp((a.data->>'deadline_at')::float8),
                        leased_until = NULL
                    WHERE subtask_id = a.data->>'subtask_id';
                WHEN 'TaskCompleted', 'TaskFailed', 'TaskCancelled' THEN
                    DELETE FROM pending_calls WHERE task_id = a.stream_id;
                ELSE
                    NULL;
                END CASE;
            END LOOP;
            RETURN NULL;
        END
        $$
        """
"""The trigger function of this revision (0008 replaces it; its downgrade puts this back)."""


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE pending_calls (
            subtask_id   text        PRIMARY KEY,
            task_id      text        NOT NULL,
            agent        text        NOT NULL,
            deadline_at  timestamptz NOT NULL,
            leased_until timestamptz,
            deployment   text        NOT NULL DEFAULT ''
        )
        """
    )
    op.execute("CREATE INDEX pending_calls_deadline ON pending_calls (deadline_at)")
    op.execute("CREATE INDEX pending_calls_task ON pending_calls (task_id)")
    op.execute(FOLLOW_EVENTS)
    op.execute(
        """
        CREATE TRIGGER events_maintain_pending_calls AFTER INSERT ON events
            REFERENCING NEW TABLE AS appended
            FOR EACH STATEMENT EXECUTE FUNCTION pending_calls_follow_events()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER events_maintain_pending_calls ON events")
    op.execute("DROP FUNCTION pending_calls_follow_events()")
    op.execute("DROP TABLE pending_calls")
