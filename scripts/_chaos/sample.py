"""What a chaos run samples while it runs: every ``SAMPLE_EVERY`` seconds the outbox's oldest
row and each worker's counters (publishes refused, dead letters, rows relayed: from its
``/metrics``), and now and then RabbitMQ's ``max_message_size`` (another user of the broker may
change it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import aiohttp
from sqlalchemy import text

from scripts.lab.harness.processes import WorkerProcess

from . import SAMPLE_EVERY
from .collector import counter_values
from .setup import Chaos, broker_max_message_size

BROKER_CHECK_EVERY = 60.0
"""Seconds between two looks at the broker's max_message_size (rabbitmqctl is not cheap)."""


async def sample(chaos: Chaos) -> None:
    """Every SAMPLE_EVERY seconds: the outbox's oldest row, and each worker's counters; the
    broker's max_message_size now and then (another user of the broker may change it)."""
    last_broker_check = time.monotonic()
    while True:
        await asyncio.sleep(SAMPLE_EVERY)
        oldest = await outbox_oldest(chaos)
        if oldest is not None:
            chaos.outbox_oldest_last = oldest
            chaos.outbox_oldest_max = max(chaos.outbox_oldest_max, oldest)
        for worker in list(chaos.slots):
            await read_counters(chaos, worker)
        if (
            chaos.args.broker_max_message_size
            and time.monotonic() - last_broker_check > BROKER_CHECK_EVERY
        ):
            last_broker_check = time.monotonic()
            await check_broker_limit(chaos)


async def outbox_oldest(chaos: Chaos) -> float | None:
    """Seconds since the oldest outbox row was written (0 when there is none); None when
    the database cannot tell."""
    try:
        async with chaos.engine_().connect() as connection:
            found = await connection.scalar(
                text("SELECT extract(epoch FROM now() - min(created_at))::float8 FROM outbox")
            )
    except Exception:
        return None
    return 0.0 if found is None else max(0.0, float(found))


async def read_counters(chaos: Chaos, worker: WorkerProcess) -> None:
    """Keep what ``worker``'s /metrics says of refused publishes and dead letters."""
    assert chaos.http is not None
    if not worker.alive():
        return
    try:
        async with chaos.http.get(
            f"http://127.0.0.1:{chaos.ports[worker.name]}/metrics",
            timeout=aiohttp.ClientTimeout(total=3),
        ) as response:
            exposition = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return
    chaos.counters[worker.name] = {
        name: counter_values(exposition, f"waystation_{name}")
        for name in ("publish_refusals", "dead_letters", "outbox_relayed")
    }


async def check_broker_limit(chaos: Chaos) -> None:
    with contextlib.suppress(Exception):
        chaos.broker_limit_seen.add(await broker_max_message_size())


def counter_totals(chaos: Chaos, name: str) -> dict[str, float]:
    """A counter summed over every process, each as last read."""
    total: Counter[str] = Counter()
    for counters in chaos.counters.values():
        total.update(counters.get(name, {}))
    return {label: value for label, value in sorted(total.items())}
