"""The broker port's contract (``workers/brokers/port.py``), run against every backend.

:class:`BrokerContract` holds the suite; each backend's class provides ``backend``: how to open a
connection, how to make one drop (it comes back by itself), and the deployment's names. The
aio-pika backend runs against the real RabbitMQ (its queues are deleted afterwards; a drop is
``rabbitmqctl close_connection``), the in-memory one against :class:`InMemoryBroker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aio_pika
import pytest
import pytest_asyncio

from scripts.lab.harness.broker import (
    broker_size_limit,
    close_broker_connections,
    delete_topology,
    fresh_prefix,
    publish_raw_properties,
)
from waystation.brokers.amqp import frames
from waystation.brokers.amqp.broker import AmqpBroker
from waystation.brokers.amqp.topology import clear_policy, policy_definition
from waystation.brokers.memory import InMemoryBroker, InMemoryConnection
from waystation.brokers.metadata import HEADER_RAW, HEADER_UNDECODABLE
from waystation.brokers.port import (
    Broker,
    BrokerUnavailable,
    Delivery,
    PublishRefused,
    Unroutable,
    Unsendable,
)
from waystation.events import OutboxMessage
from waystation.protocol.wire import Names

from ..support import Services, require

AGENT = "agent"
EVEN = {"m-0", "m-2", "m-4"}
WITHIN = 30.0


def message(names: Names, n: int, **properties: object) -> OutboxMessage:
    return OutboxMessage(
        message_id=f"m-{n}",
        routing_key=names.tasks(AGENT),
        body=b'{"n": %d}' % n,
        properties={
            "type": "task",
            "correlation_id": f"c-{n}",
            "reply_to": names.replies(AGENT),
            "content_type": "application/json",
            "headers": {"x-test": n},
            **properties,
        },
    )


@dataclass
class Inbox:
    """A consumer's handler that keeps every delivery; ``hold`` keeps handlers running."""

    deliveries: list[Delivery] = field(default_factory=list)
    running: int = 0
    most_running: int = 0
    cancelled: int = 0
    hold: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, delivery: Delivery) -> None:
        self.deliveries.append(delivery)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await self.hold.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1

    async def wait_for(self, count: int) -> list[Delivery]:
        await eventually(lambda: len(self.deliveries) >= count, f"{count} deliveries")
        return self.deliveries


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@dataclass
class Backend:
    names: Names
    open: Callable[[], Awaitable[Broker]]
    drop: Callable[[Broker], Awaitable[None]]
    delivery_limit: int
    """The broker's own delivery limit for the deployment's queues (its policy)."""
    bounded_queue: Callable[[Broker, str, int], Awaitable[None]]
    """Declare a queue of at most this many messages that rejects publishes when full."""
    size_limit: Callable[[int], contextlib.AbstractAsyncContextManager[None]]
    """The broker refuses messages larger than this many bytes, for the block, on connections
    opened within it."""
    publish_raw: Callable[[str, bytes, bytes], Awaitable[None]]
    """Publish to a queue a body with properties as raw AMQP bytes (a hostile publisher)."""


