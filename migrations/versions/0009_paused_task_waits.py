"""The paused-tasks projection says what each task waits for: its open waits of every kind.

A pause waits for peer calls, signals and timers (revision 0008). Each row keeps its open waits
in ``waits``, a JSON array in the pause's order of ``{subtask_id, kind, deadline_at}`` plus a
call's ``agent`` or a signal's ``name``, which replaces ``deadlines`` (sub-task id to deadline,
which could not say what a wait was). ``first_k`` is the pause's ``FirstK`` and
``agent_version`` the agent's version the pause recorded. ``calls_expected`` and
``calls_recorded`` become ``waits_expected`` and ``waits_recorded``: they always counted every
wait of the pause, and now that a ``FirstK`` pause resumes before each wait has its result, a
resumed row may show fewer results than waits.

``waystation tasks`` filters on the kinds of the open waits and on a signal's name: a GIN index
on ``waits`` (``jsonb_path_ops``, for containment) answers both.

The rows already there are filled from their pause's ``TaskPaused`` (what a rebuild gives),
keeping the deadlines the projection had (extended ones included).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_FILL = """
    UPDATE paused_tasks AS p
    SET waits = coalesce((
            SELECT jsonb_agg(jsonb_strip_nulls(jsonb_build_object(
                       'subtask_id', c->>'subtask_id',
                       'kind', coalesce(c->>'kind', 'call'),
                       'deadline_at', p.deadlines->(c->>'subtask_id'),
                       'agent', CASE WHEN coalesce(c->>'kind', 'call') = 'call'
                                     THEN c->>'agent' END,
                       'name', c->>'name')) ORDER BY n)
            FROM jsonb_array_elements(e.data->'calls') WITH ORDINALITY AS w(c, n)
            WHERE p.deadlines ? (c->>'subtask_id')), '[]'),
        first_k = (e.data->>'until')::integer,
        agent_version = e.data->>'agent_version'
    FROM events AS e
    WHERE e.stream_id = p.task_id AND e.event_type = 'TaskPaused'
      AND (e.data->>'pause')::integer = p.pause
"""


def upgrade() -> None:
    op.execute(
        "ALTER TABLE paused_tasks ADD COLUMN waits jsonb NOT NULL DEFAULT '[]', "
        "ADD COLUMN first_k integer, ADD COLUMN agent_version text"
    )
    op.execute(_FILL)
    op.execute("ALTER TABLE paused_tasks DROP COLUMN deadlines, ALTER COLUMN waits DROP DEFAULT")
    op.execute("ALTER TABLE paused_tasks RENAME COLUMN calls_expected TO waits_expected")
    op.execute("ALTER TABLE paused_tasks RENAME COLUMN calls_recorded TO waits_recorded")
    op.execute("CREATE INDEX paused_tasks_waits ON paused_tasks USING gin (waits jsonb_path_ops)")


def downgrade() -> None:
    op.execute("DROP INDEX paused_tasks_waits")
    op.execute("ALTER TABLE paused_tasks RENAME COLUMN waits_recorded TO calls_recorded")
    op.execute("ALTER TABLE paused_tasks RENAME COLUMN waits_expected TO calls_expected")
    op.execute("ALTER TABLE paused_tasks ADD COLUMN deadlines jsonb NOT NULL DEFAULT '{}'")
    op.execute(
        """
        UPDATE paused_tasks
        SET deadlines = (SELECT coalesce(jsonb_object_agg(w->>'subtask_id', w->'deadline_at'),
                                         '{}')
                         FROM jsonb_array_elements(waits) AS w)
        """
    )
    op.execute(
        "ALTER TABLE paused_tasks ALTER COLUMN deadlines DROP DEFAULT, DROP COLUMN waits, "
        "DROP COLUMN first_k, DROP COLUMN agent_version"
    )
