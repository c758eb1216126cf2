"""PenguiFlow's artifact store on Waystation (``workers/contrib/penguiflow/artifacts/``), run
against every backend of its port.

:class:`ArtifactStoreContract` holds the suite; each backend subclasses it and provides the
``backend`` fixture (:class:`Backend`: stores over one backend, and what a test must do behind a
store's back: let time pass, tamper with bytes, look at rows). The PostgreSQL backend runs
against the real database of this test run (the ``database_url`` fixture of
``tests/conftest.py``), which the whole session shares: ids are content-addressed, so every
test stores content of its own (:func:`content`) in sessions, traces and tenants of its own, and
only ever looks at those. Artifacts without a session all share one bucket: the one test about
it clears that bucket first, and no other test puts any.

PenguiFlow is an optional extra: without it these tests skip locally and fail under CI
(``tests.support.require``).
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import importlib.util
import logging
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest
import pytest_asyncio
from alembic import command
from alembic.config import Config
from sqlalchemy import inspect, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from scripts.lab.harness.database import columns_migrated_and_declared, fresh_database_url
from waystation import migrations
from waystation.events import StoreUnavailable
from waystation.events.postgres import create_engine

from ..support import Capability, Services, eventually, require

INSTALLED = importlib.util.find_spec("penguiflow") is not None
PENGUIFLOW = Capability(
    "penguiflow (the optional extra: pip install penguiflow==3.11.0)",
    None if INSTALLED else "it is not installed",
)
if INSTALLED:  # else every test stops at require() before it needs these
    from penguiflow.artifacts import (
        ArtifactRetentionConfig,
        ArtifactScope,
        ArtifactStore,
        discover_artifact_store,
    )

    from waystation.contrib.penguiflow.artifacts import (
        Blob,
        MemoryBlobs,
        PostgresBlobs,
        WaystationArtifactStore,
        artifacts_table,
    )

MB = 1024 * 1024


@pytest.fixture(autouse=True)
def _penguiflow() -> None:
    require(PENGUIFLOW, "the PenguiFlow artifact store")


# ---- helpers -------------------------------------------------------------------------------------


def content(tag: str = "blob", size: int | None = None) -> bytes:
    """Bytes no other test stores (ids are content-addressed), ``size`` long when given."""
    unique = f"{tag}-{uuid.uuid4()}".encode()
    return unique if size is None else unique.ljust(size, b".")[:size]


def fresh_scope(**fields: str | None) -> ArtifactScope:
    """A session and a trace of this test's own, unless ``fields`` say otherwise."""
    scope = {"session_id": f"session-{uuid.uuid4()}", "trace_id": f"trace-{uuid.uuid4()}"}
    return ArtifactScope(**{**scope, **fields})


def ids(refs: Iterable[Any]) -> list[str]:
    return [ref.id for ref in refs]


class Backend(abc.ABC):
    """Stores over one backend of the port, and what tests do behind a store's back."""

    blobs: Any

    def store(self, **retention: Any) -> WaystationArtifactStore:
        """A store over this backend with these retention settings (defaults otherwise)."""
        return WaystationArtifactStore(
            self.blobs, ArtifactRetentionConfig(**retention), clock=self.clock
        )

    def clock(self) -> float:
        raise NotImplementedError

    @abc.abstractmethod
    async def let_expire(self, store: WaystationArtifactStore, artifact_id: str) -> None:
        """Return once the artifact (put through ``store``) has expired."""

    @abc.abstractmethod
    async def tamper(self, artifact_id: str, data: bytes) -> None:
        """Replace the artifact's bytes, keeping its stored SHA-256."""

    @abc.abstractmethod
    async def kept(self, artifact_id: str) -> bool:
        """Whether the artifact is still kept at all, expired or not."""

    @abc.abstractmethod
    async def clear_unscoped(self) -> None:
        """Forget every artifact of no session."""


