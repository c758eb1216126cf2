"""A rolling upgrade: a newer worker wrote an event this one cannot read. This worker must not
decide on the rest of the stream (it could contradict the unread event): it requeues the message
for a worker that can read it (each requeue counts toward the queue's delivery limit, after which
the broker dead-letters the message, to be replayed once every worker is upgraded)."""

from __future__ import annotations

import uuid

import pytest
from aio_pika.abc import AbstractChannel, AbstractQueue

from scripts.lab.harness.clients import RecordingClient
from waystation.events import NewEvent
from waystation.events.postgres import PostgresEventStore
from waystation.observability.metrics import Metrics
from waystation.settings import Settings

from ..support import eventually, publish_reply, running_worker, take
from .test_cancellation import cancel_app, ghost

pytestmark = pytest.mark.integration

__all__ = ["ghost"]  # the fixture, shared with the cancellation tests


@pytest.mark.timeout(60)
async def test_a_stream_with_an_event_from_a_newer_version_is_left_to_a_newer_worker(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    metrics = Metrics()
    async with (
        running_worker(cancel_app(), settings, store, metrics=metrics),
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        task_id = await client.submit("boss", {"k": 2})
        requests = {m.correlation_id: m for m in await take(ghost, 2)}
        # what a newer release appended meanwhile: a known type at a schema version from the
        # future (this code has no upcaster that brings it back)
        head = (await store.read_stream(task_id))[-1]
        await store.append(
            task_id,
            head.stream_version,
            [NewEvent(uuid.uuid4(), "DeadlineExtended", {"future": True}, {}, schema_version=99)],
            prev_hash=head.hash,
        )
        before = [e.event_type for e in await store.read_stream(task_id)]

        first = f"{task_id}:1:0"
        await publish_reply(amqp_channel, requests[first], {"status": "ok", "result": 1})

        async def requeued_twice() -> bool:
            return metrics.unreadable._value.get() >= 2

        await eventually(requeued_twice, 20, "the reply to be requeued, again and again")
        assert [e.event_type for e in await store.read_stream(task_id)] == before, (
            "the worker appended to a stream it cannot fully read"
        )
        assert not client.bodies(task_id), "no result from a half-read stream"