class BrokerContract:
    """The behaviour every backend of :class:`~waystation.brokers.port.Broker` shares."""

    @pytest.fixture
    def backend(self) -> Backend:
        raise NotImplementedError("a backend's test class provides it")

    async def test_a_published_message_is_delivered_with_its_properties(
        self, backend: Backend
    ) -> None:
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        inbox = Inbox()
        await broker.consume(backend.names.tasks(AGENT), inbox, prefetch=4)
        await broker.publish(message(backend.names, 1))
        (delivery,) = await inbox.wait_for(1)
        assert delivery.queue == backend.names.tasks(AGENT)
        assert delivery.body == b'{"n": 1}'
        assert (delivery.message_id, delivery.correlation_id, delivery.type) == (
            "m-1",
            "c-1",
            "task",
        )
        assert delivery.reply_to == backend.names.replies(AGENT)
        assert delivery.content_type == "application/json"
        assert delivery.headers["x-test"] == 1
        assert (delivery.redelivered, delivery.broker_count) == (False, 0)
        await broker.ack(delivery)
        inbox.hold.set()

    async def test_deliveries_go_to_the_highest_priority_consumer_with_room(
        self, backend: Backend
    ) -> None:
        """Reply routing rests on this (``waystation.runtime.routing``): a lower consumer gets a
        delivery only while every higher one holds its prefetch."""
        low_broker, high_broker = await backend.open(), await backend.open()
        await low_broker.declare(backend.names, [AGENT])
        low, high = Inbox(), Inbox()
        queue = backend.names.tasks(AGENT)
        await low_broker.consume(queue, low, prefetch=2, priority=1)
        await high_broker.consume(queue, high, prefetch=2, priority=5)
        for n in range(3):
            await low_broker.publish(message(backend.names, n))
        await high.wait_for(2)
        await low.wait_for(1)
        assert [d.message_id for d in high.deliveries] == ["m-0", "m-1"]
        assert [d.message_id for d in low.deliveries] == ["m-2"]
        for broker, inbox in ((high_broker, high), (low_broker, low)):
            for delivery in inbox.deliveries:
                await broker.ack(delivery)
            inbox.hold.set()

    async def test_a_message_published_later_waits_in_the_broker_then_arrives_whole(
        self, backend: Backend
    ) -> None:
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        inbox = Inbox()
        await broker.consume(backend.names.tasks(AGENT), inbox, prefetch=4)
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        await broker.publish_later(message(backend.names, 7), 0.3)
        await broker.publish(message(backend.names, 8))  # not held up behind it
        first, later = await inbox.wait_for(2)
        arrived = loop.time() - sent_at
        assert (first.message_id, later.message_id) == ("m-8", "m-7")
        assert arrived >= 0.3, f"a message due after 0.3 s arrived after {arrived:.3f} s"
        assert later.queue == backend.names.tasks(AGENT) and later.body == b'{"n": 7}'
        assert (later.correlation_id, later.type, later.headers["x-test"]) == ("c-7", "task", 7)
        # no slot was held while it waited: it is a fresh delivery of the queue
        assert (later.redelivered, later.broker_count) == (False, 0)
        await broker.ack(first)
        await broker.ack(later)
        inbox.hold.set()

    async def test_declare_is_idempotent(self, backend: Backend) -> None:
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        await broker.declare(backend.names, [AGENT])
        await broker.publish(message(backend.names, 1))

    async def test_a_mandatory_publish_no_queue_takes_is_unroutable(self, backend: Backend) -> None:
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        stray = OutboxMessage("m-stray", f"{backend.names.prefix}nobody-{uuid.uuid4()}", b"{}")
        with pytest.raises(Unroutable) as raised:
            await broker.publish(stray)
        assert raised.value.routing_key == stray.routing_key
        errors = await broker.publish_all([stray, message(backend.names, 2)])
        assert isinstance(errors[0], Unroutable) and errors[1] is None

    async def test_publishes_made_at_once_are_each_confirmed_and_delivered_whole(
        self, backend: Backend
    ) -> None:
        """Single publishes and batches interleaved (``AmqpBroker`` numbers them for their
        confirms and writes a batch at once): each is confirmed or fails on its own, and each
        arrives whole, a body larger than one frame too."""
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        inbox = Inbox()
        await broker.consume(backend.names.tasks(AGENT), inbox, prefetch=64)
        large = OutboxMessage("m-large", backend.names.tasks(AGENT), b"[" + b"1," * 300_000 + b"1]")
        stray = OutboxMessage("m-stray", f"{backend.names.prefix}nobody-{uuid.uuid4()}", b"{}")
        batches = [[message(backend.names, 100 + 10 * b + n) for n in range(5)] for b in range(3)]
        batches[1][2:2] = [stray, large]
        singles = [broker.publish(message(backend.names, n)) for n in range(20)]
        outcomes = await asyncio.gather(*singles, *(broker.publish_all(batch) for batch in batches))
        assert outcomes[:20] == [None] * 20
        for batch, errors in zip(batches, outcomes[20:], strict=True):
            assert [type(e) if e else None for e in errors] == [
                Unroutable if m is stray else None for m in batch
            ]
        expected = {f"m-{n}" for n in range(20)} | {
            m.message_id for batch in batches for m in batch if m is not stray
        }
        delivered = await inbox.wait_for(len(expected))
        assert {d.message_id for d in delivered} == expected
        assert next(d for d in delivered if d.message_id == "m-large").body == large.body
        for delivery in delivered:
            await broker.ack(delivery)
        inbox.hold.set()

    async def test_a_requeued_delivery_comes_again_counted_and_marked_redelivered(
        self, backend: Backend
    ) -> None:
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        inbox = Inbox()
        await broker.consume(backend.names.tasks(AGENT), inbox, prefetch=4)
        await broker.publish(message(backend.names, 1))
        first, *_ = await inbox.wait_for(1)
        await broker.requeue(first)
        _, again = await inbox.wait_for(2)
        assert again.message_id == "m-1"
        assert again.redelivered
        assert again.broker_count == 1
        await broker.ack(again)
        inbox.hold.set()

    async def test_no_more_than_prefetch_deliveries_are_unsettled_at_once(
        self, backend: Backend
    ) -> None:
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        inbox = Inbox()
        await broker.consume(backend.names.tasks(AGENT), inbox, prefetch=2)
        await broker.publish_all([message(backend.names, n) for n in range(5)])
        delivered = await inbox.wait_for(2)
        await asyncio.sleep(0.3)  # room for a third delivery, were prefetch not respected
        assert len(inbox.deliveries) == 2 and inbox.most_running == 2
        await broker.ack(delivered[0])
        await inbox.wait_for(3)
        assert [d.message_id for d in inbox.deliveries] == ["m-0", "m-1", "m-2"]
        for delivery in inbox.deliveries[1:]:
            await broker.ack(delivery)
        await inbox.wait_for(5)
        inbox.hold.set()
        for delivery in inbox.deliveries[3:]:
            await broker.ack(delivery)

    async def test_acks_made_together_settle_exactly_their_own_deliveries(
        self, backend: Backend
    ) -> None:
        """Acks of one moment may go out together (``AmqpBroker`` batches them): each settles
        its own delivery, not the ones between them, and the others come back on a close."""
        first = await backend.open()
        await first.declare(backend.names, [AGENT])
        inbox = Inbox()
        await first.consume(backend.names.tasks(AGENT), inbox, prefetch=6)
        await first.publish_all([message(backend.names, n) for n in range(6)])
        delivered = await inbox.wait_for(6)
        await asyncio.gather(*(first.ack(d) for d in delivered if d.message_id in EVEN))
        await first.close()
        second = await backend.open()
        other = Inbox()
        await second.consume(backend.names.tasks(AGENT), other, prefetch=10)
        # a message published after them comes after whatever of them is still in the queue
        await second.publish(message(backend.names, 9))
        await eventually(
            lambda: "m-9" in {d.message_id for d in other.deliveries}, "the message after them"
        )
        assert sorted(d.message_id for d in other.deliveries) == ["m-1", "m-3", "m-5", "m-9"]
        assert all(d.redelivered for d in other.deliveries if d.message_id != "m-9")
        for delivery in other.deliveries:
            await second.ack(delivery)
        other.hold.set()

    async def test_a_delivery_is_settled_once(self, backend: Backend) -> None:
        """Settling a delivery again raises and sends nothing: RabbitMQ would close the channel
        for a tag settled twice, and every other delivery on it would return to its queue."""
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        inbox = Inbox()
        await broker.consume(backend.names.tasks(AGENT), inbox, prefetch=3)
        await broker.publish_all([message(backend.names, n) for n in range(3)])
        acked, requeued, held = await inbox.wait_for(3)
        await broker.ack(acked)
        assert not broker.settleable(acked)
        for settle in (broker.ack, broker.requeue, broker.ack):
            with pytest.raises(BrokerUnavailable):
                await settle(acked)
        await broker.requeue(requeued)
        with pytest.raises(BrokerUnavailable):
            await broker.requeue(requeued)
        # it comes again after the broker saw all of the above: the channel is still the same
        again = (await inbox.wait_for(4))[3]
        assert again.message_id == requeued.message_id and again.redelivered
        assert broker.settleable(held)
        await broker.ack(held)
        await broker.ack(again)
        inbox.hold.set()

    async def test_an_unsettled_delivery_returns_when_its_connection_drops(
        self, backend: Backend
    ) -> None:
        """…its handler is cancelled, settling it fails, and another consumer gets it again."""
        first = await backend.open()
        await first.declare(backend.names, [AGENT])
        inbox = Inbox()
        await first.consume(backend.names.tasks(AGENT), inbox, prefetch=1)
        await first.publish(message(backend.names, 1))
        (delivery,) = await inbox.wait_for(1)
        assert first.settleable(delivery)
        await backend.drop(first)
        await eventually(lambda: inbox.cancelled == 1, "the running handler to be cancelled")
        assert not first.settleable(delivery)
        with pytest.raises(BrokerUnavailable):
            await first.ack(delivery)
        other = Inbox()
        second = await backend.open()
        await second.consume(backend.names.tasks(AGENT), other, prefetch=1)
        (again,) = await other.wait_for(1)
        assert again.message_id == "m-1" and again.redelivered
        await second.ack(again)
        other.hold.set()

    async def test_a_dropped_connection_comes_back_and_consumes_again(
        self, backend: Backend
    ) -> None:
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        inbox = Inbox()
        inbox.hold.set()
        await broker.consume(backend.names.tasks(AGENT), inbox, prefetch=4)
        await backend.drop(broker)
        await eventually(lambda: broker.connected, "the connection to come back")
        for attempt in range(100):  # a publish may still meet the channel being restored
            with contextlib.suppress(BrokerUnavailable):
                await broker.publish(message(backend.names, 1))
                break
            await asyncio.sleep(0.1 * min(attempt + 1, 10))
        (delivery,) = await inbox.wait_for(1)
        assert delivery.message_id == "m-1"
        await broker.ack(delivery)

    async def test_after_cancel_consumers_nothing_new_arrives_and_held_deliveries_settle(
        self, backend: Backend
    ) -> None:
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        inbox = Inbox()
        await broker.consume(backend.names.tasks(AGENT), inbox, prefetch=4)
        await broker.publish(message(backend.names, 1))
        (held,) = await inbox.wait_for(1)
        await broker.cancel_consumers()
        assert broker.consumers == 0
        await broker.publish(message(backend.names, 2))
        await broker.ack(held)
        await asyncio.sleep(0.3)  # room for a delivery, were the consumer still there
        assert len(inbox.deliveries) == 1
        inbox.hold.set()

    async def test_past_the_delivery_limit_the_broker_dead_letters_the_message(
        self, backend: Backend
    ) -> None:
        """A message requeued past the broker's limit ends in the dead-letter queue, with the
        broker's own reason."""
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        inbox = Inbox()
        await broker.consume(backend.names.tasks(AGENT), inbox, prefetch=1)
        await broker.publish(message(backend.names, 1))
        for count in range(1, backend.delivery_limit + 2):
            deliveries = await inbox.wait_for(count)
            await broker.requeue(deliveries[-1])
        dead = Inbox()
        await broker.consume(backend.names.dead_letter_queue, dead, prefetch=1)
        (letter,) = await dead.wait_for(1)
        assert letter.message_id == "m-1"
        assert letter.headers["x-first-death-reason"] == "delivery_limit"
        assert letter.headers["x-first-death-queue"] == backend.names.tasks(AGENT)
        await broker.ack(letter)
        dead.hold.set()
        inbox.hold.set()

    async def test_the_dead_letter_exchange_routes_to_the_dead_letter_queue(
        self, backend: Backend
    ) -> None:
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        copy = OutboxMessage(
            "m-dead",
            backend.names.tasks(AGENT),
            b"{}",
            {"headers": {"x-waystation-reason": "test"}},
            exchange=backend.names.dead_letter_exchange,
        )
        await broker.publish(copy)
        dead = Inbox()
        await broker.consume(backend.names.dead_letter_queue, dead, prefetch=1)
        (letter,) = await dead.wait_for(1)
        assert letter.headers["x-waystation-reason"] == "test"
        await broker.ack(letter)
        dead.hold.set()

    # -- the broker says no --

    async def test_a_full_queue_that_rejects_publishes_refuses_only_that_message(
        self, backend: Backend
    ) -> None:
        """A ``basic.nack`` fails its own publish only, alone or in a batch, and may pass
        later: a refusal, not an ``Unsendable``."""
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        full = f"{backend.names.prefix}full"
        await backend.bounded_queue(broker, full, 1)
        await broker.publish(OutboxMessage("m-first", full, b"{}"))
        refused = OutboxMessage("m-refused", full, b"{}")
        with pytest.raises(PublishRefused) as caught:
            await broker.publish(refused)
        assert not isinstance(caught.value, Unsendable) and caught.value.reason == "refused"
        errors = await broker.publish_all([refused, message(backend.names, 1), refused])
        assert [type(e) if e else None for e in errors] == [PublishRefused, None, PublishRefused]
        await broker.publish(message(backend.names, 2))  # the channel still confirms
        inbox = Inbox()
        await broker.consume(full, inbox, prefetch=1)
        (first,) = await inbox.wait_for(1)
        await broker.ack(first)  # room again: the same message passes now
        await broker.publish(refused)
        inbox.hold.set()

    async def test_a_message_amqp_cannot_encode_is_unsendable_and_nothing_of_it_is_sent(
        self, backend: Backend
    ) -> None:
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        bad = [
            replace(message(backend.names, 1), message_id="m" * 256),
            message(backend.names, 2, correlation_id="c" * 300),
            message(backend.names, 3, headers={"raw": b"\xff\xfe"}),
            message(backend.names, 4, headers={"what": object()}),
        ]
        for one in bad:
            with pytest.raises(Unsendable) as caught:
                await broker.publish(one)
            assert caught.value.reason == "unencodable", one
        errors = await broker.publish_all([*bad, message(backend.names, 7)])
        assert [type(e) if e else None for e in errors] == [Unsendable] * 4 + [None]
        inbox = Inbox()
        await broker.consume(backend.names.tasks(AGENT), inbox, prefetch=10)
        await broker.publish(message(backend.names, 8))
        deliveries = await inbox.wait_for(2)
        assert [d.message_id for d in deliveries] == ["m-7", "m-8"]  # none of the bad ones
        inbox.hold.set()

    async def test_a_message_larger_than_the_broker_takes_is_unsendable_alone(
        self, backend: Backend
    ) -> None:
        """RabbitMQ closes the channel a message over its limit came on, failing whatever is
        under way on it (and a frame sent on it afterwards takes the connection down): the
        refusal must cost that message alone, the others published with it, large or small,
        pass, and the connection stays up."""
        limit = 96 * 1024
        large = replace(message(backend.names, 0), message_id="m-large", body=b"x" * (2 * limit))
        fits = replace(message(backend.names, 4), body=b'"' + b"y" * (80 * 1024) + b'"')
        small = [message(backend.names, n) for n in range(1, 4)]
        async with backend.size_limit(limit):
            # (RabbitMQ reads its limit when a channel opens)
            broker = await backend.open()
            await broker.declare(backend.names, [AGENT])
            errors = await broker.publish_all([small[0], large, fits, large, *small[1:]])
            assert [type(e) if e else None for e in errors] == [
                None,
                Unsendable,
                None,
                Unsendable,
                None,
                None,
            ], errors
            assert all(e.reason == "too-large" for e in errors if e is not None)
            with pytest.raises(Unsendable):  # again: refused as soon, however it is known
                await broker.publish(large)
            await broker.publish(message(backend.names, 9))
        assert broker.connected
        inbox = Inbox()
        await broker.consume(backend.names.tasks(AGENT), inbox, prefetch=10)
        deliveries = await inbox.wait_for(5)
        assert sorted(d.message_id or "" for d in deliveries) == ["m-1", "m-2", "m-3", "m-4", "m-9"]
        inbox.hold.set()

    async def test_a_delivery_whose_metadata_cannot_be_decoded_comes_with_what_could_be(
        self, backend: Backend
    ) -> None:
        """A hostile publisher's properties (here a ``message_id`` that is not UTF-8 beside a
        good ``correlation_id``, then a header table nested 3,000 deep) cost that message: it
        is delivered with what decodes and ``x-waystation-undecodable``; the connection stays
        and the next message comes as it was sent."""
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        inbox = Inbox()
        queue = backend.names.tasks(AGENT)
        await broker.consume(queue, inbox, prefetch=10)
        not_utf8 = _flags(0x0400, 0x0080) + _short(b"c-good") + _short(b"\xff\xfe-id")
        await backend.publish_raw(queue, b'{"n": 1}', not_utf8)
        await backend.publish_raw(queue, b'{"n": 2}', _flags(0x2000) + _nested_table(3000))
        await broker.publish(message(backend.names, 3))
        first, second, third = await inbox.wait_for(3)
        assert first.body == b'{"n": 1}' and first.correlation_id == "c-good"
        assert first.message_id is None
        assert "message_id" in first.headers[HEADER_UNDECODABLE]
        assert bytes(first.headers[HEADER_RAW]) == not_utf8
        assert second.body == b'{"n": 2}' and "headers" in second.headers[HEADER_UNDECODABLE]
        assert (third.message_id, third.headers.get("x-test")) == ("m-3", 3)
        assert HEADER_UNDECODABLE not in third.headers
        for delivery in (first, second, third):
            await broker.ack(delivery)
        assert broker.connected
        inbox.hold.set()


