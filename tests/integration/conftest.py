"""Fixtures of the integration tests: a plain AMQP channel, and cleanup of test-only agents."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aio_pika
import pytest_asyncio
from aio_pika.abc import AbstractChannel

from ..harness.broker import delete_topology
from ..support import Services


@pytest_asyncio.fixture
async def amqp_channel(services: Services) -> AsyncIterator[AbstractChannel]:
    """A channel (publisher confirms on) of a plain aio-pika connection: the test's own peer or
    publisher, speaking nothing but the wire format."""
    connection = await aio_pika.connect(services.amqp_url)
    try:
        yield await connection.channel(publisher_confirms=True, on_return_raises=True)
    finally:
        await connection.close()


@pytest_asyncio.fixture
async def extra_agents(services: Services, queue_prefix: str) -> AsyncIterator[list[str]]:
    """Names of agents a test app declares besides the example's; their queues are deleted after."""
    agents: list[str] = []
    yield agents
    await delete_topology(services.amqp_url, queue_prefix, agents)