class ArtifactStoreContract:
    """The suite; a backend's subclass provides ``backend``."""

    @pytest.fixture
    def backend(self) -> Backend:
        raise NotImplementedError("a backend's test class provides the backend")

    # ---- the protocol ----------------------------------------------------------------------------

    async def test_the_store_is_what_penguiflow_discovers_on_a_state_store(
        self, backend: Backend
    ) -> None:
        store = backend.store()

        class StateStore:
            artifact_store = store

        assert isinstance(store, ArtifactStore)
        assert discover_artifact_store(StateStore()) is store

    async def test_put_bytes_then_get_returns_the_bytes_and_a_complete_reference(
        self, backend: Backend
    ) -> None:
        store, data, scope = backend.store(), content("pdf"), fresh_scope(tenant_id="acme")
        ref = await store.put_bytes(
            data,
            mime_type="application/pdf",
            filename="report.pdf",
            namespace="pdf_tool",
            scope=scope,
            meta={"tool": "pdf_tool", "pages": [1, 2], "preview": None},
        )
        sha = hashlib.sha256(data).hexdigest()
        assert ref.id == f"pdf_tool_{sha[:12]}"
        assert (ref.size_bytes, ref.sha256) == (len(data), sha)
        assert (ref.mime_type, ref.filename, ref.namespace) == (
            "application/pdf",
            "report.pdf",
            "pdf_tool",
        )
        assert ref.scope == scope
        assert ref.source == {"tool": "pdf_tool", "pages": [1, 2], "preview": None}
        assert await store.get(ref.id) == data
        assert await store.get_ref(ref.id) == ref
        assert await store.exists(ref.id)
        assert ids(await store.list(scope=scope)) == [ref.id]

    async def test_put_text_stores_utf8_as_text_plain_unless_told(self, backend: Backend) -> None:
        store, scope = backend.store(), fresh_scope()
        text_ = f"héllo wörld ✓ {uuid.uuid4()}"
        ref = await store.put_text(text_, scope=scope)
        assert ref.mime_type == "text/plain"
        assert ref.size_bytes == len(text_.encode("utf-8"))
        assert ref.id.startswith("art_")
        assert await store.get(ref.id) == text_.encode("utf-8")
        markdown = await store.put_text(text_ + "!", mime_type="text/markdown", scope=scope)
        assert (await store.get_ref(markdown.id)).mime_type == "text/markdown"

    async def test_ids_are_content_addressed_so_a_repeated_put_is_idempotent(
        self, backend: Backend
    ) -> None:
        store, data, scope = backend.store(), content(), fresh_scope()
        first = await store.put_bytes(data, filename="a.bin", scope=scope, meta={"n": 1})
        again = await store.put_bytes(data, filename="b.bin", scope=scope, meta={"n": 2})
        assert again == first, "the reference kept the first time comes back"
        assert ids(await store.list(scope=scope)) == [first.id]
        elsewhere = await store.put_bytes(data, namespace="other", scope=scope)
        assert elsewhere.id != first.id
        assert ids(await store.list(scope=scope)) == [first.id, elsewhere.id]

    async def test_a_namespace_is_sanitised_in_the_id_and_kept_as_given(
        self, backend: Backend
    ) -> None:
        store, data = backend.store(), content()
        ref = await store.put_bytes(data, namespace="mcp:files/v1", scope=fresh_scope())
        assert ref.id == f"mcp_files_v1_{hashlib.sha256(data).hexdigest()[:12]}"
        assert ref.namespace == "mcp:files/v1"

    async def test_an_unknown_id_is_missing_for_every_method(self, backend: Backend) -> None:
        store, unknown = backend.store(), f"art_{uuid.uuid4().hex[:12]}"
        assert await store.get(unknown) is None
        assert await store.get_ref(unknown) is None
        assert not await store.exists(unknown)
        assert not await store.delete(unknown)

    async def test_delete_removes_the_artifact_and_says_whether_it_was_there(
        self, backend: Backend
    ) -> None:
        store, scope = backend.store(), fresh_scope()
        kept = await store.put_bytes(content("kept"), scope=scope)
        gone = await store.put_bytes(content("gone"), scope=scope)
        assert await store.delete(gone.id)
        assert not await store.delete(gone.id)
        assert await store.get(gone.id) is None
        assert await store.get_ref(gone.id) is None
        assert not await store.exists(gone.id)
        assert not await backend.kept(gone.id)
        assert ids(await store.list(scope=scope)) == [kept.id]

    async def test_what_a_caller_mutates_does_not_alter_what_is_kept(
        self, backend: Backend
    ) -> None:
        store, scope = backend.store(), fresh_scope()
        ref = await store.put_bytes(content(), scope=scope, meta={"tags": ["a"]})
        ref.source["tags"].append("b")
        ref.scope.session_id = "someone-else"
        ref.filename = "changed"
        for read in (await store.get_ref(ref.id), *(await store.list(scope=scope))):
            assert read.source == {"tags": ["a"]}
            assert read.scope == scope
            assert read.filename is None

    async def test_a_large_artifact_round_trips_byte_for_byte(self, backend: Backend) -> None:
        store = backend.store()
        data = content("large", 50 * MB)  # the default max_artifact_bytes, exactly
        ref = await store.put_bytes(data, scope=fresh_scope())
        assert ref.size_bytes == 50 * MB
        assert await store.get(ref.id) == data

    # ---- what is refused -------------------------------------------------------------------------

    async def test_content_above_max_artifact_bytes_is_refused_and_not_stored(
        self, backend: Backend
    ) -> None:
        store, scope = backend.store(max_artifact_bytes=64), fresh_scope()
        with pytest.raises(ValueError, match=r"Artifact size \(65 bytes\) exceeds limit"):
            await store.put_bytes(content(size=65), scope=scope)
        with pytest.raises(ValueError, match="exceeds limit"):
            await store.put_text("é" * 33, scope=scope)  # 66 bytes in UTF-8
        assert await store.list(scope=scope) == []
        exactly = await store.put_bytes(content(size=64), scope=scope)
        assert await store.exists(exactly.id)

    @pytest.mark.parametrize(
        "meta",
        [{"text": "nul\x00"}, {"numbers": {1, 2}}, {"nan": float("nan")}],
        ids=["nul", "set", "nan"],
    )
    async def test_metadata_jsonb_cannot_hold_is_refused_and_not_stored(
        self, backend: Backend, meta: dict[str, Any]
    ) -> None:
        store, scope = backend.store(), fresh_scope()
        with pytest.raises(ValueError, match="metadata cannot be stored"):
            await store.put_bytes(content(), scope=scope, meta=meta)
        with pytest.raises(ValueError, match="metadata cannot be stored"):
            await store.put_bytes(content(), scope=scope, filename="a\x00b")
        assert await store.list(scope=scope) == []

    async def test_bytes_that_do_not_match_their_sha256_are_not_returned_and_logged(
        self, backend: Backend, caplog: pytest.LogCaptureFixture
    ) -> None:
        store, scope = backend.store(), fresh_scope()
        ref = await store.put_bytes(content("honest"), scope=scope)
        await backend.tamper(ref.id, content("forged"))
        with caplog.at_level(logging.ERROR, logger="waystation.contrib.penguiflow.artifacts.port"):
            assert await store.get(ref.id) is None
        assert f"artifact {ref.id}: its bytes do not match their SHA-256" in caplog.text
        assert await store.get_ref(ref.id) == ref, "the reference itself is intact"

    # ---- expiry ----------------------------------------------------------------------------------

    async def test_an_expired_artifact_is_gone_for_every_method(self, backend: Backend) -> None:
        store, scope = backend.store(ttl_seconds=1), fresh_scope()
        ref = await store.put_bytes(content(), scope=scope)
        await backend.let_expire(store, ref.id)
        assert await store.get(ref.id) is None
        assert await store.get_ref(ref.id) is None
        assert not await store.exists(ref.id)
        assert await store.list(scope=scope) == []
        assert not await store.delete(ref.id), "an expired artifact was not there to delete"
        assert not await backend.kept(ref.id), "but delete removed it all the same"

    async def test_the_same_content_put_after_expiry_is_stored_anew(self, backend: Backend) -> None:
        store, data, scope = backend.store(ttl_seconds=1), content(), fresh_scope()
        first = await store.put_bytes(data, filename="old.bin", scope=scope)
        await backend.let_expire(store, first.id)
        again = await store.put_bytes(data, filename="new.bin", scope=scope)
        assert again.id == first.id
        assert again.filename == "new.bin"
        assert await store.get(again.id) == data

    async def test_purge_expired_deletes_expired_artifacts_only(self, backend: Backend) -> None:
        short, long = backend.store(ttl_seconds=1), backend.store(ttl_seconds=3600)
        scope = fresh_scope()
        live = await long.put_bytes(content("long"), scope=scope)
        expired = await short.put_bytes(content("short"), scope=scope)
        await backend.let_expire(short, expired.id)
        assert await backend.kept(expired.id), "kept until purged (or a later put purges it)"
        assert await long.purge_expired() >= 1
        assert not await backend.kept(expired.id)
        assert await long.get(live.id) is not None

    # ---- limits and eviction ---------------------------------------------------------------------

    async def test_lru_evicts_the_least_recently_used_when_a_session_is_full(
        self, backend: Backend
    ) -> None:
        store, scope = backend.store(max_artifacts_per_session=3), fresh_scope()
        a, b, c = [await store.put_bytes(content(n), scope=scope) for n in "abc"]
        assert await store.get(a.id) is not None  # a use: b is now the least recently used
        d = await store.put_bytes(content("d"), scope=scope)
        assert ids(await store.list(scope=scope)) == [a.id, c.id, d.id]
        assert not await store.exists(b.id)

    async def test_a_repeated_put_is_a_use_and_reading_the_reference_is_not(
        self, backend: Backend
    ) -> None:
        store, scope = backend.store(max_artifacts_per_session=3), fresh_scope()
        data = content("a")
        a, b, c = [await store.put_bytes(d, scope=scope) for d in (data, content(), content())]
        await store.put_bytes(data, scope=scope)  # a used again: b is the oldest use
        for look in (store.get_ref, store.exists):
            await look(b.id)
        await store.list(scope=scope)
        d = await store.put_bytes(content("d"), scope=scope)
        assert ids(await store.list(scope=scope)) == [a.id, c.id, d.id]

    async def test_fifo_evicts_the_first_put_whatever_was_used(self, backend: Backend) -> None:
        store = backend.store(max_artifacts_per_session=3, cleanup_strategy="fifo")
        scope = fresh_scope()
        a, b, c = [await store.put_bytes(content(n), scope=scope) for n in "abc"]
        assert await store.get(a.id) is not None
        d = await store.put_bytes(content("d"), scope=scope)
        assert ids(await store.list(scope=scope)) == [b.id, c.id, d.id]

    async def test_strategy_none_evicts_nothing(self, backend: Backend) -> None:
        store = backend.store(
            max_artifacts_per_session=2, max_session_bytes=10, cleanup_strategy="none"
        )
        scope = fresh_scope()
        refs = [await store.put_bytes(content(n, 8), scope=scope) for n in "abcd"]
        assert ids(await store.list(scope=scope)) == ids(refs)

    async def test_a_session_over_its_bytes_evicts_until_the_new_artifact_fits(
        self, backend: Backend
    ) -> None:
        store, scope = backend.store(max_session_bytes=100), fresh_scope()
        a, b, c = [await store.put_bytes(content(n, 40), scope=scope) for n in "abc"]
        assert ids(await store.list(scope=scope)) == [b.id, c.id]  # 120 would not fit
        small = await store.put_bytes(content("s", 20), scope=scope)
        assert ids(await store.list(scope=scope)) == [b.id, c.id, small.id]  # exactly 100
        huge = await store.put_bytes(content("h", 150), scope=scope)
        assert ids(await store.list(scope=scope)) == [huge.id], "alone, but stored"
        assert not await store.exists(a.id)

    async def test_a_trace_has_limits_of_its_own_within_its_session(self, backend: Backend) -> None:
        store = backend.store(max_artifacts_per_trace=2, max_trace_bytes=100)
        session = fresh_scope().session_id
        one, two = fresh_scope(session_id=session), fresh_scope(session_id=session)
        a, b = [await store.put_bytes(content(n), scope=one) for n in "ab"]
        other = await store.put_bytes(content("other"), scope=two)
        c = await store.put_bytes(content("c"), scope=one)
        assert ids(await store.list(scope=ArtifactScope(session_id=session))) == [
            b.id,
            other.id,
            c.id,
        ]
        assert not await store.exists(a.id)
        big = await store.put_bytes(content("big", 90), scope=one)
        assert ids(await store.list(scope=one)) == [big.id]  # 90 + either of b, c > 100
        assert await store.exists(other.id)

    async def test_sessions_are_limited_separately(self, backend: Backend) -> None:
        store = backend.store(max_artifacts_per_session=2)
        first, second = fresh_scope(), fresh_scope()
        kept = [await store.put_bytes(content(n), scope=first) for n in "ab"]
        refs = [await store.put_bytes(content(n), scope=second) for n in "cde"]
        assert ids(await store.list(scope=first)) == ids(kept)
        assert ids(await store.list(scope=second)) == ids(refs[1:])

    async def test_artifacts_of_no_session_share_one_bucket(self, backend: Backend) -> None:
        await backend.clear_unscoped()
        store = backend.store(max_artifacts_per_session=2)
        unscoped = await store.put_bytes(content("unscoped"))
        traced = await store.put_bytes(content("traced"), scope=ArtifactScope(trace_id="t"))
        third = await store.put_bytes(content("third"), scope=ArtifactScope(tenant_id="x"))
        assert not await store.exists(unscoped.id)
        assert await store.exists(traced.id)
        assert await store.exists(third.id)
        await backend.clear_unscoped()

    async def test_expired_artifacts_do_not_count_against_a_limit(self, backend: Backend) -> None:
        short = backend.store(ttl_seconds=1, max_artifacts_per_session=2)
        scope = fresh_scope()
        old = await short.put_bytes(content("old"), scope=scope)
        await backend.let_expire(short, old.id)
        long = backend.store(ttl_seconds=3600, max_artifacts_per_session=2)
        a, b = [await long.put_bytes(content(n), scope=scope) for n in "ab"]
        assert ids(await long.list(scope=scope)) == [a.id, b.id]

    async def test_concurrent_puts_into_one_session_stay_within_its_limits(
        self, backend: Backend
    ) -> None:
        store = backend.store(max_artifacts_per_session=5, max_trace_bytes=10 * 64)
        first = fresh_scope()
        session = ArtifactScope(session_id=first.session_id)
        await asyncio.gather(
            *(store.put_bytes(content(str(n), 64), scope=first) for n in range(20))
        )
        assert len(await store.list(scope=session)) == 5
        second = fresh_scope(session_id=first.session_id)
        await asyncio.gather(
            *(store.put_bytes(content(str(n), 64), scope=second) for n in range(5))
        )
        assert len(await store.list(scope=session)) == 5
        assert len(await store.list(scope=second)) == 5, "the older trace's were the oldest"

    # ---- scope -----------------------------------------------------------------------------------

    async def test_list_filters_on_every_scope_field_it_is_given(self, backend: Backend) -> None:
        store = backend.store()
        tenant, other_tenant = f"tenant-{uuid.uuid4()}", f"tenant-{uuid.uuid4()}"
        session = fresh_scope().session_id
        alice = fresh_scope(tenant_id=tenant, user_id="alice", session_id=session)
        bob = fresh_scope(tenant_id=tenant, user_id="bob", session_id=session)
        stranger = fresh_scope(tenant_id=other_tenant, user_id="alice")
        a, b, s = [
            await store.put_bytes(content(), scope=scope) for scope in (alice, bob, stranger)
        ]
        nobody = await store.put_bytes(content("no scope"))
        mine = {a.id, b.id, s.id, nobody.id}
        try:

            async def listed(**fields: str) -> list[str]:
                return [
                    i for i in ids(await store.list(scope=ArtifactScope(**fields))) if i in mine
                ]

            assert await listed(session_id=session) == [a.id, b.id]
            assert await listed(tenant_id=tenant) == [a.id, b.id]
            assert await listed(tenant_id=tenant, user_id="alice") == [a.id]
            assert await listed(user_id="alice", tenant_id=other_tenant) == [s.id]
            assert await listed(trace_id=bob.trace_id) == [b.id]
            assert await listed(session_id=session, trace_id=stranger.trace_id) == []
            assert await listed() == [a.id, b.id, s.id, nobody.id], "no field: every artifact"
            everything = [i for i in ids(await store.list()) if i in mine]
            assert everything == [a.id, b.id, s.id, nobody.id]
        finally:
            await store.delete(nobody.id)  # no session: keep the shared bucket empty


