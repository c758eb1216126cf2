"""Two deployments (two queue prefixes) sharing one database keep to their own outbox rows.

A deployment's worker relays the outbox rows its own deployment's writers left unpublished (G4),
and never another deployment's: those name queues of a broker setup it does not serve, and a row
it relayed would be deleted for good.
"""

from __future__ import annotations

import uuid

import pytest
from aio_pika.abc import AbstractChannel
from sqlalchemy import text

from scripts.lab.harness.broker import declare_quorum_queue, delete_topology, fresh_prefix
from scripts.lab.harness.database import fresh_database_url
from waystation import migrations
from waystation.events import GENESIS_HASH, NewEvent, OutboxMessage
from waystation.events.postgres import PostgresEventStore
from waystation.example import app as example_app
from waystation.settings import Settings

from ..conftest import EXAMPLE_AGENTS
from ..support import Services, count_rows, eventually, running_worker, take

pytestmark = pytest.mark.integration


async def commit_unpublished(store: PostgresEventStore, deployment: str, queue: str) -> str:
    """What a writer of ``deployment`` commits before it dies without publishing: an event and
    the outbox row of the message it implies (to ``queue``). Returns the message id."""
    message_id = f"{deployment}result-{uuid.uuid4()}"
    await store.append(
        f"deployments-{uuid.uuid4()}",
        0,
        [NewEvent(uuid.uuid4(), "Probe", {}, {"deployment": deployment, "worker_id": "died"})],
        prev_hash=GENESIS_HASH,
        outbox=[OutboxMessage(message_id, queue, b'{"status":"ok"}', {"type": "result"})],
        outbox_delay=0,  # the writer is gone: due for relaying at once
    )
    return message_id


@pytest.mark.timeout(120)
async def test_a_worker_relays_only_its_own_deployments_outbox_rows(
    settings: Settings,
    services: Services,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
) -> None:
    a = settings.model_copy(update={"worker_id": "deployment-a", "outbox_poll_interval": 0.1})
    b = settings.model_copy(
        update={
            "queue_prefix": fresh_prefix(),
            "worker_id": "deployment-b",
            "outbox_poll_interval": 0.1,
        }
    )
    inbox = await declare_quorum_queue(amqp_channel, f"{a.queue_prefix}inbox-{uuid.uuid4()}")
    try:
        of_a = await commit_unpublished(store, a.queue_prefix, inbox.name)
        async with running_worker(example_app, b, store):
            of_b = await commit_unpublished(store, b.queue_prefix, inbox.name)
            # a relay claims the oldest due rows first: once B's relay published B's row, written
            # after A's, it has passed A's by
            [first] = await take(inbox, 1, within=30)
            assert first.message_id == of_b, "B's relay published a row of deployment A"
        assert await inbox.get(fail=False) is None, "B's relay published a row of deployment A"
        assert await count_rows(store, "outbox", "message_id = :id", id=of_a) == 1
        async with running_worker(example_app, a, store):
            [relayed] = await take(inbox, 1, within=30)
            assert relayed.message_id == of_a

            async def forgotten() -> bool:
                return await count_rows(store, "outbox", "message_id = :id", id=of_a) == 0

            await eventually(forgotten, 30, "A's relay to delete the row it published")
    finally:
        await inbox.delete(if_unused=False, if_empty=False)
        await delete_topology(services.amqp_url, b.queue_prefix, EXAMPLE_AGENTS)


async def test_outbox_rows_written_before_the_outbox_knew_deployments_stay_claimable(
    services: Services,
) -> None:
    """Rows written under revision 0003 have no deployment after the upgrade to 0004: the relay
    of any deployment publishes them, as every relay did before."""
    url = fresh_database_url(services.admin_database_url)
    await migrations.upgrade(url, "0003")
    store = PostgresEventStore.from_url(url, pool_size=2)
    try:
        async with store.engine.connect() as connection:
            await connection.execute(
                text(
                    """
                    INSERT INTO outbox (message_id, stream_id, exchange, routing_key, properties,
                                        body)
                    VALUES ('written-under-0003', 's', '', 'q', '{}', '')
                    """
                )
            )
        await migrations.upgrade(url)
        assert await store.outbox_size(deployment="any-deployment.") == 1
        [entry] = await store.claim_outbox(deployment="any-deployment.")
        assert entry.message.message_id == "written-under-0003"
    finally:
        await store.close()
        await migrations.drop_database(url)
