"""PenguiFlow's artifact store on Waystation: blobs with a time to live, beside the event log.

PenguiFlow keeps binary and large text content (up to ``max_artifact_bytes``, 50 MB by default)
out of an LLM's context and hands around compact ``ArtifactRef`` references instead. Such blobs
expire and may be deleted, so they cannot live in the append-only event log: they have a table
of their own, ``penguiflow_artifacts`` (migration 0005).

:class:`WaystationArtifactStore` implements PenguiFlow's ``ArtifactStore`` protocol (3.11) with
the semantics of its reference, ``InMemoryArtifactStore`` / ``PlaygroundArtifactStore``, over a
small port, :class:`Blobs` (``port``), with two backends: :class:`PostgresBlobs` (``postgres``)
and :class:`MemoryBlobs` (``memory``: a real implementation for fast tests; the contract suite in
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
"""

from __future__ import annotations

from waystation.contrib.penguiflow.artifacts.memory import MemoryBlobs
from waystation.contrib.penguiflow.artifacts.port import (
    EXPIRE_BATCH,
    Blob,
    Blobs,
    WaystationArtifactStore,
)
from waystation.contrib.penguiflow.artifacts.postgres import PostgresBlobs, artifacts_table

__all__ = [
    "EXPIRE_BATCH",
    "Blob",
    "Blobs",
    "MemoryBlobs",
    "PostgresBlobs",
    "WaystationArtifactStore",
    "artifacts_table",
]
