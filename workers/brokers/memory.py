"""The broker port in memory: a real implementation, with the quorum-queue semantics the worker
relies on, for fast tests, the deterministic simulation, and trying handlers without services.

:class:`InMemoryBroker` is the broker (queues, exchanges, the delivery-limit policy); each worker
opens its own :class:`InMemoryConnection`, which implements the port (``waystation.brokers.port``):

* an unsettled delivery returns to the head of its queue when its connection drops or is closed;
* the broker counts deliveries that were not settled. ``counting="classic"`` (RabbitMQ before
  4.3): a requeue and a return both raise ``x-delivery-count``. ``counting="4.3"``: they raise
  only ``x-acquired-count``, and ``x-delivery-count`` (which the delivery limit reads) stays put;
* past the delivery limit the broker dead-letters the message through the queue's dead-letter
  exchange (``x-first-death-reason: delivery_limit``);
* a mandatory publish that no queue takes raises :class:`~waystation.brokers.port.Unroutable`;
* the broker can say no (``waystation.brokers.port``): a message whose routing key, properties or
headers
  AMQP cannot encode raises :class:`~waystation.brokers.port.Unsendable` before anything is sent;
  one larger than ``max_message_bytes`` raises it too (``too-large``); a queue declared with
  ``max_length`` and
  ``overflow="reject-publish"`` that is full nacks a publish, and so does the broker itself at
  ``nack_rate`` (:class:`~waystation.brokers.port.PublishRefused`);
* :meth:`InMemoryBroker.enqueue_raw` takes a message whose properties are raw bytes, as a
  hostile publisher writes them, and delivers what the AMQP backend would give for them
  (``waystation.brokers.metadata.guard_content_header``);
* a publish not yet confirmed when its connection drops raises
  :class:`~waystation.brokers.port.BrokerUnavailable`, and the message was kept or lost depending on
  whether the broker had received it;
* an ack sent just before a drop may be lost: the delivery then comes again.

Every wait is ``asyncio.sleep`` on the running loop, for ``latency(step)`` seconds when a latency
function is given (the simulation draws them from its seeded generator), so the interleavings
depend only on that function. Nothing here reads a clock or draws a random number of its own.

Why one module of some 590 lines: it is one model of RabbitMQ's semantics that the worker relies on,
and the broker, its queues and its connections share that model's state (deliveries held by a
connection return to their queue when it goes); the contract suite holds it against the real
RabbitMQ as one.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import random
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import pamqp.header

from waystation.brokers.metadata import check_encodable, guard_content_header
from waystation.brokers.port import (
    Broker,
    BrokerUnavailable,
    Delivery,
    DeliveryHandler,
    PublishRefused,
    Unroutable,
    Unsendable,
)
from waystation.events import OutboxMessage
from waystation.protocol.wire import Names

__all__ = ["InMemoryBroker", "InMemoryConnection", "StoredMessage"]

Counting = Literal["classic", "4.3"]
Latency = Callable[[str], float]

_PROPERTIES = ("message_id", "correlation_id", "reply_to", "type", "content_type", "user_id")
_HEADER_START = struct.Struct(">HHQ")


@dataclass(eq=False)
class StoredMessage:
    """A message as the broker keeps it in a queue."""

    body: bytes
    properties: dict[str, Any]
    headers: dict[str, Any]
    routing_key: str
    delivered: bool = False
    delivery_count: int = 0
    acquired_count: int = 0
    enqueued_at: float = 0.0
    """The loop's time when the broker took it."""
    fate: str | None = None
    """``acked``, ``dead-lettered`` or ``dropped`` once it left its queue for good."""
    published_by: int = 0
    """``id`` of the asyncio task that published it (for a simulation's invariants)."""

    def header_view(self) -> dict[str, Any]:
        headers = dict(self.headers)
        if self.delivery_count:
            headers["x-delivery-count"] = self.delivery_count
        if self.acquired_count:
            headers["x-acquired-count"] = self.acquired_count
        return headers


@dataclass(eq=False)
class _Consumer:
    connection: InMemoryConnection
    queue: str
    handler: DeliveryHandler
    prefetch: int
    epoch: int
    priority: int = 0
    unacked: dict[int, StoredMessage] = field(default_factory=dict)


