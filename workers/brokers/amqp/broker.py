"""The broker port on RabbitMQ, through aio-pika: what a worker uses in production.

One robust connection (it reconnects by itself, and restores its channels and consumers), one
confirming channel for publishing (mandatory, returns raised as errors), one channel for
consuming with the prefetch of the first consumer. Driver errors are translated at this
boundary into the port's own (``waystation.brokers.port``).

The hot path goes under aio-pika to aiormq, its AMQP layer, where aio-pika's objects cost a
measured share of a worker's CPU: publishes and acks are aiormq frames, and consumers take
aiormq's deliveries as they come (:class:`_DirectQueue`). aio-pika still owns the connection,
the channels and their recovery. The connection opens in a context of its own
(``waystation.brokers.amqp.frames.context``), which its reader inherits, and its publishes and acks
are marked; the deliveries' handlers run outside it. Its frames, and only its, are decoded through
the frames' dispatcher, which guards their content headers (a delivery whose metadata cannot be
decoded costs that message alone, never the connection; without the dispatcher, the guarded
transport of ``waystation.brokers.amqp.transport`` does it), and are encoded and decoded by
``waystation.brokers.amqp.frames`` (the same bytes, faster; ``fast_frames``).

The broker can say no (``waystation.brokers.port``): a nack is :class:`PublishRefused`; a message
the client cannot encode is :class:`Unsendable` before anything is sent; and one over RabbitMQ's
``max_message_size`` closes the channel it came on (``PRECONDITION_FAILED - message size N is
larger than configured max size M``), failing every publish under way on it, and a frame sent on
that channel after its close takes the whole connection down (``CHANNEL_ERROR - expected
'channel.open'``). So a message larger than :data:`LARGE_MESSAGE_BYTES`, while the broker's
limit is not known, goes on a channel of its own, one at a time: its refusal costs it alone
(:class:`Unsendable`, ``too-large``), and the limit learnt from it refuses the next larger
message here, before anything is sent.

Why one module of some 530 lines: it is the port's one implementation on aio-pika (consuming,
publishing with confirms, acks written together, the connection restored), and those share the
connection's and channels' state; the topology, the frames, the guarded transport and the private
parts are apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq.abc
import aiormq.exceptions
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
    ConsumerTag,
)

from waystation.brokers.amqp import frames, topology
from waystation.brokers.amqp._private import remember_consumer, write_frame
from waystation.brokers.amqp.transport import guarded_connection
from waystation.brokers.metadata import properties_of
from waystation.brokers.port import (
    Broker,
    BrokerError,
    BrokerUnavailable,
    Delivery,
    DeliveryHandler,
    PublishRefused,
    Unroutable,
    Unsendable,
)
from waystation.events import OutboxMessage
from waystation.policies import wait_step
from waystation.protocol.wire import Names

__all__ = ["AmqpBroker", "delivery_of"]

_UNAVAILABLE = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
)


LARGE_MESSAGE_BYTES = 64 * 1024
"""Bodies larger than this go on the channel for large messages while the broker's size limit
is not known (see the module): no broker is expected to refuse a smaller one."""
LANE_RETURN_WAIT = 10.0
"""Seconds a large message waits for its channel to come back after a refusal closed it."""
_UNENCODABLE = (TypeError, ValueError, OverflowError, struct.error, RecursionError)
"""What pamqp raises for a property or header it cannot encode (before anything is sent)."""
_TOO_LARGE = re.compile(r"message size (\d+) is larger than configured max size (\d+)")


def _size_limit(error: BaseException) -> int | None:
    """The broker's size limit, when ``error`` is its refusal of a message over it."""
    found = _TOO_LARGE.search(str(error))
    return int(found.group(2)) if found else None


def _broker_count(headers: dict[str, Any]) -> int:
    counts = [
        value
        for value in (headers.get("x-delivery-count"), headers.get("x-acquired-count"))
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0
    ]
    return max(counts, default=0)


