"""The event log on PostgreSQL: SQLAlchemy 2 Core over asyncpg.

Hot paths are single statements run in autocommit mode, so an append is exactly one round trip:
the events (all of one decision, through ``unnest``) and the outbox rows they imply go in one
statement whose data-modifying CTEs commit together or not at all. The pool does not reset
connections on return (there is no open transaction to roll back), which measured ~20% faster.

Global order: a reader that followed ``global_position`` alone would skip events whose
transaction commits after a later position's. ``read_all`` orders by ``(tx_id, global_position)``
and stops below the snapshot horizon (``SNAPSHOT_HORIZON``): the oldest transaction still running
that may yet commit events of this database, so nothing can later appear behind the cursor;
writers are never serialised.

The horizon is not ``pg_snapshot_xmin(pg_current_snapshot())``: that is the oldest transaction
running anywhere on the cluster, and one left open in another database (another application, an
idle session) would stall every reader here for as long as it lasts. Of the transactions the
statement's snapshot sees running (``pg_snapshot_xip``), the horizon ignores only those proven to
belong to another database: held right now by a session of another database
(``pg_stat_activity.backend_xid``), or prepared there (``pg_prepared_xacts``). A transaction id
belongs to one database for its whole life, so a proof read a moment after the snapshot still
holds; a transaction not found (it just ended, or is invisible to this role) keeps holding the
horizon, which only delays a reader, never makes it skip. ``horizon_holder`` names what holds it.

Errors: every driver or SQLAlchemy error leaves through ``_translate``. What may succeed when
tried again (the pool or the server out of connections, a cancelled statement, a deadlock, a
serialization failure, a lost connection, a server shutting down) becomes ``StoreUnavailable``;
the rest ``IntegrityError``. The full classification is drawn in ``waystation.events.errors``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import asyncpg
import sqlalchemy.exc
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from .chain import recorded_events
from .codec import GENESIS_HASH, dumps, loads
from .errors import EventStoreError, IntegrityError, StoreUnavailable, VersionConflict
from .hotpool import Checkout, HotConnections
from .model import NewEvent, RecordedEvent
from .store import (
    AppendResult,
    EventStore,
    ExpiredCall,
    OutboxEntry,
    OutboxMessage,
    Position,
)

__all__ = [
    "SNAPSHOT_HORIZON",
    "HorizonHolder",
    "PostgresEventStore",
    "create_engine",
    "horizon_holder",
    "split_pool",
    "translate_error",
]

_APPEND = text(
    """
    WITH head_ok AS (
        SELECT 1 WHERE (CAST(:expected AS integer) = 0 AND CAST(:prev_hash AS bytea) = :genesis)
            OR EXISTS (
                SELECT 1 FROM events
                WHERE stream_id = :stream AND stream_version = :expected AND hash = :prev_hash)
    ), appended AS (
        INSERT INTO events (stream_id, stream_version, event_id, event_type, schema_version,
                            data, metadata, prev_hash, hash)
        SELECT :stream, v, e, t, s, CAST(d AS jsonb), CAST(m AS jsonb), p, h
        FROM unnest(CAST(:versions AS integer[]), CAST(:event_ids AS uuid[]),
                    CAST(:types AS text[]), CAST(:schema_versions AS integer[]),
                    CAST(:data AS text[]), CAST(:metadata AS text[]),
                    CAST(:prev_hashes AS bytea[]), CAST(:hashes AS bytea[]))
             AS u(v, e, t, s, d, m, p, h)
        WHERE EXISTS (SELECT 1 FROM head_ok)
        RETURNING global_position, metadata->>'deployment' AS deployment
    ), published AS (
        INSERT INTO outbox (message_id, stream_id, exchange, routing_key, properties, body,
                            available_at, deployment)
        SELECT mi, :stream, ex, rk, CAST(pr AS jsonb), bd,
               now() + make_interval(secs => greatest(CAST(:outbox_delay AS double precision), dl)),
               (SELECT deployment FROM appended ORDER BY global_position LIMIT 1)
        FROM unnest(CAST(:message_ids AS text[]), CAST(:exchanges AS text[]),
                    CAST(:routing_keys AS text[]), CAST(:properties AS text[]),
                    CAST(:bodies AS bytea[]), CAST(:delays AS double precision[]))
             AS o(mi, ex, rk, pr, bd, dl)
        WHERE EXISTS (SELECT 1 FROM appended)
        RETURNING id
    )
    SELECT (SELECT count(*) FROM appended) AS appended,
           ARRAY(SELECT id FROM published ORDER BY id) AS outbox_ids,
           CASE WHEN NOT EXISTS (SELECT 1 FROM head_ok)
                THEN (SELECT max(stream_version) FROM events WHERE stream_id = :stream)
           END AS head
    """
)


def _positional(statement: str) -> tuple[str, list[str]]:
    """``statement`` with SQLAlchemy's ``:name`` parameters as asyncpg's ``$n``, and the names
    in their order (a name used twice is one parameter)."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return re.sub(r"(?<![:\w]):([a-z_]+)\b", number, statement), names