# ---- in memory -----------------------------------------------------------------------------------


class MemoryBackend(Backend):
    def __init__(self) -> None:
        self.blobs = MemoryBlobs()
        self.now = 1_700_000_000.0

    def clock(self) -> float:
        return self.now

    async def let_expire(self, store: WaystationArtifactStore, artifact_id: str) -> None:
        self.now += store.retention.ttl_seconds + 1

    async def tamper(self, artifact_id: str, data: bytes) -> None:
        kept = self.blobs._kept[artifact_id]
        kept.blob = Blob(kept.blob.ref, data)

    async def kept(self, artifact_id: str) -> bool:
        return artifact_id in self.blobs._kept

    async def clear_unscoped(self) -> None:
        for key, kept in list(self.blobs._kept.items()):
            if kept.blob.ref.scope is None or kept.blob.ref.scope.session_id is None:
                del self.blobs._kept[key]


class TestMemoryBlobs(ArtifactStoreContract):
    @pytest.fixture
    def backend(self) -> Backend:
        return MemoryBackend()

    async def test_expiry_follows_the_stores_clock_to_the_second(self) -> None:
        backend = MemoryBackend()
        store = backend.store(ttl_seconds=10)
        ref = await store.put_bytes(content())
        backend.now += 10
        assert await store.exists(ref.id), "alive for ttl_seconds, as in the reference"
        backend.now += 0.001
        assert not await store.exists(ref.id)

    async def test_a_ttl_of_zero_never_expires(self) -> None:
        backend = MemoryBackend()
        store = backend.store(ttl_seconds=0)
        ref = await store.put_bytes(content())
        backend.now += 100 * 365 * 86400
        assert await store.get(ref.id) is not None
        assert await store.purge_expired() == 0


