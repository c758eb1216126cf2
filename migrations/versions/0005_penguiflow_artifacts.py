"""PenguiFlow's artifacts: blobs with a time to live, in a table of their own.

Artifacts (up to 50 MB each) expire and may be deleted, so they cannot live in the append-only
event log. ``workers/contrib/penguiflow/artifacts/postgres.py`` (``PostgresBlobs``) reads and writes
this table and holds its ``sqlalchemy.Table``; keep the two in step. ``session_id`` and ``trace_id``
repeat the scope's, for the per-session and per-trace limits; ``expires_at`` is NULL for an
artifact that never expires; ``last_access`` orders least-recently-used eviction.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE penguiflow_artifacts (
            artifact_id  text        PRIMARY KEY,
            session_id   text,
            trace_id     text,
            mime_type    text,
            size_bytes   bigint      NOT NULL,
            filename     text,
            sha256       text        NOT NULL,
            scope        jsonb,
            source       jsonb       NOT NULL DEFAULT '{}',
            namespace    text,
            data         bytea       NOT NULL,
            created_at   timestamptz NOT NULL DEFAULT now(),
            last_access  timestamptz NOT NULL DEFAULT now(),
            expires_at   timestamptz
        )
        """
    )
    op.execute("CREATE INDEX penguiflow_artifacts_session ON penguiflow_artifacts (session_id)")
    op.execute("CREATE INDEX penguiflow_artifacts_trace ON penguiflow_artifacts (trace_id)")
    op.execute("CREATE INDEX penguiflow_artifacts_expiry ON penguiflow_artifacts (expires_at)")


def downgrade() -> None:
    op.execute("DROP TABLE penguiflow_artifacts")
