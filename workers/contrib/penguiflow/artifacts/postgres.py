"""Artifacts in PostgreSQL: :class:`PostgresBlobs`, on the table ``penguiflow_artifacts`` of the
event log's database.

A put is one transaction that takes transaction-level advisory locks on its session and then its
trace, so that two workers putting into one session at once cannot both see room for one more.
Lock order is always session before trace, so puts cannot deadlock. Driver errors leave as the
event log's ``StoreUnavailable`` / ``IntegrityError`` (``events``).
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from penguiflow.artifacts import ArtifactRef, ArtifactRetentionConfig, ArtifactScope
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from waystation.contrib.penguiflow.artifacts.port import EXPIRE_BATCH, Blob, Blobs
from waystation.events.postgres import translate_error as _translate

__all__ = ["PostgresBlobs", "artifacts_table"]

artifacts_table = sa.Table(
    "penguiflow_artifacts",
    sa.MetaData(),
    sa.Column("artifact_id", sa.Text, primary_key=True),
    sa.Column("session_id", sa.Text),
    sa.Column("trace_id", sa.Text),
    sa.Column("mime_type", sa.Text),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("filename", sa.Text),
    sa.Column("sha256", sa.Text, nullable=False),
    sa.Column("scope", JSONB(none_as_null=True)),
    sa.Column("source", JSONB, nullable=False),
    sa.Column("namespace", sa.Text),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Column("created_at", TIMESTAMP(timezone=True), nullable=False),
    sa.Column("last_access", TIMESTAMP(timezone=True), nullable=False),
    sa.Column("expires_at", TIMESTAMP(timezone=True)),
)
"""The table of migration 0005 (``migrations/versions/0005_penguiflow_artifacts.py``)."""

_t = artifacts_table
_NOW = sa.func.now()
_LIVE = sa.or_(_t.c.expires_at.is_(None), _t.c.expires_at >= _NOW)
_META = (
    _t.c.artifact_id,
    _t.c.mime_type,
    _t.c.size_bytes,
    _t.c.filename,
    _t.c.sha256,
    _t.c.scope,
    _t.c.namespace,
    _t.c.source,
)
_SESSION_LOCKS = 0x57617941  # "WayA": the first key of a session's advisory lock
_TRACE_LOCKS = 0x57617954  # "WayT": the first key of a trace's advisory lock
_LOCK = sa.text("SELECT pg_advisory_xact_lock(:namespace, hashtext(:key))")


def _ref(row: Any) -> ArtifactRef:
    return ArtifactRef(
        id=row.artifact_id,
        mime_type=row.mime_type,
        size_bytes=row.size_bytes,
        filename=row.filename,
        sha256=row.sha256,
        scope=None if row.scope is None else ArtifactScope.model_validate(row.scope),
        namespace=row.namespace,
        source=row.source,
    )


def _same(column: sa.ColumnElement[Any], value: str | None) -> sa.ColumnElement[bool]:
    return column.is_(None) if value is None else column == value


def _touch(artifact_id: str) -> sa.Update:
    return (
        sa.update(_t)
        .where(_t.c.artifact_id == artifact_id, _LIVE)
        .values(last_access=_NOW)
        .returning(*_META)
    )


class PostgresBlobs(Blobs):
    """Artifacts in ``penguiflow_artifacts``, through any engine (autocommit or not): a put
    runs in a read-committed transaction of its own, every other method is one statement.
    Under LRU a ``get`` writes the artifact's last use (an UPDATE that leaves the bytes where
    they are: PostgreSQL keeps an unchanged TOASTed value)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def put(
        self, blob: Blob, retention: ArtifactRetentionConfig, *, now: float
    ) -> ArtifactRef:
        with _translated():
            async with self.engine.connect() as connection:
                await connection.execution_options(isolation_level="READ COMMITTED")
                async with connection.begin():
                    return await self._put(connection, blob, retention)

    async def _put(
        self, connection: AsyncConnection, blob: Blob, retention: ArtifactRetentionConfig
    ) -> ArtifactRef:
        ref = blob.ref
        scope = ref.scope or ArtifactScope()
        # held to the commit: no other put of this session or trace counts until this one did
        await connection.execute(
            _LOCK, {"namespace": _SESSION_LOCKS, "key": scope.session_id or ""}
        )
        if scope.trace_id is not None:
            await connection.execute(_LOCK, {"namespace": _TRACE_LOCKS, "key": scope.trace_id})
        found = (await connection.execute(_touch(ref.id))).first()
        if found is not None:
            return _ref(found)
        await connection.execute(_expire(EXPIRE_BATCH))
        if retention.cleanup_strategy != "none":
            incoming = len(blob.data)
            buckets = [
                (
                    _same(_t.c.session_id, scope.session_id),
                    retention.max_artifacts_per_session,
                    retention.max_session_bytes,
                )
            ]
            if scope.trace_id is not None:
                buckets.append(
                    (
                        _t.c.trace_id == scope.trace_id,
                        retention.max_artifacts_per_trace,
                        retention.max_trace_bytes,
                    )
                )
            for in_bucket, max_count, max_bytes in buckets:
                await connection.execute(
                    _evict(in_bucket, retention, max_count, max_bytes - incoming)
                )
        ttl = retention.ttl_seconds
        row = {
            "artifact_id": ref.id,
            "session_id": scope.session_id,
            "trace_id": scope.trace_id,
            "mime_type": ref.mime_type,
            "size_bytes": ref.size_bytes,
            "filename": ref.filename,
            "sha256": ref.sha256,
            "scope": None if ref.scope is None else ref.scope.model_dump(),
            "source": ref.source,
            "namespace": ref.namespace,
            "data": blob.data,
            "created_at": _NOW,
            "last_access": _NOW,
            "expires_at": _NOW + sa.func.make_interval(0, 0, 0, 0, 0, 0, ttl) if ttl > 0 else None,
        }
        insert = pg_insert(_t).values(row)
        # an expired artifact with this id is replaced; a live one was put meanwhile by another
        # transaction (the row is locked now either way), and stands
        inserted = (
            await connection.execute(
                insert.on_conflict_do_update(
                    index_elements=[_t.c.artifact_id],
                    set_={name: insert.excluded[name] for name in row if name != "artifact_id"},
                    where=sa.not_(_LIVE),
                ).returning(*_META)
            )
        ).first()
        if inserted is None:
            inserted = (await connection.execute(_touch(ref.id))).one()
        return _ref(inserted)

    async def get(self, artifact_id: str, *, touch: bool, now: float) -> Blob | None:
        if touch:
            statement: sa.Executable = _touch(artifact_id).returning(_t.c.data)
        else:
            statement = sa.select(*_META, _t.c.data).where(_t.c.artifact_id == artifact_id, _LIVE)
        row = await self._first(statement)
        return None if row is None else Blob(_ref(row), row.data)

    async def get_meta(self, artifact_id: str, *, now: float) -> ArtifactRef | None:
        row = await self._first(sa.select(*_META).where(_t.c.artifact_id == artifact_id, _LIVE))
        return None if row is None else _ref(row)

    async def delete(self, artifact_id: str, *, now: float) -> bool:
        row = await self._first(
            sa.delete(_t).where(_t.c.artifact_id == artifact_id).returning(_LIVE)
        )
        return row is not None and bool(row[0])

    async def exists(self, artifact_id: str, *, now: float) -> bool:
        row = await self._first(sa.select(1).where(_t.c.artifact_id == artifact_id, _LIVE))
        return row is not None

    async def list(self, scope: ArtifactScope | None, *, now: float) -> builtins.list[ArtifactRef]:
        statement = sa.select(*_META).where(_LIVE).order_by(_t.c.created_at, _t.c.artifact_id)
        if scope is not None:
            for column, value in (
                (_t.c.session_id, scope.session_id),
                (_t.c.trace_id, scope.trace_id),
                (_t.c.scope["tenant_id"].astext, scope.tenant_id),
                (_t.c.scope["user_id"].astext, scope.user_id),
            ):
                if value is not None:
                    statement = statement.where(column == value)
        with _translated():
            async with self.engine.connect() as connection:
                rows = (await connection.execute(statement)).all()
        return [_ref(row) for row in rows]

    async def expire(self, *, now: float, limit: int = EXPIRE_BATCH) -> int:
        with _translated():
            async with self.engine.begin() as connection:
                return (await connection.execute(_expire(limit))).rowcount

    async def _first(self, statement: sa.Executable) -> sa.Row[Any] | None:
        """Run one statement (committed, should it write) and return its first row."""
        with _translated():
            async with self.engine.begin() as connection:
                return (await connection.execute(statement)).first()


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """Driver and SQLAlchemy errors leave as the event log's (``waystation.events.errors``)."""
    try:
        yield
    except Exception as error:
        raise _translate(error) from error


