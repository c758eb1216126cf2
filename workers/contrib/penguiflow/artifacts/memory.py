"""Artifacts in memory: :class:`MemoryBlobs`, the port's backend for tests and a laptop."""

from __future__ import annotations

import builtins
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from penguiflow.artifacts import ArtifactRef, ArtifactRetentionConfig, ArtifactScope, _scope_matches

from waystation.contrib.penguiflow.artifacts.port import EXPIRE_BATCH, Blob, Blobs

__all__ = ["MemoryBlobs"]


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