_APPEND_ASYNCPG, _APPEND_PARAMS = _positional(_APPEND.text)
"""The append as the hot path runs it: straight on asyncpg (see :class:`PostgresEventStore`),
which spares SQLAlchemy's execution layer and its pool (measured: ~0.1 ms of CPU per statement
against asyncpg's ~0.04 ms; the design allows it on the hot path, docs/performance.md). The
same SQL, so the same plan and types."""

_FIND_EVENTS = """
    SELECT event_id, stream_id, stream_version, hash FROM events
    WHERE event_id = ANY($1::uuid[]) ORDER BY stream_version
"""

_RUNNING_HERE = """
    SELECT running.id FROM pg_snapshot_xip(pg_current_snapshot()) AS running(id)
    WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity elsewhere
                      WHERE elsewhere.backend_xid = xid(running.id)
                        AND elsewhere.datname <> current_database())
      AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts elsewhere
                      WHERE elsewhere.transaction = xid(running.id)
                        AND elsewhere.database <> current_database())
"""
"""Transactions the statement's snapshot sees running, but those of other databases."""

SNAPSHOT_HORIZON = f"""(
    SELECT coalesce(min(here.id), pg_snapshot_xmax(pg_current_snapshot()))
    FROM ({_RUNNING_HERE}) AS here
)"""
"""SQL for the oldest transaction id that may still commit events of this database (the
snapshot's ``xmax`` when none runs): a reader stops below it. Shared with the projections' feed."""

_HORIZON_HOLDER = text(
    f"""
    SELECT here.id::text, a.pid, coalesce(a.datname, p.database),
           CASE WHEN p.gid IS NOT NULL THEN 'prepared' ELSE a.state END,
           extract(epoch FROM clock_timestamp() - coalesce(a.xact_start, p.prepared)),
           a.application_name, p.gid
    FROM ({_RUNNING_HERE} ORDER BY running.id LIMIT 1) AS here
    LEFT JOIN pg_stat_activity a ON a.backend_xid = xid(here.id)
    LEFT JOIN pg_prepared_xacts p ON p.transaction = xid(here.id)
    ORDER BY a.backend_type = 'client backend' DESC NULLS LAST
    LIMIT 1
    """
)

_COLUMNS = """stream_id, stream_version, event_id, event_type, data::text, metadata::text,
              schema_version, prev_hash, hash, global_position, tx_id::text, recorded_at"""

_READ_STREAM = text(
    f"""SELECT {_COLUMNS} FROM events WHERE stream_id = :stream AND stream_version > :after
        ORDER BY stream_version"""
)

_LAST_EVENT = text(
    f"""SELECT {_COLUMNS} FROM events WHERE stream_id = :stream
        ORDER BY stream_version DESC LIMIT 1"""
)

_READ_STREAM_ASYNCPG = _positional(_READ_STREAM.text)[0]
_LAST_EVENT_ASYNCPG = _positional(_LAST_EVENT.text)[0]

