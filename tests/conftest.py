"""Fixtures: real PostgreSQL and RabbitMQ, one database per test run, one queue prefix per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from scripts.lab.harness.broker import delete_topology, fresh_prefix
from scripts.lab.harness.database import fresh_database_url
from waystation import migrations
from waystation.events.postgres import PostgresEventStore
from waystation.settings import Settings

from .support import Capability, Services, reachable, require, started_services

EXAMPLE_AGENTS = ("orchestrator", "researcher")
SIMULATION_TEST = "test_every_invariant_holds_over_ten_thousand_seeds"


def pytest_collection_finish(session: pytest.Session) -> None:
    """When the session runs the 10,000-seed simulation among other tests, its seeds start
    now, in one background process at a low priority (CPU the other tests leave idle): the
    simulation's test then runs only what is left (``scripts.lab.simulation.runner.HeadStart``)."""
    if session.config.option.collectonly:
        return
    names = [item.name for item in session.items]
    if SIMULATION_TEST in names and len(names) > 1:
        from scripts.lab.simulation.runner import HEAD_START, HeadStart, default_seeds

        session.config.stash[HEAD_START] = HeadStart(default_seeds())


def pytest_sessionfinish(session: pytest.Session) -> None:
    from scripts.lab.simulation.runner import HEAD_START

    head_start = session.config.stash.get(HEAD_START, None)
    if head_start is not None:
        head_start.close()


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    with started_services() as found:
        missing = [
            name
            for name, url, port in (
                ("PostgreSQL", found.admin_database_url, 5432),
                ("RabbitMQ", found.amqp_url, 5672),
            )
            if not reachable(url, port)
        ]
        require(
            Capability(
                "the real PostgreSQL and RabbitMQ",
                f"{' and '.join(missing)} cannot be reached" if missing else None,
            ),
            "this test",
        )
        yield found


@pytest_asyncio.fixture(scope="session")
async def database_url(services: Services) -> AsyncIterator[str]:
    """A database of this test run's own, migrated to head, dropped at the end."""
    url = fresh_database_url(services.admin_database_url)
    await migrations.upgrade(url)
    yield url
    await migrations.drop_database(url)


@pytest_asyncio.fixture
async def store(database_url: str) -> AsyncIterator[PostgresEventStore]:
    store = PostgresEventStore.from_url(database_url, pool_size=5)
    yield store
    await store.close()


@pytest_asyncio.fixture
async def queue_prefix(services: Services) -> AsyncIterator[str]:
    """A queue prefix of this test's own; its queues and exchanges are deleted afterwards."""
    prefix = fresh_prefix()
    yield prefix
    await delete_topology(services.amqp_url, prefix, EXAMPLE_AGENTS)


@pytest.fixture
def settings(services: Services, database_url: str, queue_prefix: str) -> Settings:
    """Worker settings for this test: its own queues, short outbox delay, no broker policy."""
    return Settings(
        database_url=database_url,
        amqp_url=services.amqp_url,
        queue_prefix=queue_prefix,
        broker_policy="none",
        outbox_delay=1.0,
        outbox_poll_interval=0.2,
        concurrency=16,
        shutdown_grace=5.0,
    )
