"""The runner: keeps the projections up to date, one active runner per projection.

A runner holds a session-level advisory lock for the projection while it is active; the others
stand by and try again every ``standby_interval`` seconds, so when the holder dies (its session
ends, the lock goes with it) another takes over within about that long. The active runner wakes
on ``NOTIFY waystation_events`` (a statement trigger on ``events``) and polls every
``poll_interval`` too, for events that committed below the horizon only after the notification.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence

import sqlalchemy.exc
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .feed import catch_up
from .tables import PROJECTIONS, Projection

__all__ = ["ProjectionRunner"]

log = logging.getLogger("waystation.projections")

CHANNEL = "waystation_events"
_LOCK_NAMESPACE = 0x57617973  # "Ways": the first key of every projection's advisory lock
_TRY_LOCK = text("SELECT pg_try_advisory_lock(:namespace, hashtext(:name))")


class ProjectionRunner:
    """Keeps projections up to date; run one in as many instances as you like.

    Per projection, the instance holding its advisory lock applies the log; the others stand
    by and take over when it goes. Errors (the database restarting, say) are logged and the
    runner starts over on a new connection after a short backoff.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        projections: Sequence[Projection] | None = None,
        *,
        batch_size: int = 1000,
        poll_interval: float = 1.0,
        standby_interval: float = 1.0,
        report_interval: float = 30.0,
    ) -> None:
        self.engine = engine
        self.projections = list(projections or PROJECTIONS.values())
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.standby_interval = standby_interval
        self.report_interval = report_interval
        self.active: set[str] = set()
        """The projections this instance applies right now."""
        self.applied: dict[str, int] = {p.name: 0 for p in self.projections}

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set."""
        await asyncio.gather(*(self._keep(p, stop) for p in self.projections))

    async def _keep(self, projection: Projection, stop: asyncio.Event) -> None:
        backoff = 0.5
        while not stop.is_set():
            try:
                async with self.engine.connect() as connection:
                    await self._serve(connection, projection, stop)
                return
            except (OSError, sqlalchemy.exc.DBAPIError, sqlalchemy.exc.InterfaceError) as error:
                if projection.name in self.active:
                    log.warning("projection %s: runner lost its connection", projection.name)
                self.active.discard(projection.name)
                log.warning("projection %s: %s; retrying in %.1fs", projection.name, error, backoff)
                await _sleep_or_stop(stop, backoff * (1 + random.random() / 2))
                backoff = min(backoff * 2, 10.0)

    async def _serve(
        self, connection: AsyncConnection, projection: Projection, stop: asyncio.Event
    ) -> None:
        name = projection.name
        while not stop.is_set():
            locked = await connection.scalar(
                _TRY_LOCK, {"namespace": _LOCK_NAMESPACE, "name": name}
            )
            await connection.commit()
            if locked:
                break
            await _sleep_or_stop(stop, self.standby_interval)
        else:
            return
        self.active.add(name)
        log.info("projection %s: this runner is active", name)
        woken = asyncio.Event()
        raw = await connection.get_raw_connection()
        driver = raw.driver_connection
        assert driver is not None

        def notified(*_: object) -> None:
            woken.set()

        await driver.add_listener(CHANNEL, notified)
        reported = 0.0
        loop = asyncio.get_running_loop()
        try:
            while not stop.is_set():
                woken.clear()
                applied = await catch_up(connection, projection, batch_size=self.batch_size)
                self.applied[name] += applied
                if loop.time() - reported >= self.report_interval:
                    reported = loop.time()
                    log.info("projection %s: %d events applied so far", name, self.applied[name])
                await _wait_any(stop, woken, self.poll_interval)
        finally:
            self.active.discard(name)
            # closed, not pooled: the session's advisory lock and LISTEN go with it
            await connection.invalidate()


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


async def _wait_any(stop: asyncio.Event, woken: asyncio.Event, timeout: float) -> None:
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(woken.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
