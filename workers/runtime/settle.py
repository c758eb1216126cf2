"""The one place that settles a delivery: ack, retry, requeue or dead-letter, once its outcome is
durable.

Flows never ack: each returns a :class:`Verdict` saying what should become of its delivery, and the
worker hands it to :meth:`Settler.settle` only after every event that records the delivery's
effect has committed (G1).

* A dead letter is a copy of the delivery published to the deployment's dead-letter exchange with
  its reason (``x-waystation-reason``, ``-detail``, ``-queue``); the delivery is acked only once
  the broker confirmed the copy (G9).
* A retry (a handler that raised, with attempts left) is a copy sent back to the delivery's queue
  carrying the number of failed runs (``x-waystation-attempts``), then the delivery is acked:
  Waystation counts attempts itself, so the count means the same on every broker version
  (RabbitMQ 4.3 no longer counts a requeue in ``x-delivery-count``).
* A wait (a run that found no free slot of its agent's ``concurrency`` or ``rate``,
  ``waystation.runtime.limits``) is a copy sent back the same way, after its delay, carrying how
  often it waited (``x-waystation-waits``) and its failed runs unchanged: waiting is not an attempt.

When a copy cannot be published the delivery is requeued instead, so nothing is lost. A copy
carries the delivery's headers made sendable (``waystation.brokers.metadata.sendable``), and its
publisher's AMQP user (``x-waystation-user``); whatever goes wrong while settling, the delivery is
settled (requeued at worst), never left holding its place in the prefetch.

Answers to publishers (``Settler.answer``) go out directly, not through the outbox: one the
broker will not take is kept as a dead letter with its reason, except a result whose publisher's
reply queue is gone (:func:`to_gone_publisher`): a publisher that does not wait is normal, and
that result has no reader, so it is counted as undelivered (``Settler.undelivered``), not kept.

Why one module of some 450 lines: its dead letters, the copies it sends back and its answers all go
through one publish with its refusals retried in place (``Settler._publish``), and each falls back
on another (an answer the broker will not take becomes a dead letter).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from waystation.brokers.metadata import sendable
from waystation.brokers.port import (
    Broker,
    BrokerError,
    BrokerUnavailable,
    Delivery,
    PublishRefused,
    Unroutable,
    Unsendable,
)
from waystation.events import OutboxMessage
from waystation.events.codec import loads
from waystation.observability.observer import Observer
from waystation.protocol.intake import Rejection
from waystation.protocol.wire import (
    HEADER_ATTEMPTS,
    HEADER_DEAD_LETTERED_AT,
    HEADER_DETAIL,
    HEADER_QUEUE,
    HEADER_REASON,
    HEADER_ROOT,
    HEADER_TRACE,
    HEADER_TRACEPARENT,
    HEADER_USER,
    HEADER_WAITS,
    MAX_ID_BYTES,
    TYPE_RESULT,
    Names,
    ResultEnvelope,
    derived_id,
    result_message,
)
from waystation.runtime.verdicts import (
    Disposition,
    Verdict,
    waits_of,
)

__all__ = ["Settler", "to_gone_publisher", "unsendable_answer"]

log = logging.getLogger(__name__)

HEADER_WORKER = "x-waystation-worker"
"""On a dead letter: the worker that dead-lettered it."""
CHANNEL_RETURN_WAIT = 10.0
"""Seconds an answer waits for the publishing channel to come back (the connection up)."""
_AGENT_REPLIES = re.compile(r".*\.replies(\.\d+)?")
"""The reply queues of Waystation agents (``Names.replies``, ``Names.reply_shard``)."""
REFUSAL_RETRIES = (0.2, 0.5, 1.0)
"""Seconds between the tries of a publish the broker refuses (a nack), in place, before the
refusal is the caller's (``Settler._publish``)."""


def _moment(seconds: float) -> str:
    """A moment as a dead letter's ``HEADER_DEAD_LETTERED_AT`` says it (what the console's age
    of a letter is counted from)."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")


def _copy(
    delivery: Delivery,
    routing_key: str,
    headers: dict[str, Any],
    *,
    exchange: str,
    user_id: str | None = None,
) -> OutboxMessage:
    """A copy of ``delivery`` to publish again, with these headers made sendable (a value the
    publisher's library wrote that the worker's cannot, such as a long string that is not UTF-8,
    must not keep the delivery from being settled) and its publisher's user among them."""
    headers = sendable(headers)
    headers[HEADER_USER] = delivery.user_id or ""  # ("": it named none)
    return OutboxMessage(
        message_id=delivery.message_id or "",
        routing_key=routing_key,
        body=delivery.body,
        properties={
            "type": delivery.type,
            "correlation_id": delivery.correlation_id,
            "reply_to": delivery.reply_to,
            "content_type": delivery.content_type,
            "headers": headers,
            "user_id": user_id,
        },
        exchange=exchange,
    )