# ---- PostgreSQL ----------------------------------------------------------------------------------


class PostgresBackend(Backend):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.blobs = PostgresBlobs(engine)

    def clock(self) -> float:
        return 0.0  # 1970: PostgreSQL goes by its own clock, never by this one

    async def let_expire(self, store: WaystationArtifactStore, artifact_id: str) -> None:
        async def expired() -> bool:
            return not await store.exists(artifact_id)

        ttl = store.retention.ttl_seconds
        await eventually(expired, ttl + 30, f"artifact {artifact_id} to expire")

    async def tamper(self, artifact_id: str, data: bytes) -> None:
        async with self.engine.begin() as connection:
            await connection.execute(
                text("UPDATE penguiflow_artifacts SET data = :data WHERE artifact_id = :id"),
                {"data": data, "id": artifact_id},
            )

    async def kept(self, artifact_id: str) -> bool:
        async with self.engine.connect() as connection:
            found = await connection.scalar(
                text("SELECT count(*) FROM penguiflow_artifacts WHERE artifact_id = :id"),
                {"id": artifact_id},
            )
        return bool(found)

    async def clear_unscoped(self) -> None:
        async with self.engine.begin() as connection:
            await connection.execute(
                text("DELETE FROM penguiflow_artifacts WHERE session_id IS NULL")
            )


