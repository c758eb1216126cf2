"""The one place that settles a delivery: ack, retry, requeue or dead-letter, once its outcome is
durable.

Flows never ack: each returns a :class:`Settled` saying what should become of its delivery, and the
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
  ``workers.limits``) is a copy sent back the same way, after its delay, carrying how often it
  waited (``x-waystation-waits``) and its failed runs unchanged: waiting is not an attempt.

When a copy cannot be published the delivery is requeued instead, so nothing is lost.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from events import OutboxMessage

from .broker import Broker, BrokerError, Delivery, Unroutable
from .intake import Rejection
from .observer import Observer
from .wire import (
    HEADER_ATTEMPTS,
    HEADER_DETAIL,
    HEADER_QUEUE,
    HEADER_REASON,
    HEADER_WAITS,
    Names,
    ResultEnvelope,
    result_message,
)

__all__ = [
    "Disposition",
    "Settled",
    "Settler",
    "ack",
    "attempt_of",
    "crash_limit",
    "dead",
    "requeue",
    "retry",
    "sent_again",
    "wait",
    "waits_of",
]

log = logging.getLogger(__name__)


class Disposition(enum.Enum):
    ACK = "ack"
    RETRY = "retry"
    WAIT = "wait"
    REQUEUE = "requeue"
    DEAD_LETTER = "dead-letter"


@dataclass(frozen=True, slots=True)
class Settled:
    """What becomes of a delivery once its outcome is durable."""

    disposition: Disposition
    checkpoint_started: float | None = None
    """perf_counter() when the handler returned a pause; the checkpoint ends at the ack."""
    rejection: Rejection | None = None
    """Why a dead letter is dead."""
    tell_publisher: bool = False
    """Send the rejection to the delivery's ``reply_to`` as an error result."""
    failed_runs: int = 0
    """For a retry: the runs of its handler that have failed so far, this one included. For a
    wait: those before it (and the times the broker took it back unsettled)."""
    delay: float = 0.0
    """For a retry or a wait: seconds it waits in the broker before it is delivered again."""


def ack(checkpoint_started: float | None = None) -> Settled:
    return Settled(Disposition.ACK, checkpoint_started)


def requeue() -> Settled:
    return Settled(Disposition.REQUEUE)


def dead(reason: str, detail: str, *, tell_publisher: bool = False) -> Settled:
    return Settled(Disposition.DEAD_LETTER, None, Rejection(reason, detail), tell_publisher)


def retry(failed_runs: int, delay: float = 0.0) -> Settled:
    return Settled(Disposition.RETRY, failed_runs=failed_runs, delay=delay)


def wait(failed_runs: int, delay: float) -> Settled:
    return Settled(Disposition.WAIT, failed_runs=failed_runs, delay=delay)


def crash_limit(delivery_limit: int) -> int:
    """How many times a message may come back unsettled (its worker died, or its connection
    dropped, while holding it) before it is taken for a poison message and failed."""
    return 2 * delivery_limit


def attempt_of(delivery: Delivery) -> int:
    """Which attempt of its handler this delivery is: 1, plus the runs that failed before (which
    the worker that saw them fail wrote into ``x-waystation-attempts``), plus the times the broker
    took it back unsettled (a worker died holding it, or its connection dropped)."""
    failed = delivery.headers.get(HEADER_ATTEMPTS, 0)
    if not isinstance(failed, int) or isinstance(failed, bool) or not 0 <= failed < 1_000_000:
        failed = 0
    return 1 + failed + delivery.broker_count


def waits_of(delivery: Delivery) -> int:
    """How often this message already waited for a free slot (``x-waystation-waits``)."""
    waits = delivery.headers.get(HEADER_WAITS, 0)
    if not isinstance(waits, int) or isinstance(waits, bool) or not 0 <= waits < 1_000_000:
        return 0
    return waits


def sent_again(delivery: Delivery) -> bool:
    """Whether this message may have been handled before: the broker redelivered it, or it is a
    copy a worker sent back (a retry, or a wait for a slot). A worker that died after sending
    the copy but before acking the delivery leaves both, so only the log can tell."""
    return (
        delivery.redelivered
        or HEADER_ATTEMPTS in delivery.headers
        or HEADER_WAITS in delivery.headers
    )


def _copy(
    delivery: Delivery, routing_key: str, headers: dict[str, Any], *, exchange: str
) -> OutboxMessage:
    """A copy of ``delivery`` to publish again, with these headers."""
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
        },
        exchange=exchange,
    )


class Settler:
    """Settles deliveries through the broker port, and counts what it did."""

    def __init__(self, broker: Broker, names: Names, observer: Observer, worker_id: str) -> None:
        self.broker = broker
        self.names = names
        self.observer = observer
        self.worker_id = worker_id

    async def answer(self, message: OutboxMessage) -> None:
        """Publish an answer (a result, a cancel's status) to its ``reply_to`` queue. When that
        queue is gone (its publisher left), the answer is kept as a dead letter, ``unroutable``:
        retrying cannot help, and re-running the work that produced it would only repeat it."""
        try:
            await self.broker.publish(message)
        except Unroutable:
            await self.keep_unroutable(message)

    async def keep_unroutable(self, message: OutboxMessage) -> None:
        """Dead-letter ``message``, which no queue takes, with the reason ``unroutable``."""
        log.warning(
            "%s to %r: no such queue; dead-lettered", message.message_id, message.routing_key
        )
        self.observer.dead_letter("unroutable")
        headers = {
            **(message.properties.get("headers") or {}),
            HEADER_REASON: "unroutable",
            HEADER_DETAIL: f"no queue {message.routing_key!r} (its publisher is gone)",
            HEADER_QUEUE: message.routing_key,
            "x-waystation-worker": self.worker_id,
        }
        await self.broker.publish(
            replace(
                message,
                exchange=self.names.dead_letter_exchange,
                properties={**message.properties, "headers": headers},
            )
        )

    async def settle(self, delivery: Delivery, settled: Settled) -> None:
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
        checkpoint = (
            time.perf_counter() - settled.checkpoint_started
            if settled.checkpoint_started is not None
            else None
        )
        self.observer.settled(settled.disposition.value, checkpoint)

    async def _send_back(self, delivery: Delivery, settled: Settled) -> bool:
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
        copy = _copy(delivery, delivery.queue, headers, exchange="")
        delay = settled.delay
        try:
            if delay > 0:
                await self.broker.publish_later(copy, delay)
            else:
                await self.broker.publish(copy)
        except BrokerError as error:
            log.warning(
                "could not send %s back (%s: %s); requeueing it",
                delivery.message_id,
                settled.disposition.value,
                error,
            )
            return False
        return True

    async def _dead_letter(self, delivery: Delivery, settled: Settled) -> bool:
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
                "x-waystation-worker": self.worker_id,
            }
        )
        copy = _copy(delivery, delivery.queue, headers, exchange=self.names.dead_letter_exchange)
        try:
            await self.broker.publish(copy)
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