_READ_ALL = text(
    f"""
    SELECT {_COLUMNS} FROM events
    WHERE (tx_id, global_position) > (CAST(CAST(:tx_id AS text) AS xid8), CAST(:position AS bigint))
      AND tx_id < {SNAPSHOT_HORIZON}
    ORDER BY events.tx_id, events.global_position  -- the column: "tx_id" alone is the text
    LIMIT :limit
    """
)

_CLAIM_OUTBOX = text(
    """
    UPDATE outbox SET available_at = now() + make_interval(secs => CAST(:lease AS double precision))
    WHERE id IN (SELECT id FROM outbox
                 WHERE available_at <= now()
                   AND (CAST(:deployment AS text) IS NULL OR deployment IS NULL
                        OR deployment = :deployment)
                 ORDER BY id LIMIT :limit FOR UPDATE SKIP LOCKED)
    RETURNING id, message_id, exchange, routing_key, properties::text, body, refusals,
              extract(epoch FROM now() - created_at)::float8
    """
)

_RETRY_OUTBOX = text(
    """
    UPDATE outbox
    SET available_at = now() + make_interval(secs => CAST(:delay AS double precision)),
        refusals = refusals + CASE WHEN CAST(:refused AS text) IS NULL THEN 0 ELSE 1 END,
        last_refusal = coalesce(CAST(:refused AS text), last_refusal)
    WHERE id = ANY(CAST(:ids AS bigint[]))
    """
)

_CLAIM_EXPIRED = text(
    """
    UPDATE pending_calls
    SET leased_until = now() + make_interval(secs => CAST(:lease AS double precision))
    WHERE subtask_id IN (
        SELECT subtask_id FROM pending_calls
        WHERE deadline_at <= now() AND (leased_until IS NULL OR leased_until <= now())
          AND (CAST(:deployment AS text) IS NULL OR deployment = :deployment)
        ORDER BY deadline_at LIMIT :limit FOR UPDATE SKIP LOCKED)
    RETURNING subtask_id, task_id, agent, extract(epoch FROM now())::float8
    """
)

_PENDING_OF_TASK = text(
    "SELECT subtask_id, extract(epoch FROM deadline_at) FROM pending_calls WHERE task_id = :task"
)

_DELETE_OUTBOX = "DELETE FROM outbox WHERE id = ANY($1::bigint[])"
_REPLACE_OUTBOX = text(
    """
    UPDATE outbox
    SET message_id = :message_id, exchange = :exchange, routing_key = :routing_key,
        properties = CAST(:properties AS jsonb), body = :body
    WHERE id = :id
    """
)
_OUTBOX_SIZE = text(
    """
    SELECT count(*) FROM outbox
    WHERE CAST(:deployment AS text) IS NULL OR deployment IS NULL OR deployment = :deployment
    """
)
_OUTBOX_OLDEST = text(
    """
    SELECT extract(epoch FROM now() - min(created_at))::float8 FROM outbox
    WHERE CAST(:deployment AS text) IS NULL OR deployment IS NULL OR deployment = :deployment
    """
)


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