def _expire(limit: int) -> sa.Delete:
    """Delete up to ``limit`` expired artifacts, skipping those another transaction holds."""
    expired = (
        sa.select(_t.c.artifact_id)
        .where(_t.c.expires_at < _NOW)
        .order_by(_t.c.expires_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return sa.delete(_t).where(_t.c.artifact_id.in_(expired.scalar_subquery()))


def _evict(
    in_bucket: sa.ColumnElement[bool],
    retention: ArtifactRetentionConfig,
    max_count: int,
    bytes_left: int,
) -> sa.Delete:
    """Delete the oldest live artifacts of a bucket (a session or a trace) until it holds fewer
    than ``max_count`` and at most ``bytes_left``: keep the newest as long as both hold."""
    if retention.cleanup_strategy == "lru":
        newest_first = [_t.c.last_access.desc(), _t.c.created_at.desc(), _t.c.artifact_id.desc()]
    else:
        newest_first = [_t.c.created_at.desc(), _t.c.artifact_id.desc()]
    ranked = (
        sa.select(
            _t.c.artifact_id,
            sa.func.row_number().over(order_by=newest_first).label("rank"),
            sa.func.sum(_t.c.size_bytes).over(order_by=newest_first, rows=(None, 0)).label("kept"),
        )
        .where(in_bucket, _LIVE)
        .subquery()
    )
    victims = sa.select(ranked.c.artifact_id).where(
        sa.or_(ranked.c.rank >= max_count, ranked.c.kept > bytes_left)
    )
    return sa.delete(_t).where(_t.c.artifact_id.in_(victims.scalar_subquery()))