class _Held:
    """A delivery not settled yet (``Delivery.handle``): its tag on the aiormq channel it came
    on. Settled once: a second ack or nack of a tag is a channel error in AMQP (the broker
    would close the channel, and every delivery on it would return to its queue), so a second
    settle raises here and sends nothing, as when the channel is gone."""

    __slots__ = ("channel", "settled", "tag")

    def __init__(self, channel: aiormq.abc.AbstractChannel, tag: int | None) -> None:
        self.channel = channel
        self.tag = tag
        self.settled = False

    def settle(self) -> aiormq.abc.AbstractChannel:
        """The channel to settle it on, once."""
        if self.channel.is_closed:  # as aiormq's basic_ack checks first
            raise aiormq.exceptions.ChannelInvalidStateError(f"{self.channel!r} closed")
        if self.settled:
            raise aiormq.exceptions.ChannelInvalidStateError(
                f"delivery {self.tag} on {self.channel!r} is settled already"
            )
        self.settled = True
        return self.channel


def delivery_of(
    message: aiormq.abc.DeliveredMessage | AbstractIncomingMessage, queue: str
) -> Delivery:
    """The port's view of a delivery: aiormq's (what :class:`_DirectQueue` hands over) or
    aio-pika's (what its own recovery of a consumer hands over, see there)."""
    if isinstance(message, aiormq.abc.DeliveredMessage):
        p = message.header.properties
        deliver = message.delivery
        fields = (
            p.message_id,
            p.correlation_id,
            p.reply_to,
            p.message_type,
            p.content_type,
            p.user_id,
            p.headers,
        )
        redelivered = getattr(deliver, "redelivered", False)
        held = _Held(message.channel, getattr(deliver, "delivery_tag", None))
    else:
        m = message
        fields = (
            m.message_id,
            m.correlation_id,
            m.reply_to,
            m.type,
            m.content_type,
            m.user_id,
            m.headers,
        )
        redelivered = m.redelivered
        held = _Held(m.channel, m.delivery_tag)
    message_id, correlation_id, reply_to, message_type, content_type, user_id, headers = fields
    headers = headers or {}
    return Delivery(
        queue=queue,
        body=message.body,
        message_id=message_id,
        correlation_id=correlation_id,
        reply_to=reply_to,
        type=message_type,
        content_type=content_type,
        user_id=user_id,
        headers=headers,
        redelivered=bool(redelivered),
        broker_count=_broker_count(headers),
        handle=held,
    )


class _DirectQueue(aio_pika.RobustQueue):
    """A queue whose consumers take aiormq's deliveries as they are.

    aio-pika's ``consume`` makes each delivery an ``IncomingMessage`` (about 20 attribute sets)
    and runs the callback in a second task besides the one aiormq starts: together ~5% of a
    worker's CPU under load (docs/performance.md). This ``consume`` gives the callback to aiormq
    itself, so a delivery reaches it in aiormq's task, which is cancelled when its channel
    closes, as the inner task was. It records the consumer where aio-pika's robust queue does,
    so reconnecting restores it through this same method. The one path that does not come here
    is aio-pika's recovery of a consumer the broker cancelled while its channel stayed open: it
    calls the base class's ``consume``, which wraps; ``delivery_of`` takes either form.
    """

    async def consume(
        self,
        callback: Any,
        no_ack: bool = False,
        exclusive: bool = False,
        arguments: dict[str, Any] | None = None,
        consumer_tag: ConsumerTag | None = None,
        timeout: float | None = None,
        robust: bool = True,
    ) -> ConsumerTag:
        channel = await self.channel.get_underlay_channel()
        result = await channel.basic_consume(
            queue=self.name,
            consumer_callback=callback,
            exclusive=exclusive,
            no_ack=no_ack,
            arguments=arguments,
            consumer_tag=consumer_tag,
            timeout=timeout,
        )
        if result.consumer_tag is None:  # (as aio-pika checks)
            raise RuntimeError("the broker gave no consumer tag")
        if robust:  # what aio-pika's robust queue restores on reconnecting
            remember_consumer(
                self,
                result.consumer_tag,
                callback=callback,
                no_ack=no_ack,
                exclusive=exclusive,
                arguments=arguments,
            )
        return result.consumer_tag


