"""The artifact store's port, :class:`Blobs` (where artifacts are kept), and
:class:`WaystationArtifactStore`, PenguiFlow's ``ArtifactStore`` over it: ids, hashes, size
limits and the integrity check are decided here, once for every backend (the semantics are in
the package's docstring, :mod:`waystation.contrib.penguiflow.artifacts`)."""

from __future__ import annotations

import abc
import builtins
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from penguiflow.artifacts import (
    ArtifactRef,
    ArtifactRetentionConfig,
    ArtifactScope,
    _generate_artifact_id,
)

from waystation.events.codec import as_stored, unstorable

__all__ = ["EXPIRE_BATCH", "Blob", "Blobs", "WaystationArtifactStore"]

log = logging.getLogger(__name__)

EXPIRE_BATCH = 100
"""Expired artifacts deleted at most per statement (a put deletes one batch on its way)."""


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
