"""The hot path's connections: at most ``size`` asyncpg connections, handed out and taken back.

``PostgresEventStore`` runs its hot statements (append, the stream reads, the outbox's deletes)
here, one statement or two per checkout. asyncpg's own pool spent, per checkout, a proxy object,
a count of its idle connections, an inactivity timer set on release and cancelled on the next
acquire, and a task (``asyncio.shield``) around every release: about 5% of a worker's CPU under
load (py-spy, 2026-11-24). Here a free connection is taken from a list and given back to it,
without a task or a timer; only a caller that finds every connection busy waits, in line.

What it keeps from asyncpg's pool: at most ``size`` connections, opened when first needed (a
failed open frees its place); a wait for a free one bounded by ``timeout`` (``TimeoutError``);
a connection that is closed, or was given back after anything but a clean round trip (a
cancelled statement, a lost connection), is terminated instead of reused; ``close`` closes
the idle ones and those still out as they come back. What it leaves out: connection resets (a
hot connection holds no session state), a cap on statements per connection and closing idle
connections after a while (a worker keeps its few connections busy).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from types import TracebackType

import asyncpg

from .errors import EventStoreError

__all__ = ["HotConnections", "PoolClosed"]

CLOSE_TIMEOUT = 2.0
"""Seconds an idle connection gets to close cleanly before it is terminated."""


class PoolClosed(asyncpg.InterfaceError):  # type: ignore[misc]  # asyncpg ships no types
    """The connections were closed: nothing more is handed out."""


class HotConnections:
    """At most ``size`` connections opened by ``connect``; see the module."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[asyncpg.Connection]],
        *,
        size: int,
        timeout: float,
    ) -> None:
        if size < 1:
            raise ValueError("a pool needs room for one connection at least")
        self._connect = connect
        self.size = size
        self.timeout = timeout
        self._idle: list[asyncpg.Connection] = []
        self._counted = 0
        """Connections idle, handed out or being opened: never more than ``size``."""
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closing = False
        self._terminated = False
        self._drained: asyncio.Future[None] | None = None

    @property
    def opened(self) -> int:
        """Connections idle, handed out or being opened."""
        return self._counted

    async def acquire(self) -> asyncpg.Connection:
        """A free connection; a new one while fewer than ``size`` are open; else the next one
        given back, waiting at most ``timeout`` seconds (then ``TimeoutError``)."""
        deadline: float | None = None
        while True:
            if self._closing:
                raise PoolClosed("the hot path's connections are closed")
            while self._idle:
                connection = self._idle.pop()
                if not connection.is_closed():
                    return connection
                self._counted -= 1
            if self._counted < self.size:
                self._counted += 1
                try:
                    return await self._connect()
                except BaseException:
                    self._counted -= 1
                    self._freed()  # its place is free again: a waiter may open one
                    raise
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.timeout
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken, then cancelled or timed out: the next one goes
                else:
                    waiter.cancel()
                    # a release may have passed over it already (it skips cancelled waiters)
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
                raise

    def release(self, connection: asyncpg.Connection, *, reuse: bool = True) -> None:
        """Give ``connection`` back; ``reuse=False`` (or a closed connection, or one left in a
        transaction) terminates it and frees its place."""
        if (
            reuse
            and not self._terminated
            and not connection.is_closed()
            and not connection.is_in_transaction()
        ):
            self._idle.append(connection)
        else:
            self._counted -= 1
            connection.terminate()
        self._freed()

    def _freed(self) -> None:
        """A connection came back, or a place was freed: the next waiter goes, or, while
        closing, ``close`` looks again."""
        if self._closing:
            if self._drained is not None and not self._drained.done():
                self._drained.set_result(None)  # close() takes it from here
        else:
            self._wake()

    def _wake(self) -> None:
        """Let the longest waiter try again."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        """Stop handing out connections, close the idle ones, then each one still out as it
        comes back (``terminate`` ends a close that takes too long)."""
        self._closing = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # it finds the pool closing
        while True:
            idle, self._idle = self._idle, []
            self._counted -= len(idle)
            for connection in idle:
                try:
                    # bounded: a server gone silent would keep a plain close waiting
                    await connection.close(timeout=CLOSE_TIMEOUT)
                except Exception:
                    connection.terminate()
            if self._counted <= 0:
                return
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def terminate(self) -> None:
        """Close every idle connection now; one still out is terminated as it comes back."""
        self._closing = self._terminated = True
        idle, self._idle = self._idle, []
        self._counted -= len(idle)
        for connection in idle:
            connection.terminate()


_CLEAN = (asyncpg.PostgresError, EventStoreError)
"""Errors after which a connection is as good as before: PostgreSQL's own (it answered, the
round trip completed) and the log's (raised on what a statement returned, e.g. a version
conflict)."""


class Checkout:
    """A connection for one ``async with`` block. Given back for reuse when the block ends
    cleanly or with one of the errors in ``_CLEAN``; terminated when it ends otherwise
    (cancelled mid-statement, connection lost, anything unforeseen)."""

    __slots__ = ("_connection", "_pool")

    def __init__(self, pool: HotConnections) -> None:
        self._pool = pool
        self._connection: asyncpg.Connection | None = None

    async def __aenter__(self) -> asyncpg.Connection:
        self._connection = await self._pool.acquire()
        return self._connection

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        connection, self._connection = self._connection, None
        assert connection is not None
        self._pool.release(connection, reuse=kind is None or issubclass(kind, _CLEAN))
