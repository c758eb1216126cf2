"""The publisher client's memory stays bounded (``workers/client.py``).

It keeps the most recent ``keep_results`` results, and forgets a task it waits for once the last
``result()`` call waiting for it gives up (times out or is cancelled). Results are published
straight to its reply queue, as any worker would.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator

import aio_pika
import pytest
import pytest_asyncio
from aio_pika.abc import AbstractChannel

from waystation.client import Client
from waystation.events.codec import dumps

from ..support import Services, eventually

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def client(services: Services, queue_prefix: str) -> AsyncIterator[Client]:
    async with Client(services.amqp_url, queue_prefix=queue_prefix) as client:
        yield client


@pytest_asyncio.fixture
async def keeping_three(services: Services, queue_prefix: str) -> AsyncIterator[Client]:
    async with Client(services.amqp_url, queue_prefix=queue_prefix, keep_results=3) as client:
        yield client


async def answer(channel: AbstractChannel, client: Client, task_id: str, value: object) -> None:
    """Publish the result of ``task_id`` to the client's reply queue."""
    assert client._reply_queue is not None
    await channel.default_exchange.publish(
        aio_pika.Message(dumps({"status": "ok", "result": value}), correlation_id=task_id),
        routing_key=client._reply_queue.name,
    )


async def test_the_client_keeps_only_the_most_recent_results(
    keeping_three: Client, amqp_channel: AbstractChannel
) -> None:
    client = keeping_three
    for n in range(1, 6):
        await answer(amqp_channel, client, f"task-{n}", n)
    await eventually(lambda: "task-5" in client.results, 20, "the last result")  # in order
    assert list(client.results) == ["task-3", "task-4", "task-5"]
    assert client.results_received == 5
    assert (await client.result("task-4", 1)).result == 4
    # a repeat of a kept result is a duplicate, not a new result
    await answer(amqp_channel, client, "task-5", 5)
    await eventually(lambda: client.duplicates == 1, 20, "the repeat to be counted")
    assert list(client.results) == ["task-3", "task-4", "task-5"]


async def test_a_task_waited_for_in_vain_is_forgotten(client: Client) -> None:
    with pytest.raises(TimeoutError):
        await client.result("never-answered", 0.05)
    assert "never-answered" not in client._waiters

    waiting = asyncio.create_task(client.result("abandoned"))
    await eventually(lambda: "abandoned" in client._waiters, 20, "the wait to begin")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert "abandoned" not in client._waiters


async def test_several_waits_for_one_task_all_get_its_result_whichever_give_up(
    client: Client, amqp_channel: AbstractChannel
) -> None:
    patient = asyncio.create_task(client.result("shared"))
    bounded = asyncio.create_task(client.result("shared", 60))
    cancelled = asyncio.create_task(client.result("shared"))
    with pytest.raises(TimeoutError):
        await client.result("shared", 0.05)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert "shared" in client._waiters, "the waits still going lost their waiter"
    await answer(amqp_channel, client, "shared", "done")
    assert [(await w).result for w in (patient, bounded)] == ["done", "done"]
    assert client._waiters == {}
    assert (await client.result("shared", 0)).result == "done"


def test_after_the_client_connects_pamqps_functions_are_pamqps_own(services: Services) -> None:
    """The client reads its frames through a guard of its own connection's transport; nothing of
    pamqp (nor of aiormq, which calls it for every frame) is replaced in the process, so a
    user's own aio-pika code beside it is untouched. (A fresh process: a worker's broker in this
    test session installs the frames' dispatcher.)"""
    code = (
        "import asyncio, sys, pamqp.frame\n"
        "marshal, unmarshal = pamqp.frame.marshal, pamqp.frame.unmarshal\n"
        "from waystation import Client\n"
        "async def main():\n"
        "    async with Client(sys.argv[1], queue_prefix='pamqp-own.') as client:\n"
        "        assert client._connection is not None and not client._connection.is_closed\n"
        "        own = pamqp.frame.marshal is marshal and pamqp.frame.unmarshal is unmarshal\n"
        "    print('own' if own else 'replaced')\n"
        "asyncio.run(main())\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code, services.amqp_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert shown == "own"
