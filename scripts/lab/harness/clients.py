"""Publishers that keep every result message they receive, for checks that must see them all.

:class:`RecordingClient` is a :class:`~waystation.client.Client` that also keeps each result
message (duplicates included) and whether the broker delivered it again.
:class:`DurableResultCollector` does the same through a durable reply queue, so that results
published while its connection is down wait for it (outage and chaos runs).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from waystation.client import Client
from waystation.events import canonical
from waystation.events.codec import loads

from .broker import declare_quorum_queue


class RecordingClient(Client):
    """A :class:`Client` that also keeps every result message it receives, duplicates included.

    ``Client`` keeps the first result per task and only counts the rest; a check that must prove
    "exactly one distinct result" needs to see them all.
    """

    def __init__(self, amqp_url: str, *, queue_prefix: str = "waystation.") -> None:
        super().__init__(amqp_url, queue_prefix=queue_prefix)
        self.received: list[tuple[str | None, bytes]] = []
        """(task id, body) of every result message, in arrival order."""
        self.redelivered: Counter[str | None] = Counter()
        """Per task, result messages the broker delivered to this client again."""
        self._redelivered_flags: list[bool] = []

    async def __aenter__(self) -> RecordingClient:
        await self.connect()
        return self

    async def _on_result(self, message: AbstractIncomingMessage) -> None:
        self.received.append((message.correlation_id, bytes(message.body)))
        self._redelivered_flags.append(bool(message.redelivered))
        if message.redelivered:
            self.redelivered[message.correlation_id] += 1
        await super()._on_result(message)

    def messages(self) -> list[tuple[str | None, bytes, bool]]:
        """Every result message: (task id, body, whether the broker delivered it again)."""
        return [
            (task_id, body, redelivered)
            for (task_id, body), redelivered in zip(
                self.received, self._redelivered_flags, strict=True
            )
        ]

    def bodies(self, task_id: str) -> list[bytes]:
        """Every result body received for ``task_id``, in arrival order."""
        return [body for correlation_id, body in self.received if correlation_id == task_id]

    def distinct_results(self, task_id: str) -> set[bytes]:
        return {canonical(loads(body)) for body in self.bodies(task_id)}


class DurableResultCollector(RecordingClient):
    """A publisher whose results survive its own broker connection being closed.

    Its reply queue is a named durable quorum queue (``<prefix>test-results``) consumed with
    manual acks over a robust connection: results wait there while it reconnects, and one
    delivered but not yet acked when the connection dropped comes again (kept in ``received``,
    flagged redelivered). It submits like ``Client`` (same wire format) and records like
    :class:`RecordingClient`. ``reconnects`` counts how often the connection came back.
    """

    def __init__(
        self,
        amqp_url: str,
        *,
        queue_prefix: str = "waystation.",
        queue_name: str = "test-results",
        reconnect_interval: float = 1.0,
    ) -> None:
        super().__init__(amqp_url, queue_prefix=queue_prefix)
        self.queue_name = f"{queue_prefix}{queue_name}"
        self.connection_name = f"waystation test results {self.queue_name}"
        self.reconnects = 0
        self._reconnect_interval = reconnect_interval

    async def __aenter__(self) -> DurableResultCollector:
        await self.connect()
        return self

    async def connect(self) -> None:
        connection = await aio_pika.connect_robust(
            self.amqp_url,
            client_properties={"connection_name": self.connection_name},
            reconnect_interval=self._reconnect_interval,
        )
        connection.reconnect_callbacks.add(self._on_reconnect)
        self._connection = connection
        self._channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        self._reply_queue = await declare_quorum_queue(self._channel, self.queue_name)
        await self._reply_queue.consume(self._on_result)

    def _on_reconnect(self, *_: Any) -> None:
        self.reconnects += 1

    async def _on_result(self, message: AbstractIncomingMessage) -> None:
        await super()._on_result(message)
        await self._ack(message)

    @staticmethod
    async def _ack(message: AbstractIncomingMessage) -> None:
        try:
            await message.ack()
        except (
            aio_pika.exceptions.AMQPError,
            aio_pika.exceptions.ChannelInvalidStateError,
            ConnectionError,
        ):
            pass  # the channel died first: the broker delivers it again (a duplicate)

    async def close(self, *, delete_queue: bool = True) -> None:
        await super().close()
        if delete_queue:
            connection = await aio_pika.connect(self.amqp_url)
            try:
                await (await connection.channel()).queue_delete(self.queue_name)
            finally:
                await connection.close()
