"""The pieces of ``scripts/chaos`` that are not the run itself.

* :func:`plan_faults`: when each fault lands, a pure function of the seed: the kinds shuffled,
  one per equal slice of the results, at a random point of its slice, after a random delay.
* :class:`ChaosCollector`: the durable result collector of the tests, which also says how many
  tasks have a result and waits for more; its messages carry their ``redelivered`` flag, so
  that a result the broker delivered again (the collector's ack was lost with its connection)
  is told apart from one a worker published twice.
* :func:`probe_health`: one worker's ``/healthz`` (healthy, and messages in its handlers).

What is missing, wrong or duplicated, from the result messages and from the event log, is
checked by :mod:`tests.harness.checks` (``result_figures``, ``log_figures``).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import aiohttp
from aio_pika.abc import AbstractIncomingMessage

from events.codec import loads
from tests.harness.clients import DurableResultCollector

__all__ = [
    "FAULT_KINDS",
    "ChaosCollector",
    "Health",
    "PlannedFault",
    "plan_faults",
    "probe_health",
]

FAULT_KINDS = ("kill", "close", "pg-restart")


# ---- the fault plan ------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    """``kill`` (SIGKILL a worker, start a replacement), ``close`` (every broker connection of
    the run's vhost) or ``pg-restart`` (the run's PostgreSQL cluster stopped and started)."""
    after_results: int
    """It lands once this many results are in..."""
    delay: float
    """...and this many seconds later (a random moment in whatever is in flight)."""


def plan_faults(
    results_span: int, kills: int, closes: int, pg_restarts: int, seed: int
) -> list[PlannedFault]:
    """The faults in the order they land, spread over the first ``results_span`` results: the
    span is cut into one equal slice per fault, each fault lands at a random point of its slice
    (so no two pile up, and none waits for the end)."""
    kinds = ["kill"] * kills + ["close"] * closes + ["pg-restart"] * pg_restarts
    rng = random.Random(seed)
    rng.shuffle(kinds)
    width = results_span / max(1, len(kinds))
    return [
        PlannedFault(
            kind,
            max(1, int(width * (index + rng.random()))),
            round(rng.uniform(0.0, 1.0), 3),
        )
        for index, kind in enumerate(kinds)
    ]


# ---- results -------------------------------------------------------------------------------


class ChaosCollector(DurableResultCollector):
    """:class:`~tests.harness.clients.DurableResultCollector` that can wait until a number of
    tasks have their result."""

    def __init__(self, amqp_url: str, *, queue_prefix: str) -> None:
        super().__init__(amqp_url, queue_prefix=queue_prefix, queue_name="chaos-results")
        self._arrived = asyncio.Condition()

    async def _on_result(self, message: AbstractIncomingMessage) -> None:
        await super()._on_result(message)
        async with self._arrived:
            self._arrived.notify_all()

    def answered(self) -> int:
        """Tasks with a result so far."""
        return len(self._results)

    async def wait_answered(self, count: int) -> None:
        """Until at least ``count`` tasks have a result."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: len(self._results) >= count)


# ---- a worker's health ---------------------------------------------------------------------


@dataclass(frozen=True)
class Health:
    healthy: bool
    in_flight: int | None
    """Messages in the worker's handlers right now (None when it did not say)."""


async def probe_health(session: aiohttp.ClientSession, port: int) -> Health:
    """``GET /healthz`` of the worker listening on ``port`` (unhealthy when it does not answer)."""
    try:
        async with session.get(
            f"http://127.0.0.1:{port}/healthz", timeout=aiohttp.ClientTimeout(total=3)
        ) as response:
            body = loads(await response.read())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return Health(False, None)
    in_flight = body.get("in_flight") if isinstance(body, dict) else None
    return Health(response.status == 200, in_flight if isinstance(in_flight, int) else None)
