"""The broker port: the only way a worker reaches RabbitMQ.

A backend (``waystation.brokers.amqp.broker.AmqpBroker`` on aio-pika, ``waystation.brokers.memory``
in memory) gives the worker deliveries, publishes with confirms, and settles deliveries. It keeps
the quorum-queue semantics the worker relies on.

Contract (the shared suite in ``tests/contract/test_broker.py`` runs it against every backend):

* ``declare(names, agents)`` declares, idempotently, each agent's task and reply queues (durable
  quorum queues) and the deployment's dead-letter exchange (fanout) and queue.
* ``consume(queue, handler, prefetch=…)`` calls ``handler`` with each :class:`Delivery` of
  ``queue``, at most ``prefetch`` unsettled at once, each in a task of its own. Delivery order
  is the queue's order; a delivery that returns to its queue comes again with
  ``redelivered=True``. ``cancel_consumers()`` stops new deliveries (unsettled ones stay
  settleable). A delivery goes to a consumer of the highest ``priority`` among the queue's
  consumers with room (round robin among equals): a lower one gets deliveries only while every
  higher one holds its ``prefetch`` (RabbitMQ's consumer priorities, ``x-priority``).
* ``publish(message)`` sends a persistent, mandatory message and returns once the broker has
  confirmed it. It raises :class:`Unroutable` when no queue took it (the broker returned it),
  :class:`PublishRefused` when the broker refused it (a negative confirm: a full queue that
  rejects publishes, a queue without a leader; it may pass later), :class:`Unsendable` when the
  message can never be published as it is (larger than the broker takes, or a property or
  header AMQP cannot encode: nothing was sent), and :class:`BrokerUnavailable` when the
  connection or channel went before the confirm came: then whether the message was kept is
  unknown (it may be delivered or not), so a caller that must not lose it keeps it elsewhere
  (the outbox). A refusal is the fault of that message alone: the others published with it
  are confirmed, or fail with :class:`BrokerUnavailable`, on their own.
* ``publish_later(message, delay)`` is ``publish``, but the message reaches its queue only after
  ``delay`` seconds or a little more (never sooner), waiting in the broker meanwhile (a wait queue
  whose messages go on to their queue when their time is up): no worker holds it while it waits.
* ``ack(delivery)`` forgets a delivery; ``requeue(delivery)`` returns it to its queue. Either
  raises :class:`BrokerUnavailable` when the delivery's channel is gone: the broker has already
  returned it to its queue and delivers it again, so the redelivery must be recognised (G1).
  A delivery is settled once: settling it again raises :class:`BrokerUnavailable` and changes
  nothing (it is no longer ``settleable``).
* When the connection drops, every unsettled delivery returns to its queue, the handlers still
  running on them are cancelled (aiormq cancels a closed channel's consumer tasks), and
  publishes not yet confirmed end with :class:`BrokerUnavailable`. The connection comes back by
  itself and consuming resumes; ``connected`` says which state it is in.
* A delivery's ``broker_count`` is how many times the broker says it was delivered before
  without being settled: RabbitMQ's ``x-delivery-count``, or ``x-acquired-count`` where the broker
  has it (4.3 and later, whose ``x-delivery-count`` no longer counts a requeue or a dropped
  consumer). Counting a task's attempts does not rest on it alone (``waystation.runtime.settle``).
* Quorum-queue policy: a message delivered more than the delivery limit times without being
  settled is dead-lettered by the broker itself through the dead-letter exchange.

* Incoming metadata is hostile input: a delivery whose properties or headers cannot be decoded
  still comes, with what could be decoded and the header ``x-waystation-undecodable`` saying
  what could not (``waystation.brokers.metadata``); the connection stays up.

Errors::

    BrokerError
    ├── BrokerUnavailable   the connection or channel is gone; it comes back, retry then
    ├── Unroutable          a mandatory publish no queue took (the broker returned it)
    └── PublishRefused      the broker refused (nacked) a publish; it may pass later
        └── Unsendable      it can never be published as it is (too large, cannot be encoded)
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from waystation.events import OutboxMessage
from waystation.protocol.wire import Names

__all__ = [
    "Broker",
    "BrokerError",
    "BrokerUnavailable",
    "Delivery",
    "DeliveryHandler",
    "PublishRefused",
    "Unroutable",
    "Unsendable",
]


class BrokerError(Exception):
    """Base class of every error the broker port raises."""


class BrokerUnavailable(BrokerError):
    """The connection (or the channel) is gone. It is being restored; retry afterwards."""


class Unroutable(BrokerError):
    """No queue took a mandatory publish: the broker returned it (``routing_key`` names none)."""

    def __init__(self, message_id: str, routing_key: str) -> None:
        super().__init__(f"message {message_id!r} to {routing_key!r}: no queue takes it")
        self.message_id = message_id
        self.routing_key = routing_key


class PublishRefused(BrokerError):
    """The broker refused a publish (a negative confirm); the same message may pass later.

    ``reason`` is machine-readable (``refused``, or an :class:`Unsendable`'s)."""

    reason = "refused"

    def __init__(self, message_id: str, detail: str) -> None:
        super().__init__(f"message {message_id!r}: {detail}")
        self.message_id = message_id
        self.detail = detail


class Unsendable(PublishRefused):
    """The message can never be published as it is; nothing of it was sent. ``reason``:
    ``too-large`` (over the broker's ``max_message_size``) or ``unencodable`` (a property or
    header AMQP cannot encode, such as a short string over 255 bytes)."""

    def __init__(self, message_id: str, detail: str, *, reason: str) -> None:
        super().__init__(message_id, detail)
        self.reason = reason


@dataclass(frozen=True, slots=True, eq=False)
class Delivery:
    """A message handed to a consumer, not settled yet."""

    queue: str
    body: bytes
    message_id: str | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    type: str | None = None
    content_type: str | None = None
    user_id: str | None = None
    """The AMQP user that published it, when the publisher set it (RabbitMQ validates it)."""
    headers: Mapping[str, Any] = field(default_factory=dict)
    redelivered: bool = False
    broker_count: int = 0
    """Earlier deliveries of this message the broker counted (see the module docstring)."""
    handle: Any = field(default=None, repr=False)
    """The backend's own reference to the delivery (channel and tag): only it reads this."""


DeliveryHandler = Callable[[Delivery], Awaitable[None]]


class Broker(abc.ABC):
    """A connection to the broker for one worker: consume, publish, settle."""

    @abc.abstractmethod
    async def connect(self) -> None:
        """Open the connection (it reconnects by itself when it drops)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the connection: unsettled deliveries go back to their queues."""

    @property
    @abc.abstractmethod
    def connected(self) -> bool:
        """True while the connection is up."""

    @abc.abstractmethod
    async def declare(self, names: Names, agents: Iterable[str]) -> None:
        """Declare the deployment's queues and dead-letter exchange (idempotent)."""

    @abc.abstractmethod
    async def consume(
        self, queue: str, handler: DeliveryHandler, *, prefetch: int, priority: int = 0
    ) -> None:
        """Start handing ``queue``'s deliveries to ``handler`` (see the contract)."""

    @abc.abstractmethod
    async def cancel_consumers(self) -> None:
        """Stop every consumer of this connection; unsettled deliveries stay settleable."""

    @property
    @abc.abstractmethod
    def consumers(self) -> int:
        """How many consumers this connection runs right now."""

    @abc.abstractmethod
    async def publish(self, message: OutboxMessage) -> None:
        """Publish ``message`` (persistent, mandatory) and wait for the broker's confirm."""

    @abc.abstractmethod
    async def publish_later(self, message: OutboxMessage, delay: float) -> None:
        """Publish ``message`` to reach its queue after ``delay`` seconds (see the contract)."""

    async def publish_all(self, messages: Sequence[OutboxMessage]) -> list[BrokerError | None]:
        """Publish all of ``messages`` at once (their confirms awaited together; one with a
        ``delay`` through :meth:`publish_later`); the error of each, or None. One message's
        failure is its own: an error other than a :class:`BrokerError` (the client library
        failing on it) is that message's :class:`Unsendable`, never the batch's."""
        outcomes = await asyncio.gather(
            *(
                self.publish_later(message, message.delay)
                if message.delay > 0
                else self.publish(message)
                for message in messages
            ),
            return_exceptions=True,
        )
        errors: list[BrokerError | None] = []
        for message, outcome in zip(messages, outcomes, strict=True):
            if isinstance(outcome, BrokerError):
                errors.append(outcome)
            elif isinstance(outcome, Exception):
                detail = f"the client failed to publish it: {outcome!r}"[:500]
                errors.append(Unsendable(message.message_id, detail, reason="unencodable"))
            elif isinstance(outcome, BaseException):
                raise outcome  # (a cancellation)
            else:
                errors.append(None)
        return errors

    @abc.abstractmethod
    async def ack(self, delivery: Delivery) -> None:
        """Settle ``delivery`` for good."""

    @abc.abstractmethod
    async def requeue(self, delivery: Delivery) -> None:
        """Return ``delivery`` to its queue, to be delivered again."""

    @abc.abstractmethod
    def settleable(self, delivery: Delivery) -> bool:
        """False once ``delivery`` is settled or its channel is gone (the broker has taken it
        back)."""
