"""PenguiFlow's artifact store on Waystation: blobs with a time to live, beside the event log.

PenguiFlow keeps binary and large text content (up to ``max_artifact_bytes``, 50 MB by default)
out of an LLM's context and hands around compact ``ArtifactRef`` references instead. Such blobs
expire and may be deleted, so they cannot live in the append-only event log: they have a table
of their own, ``penguiflow_artifacts`` (migration 0005).

:class:`WaystationArtifactStore` implements PenguiFlow's ``ArtifactStore`` protocol (3.11) with
the semantics of its reference, ``InMemoryArtifactStore`` / ``PlaygroundArtifactStore``, over a
small port, :class:`Blobs`, with two backends: :class:`PostgresBlobs` and :class:`MemoryBlobs`
(a real implementation for fast tests; the contract suite in
``tests/contract/test_penguiflow_artifacts.py`` runs against both).

Semantics:

* An artifact's id is content-addressed (``{namespace}_{sha256[:12]}``, PenguiFlow's own
  ``_generate_artifact_id``), so putting the same content again is idempotent: the reference
  kept the first time comes back (its scope, filename and meta too), and nothing is written
  but the artifact's last use.
* An artifact expires ``ttl_seconds`` after it was put (never when ``ttl_seconds <= 0``); an
  expired artifact is gone for every method, and a put of the same content stores it anew.
  On PostgreSQL the database's clock (``now()``) decides, so every worker agrees; in memory the
  store's ``clock``.
* Content larger than ``max_artifact_bytes`` is refused with ``ValueError``, as the reference
  refuses it.
* Limits per session (``max_artifacts_per_session``, ``max_session_bytes``; artifacts of no
  session count together, as the reference's "default" session) and per trace
  (``max_artifacts_per_trace``, ``max_trace_bytes``): before a new artifact goes in, the
  session's and then the trace's oldest live artifacts are evicted until the new one fits:
  least recently used first with ``cleanup_strategy="lru"`` (a ``get`` or a repeated put is a
  use), first put first with ``"fifo"``, none with ``"none"`` (the limits are then not
  enforced, as in the reference). An artifact larger than a byte limit still goes in, alone.
* The scope is stored and ``list(scope=...)`` filters on it as the reference does: a field set
  in the filter must be equal in the artifact's scope, a field left None matches anything.
* ``get`` checks the bytes against their stored SHA-256 and returns None (and logs an error)
  when they differ.

Where this differs from the reference: ``"fifo"`` evicts the first put (the reference's moves
an artifact to the back on every use, which makes it LRU); ``list`` is in order of puts (the
reference's is in order of use); the per-trace limits are enforced (the reference only declares
them); and an expired artifact put again is stored anew (the reference hands back the expired
reference). Scope is stored, not enforced: ``ScopedArtifacts`` and the HTTP layer do that.

PostgreSQL: a put is one transaction that takes transaction-level advisory locks on its
session and then its trace, so that two workers putting into one session at once cannot both
see room for one more. Lock order is always session before trace, so puts cannot deadlock.
Driver errors leave as the event log's ``StoreUnavailable`` / ``IntegrityError`` (``events``).
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from penguiflow.artifacts import (
    ArtifactRef,
    ArtifactRetentionConfig,
    ArtifactScope,
    _generate_artifact_id,
    _scope_matches,
)
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from waystation.events.codec import as_stored, unstorable
from waystation.events.postgres import translate_error as _translate

__all__ = [
    "Blob",
    "Blobs",
    "MemoryBlobs",
    "PostgresBlobs",
    "WaystationArtifactStore",
    "artifacts_table",
]

log = logging.getLogger(__name__)

EXPIRE_BATCH = 100
"""Expired artifacts deleted at most per statement (a put deletes one batch on its way)."""


# ---- the port ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Blob:
    """An artifact as kept: its reference (every field of its metadata) and its bytes."""

    ref: ArtifactRef
    data: bytes


class Blobs(abc.ABC):
    """Where artifacts are kept. The store decides ids, hashes and limits; a backend keeps rows.

    ``now`` is the caller's clock (seconds since the epoch). A backend with a clock of its own
    uses that instead: :class:`PostgresBlobs` goes by the database's ``now()``, so that every
    worker agrees on what has expired. An artifact is *live* until ``ttl_seconds`` after its
    put (forever when ``ttl_seconds <= 0``); only live artifacts are found, listed or counted.
    """

    @abc.abstractmethod
    async def put(
        self, blob: Blob, retention: ArtifactRetentionConfig, *, now: float
    ) -> ArtifactRef:
        """Keep ``blob`` and return its reference; when a live artifact has its id already,
        keep nothing, count a use of that one and return its reference. An expired one with
        the id is replaced.

        Before keeping a new blob, evict live artifacts of its session, then of its trace
        (``retention.cleanup_strategy``: least recently used or first put first; ``"none"``
        evicts nothing) until the session holds fewer than ``max_artifacts_per_session`` and
        at most ``max_session_bytes`` with the new blob counted, and likewise the trace. Atomic
        against concurrent puts of the same session or trace. Also deletes a batch of expired
        artifacts.
        """

    @abc.abstractmethod
    async def get(self, artifact_id: str, *, touch: bool, now: float) -> Blob | None:
        """The live artifact with this id, or None; ``touch`` counts a use of it (LRU)."""

    @abc.abstractmethod
    async def get_meta(self, artifact_id: str, *, now: float) -> ArtifactRef | None:
        """The live artifact's reference without its bytes, or None; not a use."""

    @abc.abstractmethod
    async def delete(self, artifact_id: str, *, now: float) -> bool:
        """Delete the artifact; True when a live one was deleted (an expired one goes too)."""

    @abc.abstractmethod
    async def exists(self, artifact_id: str, *, now: float) -> bool:
        """Whether a live artifact has this id."""

    @abc.abstractmethod
    async def list(self, scope: ArtifactScope | None, *, now: float) -> builtins.list[ArtifactRef]:
        """Live artifacts whose scope matches ``scope`` (see the module), in order of puts."""

    @abc.abstractmethod
    async def expire(self, *, now: float, limit: int = EXPIRE_BATCH) -> int:
        """Delete up to ``limit`` expired artifacts; how many were deleted."""


