"""Indexes for paging through the paused-tasks projection by keyset, in each order the console
offers, with or without an agent: ``(paused_since, task_id)`` (oldest and newest first, and the
age filters), ``(agent, paused_since, task_id)`` (which replaces ``(agent, paused_since)``, whose
ties on ``paused_since`` a keyset could not break), and the earliest deadline first, nulls last,
as ``(coalesce(earliest_deadline, 'infinity'), task_id)`` with and without the agent in front: a
resumed row has no open wait, so no deadline, and a keyset over a nullable column would need an
``OR`` that no index answers. ``waystation.projections.postgres.paused_tasks_page`` writes its
conditions on exactly these expressions.

The filters on what a task waits for stay with the GIN index on ``waits`` (revision 0009).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

DEADLINE = "coalesce(earliest_deadline, 'infinity'::timestamptz)"
"""The sort key of the deadline order: a row without an open wait comes last."""


KINDS = ("call", "signal", "timer")


def upgrade() -> None:
    op.execute("DROP INDEX paused_tasks_agent")
    op.execute("CREATE INDEX paused_tasks_agent ON paused_tasks (agent, paused_since, task_id)")
    op.execute("CREATE INDEX paused_tasks_since ON paused_tasks (paused_since, task_id)")
    op.execute(f"CREATE INDEX paused_tasks_deadline ON paused_tasks (({DEADLINE}), task_id)")
    op.execute(
        f"CREATE INDEX paused_tasks_agent_deadline ON paused_tasks (agent, ({DEADLINE}), task_id)"
    )
    for kind in KINDS:
        waiting = f"""WHERE waits @> '[{{"kind": "{kind}"}}]'::jsonb"""
        op.execute(
            f"CREATE INDEX paused_tasks_{kind}_since ON paused_tasks (paused_since, task_id) "
            f"{waiting}"
        )
        op.execute(
            f"CREATE INDEX paused_tasks_{kind}_deadline ON paused_tasks (({DEADLINE}), task_id) "
            f"{waiting}"
        )


def downgrade() -> None:
    for kind in KINDS:
        op.execute(f"DROP INDEX paused_tasks_{kind}_deadline")
        op.execute(f"DROP INDEX paused_tasks_{kind}_since")
    op.execute("DROP INDEX paused_tasks_agent_deadline")
    op.execute("DROP INDEX paused_tasks_deadline")
    op.execute("DROP INDEX paused_tasks_since")
    op.execute("DROP INDEX paused_tasks_agent")
    op.execute("CREATE INDEX paused_tasks_agent ON paused_tasks (agent, paused_since)")
