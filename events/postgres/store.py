"""The log on PostgreSQL: the store, its engine, and its connections.

Hot paths are single statements run in autocommit mode, so an append is exactly one round trip
(:mod:`.statements`). The pool does not reset connections on return (there is no open transaction
to roll back), which measured ~20% faster. Every error leaves through
:func:`~.translate.translate_error`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from ..chain import recorded_events
from ..codec import GENESIS_HASH, dumps, loads
from ..errors import EventStoreError, IntegrityError, StoreUnavailable, VersionConflict
from ..hotpool import Checkout, HotConnections
from ..model import NewEvent, RecordedEvent
from ..store import (
    AppendResult,
    EventStore,
    ExpiredCall,
    OutboxEntry,
    OutboxMessage,
    Position,
)
from .horizon import HorizonHolder, horizon_holder
from .statements import (
    _APPEND_ASYNCPG,
    _APPEND_PARAMS,
    _CLAIM_EXPIRED,
    _CLAIM_OUTBOX,
    _DELETE_OUTBOX,
    _FIND_EVENTS,
    _LAST_EVENT_ASYNCPG,
    _OUTBOX_OLDEST,
    _OUTBOX_SIZE,
    _PENDING_OF_TASK,
    _READ_ALL,
    _READ_STREAM_ASYNCPG,
    _REPLACE_OUTBOX,
    _RETRY_OUTBOX,
)
from .translate import translate_error as _translate

__all__ = ["PostgresEventStore", "create_engine", "split_pool"]


def create_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    """An engine tuned for the log: autocommit statements, no reset on return, pre-ping off.

    No overflow: an overflow connection is closed when it is returned to a full pool, so a burst
    of work above ``pool_size`` would open and close connections all the time (measured: ~600
    new connections per 2,000 parents and a 10x slower checkpoint). Callers wait for a pooled
    connection instead.
    """
    return create_async_engine(
        url,
        isolation_level="AUTOCOMMIT",
        pool_size=pool_size,
        max_overflow=0,
        pool_reset_on_return=None,
    )


def _row_to_event(row: Any) -> RecordedEvent:
    return RecordedEvent(
        stream_id=row[0],
        stream_version=row[1],
        event_id=row[2],
        event_type=row[3],
        data=loads(row[4]),
        metadata=loads(row[5]),
        schema_version=row[6],
        prev_hash=bytes(row[7]),
        hash=bytes(row[8]),
        global_position=row[9],
        tx_id=int(row[10]),
        recorded_at=row[11],
    )


HOT_SHARE_MIN_POOL = 4
"""From this ``pool_size`` up, two of a store's connections serve SQLAlchemy's side; below, one."""


def split_pool(pool_size: int) -> tuple[int, int]:
    """``(hot, engine)``: how many of ``pool_size`` connections the hot path (asyncpg's, its
    own) and the rest (SQLAlchemy's) may hold. Together they hold ``pool_size``, or 2 when it
    is 1."""
    engine = 2 if pool_size >= HOT_SHARE_MIN_POOL else 1
    return max(1, pool_size - engine), engine


class _HotCheckout(Checkout):
    """A hot checkout whose wait for a free connection ends in ``StoreUnavailable``."""

    __slots__ = ("_store",)

    def __init__(self, store: PostgresEventStore) -> None:
        super().__init__(store._hot)
        self._store = store

    async def __aenter__(self) -> asyncpg.Connection:
        try:
            return await super().__aenter__()
        except TimeoutError as error:
            store = self._store
            raise StoreUnavailable(
                f"no database connection free within {store.checkout_timeout:g} s "
                f"(the hot path's pool holds {store.hot_pool_size})"
            ) from error


class PostgresEventStore(EventStore):
    """The log in PostgreSQL. Owns its engine unless one is passed in.

    Two pools. The hot path (``append``, ``read_stream``, ``last_event``, ``delete_outbox``) runs
    on at most ``hot_pool_size`` asyncpg connections of its own (``waystation.events.hotpool``; the
    engine's pool size when not given); everything else on SQLAlchemy's. A profile under load
    put a third of the worker's database CPU in SQLAlchemy's checkout and release around each
    hot statement (three greenlet switches and a pool event per statement), and later 5% of the
    worker's CPU in asyncpg's own pool (a proxy, a timer and a task per checkout): a hot
    checkout is now a list's pop and append. The hot connections are opened by the engine (so
    with its URL, connect arguments and on-connect setup) and then detached from its pool; they
    wait ``checkout_timeout`` (the engine pool's timeout) for a free one, as SQLAlchemy's would.
    """

    def __init__(
        self, engine: AsyncEngine, *, owns_engine: bool = False, hot_pool_size: int | None = None
    ) -> None:
        self.engine = engine
        self._owns_engine = owns_engine
        pool: Any = engine.pool
        self.hot_pool_size = hot_pool_size or (pool.size() if hasattr(pool, "size") else 5)
        self.checkout_timeout = float(pool.timeout()) if hasattr(pool, "timeout") else 30.0
        self._hot = HotConnections(
            self._open_hot, size=self.hot_pool_size, timeout=self.checkout_timeout
        )

    @classmethod
    def from_url(cls, url: str, *, pool_size: int = 10) -> PostgresEventStore:
        """A store of at most ``pool_size`` connections (see :func:`split_pool`)."""
        hot, engine = split_pool(pool_size)
        return cls(create_engine(url, pool_size=engine), owns_engine=True, hot_pool_size=hot)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._hot.close(), timeout=10)
        except Exception:
            self._hot.terminate()
        if self._owns_engine:
            await self.engine.dispose()

    async def _open_hot(self) -> asyncpg.Connection:
        """A new hot connection: opened by the engine, then detached from its pool."""
        proxied = await self.engine.raw_connection()
        driver = proxied.driver_connection  # read first: detaching clears it
        proxied.detach()
        assert isinstance(driver, asyncpg.Connection)
        return driver

    def _hot_connection(self) -> _HotCheckout:
        """``async with``: a hot connection, waited for at most ``checkout_timeout`` (then
        StoreUnavailable); terminated on release when its statement did not end cleanly."""
        return _HotCheckout(self)

    async def append(
        self,
        stream_id: str,
        expected_version: int,
        events: Sequence[NewEvent],
        *,
        prev_hash: bytes,
        outbox: Sequence[OutboxMessage] = (),
        outbox_delay: float = 5.0,
    ) -> AppendResult:
        if not events:
            raise IntegrityError("an append needs at least one event")
        recorded = recorded_events(stream_id, expected_version, events, prev_hash)
        params = {
            "stream": stream_id,
            "expected": expected_version,
            "prev_hash": prev_hash,
            "genesis": GENESIS_HASH,  # a new stream chains to it, as in every backend
            "versions": [e.stream_version for e in recorded],
            "event_ids": [e.event_id for e in events],
            "types": [e.event_type for e in events],
            "schema_versions": [e.schema_version for e in events],
            "data": [dumps(e.data).decode() for e in events],
            "metadata": [dumps(e.metadata).decode() for e in events],
            "prev_hashes": [e.prev_hash for e in recorded],
            "hashes": [e.hash for e in recorded],
            "outbox_delay": outbox_delay,
            "message_ids": [m.message_id for m in outbox],
            "exchanges": [m.exchange for m in outbox],
            "routing_keys": [m.routing_key for m in outbox],
            "properties": [dumps(m.properties).decode() for m in outbox],
            "bodies": [m.body for m in outbox],
            "delays": [float(m.delay) for m in outbox],
        }
        try:
            async with self._hot_connection() as connection:
                try:
                    row = await connection.fetchrow(
                        _APPEND_ASYNCPG, *(params[name] for name in _APPEND_PARAMS)
                    )
                except asyncpg.UniqueViolationError:
                    # a unique key was hit: our own events again, or someone else's at our version
                    return await self._after_collision(
                        connection, stream_id, expected_version, events
                    )
                assert row is not None
                if row["appended"] == 0:
                    # the stream's head came back with the refusal: a conflict costs no more
                    # round trips than the append itself
                    if (row["head"] or 0) != expected_version:
                        raise VersionConflict(stream_id, expected_version)
                    raise IntegrityError(
                        f"prev_hash does not match the hash of {stream_id!r} v{expected_version}"
                    )
        except EventStoreError:
            raise
        except Exception as error:
            raise _translate(error) from error
        return AppendResult(
            version=recorded[-1].stream_version,
            last_hash=recorded[-1].hash,
            outbox_ids=tuple(row["outbox_ids"]),
            recorded=tuple(recorded),
        )

    async def _after_collision(
        self,
        connection: asyncpg.Connection,
        stream_id: str,
        expected_version: int,
        events: Sequence[NewEvent],
    ) -> AppendResult:
        found = {
            row["event_id"]: row
            for row in await connection.fetch(_FIND_EVENTS, [e.event_id for e in events])
        }
        first = found.get(events[0].event_id)
        if first is None:
            raise VersionConflict(stream_id, expected_version)
        if first["stream_id"] != stream_id:
            raise IntegrityError(f"event {events[0].event_id} belongs to {first['stream_id']!r}")
        last = max(
            (row for row in found.values() if row["stream_id"] == stream_id),
            key=lambda row: row["stream_version"],
        )
        return AppendResult(
            version=last["stream_version"], last_hash=bytes(last["hash"]), duplicate=True
        )

    async def _fetch(self, statement: str, *args: Any) -> list[Any]:
        """Rows of a read on the hot path's connections (see the class)."""
        try:
            async with self._hot_connection() as connection:
                return list(await connection.fetch(statement, *args))
        except EventStoreError:
            raise
        except Exception as error:
            raise _translate(error) from error

    async def read_stream(self, stream_id: str, *, after: int = 0) -> list[RecordedEvent]:
        rows = await self._fetch(_READ_STREAM_ASYNCPG, stream_id, after)
        return [_row_to_event(row) for row in rows]

    async def last_event(self, stream_id: str) -> RecordedEvent | None:
        rows = await self._fetch(_LAST_EVENT_ASYNCPG, stream_id)
        return _row_to_event(rows[0]) if rows else None

    async def read_all(
        self, after: Position = Position(), limit: int = 1000
    ) -> list[RecordedEvent]:
        params = {"tx_id": str(after.tx_id), "position": after.global_position, "limit": limit}
        try:
            async with self.engine.connect() as connection:
                rows = (await connection.execute(_READ_ALL, params)).all()
        except Exception as error:
            raise _translate(error) from error
        return [_row_to_event(row) for row in rows]

    async def horizon_holder(self) -> HorizonHolder | None:
        """What holds ``read_all``'s horizon now (see :func:`horizon_holder`)."""
        try:
            return await horizon_holder(self.engine)
        except Exception as error:
            raise _translate(error) from error

    async def claim_outbox(
        self, limit: int = 100, lease: float = 30.0, *, deployment: str | None = None
    ) -> list[OutboxEntry]:
        params = {"limit": limit, "lease": lease, "deployment": deployment}
        try:
            async with self.engine.connect() as connection:
                rows = (await connection.execute(_CLAIM_OUTBOX, params)).all()
        except Exception as error:
            raise _translate(error) from error
        return [
            OutboxEntry(
                id=row[0],
                message=OutboxMessage(
                    message_id=row[1],
                    exchange=row[2],
                    routing_key=row[3],
                    properties=loads(row[4]),
                    body=bytes(row[5]),
                ),
                refusals=row[6],
                age=max(0.0, row[7]),
            )
            for row in sorted(rows, key=lambda r: r[0])
        ]

    async def retry_outbox(
        self, ids: Sequence[int], delay: float, *, refused: str | None = None
    ) -> None:
        if not ids:
            return
        params = {"ids": list(ids), "delay": delay, "refused": refused}
        try:
            async with self.engine.connect() as connection:
                await connection.execute(_RETRY_OUTBOX, params)
        except Exception as error:
            raise _translate(error) from error

    async def replace_outbox(self, outbox_id: int, message: OutboxMessage) -> None:
        params = {
            "id": outbox_id,
            "message_id": message.message_id,
            "exchange": message.exchange,
            "routing_key": message.routing_key,
            "properties": dumps(message.properties).decode(),
            "body": message.body,
        }
        try:
            async with self.engine.connect() as connection:
                await connection.execute(_REPLACE_OUTBOX, params)
        except Exception as error:
            raise _translate(error) from error

    async def delete_outbox(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        try:
            async with self._hot_connection() as connection:
                await connection.execute(_DELETE_OUTBOX, list(ids))
        except EventStoreError:
            raise
        except Exception as error:
            raise _translate(error) from error

    async def outbox_size(self, *, deployment: str | None = None) -> int:
        try:
            async with self.engine.connect() as connection:
                found = await connection.scalar(_OUTBOX_SIZE, {"deployment": deployment})
                return int(found or 0)
        except Exception as error:
            raise _translate(error) from error

    async def outbox_oldest(self, *, deployment: str | None = None) -> float | None:
        try:
            async with self.engine.connect() as connection:
                found = await connection.scalar(_OUTBOX_OLDEST, {"deployment": deployment})
        except Exception as error:
            raise _translate(error) from error
        return None if found is None else max(0.0, float(found))

    async def claim_expired_calls(
        self, limit: int = 100, lease: float = 30.0, *, deployment: str | None = None
    ) -> list[ExpiredCall]:
        params = {"limit": limit, "lease": lease, "deployment": deployment}
        try:
            async with self.engine.connect() as connection:
                rows = (await connection.execute(_CLAIM_EXPIRED, params)).all()
        except Exception as error:
            raise _translate(error) from error
        return [
            ExpiredCall(subtask_id=r[0], task_id=r[1], agent=r[2], now=r[3], kind=r[4])
            for r in rows
        ]

    async def pending_call_deadlines(self, task_id: str) -> dict[str, float]:
        try:
            async with self.engine.connect() as connection:
                rows = (await connection.execute(_PENDING_OF_TASK, {"task": task_id})).all()
        except Exception as error:
            raise _translate(error) from error
        return {r[0]: float(r[1]) for r in rows}