# ---- the store -----------------------------------------------------------------------------------


class WaystationArtifactStore:
    """PenguiFlow's ``ArtifactStore`` over :class:`Blobs` (see the module for the semantics)."""

    def __init__(
        self,
        blobs: Blobs,
        retention: ArtifactRetentionConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.blobs = blobs
        self.retention = retention or ArtifactRetentionConfig()
        self._clock = clock

    async def put_bytes(
        self,
        data: bytes,
        *,
        mime_type: str | None = None,
        filename: str | None = None,
        namespace: str | None = None,
        scope: ArtifactScope | None = None,
        meta: dict[str, Any] | None = None,
    ) -> ArtifactRef:
        """Store ``data``; its reference (the first one's when the content is already here)."""
        data = bytes(data)
        limit = self.retention.max_artifact_bytes
        if len(data) > limit:
            raise ValueError(f"Artifact size ({len(data)} bytes) exceeds limit ({limit} bytes)")
        source = dict(meta or {})
        fields = {"mime_type": mime_type, "filename": filename, "namespace": namespace}
        problem = unstorable(
            {**fields, "scope": scope.model_dump() if scope else None, "meta": source}
        )
        if problem is not None:
            raise ValueError(f"the artifact's metadata cannot be stored: {problem}")
        ref = ArtifactRef(
            id=_generate_artifact_id(data, namespace),
            size_bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            scope=scope.model_copy() if scope else None,
            source=as_stored(source),  # as jsonb gives it back, whichever backend keeps it
            **fields,
        )
        return await self.blobs.put(Blob(ref, data), self.retention, now=self._clock())

    async def put_text(
        self,
        text: str,
        *,
        mime_type: str = "text/plain",
        filename: str | None = None,
        namespace: str | None = None,
        scope: ArtifactScope | None = None,
        meta: dict[str, Any] | None = None,
    ) -> ArtifactRef:
        """Store ``text`` as UTF-8."""
        return await self.put_bytes(
            text.encode("utf-8"),
            mime_type=mime_type,
            filename=filename,
            namespace=namespace,
            scope=scope,
            meta=meta,
        )

    async def get(self, artifact_id: str) -> bytes | None:
        """The artifact's bytes; None when it is missing, expired or corrupt."""
        touch = self.retention.cleanup_strategy == "lru"
        blob = await self.blobs.get(artifact_id, touch=touch, now=self._clock())
        if blob is None:
            return None
        actual = hashlib.sha256(blob.data).hexdigest()
        if actual != blob.ref.sha256:
            log.error(
                "artifact %s: its bytes do not match their SHA-256 (stored %s, read %s); "
                "not returned",
                artifact_id,
                blob.ref.sha256,
                actual,
            )
            return None
        return blob.data

    async def get_ref(self, artifact_id: str) -> ArtifactRef | None:
        return await self.blobs.get_meta(artifact_id, now=self._clock())

    async def delete(self, artifact_id: str) -> bool:
        return await self.blobs.delete(artifact_id, now=self._clock())

    async def exists(self, artifact_id: str) -> bool:
        return await self.blobs.exists(artifact_id, now=self._clock())

    async def list(self, *, scope: ArtifactScope | None = None) -> builtins.list[ArtifactRef]:
        """Artifacts matching ``scope`` (every one when None), in order of puts."""
        return await self.blobs.list(scope, now=self._clock())

    async def purge_expired(self) -> int:
        """Delete every expired artifact (a put deletes a batch too); how many were deleted.
        For a periodic sweep: expired artifacts are already invisible, this frees their space."""
        total = 0
        while deleted := await self.blobs.expire(now=self._clock()):
            total += deleted
        return total


# ---- in memory -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Kept:
    blob: Blob
    expires_at: float | None
    put_order: int
    used_order: int

    def live(self, now: float) -> bool:
        return self.expires_at is None or now <= self.expires_at


class MemoryBlobs(Blobs):
    """Artifacts in a dict. Every method completes without awaiting, so each is atomic on the
    loop. The order of uses and puts is a counter, so it does not depend on a clock's grain."""

    def __init__(self) -> None:
        self._kept: dict[str, _Kept] = {}
        self._order = itertools.count()

    async def put(
        self, blob: Blob, retention: ArtifactRetentionConfig, *, now: float
    ) -> ArtifactRef:
        found = self._live(blob.ref.id, now)
        if found is not None:
            found.used_order = next(self._order)
            return _copy(found.blob.ref)
        self._kept.pop(blob.ref.id, None)  # expired
        await self.expire(now=now)
        if retention.cleanup_strategy != "none":
            scope = blob.ref.scope or ArtifactScope()
            incoming = len(blob.data)
            self._evict(
                lambda kept: _session(kept.blob.ref) == scope.session_id,
                incoming,
                retention.max_artifacts_per_session,
                retention.max_session_bytes,
                retention,
                now,
            )
            if scope.trace_id is not None:
                self._evict(
                    lambda kept: _trace(kept.blob.ref) == scope.trace_id,
                    incoming,
                    retention.max_artifacts_per_trace,
                    retention.max_trace_bytes,
                    retention,
                    now,
                )
        ttl = retention.ttl_seconds
        order = next(self._order)
        self._kept[blob.ref.id] = _Kept(
            Blob(_copy(blob.ref), blob.data), now + ttl if ttl > 0 else None, order, order
        )
        return _copy(blob.ref)

    def _evict(
        self,
        in_bucket: Callable[[_Kept], bool],
        incoming: int,
        max_count: int,
        max_bytes: int,
        retention: ArtifactRetentionConfig,
        now: float,
    ) -> None:
        bucket = [kept for kept in self._kept.values() if kept.live(now) and in_bucket(kept)]
        if retention.cleanup_strategy == "lru":
            bucket.sort(key=lambda kept: kept.used_order)
        else:
            bucket.sort(key=lambda kept: kept.put_order)
        count, total = len(bucket), sum(len(kept.blob.data) for kept in bucket)
        for oldest in bucket:
            if count < max_count and total + incoming <= max_bytes:
                break
            del self._kept[oldest.blob.ref.id]
            count, total = count - 1, total - len(oldest.blob.data)

    async def get(self, artifact_id: str, *, touch: bool, now: float) -> Blob | None:
        found = self._live(artifact_id, now)
        if found is None:
            return None
        if touch:
            found.used_order = next(self._order)
        return Blob(_copy(found.blob.ref), found.blob.data)

    async def get_meta(self, artifact_id: str, *, now: float) -> ArtifactRef | None:
        found = self._live(artifact_id, now)
        return None if found is None else _copy(found.blob.ref)

    async def delete(self, artifact_id: str, *, now: float) -> bool:
        found = self._kept.pop(artifact_id, None)
        return found is not None and found.live(now)

    async def exists(self, artifact_id: str, *, now: float) -> bool:
        return self._live(artifact_id, now) is not None

    async def list(self, scope: ArtifactScope | None, *, now: float) -> builtins.list[ArtifactRef]:
        return [
            _copy(kept.blob.ref)
            for kept in sorted(self._kept.values(), key=lambda kept: kept.put_order)
            if kept.live(now) and (scope is None or _scope_matches(kept.blob.ref.scope, scope))
        ]

    async def expire(self, *, now: float, limit: int = EXPIRE_BATCH) -> int:
        expired = [key for key, kept in self._kept.items() if not kept.live(now)][:limit]
        for key in expired:
            del self._kept[key]
        return len(expired)

    def _live(self, artifact_id: str, now: float) -> _Kept | None:
        found = self._kept.get(artifact_id)
        return found if found is not None and found.live(now) else None


def _copy(ref: ArtifactRef) -> ArtifactRef:
    """A caller's own copy, as a database hands out: mutating it cannot alter what is kept."""
    return ref.model_copy(deep=True)


def _session(ref: ArtifactRef) -> str | None:
    return ref.scope.session_id if ref.scope is not None else None


def _trace(ref: ArtifactRef) -> str | None:
    return ref.scope.trace_id if ref.scope is not None else None


# ---- PostgreSQL ----------------------------------------------------------------------------------

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
