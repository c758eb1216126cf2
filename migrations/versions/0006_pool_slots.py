"""The pool's slots: one row per slot of an agent's ``concurrency`` (kind ``runs``) or ``rate``
(kind ``starts``), per deployment.

A slot is free when ``expires_at`` has passed (``-infinity`` when given back or never taken). A
run's worker takes one with ``FOR UPDATE SKIP LOCKED``, renews a ``runs`` slot while its run
lasts and gives it back at the end; a ``starts`` slot stays taken for the rate's period.
``lease`` is the taker's id for it, ``holder`` the worker and ``task_id`` the task (for whoever
looks). ``workers/slots/postgres.py`` (``PostgresSlotLeases``) reads and writes this table and
holds its ``sqlalchemy.Table``; keep the two in step. Unlike ``events``, rows are updated: slots
are not history.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE pool_slots (
            deployment  text        NOT NULL,
            agent       text        NOT NULL,
            kind        text        NOT NULL CHECK (kind IN ('runs', 'starts')),
            slot        integer     NOT NULL CHECK (slot >= 0),
            lease       text,
            holder      text,
            task_id     text,
            taken_at    timestamptz,
            expires_at  timestamptz NOT NULL DEFAULT '-infinity',
            PRIMARY KEY (deployment, agent, kind, slot)
        )
        """
    )
    # a take walks an agent's slots of one kind, free longest first (a rate may have thousands)
    op.execute(
        "CREATE INDEX pool_slots_free ON pool_slots (deployment, agent, kind, expires_at, slot)"
    )
    # a renewal or a give-back finds its rows by lease
    op.execute("CREATE INDEX pool_slots_lease ON pool_slots (lease) WHERE lease IS NOT NULL")


def downgrade() -> None:
    op.execute("DROP TABLE pool_slots")
