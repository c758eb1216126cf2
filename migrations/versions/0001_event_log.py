"""The event log, its append-only guard, and the transactional outbox.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE events (
            global_position bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            tx_id           xid8        NOT NULL DEFAULT pg_current_xact_id(),
            stream_id       text        NOT NULL,
            stream_version  integer     NOT NULL CHECK (stream_version > 0),
            event_id        uuid        NOT NULL,
            event_type      text        NOT NULL,
            schema_version  integer     NOT NULL DEFAULT 1,
            data            jsonb       NOT NULL,
            metadata        jsonb       NOT NULL,
            recorded_at     timestamptz NOT NULL DEFAULT now(),
            prev_hash       bytea       NOT NULL,
            hash            bytea       NOT NULL,
            CONSTRAINT events_event_id_key UNIQUE (event_id),
            CONSTRAINT events_stream_version_key UNIQUE (stream_id, stream_version)
        )
        """
    )
    # Readers follow (tx_id, global_position) below the snapshot horizon; see
    # events/postgres/horizon.py.
    op.execute("CREATE INDEX events_commit_order ON events (tx_id, global_position)")
    op.execute(
        """
        CREATE FUNCTION events_are_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'the event log is append-only: % on events is not allowed', TG_OP
                USING ERRCODE = 'restrict_violation';
        END
        $$
        """
    )
    op.execute(
        """
        CREATE TRIGGER events_no_update_or_delete BEFORE UPDATE OR DELETE ON events
            FOR EACH ROW EXECUTE FUNCTION events_are_append_only()
        """
    )
    op.execute(
        """
        CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
            FOR EACH STATEMENT EXECUTE FUNCTION events_are_append_only()
        """
    )
    op.execute(
        """
        CREATE TABLE outbox (
            id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            message_id   text        NOT NULL,
            stream_id    text        NOT NULL,
            exchange     text        NOT NULL,
            routing_key  text        NOT NULL,
            properties   jsonb       NOT NULL,
            body         bytea       NOT NULL,
            created_at   timestamptz NOT NULL DEFAULT now(),
            available_at timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute("CREATE INDEX outbox_available ON outbox (available_at)")


def downgrade() -> None:
    op.execute("DROP TABLE outbox")
    op.execute("DROP TABLE events")
    op.execute("DROP FUNCTION events_are_append_only()")