def _short_enough(message: OutboxMessage) -> OutboxMessage:
    """``message`` with each property too long for AMQP moved into a header of its own (its
    message id replaced by a derived one): a dead letter must be sendable, whatever made its
    message unsendable."""
    headers = sendable(message.properties.get("headers") or {})
    properties = dict(message.properties)
    for name in ("correlation_id", "reply_to", "type", "content_type"):
        value = properties.get(name)
        if isinstance(value, str) and len(value.encode()) > MAX_ID_BYTES:
            headers[f"x-waystation-{name.replace('_', '-')}"] = value
            properties[name] = None
    message_id = message.message_id
    if len(message_id.encode()) > MAX_ID_BYTES:
        headers["x-waystation-message-id"] = message_id
        message_id = derived_id(message_id, ":dead")
    return replace(message, message_id=message_id, properties={**properties, "headers": headers})


class Settler:
    """Settles deliveries through the broker port, and counts what it did.

    ``amqp_user``: the AMQP user the workers connect as. A message whose (broker-checked)
    ``user_id`` is that user was published by a worker: only on such a copy is the publisher
    named in ``x-waystation-user`` believed (:meth:`received`)."""

    def __init__(
        self,
        broker: Broker,
        names: Names,
        observer: Observer,
        worker_id: str,
        *,
        amqp_user: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.broker = broker
        self.names = names
        self.observer = observer
        self.worker_id = worker_id
        self.amqp_user = amqp_user
        self.clock = clock
        """The worker's wall clock (the simulation's own): when a letter was dead-lettered."""

    def received(self, delivery: Delivery) -> Delivery:
        """``delivery`` as its flow sees it: a copy a worker sent back names the original
        publisher's AMQP user as its ``user_id`` (the actor its events record)."""
        user = delivery.headers.get(HEADER_USER)
        if user is None or delivery.user_id is None or delivery.user_id != self.amqp_user:
            return delivery
        return replace(delivery, user_id=str(user) or None)

    # ---- answers ------------------------------------------------------------------------------

    async def answer(self, message: OutboxMessage, *, agent: str | None = None) -> None:
        """Publish an answer (a result, a cancel's status) to its ``reply_to`` queue.

        A result whose queue is gone (its publisher left without waiting: normal, and nobody can
        read it now) is counted as undelivered for ``agent`` (:meth:`undelivered`); retrying
        cannot help, and re-running the work that produced it would only repeat it. What else
        cannot pass is kept as a dead letter: an answer to a queue that is gone which is not a
        publisher's (a Waystation agent's reply queue: ``unroutable``), or one that can never be
        sent as it is (``too-large``, ``unencodable``; its publisher then gets an error result
        saying so, when that one can be sent). A refusal that may pass later
        (:class:`PublishRefused`, a full queue) is raised: the caller decides
        (:meth:`answer_or_keep`)."""
        try:
            await self._publish(message)
        except (Unroutable, Unsendable) as error:
            if to_gone_publisher(message, error):
                self.undelivered(message, agent)
                return
            await self.keep_answer(message, error)

    def undelivered(self, message: OutboxMessage, agent: str | None) -> None:
        """The result ``message`` was not delivered: its publisher's reply queue is gone (it did
        not wait). Counted (``waystation_results_undelivered_total``) and logged at debug: not a
        dead letter, and no alert. A result the log records stays there to be asked for."""
        log.debug(
            "%s to %r not delivered: its publisher's queue is gone (it did not wait)",
            message.message_id,
            message.routing_key,
        )
        self.observer.undelivered(agent or "?")

    async def _publish(self, message: OutboxMessage, *, later: float = 0.0) -> None:
        """Publish ``message`` (``later``: to arrive after that many seconds), riding out what
        may pass in a moment: the publishing channel coming back while the connection stays up
        (RabbitMQ closes it when it refuses a message for its size, and every publish under way
        on it fails with that), and a refusal tried again a few times (:data:`REFUSAL_RETRIES`).
        An answer or a copy lost to another message's refusal must not make a handler run
        again, nor a delivery go back to its queue. Raises what remains."""
        deadline: float | None = None
        refusals = 0
        while True:
            try:
                if later > 0:
                    await self.broker.publish_later(message, later)
                else:
                    await self.broker.publish(message)
                return
            except Unsendable:
                raise
            except PublishRefused:
                if refusals == len(REFUSAL_RETRIES):
                    raise
                await asyncio.sleep(REFUSAL_RETRIES[refusals])
                refusals += 1
            except BrokerUnavailable:
                now = asyncio.get_running_loop().time()
                if deadline is None:
                    deadline = now + CHANNEL_RETURN_WAIT
                if not self.broker.connected or now > deadline:
                    raise
                await asyncio.sleep(0.05)

    async def keep_answer(self, message: OutboxMessage, error: BrokerError) -> None:
        """Keep the answer ``message`` as a dead letter (:meth:`keep`); when it can never be
        sent as it is, its publisher gets an error result saying so instead, if that one can
        be sent (not to a queue that is gone or full)."""
        await self.keep(message, error)
        if isinstance(error, Unsendable):
            await self._tell_unsendable(message, error)

    async def answer_or_keep(self, message: OutboxMessage, *, agent: str | None = None) -> None:
        """:meth:`answer`; one the broker keeps refusing (a full queue) is kept as a dead letter
        (``refused``) once the tries in place are spent."""
        try:
            await self.answer(message, agent=agent)
        except Unsendable:  # (answer raises it only when even keeping it failed)
            raise
        except PublishRefused as refused:
            await self.keep(message, refused)

    async def _tell_unsendable(self, message: OutboxMessage, error: PublishRefused) -> None:
        """The answer ``message`` can never be sent: its publisher gets an error result instead,
        when that one can be now (it is small; its queue may still refuse it)."""
        instead = unsendable_answer(message, error)
        if instead is None:
            return
        try:
            await self._publish(instead)
        except BrokerError as failure:
            log.warning("could not tell %r that its answer is undeliverable: %s", instead, failure)

    async def keep(self, message: OutboxMessage, error: BrokerError) -> None:
        """Dead-letter ``message``, which the broker will not take, with the reason of
        ``error`` (``unroutable``, ``too-large``, ``unencodable``, ``refused``). The copy is made
        sendable: its over-long properties move into headers, and a body the broker refuses for
        its size is left out (``x-waystation-body-omitted``; the log holds what the message
        said). Raises :class:`BrokerError` when even that could not be published."""
        reason = _reason_of(error)
        detail = (
            f"no queue {message.routing_key!r} (its publisher is gone)"
            if isinstance(error, Unroutable)
            else str(error)
        )
        log.warning(
            "%s to %r: %s; dead-lettered (%s)",
            message.message_id,
            message.routing_key,
            detail,
            reason,
        )
        self.observer.dead_letter(reason)
        kept = _short_enough(message)
        headers = {
            **kept.properties["headers"],
            HEADER_REASON: reason,
            HEADER_DETAIL: detail[:1000],
            HEADER_QUEUE: message.routing_key,
            HEADER_WORKER: self.worker_id,
            HEADER_DEAD_LETTERED_AT: _moment(self.clock()),
        }
        letter = replace(
            kept,
            exchange=self.names.dead_letter_exchange,
            properties={**kept.properties, "headers": headers},
            delay=0.0,
        )
        try:
            await self._publish(letter)
        except Unsendable as refused:
            if refused.reason != "too-large":
                raise
            omitted = {**headers, "x-waystation-body-omitted": f"{len(message.body)} bytes"}
            await self._publish(
                replace(letter, body=b"", properties={**letter.properties, "headers": omitted})
            )

    # ---- settling -----------------------------------------------------------------------------

    async def settle(self, delivery: Delivery, settled: Verdict) -> None:
        try:
            if settled.disposition is Disposition.ACK:
                await self.broker.ack(delivery)
            elif settled.disposition in (Disposition.RETRY, Disposition.WAIT):
                if not await self._send_back(delivery, settled):
                    await self.broker.requeue(delivery)
                    return
                await self.broker.ack(delivery)
            elif settled.disposition is Disposition.REQUEUE:
                await self.broker.requeue(delivery)
            elif not await self._dead_letter(delivery, settled):
                await self.broker.requeue(delivery)
                return
            else:
                await self.broker.ack(delivery)
        except BrokerError as error:
            # the channel is gone: the broker redelivers, and the redelivery is recognised (G1)
            log.warning(
                "could not %s message %s: %s",
                settled.disposition.value,
                delivery.message_id,
                error,
            )
            return
        except Exception:
            # never leave a delivery unsettled, holding its place in the prefetch
            log.exception(
                "settling message %s (%s) failed; requeueing it",
                delivery.message_id,
                settled.disposition.value,
            )
            self.observer.count("processing_errors")
            with contextlib.suppress(BrokerError):
                await self.broker.requeue(delivery)
            return
        checkpoint = (
            time.perf_counter() - settled.checkpoint_started
            if settled.checkpoint_started is not None
            else None
        )
        self.observer.settled(settled.disposition.value, checkpoint)

    async def _send_back(self, delivery: Delivery, settled: Verdict) -> bool:
        """Publish a copy of ``delivery`` to its own queue counting its failed runs (and, for a
        wait, one more wait), to arrive after its delay (waiting in the broker, not here); False
        if that failed (the delivery is then requeued at once, and the broker's count carries
        on)."""
        headers: dict[str, Any] = {
            key: value
            for key, value in delivery.headers.items()
            if key not in ("x-delivery-count", "x-acquired-count")
        }
        if settled.disposition is Disposition.WAIT:
            headers[HEADER_WAITS] = waits_of(delivery) + 1
        if settled.failed_runs or settled.disposition is Disposition.RETRY:
            headers[HEADER_ATTEMPTS] = settled.failed_runs
        copy = _copy(delivery, delivery.queue, headers, exchange="", user_id=self.amqp_user)
        try:
            await self._publish(copy, later=settled.delay)
        except BrokerError as error:
            log.warning(
                "could not send %s back (%s: %s); requeueing it",
                delivery.message_id,
                settled.disposition.value,
                error,
            )
            return False
        return True

    async def _dead_letter(self, delivery: Delivery, settled: Verdict) -> bool:
        """Publish ``delivery`` to the dead-letter exchange with its reason; False on failure."""
        rejection = settled.rejection or Rejection("rejected", "")
        log.error(
            "dead-lettering message %s from %s: %s (%s)",
            delivery.message_id,
            delivery.queue,
            rejection.reason,
            rejection.detail,
        )
        self.observer.dead_letter(rejection.reason)
        headers: dict[str, Any] = dict(delivery.headers)
        headers.update(
            {
                HEADER_REASON: rejection.reason,
                HEADER_DETAIL: rejection.detail[:1000],
                HEADER_QUEUE: delivery.queue,
                HEADER_WORKER: self.worker_id,
                HEADER_DEAD_LETTERED_AT: _moment(self.clock()),
            }
        )
        copy = _copy(delivery, delivery.queue, headers, exchange=self.names.dead_letter_exchange)
        try:
            await self._publish(copy)
        except Unsendable:
            # what even a sendable copy cannot carry (a body over the broker's limit now):
            # kept without it, saying so, rather than never settled
            omitted = {**copy.properties["headers"], "x-waystation-body-omitted": "unsendable"}
            try:
                await self._publish(
                    replace(copy, body=b"", properties={**copy.properties, "headers": omitted})
                )
            except BrokerError as error:
                log.warning(
                    "could not dead-letter %s (%s); requeueing it", delivery.message_id, error
                )
                return False
        except BrokerError as error:
            log.warning("could not dead-letter %s (%s); requeueing it", delivery.message_id, error)
            return False
        if settled.tell_publisher and delivery.reply_to:
            task_id = delivery.message_id or str(uuid.uuid4())
            envelope = ResultEnvelope(
                "error", error={"type": rejection.reason, "message": rejection.detail}
            )
            with contextlib.suppress(BrokerError):
                await self.answer(
                    result_message(task_id, delivery.reply_to, delivery.correlation_id, envelope)
                )
        return True


def to_gone_publisher(message: OutboxMessage, error: BrokerError) -> bool:
    """Whether ``error`` says that the result ``message`` has no queue to go to because its
    publisher's reply queue is gone. A result to a Waystation agent's reply queue (a reply to a
    paused task's call) is not: that queue is the deployment's own, and its loss is a fault."""
    return (
        isinstance(error, Unroutable)
        and message.properties.get("type") == TYPE_RESULT
        and _AGENT_REPLIES.fullmatch(message.routing_key) is None
    )


def unsendable_answer(message: OutboxMessage, error: PublishRefused) -> OutboxMessage | None:
    """What a publisher is told instead of the result ``message``, which can never be sent as it
    is (``error``): an error result under the same message id (None: ``message`` is no result)."""
    if message.properties.get("type") != TYPE_RESULT:
        return None
    try:
        body = loads(message.body)
    except ValueError:
        body = None
    task_id = body.get("task_id") if isinstance(body, dict) else None
    given = body.get("error") if isinstance(body, dict) else None
    if isinstance(given, dict) and given.get("type") == "undeliverable-result":
        return None  # it is the answer given instead already
    envelope = ResultEnvelope(
        "error",
        error={"type": "undeliverable-result", "message": f"{error.reason}: {error.detail}"},
        task_id=task_id if isinstance(task_id, str) else None,
    )
    instead = result_message(
        str(task_id or message.message_id),
        message.routing_key,
        message.properties.get("correlation_id"),
        envelope,
        {k: v for k, v in (message.properties.get("headers") or {}).items() if k in _CARRIED},
    )
    return replace(instead, message_id=message.message_id)


_CARRIED = (HEADER_ROOT, HEADER_TRACE, HEADER_TRACEPARENT)
"""The headers an answer given instead keeps of the one it replaces."""


def _reason_of(error: BrokerError) -> str:
    """The dead letter's reason for what the broker said."""
    if isinstance(error, Unroutable):
        return "unroutable"
    if isinstance(error, PublishRefused):
        return error.reason
    return "unavailable"