@dataclass(eq=False)
class _Queue:
    name: str
    ready: collections.deque[StoredMessage] = field(default_factory=collections.deque)
    consumers: list[_Consumer] = field(default_factory=list)
    turn: int = 0
    delivery_limit: int | None = None
    dead_letter_exchange: str | None = None
    max_length: int | None = None
    """With ``overflow="reject-publish"``: a publish to the queue holding this many is nacked."""

    def full(self) -> bool:
        held = len(self.ready) + sum(len(c.unacked) for c in self.consumers)
        return self.max_length is not None and held >= self.max_length


class InMemoryBroker:
    """The broker: queues and exchanges in memory, shared by every connection to it."""

    def __init__(
        self,
        *,
        delivery_limit: int | None = 5,
        counting: Counting = "classic",
        latency: Latency | None = None,
        rng: random.Random | None = None,
        duplicate_rate: float = 0.0,
        keep_ledger: bool = False,
        max_message_bytes: int | None = None,
        nack_rate: float = 0.0,
    ) -> None:
        self.delivery_limit = delivery_limit
        self.max_message_bytes = max_message_bytes
        """RabbitMQ's ``max_message_size``: a larger body is refused (None: no limit)."""
        self.nack_rate = nack_rate
        """Share of publishes the broker nacks of itself (a queue without a leader, a full
        disk), drawn from ``rng``."""
        self.refused = 0
        """Publishes refused: nacked, or too large."""
        self.counting = counting
        self.latency = latency
        self.duplicate_rate = duplicate_rate
        """Share of routed messages enqueued twice (a publisher that retried a lost confirm)."""
        self._rng = rng or random.Random(0)
        self.queues: dict[str, _Queue] = {}
        self._fanouts: dict[str, list[str]] = {}
        self._tags = 0
        self.connections: list[InMemoryConnection] = []
        self.keep_ledger = keep_ledger
        self.duplicated = 0
        """Messages enqueued twice (``duplicate_rate``)."""
        self.returned = 0
        self.waiting = 0
        """Messages published for later that have not reached their queue yet (a wait queue)."""
        """Deliveries taken back unsettled because their connection dropped or was killed."""
        self.ledger: list[StoredMessage] = []
        """With ``keep_ledger``: every message the broker took, in order, with its fate."""

    # ---- administration (what a broker's operator or a test does) ----------------------------

    def declare_queue(self, name: str, *, max_length: int | None = None) -> None:
        """Declare ``name``; with ``max_length``, as a queue with ``x-max-length`` and
        ``x-overflow: reject-publish``."""
        queue = self.queues.setdefault(name, _Queue(name))
        if max_length is not None:
            queue.max_length = max_length

    def delete_queue(self, name: str) -> None:
        queue = self.queues.pop(name, None)
        if queue is not None:
            for message in queue.ready:
                message.fate = "dropped"
            for consumer in queue.consumers:
                consumer.connection.forget(consumer)

    def declare_fanout(self, exchange: str, queue: str) -> None:
        self.declare_queue(queue)
        bound = self._fanouts.setdefault(exchange, [])
        if queue not in bound:
            bound.append(queue)

    def apply_policy(self, names: Names) -> None:
        """The deployment's policy: delivery limit and dead-letter exchange on its queues."""
        for queue in self.queues.values():
            if queue.name.startswith(names.prefix) and queue.name != names.dead_letter_queue:
                queue.delivery_limit = self.delivery_limit
                queue.dead_letter_exchange = names.dead_letter_exchange

    def messages(self, queue: str) -> list[StoredMessage]:
        """The messages ready in ``queue`` (not delivered to anyone), in order."""
        found = self.queues.get(queue)
        return list(found.ready) if found else []

    def unsettled(self) -> int:
        """Deliveries handed out and not settled yet, over every queue."""
        return sum(len(c.unacked) for q in self.queues.values() for c in q.consumers)

    # ---- routing and delivery ----------------------------------------------------------------

    def route(self, exchange: str, routing_key: str) -> list[str]:
        if exchange == "":
            return [routing_key] if routing_key in self.queues else []
        return [q for q in self._fanouts.get(exchange, []) if q in self.queues]

    def enqueue_later(self, queues: Iterable[str], message: OutboxMessage, delay: float) -> None:
        """``enqueue`` after ``delay`` seconds; meanwhile the message counts in ``waiting``."""
        self.waiting += 1
        queues = list(queues)

        def arrive() -> None:
            self.waiting -= 1
            self.enqueue(queues, message)

        asyncio.get_running_loop().call_later(max(0.0, delay), arrive)

    def refusal(self, queues: Iterable[str], message: OutboxMessage) -> str | None:
        """Why the broker nacks ``message`` to ``queues`` (None: it takes it)."""
        full = [name for name in queues if self.queues[name].full()]
        if full:
            return f"queue {full[0]!r} is full (x-overflow: reject-publish)"
        if self.nack_rate and self._rng.random() < self.nack_rate:
            return "the broker nacked it"
        return None

    def enqueue_raw(self, queue: str, body: bytes, properties: bytes) -> None:
        """Put a message whose properties are ``properties`` as raw AMQP bytes (a content
        header's, after its flags' class, weight and body size) in ``queue``, delivered as the
        AMQP backend would decode them: what cannot be decoded is named in the headers."""
        payload, header = guard_content_header(_HEADER_START.pack(60, 0, len(body)) + properties)
        if header is None:  # replaced: what the AMQP backend's reader decodes then
            header = pamqp.header.ContentHeader()
            header.unmarshal(payload)
        p = header.properties
        given = {
            "message_id": p.message_id,
            "correlation_id": p.correlation_id,
            "reply_to": p.reply_to,
            "type": p.message_type,
            "content_type": p.content_type,
            "user_id": p.user_id,
        }
        self.enqueue([queue], OutboxMessage("", queue, body, {**given, "headers": p.headers}))

    def enqueue(self, queues: Iterable[str], message: OutboxMessage) -> None:
        properties = {
            "message_id": message.message_id or message.properties.get("message_id") or None,
            **{k: message.properties.get(k) for k in _PROPERTIES if k != "message_id"},
        }
        copies = 2 if self.duplicate_rate and self._rng.random() < self.duplicate_rate else 1
        self.duplicated += copies - 1
        now = asyncio.get_running_loop().time()
        publisher = id(asyncio.current_task())
        for name in queues:
            for _ in range(copies):
                stored = StoredMessage(
                    message.body,
                    dict(properties),
                    dict(message.properties.get("headers") or {}),
                    message.routing_key,
                    enqueued_at=now,
                    published_by=publisher,
                )
                self.queues[name].ready.append(stored)
                if self.keep_ledger:
                    self.ledger.append(stored)
        self.pump()

    def give_back(self, queue_name: str, message: StoredMessage) -> None:
        """A delivery comes back unsettled (requeued by its consumer, or returned because its
        connection went): counted, then dead-lettered past the delivery limit."""
        if self.counting == "classic":
            message.delivery_count += 1
        else:
            message.acquired_count += 1
        queue = self.queues.get(queue_name)
        if queue is None:
            message.fate = "dropped"
            return
        if queue.delivery_limit is not None and message.delivery_count > queue.delivery_limit:
            self._dead_letter(queue, message, "delivery_limit")
        else:
            queue.ready.appendleft(message)
        self.pump()

    def _dead_letter(self, queue: _Queue, message: StoredMessage, reason: str) -> None:
        targets = (
            self.route(queue.dead_letter_exchange, message.routing_key)
            if queue.dead_letter_exchange is not None
            else []
        )
        # without a dead-letter queue, RabbitMQ drops it
        message.fate = "dead-lettered" if targets else "dropped"
        headers = {
            **message.header_view(),
            "x-first-death-reason": reason,
            "x-first-death-queue": queue.name,
        }
        for target in targets:
            copy = StoredMessage(
                message.body,
                dict(message.properties),
                headers,
                queue.name,
                enqueued_at=message.enqueued_at,
            )
            self.queues[target].ready.append(copy)
            if self.keep_ledger:
                self.ledger.append(copy)

    def pump(self) -> None:
        """Hand ready messages to consumers with room, round robin within each queue."""
        for queue in list(self.queues.values()):
            while queue.ready and queue.consumers:
                consumer = self._next_consumer(queue)
                if consumer is None:
                    break
                message = queue.ready.popleft()
                self._tags += 1
                consumer.unacked[self._tags] = message
                consumer.connection.deliver(consumer, self._tags, message)
                message.delivered = True

    @staticmethod
    def _next_consumer(queue: _Queue) -> _Consumer | None:
        """The next consumer with room, of the highest priority that has one (RabbitMQ's
        consumer priorities); round robin among consumers of that priority."""
        count = len(queue.consumers)
        best: tuple[int, int] | None = None  # (priority, offset)
        for offset in range(count):
            consumer = queue.consumers[(queue.turn + offset) % count]
            if len(consumer.unacked) < consumer.prefetch and (
                best is None or consumer.priority > best[0]
            ):
                best = (consumer.priority, offset)
        if best is None:
            return None
        queue.turn = (queue.turn + best[1] + 1) % count
        return queue.consumers[(queue.turn - 1) % count]

    def connection(self, name: str, *, reconnect_after: float = 0.5) -> InMemoryConnection:
        connection = InMemoryConnection(self, name, reconnect_after=reconnect_after)
        self.connections.append(connection)
        return connection


