"""Publishing with publisher confirms: persistent, mandatory, returns treated as errors."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange

from events import OutboxMessage

__all__ = ["Publisher"]


class Publisher:
    """Publishes :class:`~events.OutboxMessage` s on one confirming channel.

    A message the broker cannot route (no such queue) raises ``aiormq.exceptions.PublishError``;
    one it refuses raises ``DeliveryError``; a lost connection raises a connection error. The
    caller decides what each means.
    """

    def __init__(self, channel: AbstractChannel) -> None:
        self._channel = channel
        self._exchanges: dict[str, AbstractExchange] = {"": channel.default_exchange}

    async def _exchange(self, name: str) -> AbstractExchange:
        exchange = self._exchanges.get(name)
        if exchange is None:
            exchange = await self._channel.get_exchange(name, ensure=False)
            self._exchanges[name] = exchange
        return exchange

    async def publish(self, message: OutboxMessage) -> None:
        properties = message.properties
        exchange = await self._exchange(message.exchange)
        await exchange.publish(
            aio_pika.Message(
                message.body,
                message_id=message.message_id or None,
                correlation_id=properties.get("correlation_id"),
                reply_to=properties.get("reply_to"),
                type=properties.get("type"),
                content_type=properties.get("content_type"),
                headers=properties.get("headers") or None,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=message.routing_key,
            mandatory=True,
        )

    async def publish_all(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        """Publish all at once (confirms pipelined); the error of each, or None."""
        outcomes = await asyncio.gather(
            *(self.publish(message) for message in messages), return_exceptions=True
        )
        return [o if isinstance(o, BaseException) else None for o in outcomes]
