"""What the PostgreSQL store raises when the database fails, for real errors of the real server.

A transient failure (the pool has no free connection, too many connections, a cancelled
statement, a deadlock, a serialization failure, a server shutting down or refusing connections)
must come out as ``StoreUnavailable``, which the worker retries in place without using up the
message's delivery limit; only a real breach of the log's rules is an ``IntegrityError``.
Each test provokes the error for real and checks its SQLSTATE first, so it proves the class of
error it names. Where the store's own statements can run into the error, it goes through the
store's methods; otherwise the real exception is handed to the store's translation.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import sqlalchemy.exc
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from scripts.lab.harness.database import PostgresCluster
from waystation.events import (
    GENESIS_HASH,
    IntegrityError,
    NewEvent,
    StoreUnavailable,
    VersionConflict,
)
from waystation.events.postgres import PostgresEventStore, translate_error

from ..support import eventually, serving_cluster

pytestmark = pytest.mark.integration


def sqlstate_of(error: BaseException | None) -> str | None:
    """The SQLSTATE the server sent, wherever the driver layers put it."""
    while error is not None:
        for layer in (error, getattr(error, "orig", None)):
            code = getattr(layer, "sqlstate", None)
            if isinstance(code, str):
                return code
        error = error.__cause__
    return None


def probe(n: int, **data: Any) -> NewEvent:
    return NewEvent(uuid.uuid4(), "Probe", {"n": n, **data}, {"worker_id": "errors"})


def store_engine(url: str, **server_settings: str) -> AsyncEngine:
    """An engine like the store's own (``waystation.events.postgres.create_engine``) with session
    settings."""
    return create_async_engine(
        url,
        isolation_level="AUTOCOMMIT",
        pool_size=2,
        max_overflow=0,
        pool_reset_on_return=None,
        connect_args={"server_settings": server_settings},
    )


@contextlib.asynccontextmanager
async def uncommitted_event(
    url: str, stream_id: str, version: int, **settings: str
) -> AsyncIterator[AsyncConnection]:
    """A transaction holding an uncommitted event at ``stream_id`` v``version``: an append of
    that version waits for it. Rolled back at the end."""
    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            for name, value in settings.items():
                await connection.execute(text(f"SET {name} = '{value}'"))
            await connection.execute(
                text(
                    """
                    INSERT INTO events (stream_id, stream_version, event_id, event_type, data,
                                        metadata, prev_hash, hash)
                    VALUES (:stream, :version, :event_id, 'Blocker', '{}', '{}', '', '')
                    """
                ),
                {"stream": stream_id, "version": version, "event_id": uuid.uuid4()},
            )
            try:
                yield connection
            finally:
                await connection.rollback()
    finally:
        await engine.dispose()


async def waiting_for_a_lock(engine: AsyncEngine, statement_marker: str) -> bool:
    """Whether a session of this database runs a statement containing ``statement_marker`` and
    waits for a lock."""
    async with engine.connect() as connection:
        found = await connection.scalar(
            text(
                """
                SELECT count(*) FROM pg_stat_activity
                WHERE datname = current_database() AND pid <> pg_backend_pid()
                  AND wait_event_type = 'Lock' AND strpos(query, :marker) > 0
                """
            ),
            {"marker": statement_marker},
        )
    return bool(found)


async def unavailable_on_read(url: str) -> StoreUnavailable:
    """What a new store of ``url`` raises on its first read, which must be StoreUnavailable."""
    store = PostgresEventStore.from_url(url)
    try:
        with pytest.raises(StoreUnavailable) as raised:
            await store.read_stream("unavailable")
    finally:
        await store.close()
    return raised.value


# ---- transient: StoreUnavailable -----------------------------------------------------------------


async def test_a_pool_checkout_timeout_is_store_unavailable(database_url: str) -> None:
    """Both pools: SQLAlchemy's (the rest) and asyncpg's (the hot path), each with its one
    connection held, make the next statement wait pool_timeout and then StoreUnavailable."""
    engine = create_async_engine(
        database_url, isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0, pool_timeout=0.2
    )
    store = PostgresEventStore(engine, owns_engine=True, hot_pool_size=1)
    try:
        async with engine.connect():  # SQLAlchemy's only connection, held
            with pytest.raises(StoreUnavailable) as raised:
                await store.outbox_size()
            assert isinstance(raised.value.__cause__, sqlalchemy.exc.TimeoutError)
            with pytest.raises(StoreUnavailable):  # a first hot connection is opened by it
                await store.read_stream("pool-timeout")
        async with store._hot_connection():  # the hot path's only connection, held
            with pytest.raises(StoreUnavailable) as raised:
                await store.read_stream("pool-timeout")
            assert "no database connection free within 0.2 s" in str(raised.value)
            with pytest.raises(StoreUnavailable):
                await store.append("pool-timeout", 0, [probe(1)], prev_hash=GENESIS_HASH)
            assert await store.outbox_size() == 0  # the other pool still serves
        assert await store.read_stream("pool-timeout") == []  # both pools work again
    finally:
        await store.close()


async def test_a_hot_connection_is_reused_after_a_server_error_not_after_a_cancel(
    database_url: str,
) -> None:
    """A statement PostgreSQL refused, or one whose answer was a version conflict, completed its
    round trip: its connection is reused. One
    cancelled while the server runs it is not (its protocol waits for the cancel): it is
    terminated, its place freed, and the next statement opens another."""
    stream = f"hot-reuse-{uuid.uuid4()}"
    store = PostgresEventStore.from_url(database_url, pool_size=4)
    try:
        assert await store.read_stream(stream) == []
        (connection,) = store._hot._idle
        with pytest.raises(IntegrityError):
            await store._fetch("SELECT 1 / 0")  # 22012, from the server
        assert store._hot._idle == [connection] and not connection.is_closed()
        await store.append(stream, 0, [probe(1)], prev_hash=GENESIS_HASH)
        with pytest.raises(VersionConflict):  # raised on the statement's answer
            await store.append(stream, 0, [probe(2)], prev_hash=GENESIS_HASH)
        assert store._hot._idle == [connection] and not connection.is_closed()

        marker = f"hot-cancel-{uuid.uuid4().hex}"
        sleeping = asyncio.ensure_future(store._fetch(f"SELECT pg_sleep(600), '{marker}'"))
        async with store.engine.connect() as watcher:

            async def running() -> bool:
                found = await watcher.scalar(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE state = 'active' AND strpos(query, :marker) > 0 "
                        "AND pid <> pg_backend_pid()"
                    ),
                    {"marker": marker},
                )
                return bool(found)

            await eventually(running, 60, "the statement running on the server")
        sleeping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sleeping
        assert connection.is_closed() and store._hot.opened == 0
        assert len(await store.read_stream(stream)) == 1
        assert store._hot.opened == 1 and store._hot._idle != [connection]
    finally:
        await store.close()


async def test_too_many_connections_is_store_unavailable(database_url: str) -> None:
    """SQLSTATE 53300, here from a role's connection limit (a full server gives the same)."""
    role = f"wst_limited_{uuid.uuid4().hex[:8]}"
    admin = create_async_engine(database_url, isolation_level="AUTOCOMMIT")
    url = make_url(database_url).set(username=role)
    try:
        async with admin.connect() as connection:
            await connection.execute(text(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 1"))
        held = await asyncpg.connect(user=role, **_asyncpg_address(database_url))
        try:
            raised = await unavailable_on_read(url.render_as_string(hide_password=False))
            assert sqlstate_of(raised.__cause__) == "53300"
            # the driver's own exception, raised at connect time
            with pytest.raises(asyncpg.TooManyConnectionsError) as refused:
                await asyncpg.connect(user=role, **_asyncpg_address(database_url))
            assert isinstance(translate_error(refused.value), StoreUnavailable)
        finally:
            await held.close()
    finally:
        async with admin.connect() as connection:
            await connection.execute(text(f"DROP ROLE IF EXISTS {role}"))
        await admin.dispose()


async def test_a_cancelled_statement_is_store_unavailable(database_url: str) -> None:
    """SQLSTATE 57014: an append waiting on another transaction's row past statement_timeout."""
    stream = f"cancelled-{uuid.uuid4()}"
    store = PostgresEventStore(
        store_engine(database_url, statement_timeout="300"), owns_engine=True
    )
    try:
        async with uncommitted_event(database_url, stream, 1):
            with pytest.raises(StoreUnavailable) as raised:
                await store.append(stream, 0, [probe(1)], prev_hash=GENESIS_HASH)
            assert sqlstate_of(raised.value.__cause__) == "57014"
        assert await store.read_stream(stream) == []
    finally:
        await store.close()


async def test_a_deadlock_is_store_unavailable(database_url: str) -> None:
    """SQLSTATE 40P01: an append and another transaction each wait for the other's row.

    The append takes v1, then waits for the other transaction's uncommitted v2; the other then
    waits for v1. Whoever's deadlock check runs first is the one PostgreSQL aborts: the append's
    session checks after 3 s of waiting, the other's after a minute, so the append is the victim
    provided the other starts waiting within those 3 s (one round trip after we see the append
    wait).
    """
    stream = f"deadlock-{uuid.uuid4()}"
    engine = store_engine(database_url, deadlock_timeout="3s")
    store = PostgresEventStore(engine, owns_engine=True)
    watcher = create_async_engine(database_url)
    try:
        async with uncommitted_event(database_url, stream, 2, deadlock_timeout="60s") as other:
            append = asyncio.create_task(
                store.append(stream, 0, [probe(1), probe(2)], prev_hash=GENESIS_HASH)
            )
            await eventually(
                lambda: append.done() or waiting_for_a_lock(watcher, "head_ok"),
                within=30,
                what="the append to wait for the uncommitted v2",
            )
            closing_the_cycle = asyncio.create_task(
                other.execute(
                    text(
                        """
                        INSERT INTO events (stream_id, stream_version, event_id, event_type,
                                            data, metadata, prev_hash, hash)
                        VALUES (:stream, 1, :event_id, 'Blocker', '{}', '{}', '', '')
                        """
                    ),
                    {"stream": stream, "event_id": uuid.uuid4()},
                )
            )
            try:
                with pytest.raises(StoreUnavailable) as raised:
                    await append
            finally:
                # the other's insert goes on once the append's transaction has ended
                await asyncio.gather(closing_the_cycle, return_exceptions=True)
            assert sqlstate_of(raised.value.__cause__) == "40P01"
            assert closing_the_cycle.exception() is None  # the append rolled back: v1 was free
        assert await store.read_stream(stream) == []
    finally:
        await store.close()
        await watcher.dispose()


async def test_a_serialization_failure_is_store_unavailable(database_url: str) -> None:
    """SQLSTATE 40001: two serializable transactions that each read what the other writes.

    The store's own statements run at read committed, so this comes from two transactions of
    their own; the error they produce is handed to the store's translation.
    """
    table = f"on_call_{uuid.uuid4().hex[:8]}"
    engine = create_async_engine(database_url, isolation_level="SERIALIZABLE")
    admin = create_async_engine(database_url, isolation_level="AUTOCOMMIT")
    async with admin.connect() as connection:
        await connection.execute(text(f"CREATE TABLE {table} (id int PRIMARY KEY, on_call bool)"))
        await connection.execute(text(f"INSERT INTO {table} VALUES (1, true), (2, true)"))
    try:
        async with engine.connect() as first, engine.connect() as second:
            for connection in (first, second):
                await connection.execute(text(f"SELECT count(*) FROM {table} WHERE on_call"))
            await first.execute(text(f"UPDATE {table} SET on_call = false WHERE id = 1"))
            await second.execute(text(f"UPDATE {table} SET on_call = false WHERE id = 2"))
            await first.commit()
            with pytest.raises(sqlalchemy.exc.DBAPIError) as failed:
                await second.commit()
        assert sqlstate_of(failed.value) == "40001"
        assert isinstance(translate_error(failed.value), StoreUnavailable)
    finally:
        async with admin.connect() as connection:
            await connection.execute(text(f"DROP TABLE {table}"))
        await admin.dispose()
        await engine.dispose()


async def test_a_refused_connection_is_store_unavailable(database_url: str) -> None:
    closed = make_url(database_url).set(host="127.0.0.1", port=_closed_port())
    raised = await unavailable_on_read(closed.render_as_string(hide_password=False))
    assert isinstance(raised.__cause__, OSError)
    with pytest.raises(OSError) as refused:
        await asyncpg.connect(host="127.0.0.1", port=closed.port, user="postgres")
    assert isinstance(translate_error(refused.value), StoreUnavailable)


@pytest.mark.timeout(180)
async def test_a_server_that_cannot_accept_connections_now_is_store_unavailable(
    database_url: str,
) -> None:
    """SQLSTATE 57P03 ("the database system is shutting down"), from a scratch cluster in a smart
    shutdown: it waits for its last session to end and refuses new ones meanwhile."""
    home = serving_cluster(database_url, "a scratch cluster in a smart shutdown")
    async with PostgresCluster.scratch(home.version) as cluster:
        url = cluster.url("postgres")
        address = _asyncpg_address(url)
        last_session = await asyncpg.connect(user="postgres", **address)
        stopping = await asyncio.create_subprocess_exec(
            "pg_ctlcluster", "--skip-systemctl-redirect", cluster.version, cluster.name, "stop",
            "--mode", "smart",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            refusal: list[Exception] = []

            async def refused() -> bool:
                try:
                    await (await asyncpg.connect(user="postgres", **address)).close()
                except asyncpg.CannotConnectNowError as error:
                    refusal.append(error)
                    return True
                return False

            await eventually(refused, within=60, what="the cluster to refuse new sessions")
            assert isinstance(translate_error(refusal[0]), StoreUnavailable)
            raised = await unavailable_on_read(url)
            assert sqlstate_of(raised.__cause__) == "57P03"
        finally:
            await last_session.close()
            await stopping.wait()


# ---- permanent: IntegrityError -------------------------------------------------------------------


async def test_breaches_of_the_log_s_rules_stay_integrity_errors(
    store: PostgresEventStore, database_url: str
) -> None:
    # data jsonb cannot hold (22P05): retrying would fail the same way forever
    with pytest.raises(IntegrityError) as raised:
        await store.append(
            f"nul-{uuid.uuid4()}", 0, [probe(1, text="a\u0000b")], prev_hash=GENESIS_HASH
        )
    assert sqlstate_of(raised.value.__cause__) == "22P05"
    # a stream id longer than an index row allows (54000)
    with pytest.raises(IntegrityError) as raised:
        await store.append(
            "long-" + "".join(uuid.uuid4().hex for _ in range(300)),
            0,
            [probe(1)],
            prev_hash=GENESIS_HASH,
        )
    assert sqlstate_of(raised.value.__cause__) == "54000"
    # the append-only guard (23001), as a direct UPDATE meets it
    stream = f"guarded-{uuid.uuid4()}"
    await store.append(stream, 0, [probe(1)], prev_hash=GENESIS_HASH)
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as connection:
            with pytest.raises(sqlalchemy.exc.DBAPIError) as refused:
                await connection.execute(
                    text("UPDATE events SET event_type = 'Changed' WHERE stream_id = :stream"),
                    {"stream": stream},
                )
            await connection.rollback()
    finally:
        await engine.dispose()
    assert sqlstate_of(refused.value) == "23001"
    assert isinstance(translate_error(refused.value), IntegrityError)


# ---- helpers -------------------------------------------------------------------------------------


def _asyncpg_address(url: str) -> dict[str, Any]:
    parsed = make_url(url)
    return {
        "host": parsed.host or "127.0.0.1",
        "port": parsed.port or 5432,
        "database": parsed.database,
    }


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