class InMemoryConnection(Broker):
    """One worker's connection to an :class:`InMemoryBroker`; it reconnects by itself after
    :meth:`drop` (as aio-pika's robust connection does), never after :meth:`kill`."""

    def __init__(self, broker: InMemoryBroker, name: str, *, reconnect_after: float) -> None:
        self.broker = broker
        self.name = name
        self.reconnect_after = reconnect_after
        self._up = False
        self._dead = False
        self._epoch = 0
        self._wanted: list[tuple[str, DeliveryHandler, int, int]] = []
        self._consumers: list[_Consumer] = []
        self._running: dict[int, asyncio.Task[None]] = {}
        self._context = contextvars.copy_context()
        self.on_sent: Callable[[OutboxMessage], None] | None = None
        """Called when the broker took a publish and its confirm is on its way back."""
        self.on_refused: Callable[[OutboxMessage, str], None] | None = None
        """Called when the broker refused a publish (a nack, a size), with why."""

    async def _wait(self, step: str) -> None:
        await asyncio.sleep(self.broker.latency(step) if self.broker.latency else 0)

    def _require_up(self) -> int:
        if not self._up:
            raise BrokerUnavailable(f"connection {self.name!r} is down")
        return self._epoch

    async def connect(self) -> None:
        if self._dead:
            raise BrokerUnavailable(f"connection {self.name!r} was killed")
        await self._wait("connect")
        # deliveries run in the context of whoever connected (as aiormq's reader task does),
        # each in a copy of its own
        self._context = contextvars.copy_context()
        self._up = True

    async def close(self) -> None:
        self._drop()
        self._dead = True

    @property
    def connected(self) -> bool:
        return self._up

    async def declare(self, names: Names, agents: Iterable[str]) -> None:
        self._require_up()
        await self._wait("declare")
        self.broker.declare_fanout(names.dead_letter_exchange, names.dead_letter_queue)
        for agent in agents:
            self.broker.declare_queue(names.tasks(agent))
            for queue in names.reply_queues(agent):
                self.broker.declare_queue(queue)
        self.broker.apply_policy(names)

    async def consume(
        self, queue: str, handler: DeliveryHandler, *, prefetch: int, priority: int = 0
    ) -> None:
        self._require_up()
        if queue not in self.broker.queues:
            raise BrokerUnavailable(f"no queue {queue!r}: the broker closed the channel")
        self._wanted.append((queue, handler, prefetch, priority))
        self._subscribe(queue, handler, prefetch, priority)

    def _subscribe(
        self, queue: str, handler: DeliveryHandler, prefetch: int, priority: int
    ) -> None:
        found = self.broker.queues.get(queue)
        if found is None:
            return
        consumer = _Consumer(self, queue, handler, prefetch, self._epoch, priority)
        self._consumers.append(consumer)
        found.consumers.append(consumer)
        self.broker.pump()

    async def cancel_consumers(self) -> None:
        self._wanted.clear()
        for consumer in self._consumers:
            queue = self.broker.queues.get(consumer.queue)
            if queue is not None and consumer in queue.consumers:
                queue.consumers.remove(consumer)
        # their unsettled deliveries stay settleable through self._consumers

    @property
    def consumers(self) -> int:
        return len(self._wanted) if self._up else 0

    def forget(self, consumer: _Consumer) -> None:
        """The broker deleted ``consumer``'s queue."""
        if consumer in self._consumers:
            self._consumers.remove(consumer)
        self._wanted = [w for w in self._wanted if w[0] != consumer.queue]

    def deliver(self, consumer: _Consumer, tag: int, message: StoredMessage) -> None:
        headers = message.header_view()
        delivery = Delivery(
            queue=consumer.queue,
            body=message.body,
            headers=headers,
            redelivered=message.delivered,
            broker_count=max(message.delivery_count, message.acquired_count),
            handle=(consumer, tag),
            **{k: message.properties.get(k) for k in _PROPERTIES},
        )

        async def run() -> None:
            try:
                await self._wait("deliver")
                await consumer.handler(delivery)
            finally:
                self._running.pop(tag, None)

        self._running[tag] = asyncio.get_running_loop().create_task(
            run(), context=self._context.copy()
        )

    async def publish(self, message: OutboxMessage) -> None:
        await self._publish(message, None)

    async def publish_later(self, message: OutboxMessage, delay: float) -> None:
        await self._publish(message, delay)

    async def _publish(self, message: OutboxMessage, delay: float | None) -> None:
        check_encodable(message)  # the client refuses it: nothing is sent
        epoch = self._require_up()
        await self._wait("publish")
        if not self._up or self._epoch != epoch:
            # lost on the way: the broker never saw it
            raise BrokerUnavailable(f"connection {self.name!r} dropped before the publish")
        limit = self.broker.max_message_bytes
        if limit is not None and len(message.body) > limit:
            # (RabbitMQ closes the channel it came on: the AMQP backend sends a large message
            # on a channel of its own, so that this costs it alone)
            self.broker.refused += 1
            detail = f"message size {len(message.body)} is larger than the broker's maximum {limit}"
            if self.on_refused is not None:
                self.on_refused(message, detail)
            raise Unsendable(message.message_id, detail, reason="too-large")
        queues = self.broker.route(message.exchange, message.routing_key)
        refused = self.broker.refusal(queues, message) if queues else None
        if refused is None and queues:
            if delay is None:
                self.broker.enqueue(queues, message)
            else:
                # kept by the broker while it waits (a wait queue), whatever this connection does
                self.broker.enqueue_later(queues, message, delay)
        elif refused is not None:
            self.broker.refused += 1
        if refused is not None:
            if self.on_refused is not None:
                self.on_refused(message, refused)
        elif self.on_sent is not None:
            self.on_sent(message)
        await self._wait("confirm")
        if not self._up or self._epoch != epoch:
            # kept (if routed), but the confirm is lost
            raise BrokerUnavailable(f"connection {self.name!r} dropped before the confirm")
        if not queues:
            raise Unroutable(message.message_id, message.routing_key)
        if refused is not None:
            raise PublishRefused(message.message_id, refused)

    def _owned(self, delivery: Delivery) -> tuple[_Consumer, int]:
        consumer, tag = delivery.handle
        if (
            not self._up
            or consumer.connection is not self
            or consumer.epoch != self._epoch
            or tag not in consumer.unacked
        ):
            raise BrokerUnavailable("the delivery's channel is gone")
        return consumer, tag

    async def ack(self, delivery: Delivery) -> None:
        consumer, tag = self._owned(delivery)
        epoch = self._epoch
        await self._wait("ack")
        if self._epoch == epoch and tag in consumer.unacked:  # else the ack was lost in the drop
            consumer.unacked.pop(tag).fate = "acked"
            self.broker.pump()

    async def requeue(self, delivery: Delivery) -> None:
        consumer, tag = self._owned(delivery)
        epoch = self._epoch
        await self._wait("ack")
        if self._epoch == epoch and tag in consumer.unacked:
            self.broker.give_back(consumer.queue, consumer.unacked.pop(tag))

    def settleable(self, delivery: Delivery) -> bool:
        try:
            self._owned(delivery)
        except BrokerUnavailable:
            return False
        return True

    # ---- faults -------------------------------------------------------------------------------

    def _drop(self) -> None:
        if not self._up:
            return
        self._up = False
        self._epoch += 1
        for consumer in self._consumers:
            queue = self.broker.queues.get(consumer.queue)
            if queue is not None and consumer in queue.consumers:
                queue.consumers.remove(consumer)
            unacked, consumer.unacked = consumer.unacked, {}
            self.broker.returned += len(unacked)
            for tag, message in unacked.items():
                task = self._running.pop(tag, None)
                if task is not None:
                    task.cancel()  # as aiormq cancels a closed channel's consumer tasks
                self.broker.give_back(consumer.queue, message)
        self._consumers = []

    def drop(self) -> None:
        """The connection drops (a network fault, ``close_all_connections``); it comes back
        after ``reconnect_after`` seconds with its consumers."""
        if self._dead or not self._up:
            return
        self._drop()
        asyncio.get_running_loop().call_later(self.reconnect_after, self._restore)

    def _restore(self) -> None:
        if self._dead or self._up:
            return
        self._up = True
        for queue, handler, prefetch, priority in self._wanted:
            self._subscribe(queue, handler, prefetch, priority)

    def kill(self) -> None:
        """The worker's process died: the connection drops for good."""
        self._drop()
        self._dead = True
