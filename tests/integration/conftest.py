"""Fixtures of the integration tests: a plain AMQP channel, cleanup of test-only agents, the
file test apps' workers write their runs to, and a database or log of a test's own."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika
import pytest
import pytest_asyncio
from aio_pika.abc import AbstractChannel
from sqlalchemy.ext.asyncio import AsyncEngine

from scripts.lab.harness.broker import delete_topology
from scripts.lab.harness.database import fresh_database_url
from waystation import migrations
from waystation.events.postgres import PostgresEventStore
from waystation.projections.postgres import create_engine
from waystation.settings import Settings

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


@pytest.fixture
def runs_file(tmp_path: Path) -> Path:
    """A file the worker processes of a test app write their runs to (``tests/apps``)."""
    return tmp_path / "runs.txt"


@pytest_asyncio.fixture
async def extra_agents(services: Services, queue_prefix: str) -> AsyncIterator[list[str]]:
    """Names of agents a test app declares besides the example's; their queues are deleted after."""
    agents: list[str] = []
    yield agents
    await delete_topology(services.amqp_url, queue_prefix, agents)


@pytest_asyncio.fixture
async def log_db(services: Services) -> AsyncIterator[tuple[PostgresEventStore, AsyncEngine]]:
    """A fresh database of this test's own: the log's store and an engine for projections."""
    url = fresh_database_url(services.admin_database_url)
    await migrations.upgrade(url)
    store = PostgresEventStore.from_url(url, pool_size=10)
    engine = create_engine(url)
    try:
        yield store, engine
    finally:
        await engine.dispose()
        await store.close()
        await migrations.drop_database(url)


@pytest_asyncio.fixture
async def own_log(
    services: Services, settings: Settings
) -> AsyncIterator[tuple[Settings, PostgresEventStore]]:
    """Settings and a store for a fresh database of this test's own, dropped afterwards: for a
    test that reads the whole log (``verify``, ``export``, the projections)."""
    url = fresh_database_url(services.admin_database_url)
    await migrations.upgrade(url)
    store = PostgresEventStore.from_url(url, pool_size=3)
    try:
        yield settings.model_copy(update={"database_url": url}), store
    finally:
        await store.close()
        await migrations.drop_database(url)