async def _publish_when_back(broker: Broker, one: OutboxMessage) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN
    while True:
        try:
            await broker.publish(one)
            return
        except BrokerUnavailable:
            assert loop.time() < deadline, "the publishing channel never came back"
            await asyncio.sleep(0.05)


def _flags(*flags: int) -> bytes:
    return sum(flags).to_bytes(2, "big")


def _short(value: bytes) -> bytes:
    return bytes((len(value),)) + value


def _nested_table(depth: int) -> bytes:
    table = (0).to_bytes(4, "big")
    for _ in range(depth):
        entry = _short(b"k") + b"F" + table
        table = len(entry).to_bytes(4, "big") + entry
    return table


# ---- aio-pika on the real RabbitMQ --------------------------------------------------------------


class TestAmqpBroker(BrokerContract):
    @pytest_asyncio.fixture
    async def backend(self, services: Services) -> AsyncIterator[Backend]:
        require(services.rabbitmqctl, "the aio-pika broker contract (drops, the policy)")
        names = Names(fresh_prefix())
        opened: list[AmqpBroker] = []

        async def open_one() -> Broker:
            broker = AmqpBroker(
                services.amqp_url,
                connection_name=f"waystation contract {uuid.uuid4()}",
                delivery_limit=1,
                policy="rabbitmqctl",
            )
            await broker.connect()
            opened.append(broker)
            return broker

        async def drop(broker: Broker) -> None:
            assert isinstance(broker, AmqpBroker)
            assert await close_broker_connections(broker.connection_name) == 1
            await eventually(lambda: not broker.connected, "the connection to drop")

        async def bounded_queue(broker: Broker, name: str, length: int) -> None:
            assert isinstance(broker, AmqpBroker)
            await broker._channel().declare_queue(
                name,
                auto_delete=True,
                arguments={"x-max-length": length, "x-overflow": "reject-publish"},
            )

        async def raw(queue: str, body: bytes, properties: bytes) -> None:
            await publish_raw_properties(services.amqp_url, queue, body, properties)

        # Waystation's own limits come first; the broker's policy is the backstop past them
        (_, policy) = policy_definition(names, 1)
        limit = policy["delivery-limit"]
        assert isinstance(limit, int)
        yield Backend(names, open_one, drop, limit, bounded_queue, broker_size_limit, raw)
        for broker in opened:
            await broker.close()
        await delete_topology(services.amqp_url, names.prefix, [AGENT])
        await clear_policy(names)

    async def test_only_its_own_frames_go_through_the_fast_codec(
        self, backend: Backend, services: Services, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``waystation.brokers.amqp.frames`` takes pamqp's place for the whole process, yet codes
        only the broker's own frames: a connection the test opens, or a handler opens while it runs
        on a delivery, is pamqp's alone, before and after the broker reconnects."""
        seen: list[bytes] = []
        marshal, unmarshal = frames.marshal, frames.unmarshal

        def marshalled(frame: Any, channel: int) -> bytes:
            written = marshal(frame, channel)
            seen.append(written)
            return written

        def unmarshalled(data: bytes) -> Any:
            seen.append(data)
            return unmarshal(data)

        monkeypatch.setattr(frames, "marshal", marshalled)
        monkeypatch.setattr(frames, "unmarshal", unmarshalled)
        broker = await backend.open()
        await broker.declare(backend.names, [AGENT])
        theirs = f"{backend.names.prefix}theirs"

        async def their_publish(marker: bytes) -> None:
            connection = await aio_pika.connect(services.amqp_url)
            try:
                channel = await connection.channel()
                queue = await channel.declare_queue(theirs, auto_delete=True)
                await channel.default_exchange.publish(aio_pika.Message(marker), routing_key=theirs)
                got = await queue.get(timeout=10)
                assert got.body == marker
                await got.ack()
            finally:
                await connection.close()

        handled: list[bytes] = []

        async def handler(delivery: Delivery) -> None:
            await their_publish(b"from-a-handler")  # a handler's own connection
            handled.append(delivery.body)
            await broker.ack(delivery)

        await broker.consume(backend.names.tasks(AGENT), handler, prefetch=1)
        await broker.publish(message(backend.names, 1))
        await eventually(lambda: len(handled) == 1, "the delivery handled")
        await their_publish(b"from-the-test")
        assert any(b'{"n": 1}' in frame for frame in seen), "its own frames went to pamqp"
        assert not any(b"from-" in frame or theirs.encode() in frame for frame in seen)
        await backend.drop(broker)
        await eventually(lambda: broker.connected, "the connection back")
        seen.clear()
        await _publish_when_back(broker, message(backend.names, 2))
        await eventually(lambda: len(handled) == 2, "the delivery handled after reconnecting")
        assert any(b'{"n": 2}' in frame for frame in seen), "after reconnecting, pamqp's"
        assert not any(b"from-" in frame or theirs.encode() in frame for frame in seen)

    async def test_a_consumer_aio_pika_recovers_itself_still_delivers(
        self, backend: Backend
    ) -> None:
        """The broker's consumers take aiormq's deliveries as they come; aio-pika's recovery of
        a consumer the broker cancelled (its channel still open) registers it again through its
        base ``Queue.consume``, which hands over aio-pika's messages instead: those are
        delivered and settled the same way."""
        broker = await backend.open()
        assert isinstance(broker, AmqpBroker)
        await broker.declare(backend.names, [AGENT])
        inbox = Inbox()
        await broker.consume(backend.names.tasks(AGENT), inbox, prefetch=2)
        ((queue, tag),) = broker._consumers
        assert isinstance(queue, aio_pika.RobustQueue)
        recorded = dict(queue._consumers[tag])
        await queue.cancel(tag)
        # what RobustChannel._restore_missing_consumers does for a cancelled consumer
        await aio_pika.Queue.consume(queue, consumer_tag=tag, **recorded)
        await broker.publish(message(backend.names, 1))
        (delivery,) = await inbox.wait_for(1)
        assert (delivery.message_id, delivery.correlation_id, delivery.type) == (
            "m-1",
            "c-1",
            "task",
        )
        assert delivery.headers["x-test"] == 1 and not delivery.redelivered
        await broker.requeue(delivery)
        again = (await inbox.wait_for(2))[1]
        assert again.message_id == "m-1" and again.redelivered and again.broker_count == 1
        await broker.ack(again)
        assert not broker.settleable(again)
        inbox.hold.set()


# ---- in memory ----------------------------------------------------------------------------------


class TestInMemoryBroker(BrokerContract):
    @pytest.fixture
    def backend(self) -> Backend:
        server = InMemoryBroker(delivery_limit=2)

        async def open_one() -> Broker:
            connection = server.connection(f"contract-{uuid.uuid4()}", reconnect_after=0.05)
            await connection.connect()
            return connection

        async def drop(broker: Broker) -> None:
            assert isinstance(broker, InMemoryConnection)
            broker.drop()

        async def bounded_queue(broker: Broker, name: str, length: int) -> None:
            server.declare_queue(name, max_length=length)

        @contextlib.asynccontextmanager
        async def size_limit(limit: int) -> AsyncIterator[None]:
            server.max_message_bytes = limit
            try:
                yield
            finally:
                server.max_message_bytes = None

        async def raw(queue: str, body: bytes, properties: bytes) -> None:
            server.enqueue_raw(queue, body, properties)

        return Backend(
            Names(fresh_prefix()),
            open_one,
            drop,
            delivery_limit=2,
            bounded_queue=bounded_queue,
            size_limit=size_limit,
            publish_raw=raw,
        )

    async def test_under_4_3_counting_a_requeue_raises_only_the_acquired_count(self) -> None:
        """RabbitMQ 4.3: ``x-delivery-count`` no longer counts a requeue, ``x-acquired-count``
        does; ``broker_count`` reads whichever the broker has, and the limit never fires."""
        server = InMemoryBroker(delivery_limit=2, counting="4.3")
        names = Names(fresh_prefix())
        broker = server.connection("c")
        await broker.connect()
        await broker.declare(names, [AGENT])
        inbox = Inbox()
        await broker.consume(names.tasks(AGENT), inbox, prefetch=1)
        await broker.publish(message(names, 1))
        for count in range(1, 5):
            deliveries = await inbox.wait_for(count)
            await broker.requeue(deliveries[-1])
        last = (await inbox.wait_for(5))[-1]
        assert "x-delivery-count" not in last.headers
        assert last.headers["x-acquired-count"] == 4 and last.broker_count == 4
        assert server.messages(names.dead_letter_queue) == []
        inbox.hold.set()

    async def test_a_publish_cut_off_by_a_drop_is_kept_or_lost_but_never_confirmed(
        self,
    ) -> None:
        steps: list[str] = []

        def latency(step: str) -> float:
            steps.append(step)
            return 0.01

        server = InMemoryBroker(latency=latency)
        names = Names(fresh_prefix())
        broker = server.connection("c", reconnect_after=0.05)
        await broker.connect()
        await broker.declare(names, [AGENT])
        # dropped while the message is on its way: the broker never saw it
        sending = asyncio.create_task(broker.publish(message(names, 1)))
        await asyncio.sleep(0)
        broker.drop()
        with pytest.raises(BrokerUnavailable):
            await sending
        assert server.messages(names.tasks(AGENT)) == []
        # dropped while its confirm is on its way: kept, yet the publisher cannot know it
        await eventually(lambda: broker.connected, "the connection to come back")
        sending = asyncio.create_task(broker.publish(message(names, 2)))
        await eventually(lambda: steps[-1] == "confirm", "the confirm to be on its way")
        broker.drop()
        with pytest.raises(BrokerUnavailable):
            await sending
        assert [m.properties["message_id"] for m in server.messages(names.tasks(AGENT))] == ["m-2"]