@dataclass(slots=True)
class _Acks:
    written: asyncio.Future[None]
    """Done once the frame of every ack below is handed to the socket (or failed)."""
    tags: list[int] = field(default_factory=list)


def _translated(error: BaseException) -> BrokerError:
    if isinstance(error, BrokerError):
        return error
    return BrokerUnavailable(str(error) or type(error).__name__)


class AmqpBroker(Broker):
    """The port on a RabbitMQ broker at ``url``.

    ``delivery_limit``, ``policy`` (``auto``, ``rabbitmqctl``, ``management`` or ``none``) and
    ``management_url`` (default: derived from ``url``) say how :meth:`declare` applies the
    deployment's queue policy (``waystation.brokers.amqp.topology``).
    """

    def __init__(
        self,
        url: str,
        *,
        connection_name: str = "waystation worker",
        delivery_limit: int = 5,
        policy: str = "none",
        management_url: str | None = None,
        fast_frames: bool = True,
    ) -> None:
        self.url = url
        self._dispatched = frames.install()
        """Whether this connection's frames are read through the frames' dispatcher, which
        guards their content headers (else through the guarded transport)."""
        self.fast_frames = fast_frames and self._dispatched
        """Whether this connection's frames are coded by ``waystation.brokers.amqp.frames``."""
        self._management_url = management_url or topology.management_url_of(url)
        self.connection_name = connection_name
        self._delivery_limit = delivery_limit
        self._policy = policy
        self._connection: AbstractRobustConnection | None = None
        self._publishing: AbstractChannel | None = None
        self._consuming: AbstractChannel | None = None
        self._consumers: list[tuple[AbstractQueue, str]] = []
        self._names: Names | None = None
        self._waits: set[int] = set()
        """The wait steps (ms) declared on this connection."""
        self._acks: dict[aiormq.abc.AbstractChannel, _Acks] = {}
        """Per channel, the acks of this turn of the loop, sent together at its end."""
        self._sending: set[asyncio.Future[None]] = set()
        self.max_message_bytes: int | None = None
        """The broker's ``max_message_size``, once a refusal told it: a larger message is
        refused here (``Unsendable``), without closing the channel again."""
        self._large: AbstractChannel | None = None
        self._large_turn = asyncio.Lock()
        """One large message at a time on ``_large`` (see the module)."""

    async def connect(self) -> None:
        try:
            # in a context of its own: its reader task, and the reconnections, inherit it
            opening = asyncio.get_running_loop().create_task(
                guarded_connection(
                    self.url,
                    client_properties={"connection_name": self.connection_name},
                    reader=not self._dispatched,
                ),
                context=frames.context(self.fast_frames, guarded=self._dispatched),
            )
            self._connection = await opening
            self._publishing = await self._connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
        except _UNAVAILABLE as error:
            raise _translated(error) from error

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None

    @property
    def connected(self) -> bool:
        connection = self._connection
        return connection is not None and connection.connected.is_set()

    def _channel(self) -> AbstractChannel:
        if self._publishing is None:
            raise BrokerUnavailable("the broker connection is not open")
        return self._publishing

    async def declare(self, names: Names, agents: Iterable[str]) -> None:
        self._names = names
        agents = list(agents)
        try:
            await topology.declare(self._channel(), names, agents)
        except _UNAVAILABLE as error:
            raise _translated(error) from error
        await topology.apply_policy(
            names,
            self._delivery_limit,
            self._policy,
            vhost=topology.vhost_of(self.url),
            management_url=self._management_url,
        )

    async def consume(
        self, queue: str, handler: DeliveryHandler, *, prefetch: int, priority: int = 0
    ) -> None:
        if self._connection is None:
            raise BrokerUnavailable("the broker connection is not open")
        try:
            if self._consuming is None:
                self._consuming = await self._connection.channel()
                # its queues (the ones it restores too) consume aiormq's deliveries directly
                self._consuming.QUEUE_CLASS = _DirectQueue
                await self._consuming.set_qos(prefetch_count=prefetch)
            declared = await self._consuming.get_queue(queue, ensure=True)

            async def on_message(
                message: aiormq.abc.DeliveredMessage | AbstractIncomingMessage,
            ) -> None:
                # the handler's own frames (a connection it opens) are not this connection's
                with frames.scope(False):
                    await handler(delivery_of(message, queue))

            tag = await declared.consume(
                on_message, arguments={"x-priority": priority} if priority else None
            )
        except _UNAVAILABLE as error:
            raise _translated(error) from error
        self._consumers.append((declared, tag))

    async def cancel_consumers(self) -> None:
        for queue, tag in self._consumers:
            with contextlib.suppress(Exception):
                await queue.cancel(tag)
        self._consumers.clear()

    @property
    def consumers(self) -> int:
        return len(self._consumers)

    async def publish(self, message: OutboxMessage) -> None:
        await self._publish(message, message.exchange)

    async def publish_later(self, message: OutboxMessage, delay: float) -> None:
        """Through the wait queue of the delay's step (``waystation.policies.wait_step``): a quorum
        queue whose messages expire after the step and are dead-lettered, at least once, to the
        default exchange with their own routing key, which is their queue. Declared on first
        use; its exchange (fanout) keeps the routing key as it is."""
        if self._names is None:
            raise BrokerUnavailable("publish_later before declare: the deployment is not known")
        step = wait_step(delay)
        name = self._names.wait(step)
        if step not in self._waits:
            try:
                channel = self._channel()
                exchange = await channel.declare_exchange(
                    name, aio_pika.ExchangeType.FANOUT, durable=True
                )
                queue = await channel.declare_queue(
                    name, durable=True, arguments=topology.wait_queue_arguments(step)
                )
                await queue.bind(exchange)
            except _UNAVAILABLE as error:
                raise _translated(error) from error
            self._waits.add(step)
        await self._publish(message, name)

    async def _publish(self, message: OutboxMessage, exchange_name: str) -> None:
        size = len(message.body)
        limit = self.max_message_bytes
        if limit is not None and size > limit:
            raise Unsendable(
                message.message_id,
                f"message size {size} is larger than the broker's maximum {limit}",
                reason="too-large",
            )
        if limit is None and size > LARGE_MESSAGE_BYTES:
            async with self._large_turn:
                if self.max_message_bytes is None:  # (still: none of those before told it)
                    lane = await self._large_channel()
                    await self._publish_on(message, exchange_name, lane)
                    return
            limit = self.max_message_bytes
            if size > limit:
                raise Unsendable(
                    message.message_id,
                    f"message size {size} is larger than the broker's maximum {limit}",
                    reason="too-large",
                )
        await self._publish_on(message, exchange_name, self._channel())

    async def _large_channel(self) -> AbstractChannel:
        """The channel of large messages, opened when the first one comes; once it is back, when
        a refusal closed it (aio-pika reopens it)."""
        if self._connection is None:
            raise BrokerUnavailable("the broker connection is not open")
        try:
            if self._large is None:
                self._large = await self._connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
            elif self._large.is_closed and isinstance(self._large, aio_pika.RobustChannel):
                await asyncio.wait_for(self._large.ready(), LANE_RETURN_WAIT)
        except TimeoutError as error:
            raise BrokerUnavailable("the channel of large messages did not come back") from error
        except _UNAVAILABLE as error:
            raise _translated(error) from error
        return self._large

    async def _publish_on(
        self, message: OutboxMessage, exchange_name: str, publishing: AbstractChannel
    ) -> None:
        size = len(message.body)
        try:
            if publishing.is_closed:  # as aio-pika's Exchange.publish checks first
                raise aiormq.exceptions.ChannelInvalidStateError(f"{publishing!r} closed")
            channel = await publishing.get_underlay_channel()
            # straight to aiormq: aio-pika's Message costs ~25 attribute sets per publish (a
            # measured share of the worker's CPU) to build these same properties
            with frames.scope(self.fast_frames):
                await channel.basic_publish(
                    message.body,
                    exchange=exchange_name,
                    routing_key=message.routing_key,
                    properties=properties_of(message),
                    mandatory=True,
                )
        except aiormq.exceptions.PublishError as error:
            raise Unroutable(message.message_id, message.routing_key) from error
        except aiormq.exceptions.DeliveryError as error:
            raise PublishRefused(message.message_id, "the broker nacked it") from error
        except aiormq.exceptions.ChannelPreconditionFailed as error:
            limit = _size_limit(error)
            if limit is not None:
                self.max_message_bytes = min(limit, self.max_message_bytes or limit)
                if size > limit:
                    raise Unsendable(message.message_id, str(error), reason="too-large") from error
            raise _translated(error) from error  # closed for another message: send it again
        except _UNAVAILABLE as error:
            raise _translated(error) from error
        except _UNENCODABLE as error:
            detail = f"cannot be encoded: {error or type(error).__name__}"
            raise Unsendable(message.message_id, detail, reason="unencodable") from error

    async def ack(self, delivery: Delivery) -> None:
        """Acks made in one turn of the event loop on one channel go out in one write (one
        ``basic.ack`` frame each, so nothing depends on which other tags are settled); each
        returns once that write is handed to the socket, as aiormq's own ack does."""
        held: _Held = delivery.handle
        try:
            channel = held.settle()
            if held.tag is None:  # (a message got without a consumer's ack)
                return
            acks = self._acks.get(channel)
            if acks is None:
                # the channel rejects its futures when it closes: no ack waits for ever
                acks = self._acks[channel] = _Acks(channel.create_future())
                asyncio.get_running_loop().call_soon(self._send_acks, channel)
            acks.tags.append(held.tag)
            # shielded: one waiter cancelled (its handler's channel closing) leaves the rest
            await asyncio.shield(acks.written)
        except _UNAVAILABLE as error:
            raise _translated(error) from error

    def _send_acks(self, channel: aiormq.abc.AbstractChannel) -> None:
        acks = self._acks.pop(channel)
        if channel.is_closed:
            if not acks.written.done():
                acks.written.set_exception(
                    aiormq.exceptions.ChannelInvalidStateError(f"{channel!r} closed")
                )
            return
        try:
            with frames.scope(self.fast_frames):
                frame = aiormq.abc.ChannelFrame.marshall(
                    channel_number=channel.number,
                    frames=[aiormq.spec.Basic.Ack(delivery_tag=tag) for tag in acks.tags],
                    drain_future=acks.written,
                )
            waiting = write_frame(channel, frame)
            if waiting is not None:  # the writer is behind: kept until it has room
                self._sending.add(waiting)
                waiting.add_done_callback(self._sending.discard)
        except Exception as error:  # a callback's error would reach no one: the acks get it
            if not acks.written.done():
                acks.written.set_exception(error)

    async def requeue(self, delivery: Delivery) -> None:
        held: _Held = delivery.handle
        try:
            channel = held.settle()
            if held.tag is not None:
                with frames.scope(self.fast_frames):
                    await channel.basic_nack(held.tag, requeue=True)
        except _UNAVAILABLE as error:
            raise _translated(error) from error

    def settleable(self, delivery: Delivery) -> bool:
        held: _Held = delivery.handle
        return not held.settled and not held.channel.is_closed
