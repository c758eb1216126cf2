"""The hot path's connections (``waystation.events.hotpool``): at most ``size`` open, reused when
given back cleanly, terminated otherwise, a bounded wait in line for a free one, and a close that
waits for the ones still out. Stand-in connections here; tests/integration/test_store_errors.py runs
the store's own checkouts on PostgreSQL (a cancelled statement's connection is not reused)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from waystation.events.hotpool import HotConnections, PoolClosed

from ..support import eventually

pytestmark = pytest.mark.timeout(60)

FOREVER = 3600.0


class Connection:
    """What the pool asks of an asyncpg connection."""

    numbers = itertools.count(1)

    def __init__(self) -> None:
        self.number = next(self.numbers)
        self.closed = False
        self.terminated = False
        self.in_transaction = False
        self.gone = asyncio.Event()

    def is_closed(self) -> bool:
        return self.closed

    def is_in_transaction(self) -> bool:
        return self.in_transaction

    def terminate(self) -> None:
        self.closed = self.terminated = True
        self.gone.set()

    async def close(self, *, timeout: float | None = None) -> None:
        self.closed = True
        self.gone.set()


class Opener:
    """``connect``: opens stand-in connections, failing the next ``fail`` times."""

    def __init__(self) -> None:
        self.opened: list[Connection] = []
        self.fail = 0

    async def __call__(self) -> Connection:
        await asyncio.sleep(0)
        if self.fail:
            self.fail -= 1
            raise OSError("connection refused")
        self.opened.append(Connection())
        return self.opened[-1]


def pool_of(size: int, timeout: float = FOREVER) -> tuple[HotConnections, Opener]:
    opener = Opener()
    return HotConnections(opener, size=size, timeout=timeout), opener


async def waiting(pool: HotConnections, count: int) -> None:
    """Until ``count`` callers wait in line."""
    await eventually(
        lambda: sum(not waiter.done() for waiter in pool._waiters) >= count,
        FOREVER,
        f"{count} callers waiting",
        interval=0,
    )


async def test_a_connection_given_back_is_reused_and_never_more_than_size_are_opened() -> None:
    pool, opener = pool_of(2)
    first = await pool.acquire()
    pool.release(first)
    assert await pool.acquire() is first
    second = await pool.acquire()
    assert len(opener.opened) == 2 and second is not first
    third = asyncio.ensure_future(pool.acquire())
    await waiting(pool, 1)
    assert len(opener.opened) == 2 and pool.opened == 2
    pool.release(second)
    assert await third is second


async def test_callers_waiting_are_served_in_order() -> None:
    pool, _ = pool_of(1)
    held = await pool.acquire()
    served: list[str] = []

    async def use(name: str) -> None:
        connection = await pool.acquire()
        served.append(name)
        pool.release(connection)

    users = [asyncio.ensure_future(use(name)) for name in "abc"]
    await waiting(pool, 3)
    pool.release(held)
    await asyncio.gather(*users)
    assert served == ["a", "b", "c"]


async def test_a_wait_past_the_timeout_raises_and_leaves_the_line() -> None:
    pool, _ = pool_of(1, timeout=0.05)
    held = await pool.acquire()
    with pytest.raises(TimeoutError):
        await pool.acquire()
    assert not pool._waiters
    pool.release(held)
    assert await pool.acquire() is held


async def test_a_failed_open_frees_its_place() -> None:
    pool, opener = pool_of(1)
    opener.fail = 1
    with pytest.raises(OSError):
        await pool.acquire()
    assert pool.opened == 0
    assert await pool.acquire() is opener.opened[0]


async def test_a_failed_open_lets_a_waiter_open_one() -> None:
    pool, opener = pool_of(2)
    held = await pool.acquire()
    opener.fail = 1
    failing = asyncio.ensure_future(pool.acquire())  # takes the second place, then fails
    third = asyncio.ensure_future(pool.acquire())  # waits: both places taken
    await waiting(pool, 1)
    with pytest.raises(OSError):
        await failing
    assert await asyncio.wait_for(third, FOREVER) is opener.opened[-1]
    assert opener.opened[-1] is not held


async def test_one_given_back_after_an_unclean_round_trip_is_terminated() -> None:
    pool, _ = pool_of(1)
    connection = await pool.acquire()
    waiter = asyncio.ensure_future(pool.acquire())
    await waiting(pool, 1)
    pool.release(connection, reuse=False)
    fresh = await waiter
    assert connection.terminated and fresh is not connection and pool.opened == 1


@pytest.mark.parametrize("state", ["closed", "in a transaction"])
async def test_one_closed_or_in_a_transaction_is_not_reused(state: str) -> None:
    pool, _ = pool_of(1)
    connection = await pool.acquire()
    if state == "closed":
        connection.closed = True
    else:
        connection.in_transaction = True
    pool.release(connection)
    fresh = await pool.acquire()
    assert fresh is not connection and pool.opened == 1


async def test_an_idle_connection_closed_meanwhile_is_skipped() -> None:
    pool, _ = pool_of(1)
    connection = await pool.acquire()
    pool.release(connection)
    connection.closed = True  # the server went away while it was idle
    fresh = await pool.acquire()
    assert fresh is not connection and pool.opened == 1


async def test_a_waiter_woken_then_cancelled_passes_its_turn_on() -> None:
    pool, _ = pool_of(1)
    held = await pool.acquire()
    first = asyncio.ensure_future(pool.acquire())
    second = asyncio.ensure_future(pool.acquire())
    await waiting(pool, 2)
    pool.release(held)  # wakes the first ...
    first.cancel()  # ... which is cancelled before it runs
    assert await asyncio.wait_for(second, FOREVER) is held
    assert first.cancelled()


async def test_close_closes_idle_ones_then_each_one_out_as_it_comes_back() -> None:
    pool, _ = pool_of(3)
    idle, out = await pool.acquire(), await pool.acquire()
    pool.release(idle)
    waiter_pool, _ = pool_of(1)
    held = await waiter_pool.acquire()
    waiter = asyncio.ensure_future(waiter_pool.acquire())
    await waiting(waiter_pool, 1)
    closing = asyncio.ensure_future(pool.close())
    waiter_closing = asyncio.ensure_future(waiter_pool.close())
    with pytest.raises(PoolClosed):
        await waiter
    await idle.gone.wait()
    assert not closing.done() and not out.closed
    with pytest.raises(PoolClosed):
        await pool.acquire()
    pool.release(out)
    await asyncio.wait_for(closing, FOREVER)
    assert out.closed and not out.terminated and pool.opened == 0
    waiter_pool.release(held)
    await asyncio.wait_for(waiter_closing, FOREVER)
    assert held.closed


async def test_terminate_ends_a_close_that_waits() -> None:
    pool, _ = pool_of(2)
    idle, out = await pool.acquire(), await pool.acquire()
    pool.release(idle)
    closing = asyncio.ensure_future(pool.close())
    await idle.gone.wait()
    closing.cancel()
    pool.terminate()
    pool.release(out)
    assert out.terminated and pool.opened == 0


async def test_a_waiter_cancelled_as_a_connection_comes_back_is_cancelled_not_broken() -> None:
    """Cancelled, then passed over by a release before it ran: the caller sees its own
    cancellation (a ValueError here once surfaced as a permanent store error)."""
    pool, _ = pool_of(1)
    held = await pool.acquire()
    waiter = asyncio.ensure_future(pool.acquire())
    await waiting(pool, 1)
    waiter.cancel()
    pool.release(held)  # skips the cancelled waiter before it runs its own cleanup
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not pool._waiters
    assert await pool.acquire() is held


class BlockingOpener(Opener):
    """Opens only when ``go`` is set; fails the open instead when ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.started = asyncio.Event()

    async def __call__(self) -> Connection:
        self.started.set()
        await self.go.wait()
        return await super().__call__()


async def test_close_ends_when_an_open_under_way_fails() -> None:
    opener = BlockingOpener()
    pool = HotConnections(opener, size=1, timeout=FOREVER)
    opening = asyncio.ensure_future(pool.acquire())
    await opener.started.wait()
    closing = asyncio.ensure_future(pool.close())
    await eventually(lambda: pool._drained is not None, FOREVER, "close waits", interval=0)
    opener.fail = 1
    opener.go.set()
    with pytest.raises(OSError):
        await opening
    await asyncio.wait_for(closing, FOREVER)
    assert pool.opened == 0


async def test_close_gives_up_on_an_idle_connection_that_does_not_close() -> None:
    """A server gone silent: closing its connection would wait for ever; it is terminated."""

    class Silent(Connection):
        async def close(self, *, timeout: float | None = None) -> None:
            self.close_timeout = timeout
            if timeout is None:
                await asyncio.Event().wait()
            raise TimeoutError

    pool = HotConnections(lambda: asyncio.sleep(0, Silent()), size=1, timeout=FOREVER)
    connection = await pool.acquire()
    pool.release(connection)
    await asyncio.wait_for(pool.close(), FOREVER)
    assert connection.terminated and connection.close_timeout is not None