@dataclass(frozen=True, slots=True)
class HorizonHolder:
    """The oldest running transaction that may yet commit events of this database. Readers of
    the log (``read_all``, the projections) do not move past its transaction id until it ends:
    one left open stalls them all. Fields PostgreSQL hides from this role are None (a role
    granted ``pg_read_all_stats`` sees every session's)."""

    xid: int
    pid: int | None
    """The session's backend process; None for a prepared transaction, which has none."""
    database: str | None
    state: str | None
    """``pg_stat_activity.state`` (``active``, ``idle in transaction``, …), or ``prepared``."""
    age_seconds: float | None
    """How long the transaction has been open (prepared: since it was prepared)."""
    application_name: str | None = None
    prepared: str | None = None
    """The global id of a prepared transaction (``ROLLBACK PREPARED`` takes it)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        who = f"prepared transaction {self.prepared!r}" if self.prepared else f"pid {self.pid}"
        age = f"{self.age_seconds:.1f}s" if self.age_seconds is not None else "unknown"
        return (
            f"{who} in database {self.database or '?'} ({self.state or 'state unknown'}, "
            f"transaction {self.xid} open for {age}, application {self.application_name or '-'!r})"
        )


async def horizon_holder(engine: AsyncEngine) -> HorizonHolder | None:
    """What holds the log's snapshot horizon now, or None when no transaction does."""
    async with engine.connect() as connection:
        row = (await connection.execute(_HORIZON_HOLDER)).one_or_none()
    if row is None:
        return None
    return HorizonHolder(
        xid=int(row[0]),
        pid=row[1],
        database=row[2],
        state=row[3],
        age_seconds=float(row[4]) if row[4] is not None else None,
        application_name=row[5] or None,
        prepared=row[6],
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


_TRANSIENT_SQLSTATES = ("08", "53", "57P", "57014", "40001", "40P01", "55P03")
"""SQLSTATEs (or their classes) that say "not now" rather than "never": connection exceptions,
insufficient resources (53300 too many connections, out of memory, disk full), the server
shutting down or not accepting connections yet, a cancelled statement (statement_timeout,
pg_cancel_backend), a serialization failure, a deadlock, a lock timeout. The statement rolled
back; running it again may succeed."""


def _sqlstate(error: BaseException) -> str | None:
    """The SQLSTATE the server sent, wherever the layers put it: on the driver's exception
    (asyncpg, raised bare at connect time) or on the one SQLAlchemy wraps (``orig``)."""
    layer: BaseException | None = error
    for _ in range(4):  # error -> orig / cause -> the driver's own exception
        if layer is None:
            return None
        for candidate in (layer, getattr(layer, "orig", None)):
            code = getattr(candidate, "sqlstate", None)
            if isinstance(code, str) and code:
                return code
        layer = getattr(layer, "orig", None) or layer.__cause__
    return None


def translate_error(error: Exception) -> EventStoreError:
    """Map a driver or SQLAlchemy error to the log's own hierarchy (see
    ``waystation.events.errors``); for other tables of the same database too
    (``waystation.contrib.penguiflow.artifacts``)."""
    if isinstance(
        error, (asyncpg.exceptions._base.DataError, asyncpg.exceptions.ClientConfigurationError)
    ):
        # an argument the driver cannot encode, a bad setting: InterfaceErrors too, but never
        # transient (retrying would loop)
        return IntegrityError(str(error))
    if isinstance(error, sqlalchemy.exc.DBAPIError) and error.connection_invalidated:
        return StoreUnavailable(str(error.orig or error))
    if isinstance(
        error,
        (
            # the driver's own, when used directly (the hot path): the connection closed under
            # it, or was left mid-statement by a cancelled caller
            asyncpg.exceptions.InterfaceError,
            asyncpg.exceptions.InternalClientError,
            OSError,  # connection refused, reset, unreachable
            TimeoutError,  # the builtin one: a connect or command timeout of the driver
            sqlalchemy.exc.TimeoutError,  # no pooled connection free within pool_timeout
            sqlalchemy.exc.InterfaceError,
            sqlalchemy.exc.OperationalError,
        ),
    ):
        return StoreUnavailable(str(getattr(error, "orig", None) or error))
    sqlstate = _sqlstate(error)
    if sqlstate is not None and sqlstate.startswith(_TRANSIENT_SQLSTATES):
        return StoreUnavailable(f"{sqlstate}: {getattr(error, 'orig', None) or error}")
    return IntegrityError(str(error))


_translate = translate_error


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
        return [ExpiredCall(subtask_id=r[0], task_id=r[1], agent=r[2], now=r[3]) for r in rows]

    async def pending_call_deadlines(self, task_id: str) -> dict[str, float]:
        try:
            async with self.engine.connect() as connection:
                rows = (await connection.execute(_PENDING_OF_TASK, {"task": task_id})).all()
        except Exception as error:
            raise _translate(error) from error
        return {r[0]: float(r[1]) for r in rows}
