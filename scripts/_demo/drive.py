"""The demo's drive: 500 tasks submitted at a pace, one worker SIGKILLed in the middle of a burst
and replaced, and the progress shown until every result is in (:mod:`.output`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from scripts.lab.harness.broker import broker_counters
from waystation.client import Client

from . import PREFIX, TASKS, WORK_MS, K
from .setup import Demo

SUBMIT_PER_S = 80.0
"""Submission pace, so the run lasts a few seconds and the kill lands in the middle of it."""
KILL_AFTER = TASKS // 2
BURST = 60
"""The tasks before the kill are submitted at once, so the killed worker surely has work."""
KILL_DELAY = 0.05
RESULT_TIMEOUT = 60.0
"""How long the results may take after the last submission."""


@dataclass
class Driven:
    """What the drive leaves for the checks."""

    task_ids: dict[str, int]
    """Each submitted task's ``n``, by task id."""
    results: dict[str, Any]
    """The result of each task that has one, by task id."""
    duplicate_messages: int
    """Result messages the client ignored: a second one for a task."""
    done: int
    """Results in when the drive ended."""
    broker_before: dict[str, int] | None
    broker_after: dict[str, int] | None
    """RabbitMQ's global counters around the drive (None when rabbitmqctl can't tell)."""


async def drive(demo: Demo, failures: list[str]) -> Driven:
    """Submit every task (the kill among them) and follow the results until all are in."""
    broker_before = broker_counters()
    async with Client(demo.amqp_url, queue_prefix=PREFIX) as client:
        task_ids: dict[str, int] = {}
        submitter = asyncio.create_task(submit_all(demo, client, task_ids))
        try:
            done = await follow(demo, client, task_ids, submitter, failures)
        finally:
            if not submitter.done():
                submitter.cancel()
                with contextlib.suppress(BaseException):
                    await submitter
        await asyncio.sleep(0.5)  # a duplicate result, if any, has time to arrive
        results = {t: client.results[t] for t in task_ids if t in client.results}
        duplicate_messages = client.duplicates
    broker_after = broker_counters()
    return Driven(task_ids, results, duplicate_messages, done, broker_before, broker_after)


async def submit_all(demo: Demo, client: Client, task_ids: dict[str, int]) -> None:
    for n in range(TASKS):
        task_ids[await client.submit("orchestrator", {"n": n, "k": K, "work_ms": WORK_MS})] = n
        if n + 1 == KILL_AFTER:
            # the burst just before is in the works: kill a worker in the middle of it
            await asyncio.sleep(KILL_DELAY)
            demo.killed = demo.workers[1]
            demo.killed.kill()
            demo.say(
                f"submitted {n + 1}/{TASKS} (the last {BURST} at once): "
                f"SIGKILL {demo.killed.name} (pid {demo.killed.pid}) mid-run"
            )
            demo.start_worker()
        if not KILL_AFTER - BURST <= n + 1 < KILL_AFTER:
            await asyncio.sleep(1 / SUBMIT_PER_S)


async def follow(
    demo: Demo,
    client: Client,
    task_ids: dict[str, int],
    submitter: asyncio.Task[None],
    failures: list[str],
) -> int:
    """Show the progress until every result is in (or the time is up); the results in."""
    deadline = time.monotonic() + TASKS / SUBMIT_PER_S + RESULT_TIMEOUT
    with demo.out.progress(TASKS) as show:
        while True:
            await asyncio.sleep(0.2)
            done = sum(1 for t in task_ids if t in client.results)
            show(done, len(task_ids), await demo.paused_now(), len(demo.alive()))
            if submitter.done():
                submitter.result()  # raise its error, if any
                if done == TASKS:
                    return done
            if time.monotonic() > deadline:
                failures.append(
                    f"only {done} of {TASKS} results within {RESULT_TIMEOUT:.0f}s "
                    f"after the last submission"
                )
                return done
