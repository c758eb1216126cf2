"""A world for one embedded test: an in-memory broker, store and pool slots, workers, and a
publisher."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

from waystation.agent import App
from waystation.brokers.amqp.topology import policy_definition
from waystation.brokers.memory import InMemoryBroker, InMemoryConnection
from waystation.brokers.port import Delivery
from waystation.events import OutboxMessage
from waystation.events.codec import dumps, loads
from waystation.events.memory import InMemoryEventStore
from waystation.protocol.wire import CONTENT_TYPE, Names
from waystation.runtime.worker import Worker
from waystation.settings import Settings
from waystation.testing import InMemoryPool

PREFIX = "mem."
RESULTS = "mem.test-results"
WITHIN = 30.0


def settings(**overrides: Any) -> Settings:
    base = {
        "queue_prefix": PREFIX,
        "broker_policy": "none",
        "delivery_limit": 3,
        "outbox_delay": 1.0,
        "outbox_poll_interval": 0.2,
        "sweep_interval": 0.2,
        "shutdown_grace": 2.0,
        "metrics_port": 0,
    }
    return Settings(**{**base, **overrides})


class World(InMemoryPool):
    """The test kit's in-memory pool of ``app`` (``waystation.testing``), its workers started
    one by one, with a publisher of its own that sends any message a test needs and collects
    every answer (in ``answers``, by correlation id)."""

    def __init__(
        self,
        app: App,
        config: Settings,
        *,
        counting: str = "classic",
        store: InMemoryEventStore | None = None,
    ) -> None:
        names = Names(config.queue_prefix)
        _, policy = policy_definition(names, config.delivery_limit)
        limit = policy["delivery-limit"]
        assert isinstance(limit, int)
        broker = InMemoryBroker(delivery_limit=limit, counting=counting)  # type: ignore[arg-type]
        super().__init__(app, workers=0, settings=config, broker=broker, store=store)
        self.answers: dict[str, list[Any]] = defaultdict(list)
        self.publisher: InMemoryConnection = self.broker.connection("publisher")

    async def start_worker(self, name: str = "w") -> Worker:
        return await self.add_worker(name)

    async def open(self) -> None:
        await self.start()
        await self.publisher.connect()
        await self.publisher.declare(self.names, self.app.agents)
        self.broker.declare_queue(RESULTS)
        await self.publisher.consume(RESULTS, self._collect, prefetch=100)

    async def _collect(self, delivery: Delivery) -> None:
        self.answers[delivery.correlation_id or ""].append(loads(delivery.body))
        await self.publisher.ack(delivery)

    async def publish(
        self,
        agent: str,
        body: Any,
        *,
        message_id: str | None = None,
        kind: str = "task",
        reply_to: str | None = RESULTS,
        correlation_id: str | None = None,
    ) -> str:
        message_id = message_id or str(uuid.uuid4())
        await self.publisher.publish(
            OutboxMessage(
                message_id=message_id,
                routing_key=self.names.tasks(agent),
                body=dumps(body),
                properties={
                    "type": kind,
                    "correlation_id": correlation_id or message_id,
                    "reply_to": reply_to,
                    "content_type": CONTENT_TYPE,
                },
            )
        )
        return message_id

    async def answer(self, correlation_id: str) -> Any:
        await eventually(lambda: bool(self.answers.get(correlation_id)), f"{correlation_id}")
        return self.answers[correlation_id][0]

    async def taken_by_a_holder(self, queue: str) -> tuple[InMemoryConnection, list[Delivery]]:
        """A connection of its own that takes ``queue``'s next delivery and holds it, unsettled
        (``kill()`` it and the delivery is redelivered, as when a worker dies holding it)."""
        holder = self.broker.connection("holder")
        await holder.connect()
        held: list[Delivery] = []

        async def hold(delivery: Delivery) -> None:
            held.append(delivery)

        await holder.consume(queue, hold, prefetch=1)
        return holder, held

    async def close(self) -> None:
        await super().close()
        await self.publisher.close()


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def world(app: App, config: Settings | None = None, **options: Any) -> AsyncIterator[World]:
    opened = World(app, config or settings(), **options)
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()
