"""Waits of every kind: the pending-calls projection keeps each wait's kind and signal name, and
forgets the waits a ``FirstK`` pause gave up.

A pause's waits are peer calls, signals and timers (``TaskPaused`` v2); each is a row here until
something claims it, so the one sweeper records a call's or a signal's timeout and fires a timer
(G6). A ``TaskResumed`` that names ``abandoned`` waits removes the task's remaining rows: the
pause no longer waits for them. Rows written before this revision are calls.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import importlib

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

FOLLOW_EVENTS = """
        CREATE OR REPLACE FUNCTION pending_calls_follow_events() RETURNS trigger
        LANGUAGE plpgsql AS $$
        DECLARE
            a record;
        BEGIN
            -- one pass in append order, touching the table only for the events that concern it
            -- (most appends are a claim and a result: one DELETE by primary key)
            FOR a IN SELECT stream_id, event_type, data, metadata FROM appended
                     ORDER BY stream_version LOOP
                CASE a.event_type
                WHEN 'TaskPaused' THEN
                    INSERT INTO pending_calls
                        (subtask_id, task_id, agent, deadline_at, deployment, kind, name)
                    SELECT c->>'subtask_id', a.stream_id, c->>'agent',
                           to_timestamp((c->>'deadline_at')::float8),
                           coalesce(a.metadata->>'deployment', ''),
                           coalesce(c->>'kind', 'call'), c->>'name'
                    FROM jsonb_array_elements(a.data->'calls') AS c
                    ON CONFLICT (subtask_id) DO NOTHING;
                WHEN 'SubtaskClaimed' THEN
                    DELETE FROM pending_calls WHERE subtask_id = a.data->>'subtask_id';
                WHEN 'DeadlineExtended' THEN
                    UPDATE pending_calls
                    SET deadline_at = to_timestamp((a.data->>'deadline_at')::float8),
                        leased_until = NULL
                    WHERE subtask_id = a.data->>'subtask_id';
                WHEN 'TaskResumed' THEN
                    IF a.data ? 'abandoned' THEN
                        DELETE FROM pending_calls WHERE task_id = a.stream_id;
                    END IF;
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


def upgrade() -> None:
    op.execute(
        "ALTER TABLE pending_calls ADD COLUMN kind text NOT NULL DEFAULT 'call', "
        "ADD COLUMN name text"
    )
    op.execute(FOLLOW_EVENTS)


def downgrade() -> None:
    before = importlib.import_module("waystation.migrations.versions.0002_pending_calls")
    op.execute(before.FOLLOW_EVENTS.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
    op.execute("ALTER TABLE pending_calls DROP COLUMN kind, DROP COLUMN name")
