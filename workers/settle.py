"""The one place that settles a delivery: ack, requeue or dead-letter, once its outcome is durable.

Flows never ack: each returns a :class:`Settled` saying what should become of its delivery, and the
worker hands it to :meth:`Settler.settle` only after every event that records the delivery's
effect has committed (G1). A dead letter is a copy of the delivery published to the deployment's
dead-letter exchange with its reason (``x-waystation-reason``, ``-detail``, ``-queue``), and the
delivery acked only once the broker confirmed the copy (G9); when the copy cannot be published
the delivery is requeued instead, so nothing is lost.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from events import OutboxMessage

from .broker import Broker, BrokerError, Delivery
from .intake import Rejection
from .observer import Observer
from .wire import (
    HEADER_DETAIL,
    HEADER_PRIOR_ATTEMPTS,
    HEADER_QUEUE,
    HEADER_REASON,
    TYPE_RESUME,
    Names,
    ResultEnvelope,
    result_message,
)

__all__ = ["Disposition", "Settled", "Settler", "ack", "attempt_of", "dead", "requeue"]

log = logging.getLogger(__name__)


class Disposition(enum.Enum):
    ACK = "ack"
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


def ack(checkpoint_started: float | None = None) -> Settled:
    return Settled(Disposition.ACK, checkpoint_started)


def requeue() -> Settled:
    return Settled(Disposition.REQUEUE)


def dead(reason: str, detail: str, *, tell_publisher: bool = False) -> Settled:
    return Settled(Disposition.DEAD_LETTER, None, Rejection(reason, detail), tell_publisher)


def attempt_of(delivery: Delivery) -> int:
    """Which attempt this delivery is: the broker counts redeliveries, and a resume message
    counts the runs that failed in place before it was sent."""
    prior = delivery.headers.get(HEADER_PRIOR_ATTEMPTS, 0) if delivery.type == TYPE_RESUME else 0
    attempt = delivery.broker_count + 1
    return attempt + (prior if isinstance(prior, int) and 0 <= prior < 100 else 0)


class Settler:
    """Settles deliveries through the broker port, and counts what it did."""

    def __init__(self, broker: Broker, names: Names, observer: Observer, worker_id: str) -> None:
        self.broker = broker
        self.names = names
        self.observer = observer
        self.worker_id = worker_id

    async def settle(self, delivery: Delivery, settled: Settled) -> None:
        try:
            if settled.disposition is Disposition.ACK:
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
        copy = OutboxMessage(
            message_id=delivery.message_id or "",
            routing_key=delivery.queue,
            body=delivery.body,
            properties={
                "type": delivery.type,
                "correlation_id": delivery.correlation_id,
                "reply_to": delivery.reply_to,
                "content_type": delivery.content_type,
                "headers": headers,
            },
            exchange=self.names.dead_letter_exchange,
        )
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
                await self.broker.publish(
                    result_message(task_id, delivery.reply_to, delivery.correlation_id, envelope)
                )
        return True