class TestPostgresBlobs(ArtifactStoreContract):
    @pytest_asyncio.fixture
    async def engine(self, database_url: str) -> AsyncIterator[AsyncEngine]:
        """The event log's own engine (autocommit), as the StateStore adapter shares it."""
        engine = create_engine(database_url, pool_size=5)
        yield engine
        await engine.dispose()

    @pytest.fixture
    def backend(self, engine: AsyncEngine) -> Backend:
        return PostgresBackend(engine)

    async def test_expiry_goes_by_the_database_clock_not_the_workers(
        self, engine: AsyncEngine
    ) -> None:
        retention = ArtifactRetentionConfig(ttl_seconds=3600)
        scope = fresh_scope()
        for worker_clock in (0.0, 4_000_000_000.0):  # 1970, 2096
            store = WaystationArtifactStore(
                PostgresBlobs(engine), retention, clock=lambda at=worker_clock: at
            )
            ref = await store.put_bytes(content(), scope=scope)
            assert await store.get(ref.id) is not None
        async with engine.connect() as connection:
            lifetimes = (
                await connection.execute(
                    text(
                        "SELECT extract(epoch FROM expires_at - created_at) "
                        "FROM penguiflow_artifacts WHERE session_id = :session"
                    ),
                    {"session": scope.session_id},
                )
            ).scalars()
            assert [float(seconds) for seconds in lifetimes] == [3600.0, 3600.0]

    async def test_a_put_leaves_the_shared_engine_in_autocommit(self, database_url: str) -> None:
        """The event log's statements on the same pooled connection must still commit alone."""
        engine = create_engine(database_url, pool_size=1)
        try:
            store = WaystationArtifactStore(PostgresBlobs(engine))
            await store.put_bytes(content(), scope=fresh_scope())
            async with engine.connect() as connection:
                await connection.execute(text("SELECT 1"))
                raw = await connection.get_raw_connection()
                assert raw.driver_connection is not None
                assert not raw.driver_connection.is_in_transaction()
        finally:
            await engine.dispose()

    async def test_a_transactional_engine_works_as_well(self, database_url: str) -> None:
        engine = create_async_engine(database_url)
        try:
            store = WaystationArtifactStore(
                PostgresBlobs(engine), ArtifactRetentionConfig(max_artifacts_per_session=1)
            )
            scope = fresh_scope()
            first = await store.put_bytes(content(), scope=scope)
            second = await store.put_bytes(content(), scope=scope)
            assert ids(await store.list(scope=scope)) == [second.id]
            assert await store.get(second.id) is not None
            assert await store.delete(second.id)
            assert not await store.exists(first.id)
        finally:
            await engine.dispose()

    async def test_an_unreachable_database_is_store_unavailable(self) -> None:
        engine = create_async_engine("postgresql+asyncpg://postgres@127.0.0.1:1/nowhere")
        try:
            store = WaystationArtifactStore(PostgresBlobs(engine))
            with pytest.raises(StoreUnavailable):
                await store.put_bytes(content())
            with pytest.raises(StoreUnavailable):
                await store.get("art_000000000000")
            with pytest.raises(StoreUnavailable):
                await store.list()
        finally:
            await engine.dispose()

    async def test_the_table_definition_matches_the_migration(self, engine: AsyncEngine) -> None:
        migrated, declared = await columns_migrated_and_declared(engine, artifacts_table)
        assert migrated == declared
        async with engine.connect() as connection:
            indexes = await connection.run_sync(
                lambda sync: inspect(sync).get_indexes("penguiflow_artifacts")
            )
        assert sorted(tuple(index["column_names"]) for index in indexes) == [
            ("expires_at",),
            ("session_id",),
            ("trace_id",),
        ]

    async def test_the_migration_downgrades_to_0004_and_upgrades_again(
        self, services: Services
    ) -> None:
        url = fresh_database_url(services.admin_database_url)
        config = Config()
        config.set_main_option("script_location", migrations.SCRIPT_LOCATION)
        config.attributes["database_url"] = url

        async def table() -> str | None:
            engine = create_async_engine(url)
            try:
                async with engine.connect() as connection:
                    return await connection.scalar(
                        text("SELECT CAST(to_regclass('penguiflow_artifacts') AS text)")
                    )
            finally:
                await engine.dispose()

        await migrations.upgrade(url)
        try:
            assert await table() == "penguiflow_artifacts"
            await asyncio.to_thread(command.downgrade, config, "0004")
            assert await table() is None
            await migrations.upgrade(url)
            assert await table() == "penguiflow_artifacts"
        finally:
            await migrations.drop_database(url)
