"""Inspecting and replaying the dead-letter queue (what ``waystation dead-letters`` runs).

A dead letter keeps its body and properties; the worker that dead-lettered it added
``x-waystation-reason``, ``x-waystation-detail``, ``x-waystation-queue`` (where it came from)
and ``x-waystation-dead-lettered-at`` (when). Messages the broker dead-lettered by itself (the
policy's delivery limit) carry RabbitMQ's ``x-first-death-queue``, ``x-first-death-reason`` and
``x-death`` (with its time) instead.

The queue is read by taking letters and putting them back: a letter being looked at is, for that
moment, invisible to anyone else reading the queue (another console, ``dead-letters list``).

A replay given the event store is recorded in the log: one ``DeadLettersReplayed`` per replay, in
the operations stream (``waystation.events.operations``), naming who replayed (``actor``) and
what went back where.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from yarl import URL

from waystation.brokers.amqp.transport import guarded_connection
from waystation.brokers.metadata import sendable
from waystation.events import DeadLettersReplayed, EventStore
from waystation.events.operations import append_operation
from waystation.protocol.actors import clean_actor
from waystation.protocol.wire import (
    HEADER_ACTOR,
    HEADER_DEAD_LETTERED_AT,
    HEADER_DETAIL,
    HEADER_QUEUE,
    HEADER_REASON,
    Names,
)

__all__ = ["DeadLetter", "ReplayNotRecorded", "browse", "count", "replay"]

log = logging.getLogger(__name__)


class ReplayNotRecorded(Exception):
    """Dead letters were replayed (``replayed``), but the log could not record it (``cause``)."""

    def __init__(self, replayed: list[DeadLetter], cause: BaseException) -> None:
        super().__init__(
            f"{len(replayed)} dead letter(s) were replayed, but the log did not record it: "
            f"{cause!r}"
        )
        self.replayed = replayed
        self.cause = cause


@dataclass(frozen=True, slots=True)
class DeadLetter:
    message_id: str | None
    correlation_id: str | None
    type: str | None
    reason: str
    detail: str
    queue: str | None
    """The queue it came from, where a replay sends it back."""
    body: bytes
    dead_lettered_at: datetime | None = None
    """When, as far as the letter says (None when it does not)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "message_id": self.message_id,
            "correlation_id": self.correlation_id,
            "type": self.type,
            "reason": self.reason,
            "detail": self.detail,
            "queue": self.queue,
            "body": self.body.decode("utf-8", errors="replace"),
            "dead_lettered_at": (
                self.dead_lettered_at.isoformat() if self.dead_lettered_at is not None else None
            ),
        }


def _describe(message: AbstractIncomingMessage) -> DeadLetter:
    headers = message.headers or {}
    reason = headers.get(HEADER_REASON) or headers.get("x-first-death-reason") or "unknown"
    queue = headers.get(HEADER_QUEUE) or headers.get("x-first-death-queue")
    return DeadLetter(
        message_id=message.message_id,
        correlation_id=message.correlation_id,
        type=message.type,
        reason=str(reason),
        detail=str(headers.get(HEADER_DETAIL) or ""),
        queue=str(queue) if queue else None,
        body=message.body,
        dead_lettered_at=_dead_lettered_at(message, headers),
    )


def _dead_lettered_at(message: AbstractIncomingMessage, headers: Any) -> datetime | None:
    """When ``message`` was dead-lettered: the worker's header, else the time of RabbitMQ's
    latest ``x-death`` (the first entry), else its ``timestamp`` property (when it was
    published, if its publisher said). Whatever is not a time is passed over: headers come from
    publishers too."""
    stamp = headers.get(HEADER_DEAD_LETTERED_AT)
    if isinstance(stamp, str):
        try:
            moment = datetime.fromisoformat(stamp)
        except ValueError:
            pass
        else:
            return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict):
        moment = deaths[0].get("time")
        if isinstance(moment, datetime):
            return moment
    return message.timestamp if isinstance(message.timestamp, datetime) else None


async def _take(
    amqp_url: str,
    names: Names,
    limit: int,
    act: Callable[[aio_pika.abc.AbstractChannel, AbstractIncomingMessage, DeadLetter], Any],
) -> list[DeadLetter]:
    """Get up to ``limit`` dead letters; ``act`` returns True to ack one, else it goes back."""
    # read defensively: a letter the broker dead-lettered by itself keeps its metadata as it came
    connection = await guarded_connection(
        amqp_url, client_properties={"connection_name": "waystation dead-letters"}
    )
    seen: list[DeadLetter] = []
    kept: list[AbstractIncomingMessage] = []
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        queue = await channel.declare_queue(names.dead_letter_queue, passive=True)
        # only the letters there now: a replayed message its worker dead-letters again at once
        # arrives behind them, and is not taken (and replayed again, and again) in this round
        limit = min(limit, queue.declaration_result.message_count or 0)
        while len(seen) < limit:
            message = await queue.get(fail=False)
            if message is None:
                break
            letter = _describe(message)
            try:
                done = await act(channel, message, letter)
            except aio_pika.exceptions.DeliveryError as refused:
                # the broker returned what ``act`` published (no queue of that name any more)
                # or refused it: the letter stays, nothing is lost
                log.warning(
                    "dead letter %s stays: %s refused it (%s)",
                    letter.message_id,
                    letter.queue,
                    refused,
                )
                done = False
            if done:
                await message.ack()
            else:
                kept.append(message)
            seen.append(letter)
    finally:
        for message in kept:
            await message.nack(requeue=True)
        await connection.close()
    return seen


async def count(amqp_url: str, names: Names) -> int:
    """How many dead letters wait in the queue (0 when no worker has declared it yet), without
    taking any: the broker's count as of a passive declare."""
    connection = await guarded_connection(
        amqp_url, client_properties={"connection_name": "waystation dead-letters"}
    )
    try:
        channel = await connection.channel()
        try:
            queue = await channel.declare_queue(names.dead_letter_queue, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:  # no worker has declared it yet
            return 0
        return queue.declaration_result.message_count or 0
    finally:
        await connection.close()


async def browse(amqp_url: str, names: Names, limit: int = 50) -> list[DeadLetter]:
    """Up to ``limit`` dead letters, left in the queue."""

    async def keep(*_: Any) -> bool:
        return False

    return await _take(amqp_url, names, limit, keep)


async def replay(
    amqp_url: str,
    names: Names,
    *,
    reason: str | None = None,
    message_id: str | None = None,
    limit: int = 50,
    store: EventStore | None = None,
    actor: str | None = None,
) -> list[DeadLetter]:
    """Send dead letters (of ``reason`` and with ``message_id``, each if given) back to the
    queue they came from, among the first ``limit`` letters of the queue.

    Each is republished with its body and properties, without the dead-letter headers (but
    with the actor a cancel or a signal named), and acked from the dead-letter queue only once
    the broker confirmed the republish. Returns the ones replayed; the others stay in the queue,
    among them those whose queue no longer exists or refused them.
    A letter is replayed once per call: one that fails again at once and comes back to the
    dead-letter queue during the replay stays there (:func:`_take` looks only at the letters
    there when it starts).

    With ``store``, the replay is recorded once it is done: one ``DeadLettersReplayed`` event in
    the operations stream naming ``actor`` (cleaned as the worker cleans a header's), the
    ``reason`` filter, the letters' message ids and queues, for the letters actually
    republished (none: nothing is recorded), also when the replay stops half-way on an error
    (the letters sent back before it are recorded, and the error raised). If that append
    fails, the replay has happened all the same (the letters are back in their queues and gone
    from the dead-letter queue): the failure is logged as an error naming every message id, and
    :class:`ReplayNotRecorded` raised with the letters replayed, for the caller to report and
    exit non-zero.
    """
    replayed: list[DeadLetter] = []

    async def send_back(
        channel: aio_pika.abc.AbstractChannel, message: AbstractIncomingMessage, letter: DeadLetter
    ) -> bool:
        if (
            letter.queue is None
            or (reason is not None and letter.reason != reason)
            or (message_id is not None and letter.message_id != message_id)
        ):
            return False
        headers = sendable(
            {
                key: value
                for key, value in (message.headers or {}).items()
                if key == HEADER_ACTOR
                or (
                    not key.startswith(
                        ("x-waystation-", "x-death", "x-first-death", "x-last-death")
                    )
                    and key != "x-delivery-count"
                )
            }
        )
        await channel.default_exchange.publish(
            aio_pika.Message(
                message.body,
                message_id=message.message_id,
                correlation_id=message.correlation_id,
                reply_to=message.reply_to,
                type=message.type,
                content_type=message.content_type,
                headers=headers,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=letter.queue,
            mandatory=True,
        )
        replayed.append(letter)
        return True

    try:
        await _take(amqp_url, names, limit, send_back)
    finally:  # what went back before a failure (a dropped connection) went back all the same
        if store is not None and replayed:
            await _record(store, replayed, names, amqp_url, reason=reason, actor=clean_actor(actor))
    return replayed


async def _record(
    store: EventStore,
    replayed: list[DeadLetter],
    names: Names,
    amqp_url: str,
    *,
    reason: str | None,
    actor: str | None,
) -> None:
    """Record a replay that happened (see :func:`replay`)."""
    event = DeadLettersReplayed(
        actor=actor,
        reason=reason,
        count=len(replayed),
        message_ids=tuple(letter.message_id for letter in replayed),
        queues=tuple(sorted({letter.queue for letter in replayed if letter.queue})),
    )
    try:
        await append_operation(
            store,
            event,
            actor=actor,
            amqp_user=URL(amqp_url).user or "guest",
            deployment=names.prefix,
        )
    except Exception as error:
        log.error(
            "REPLAYED BUT NOT RECORDED: %d dead letter(s) went back to their queues (%s) but "
            "the log could not record it: %r; message ids: %s",
            len(replayed),
            ", ".join(event.queues),
            error,
            ", ".join(str(m) for m in event.message_ids),
        )
        raise ReplayNotRecorded(replayed, error) from error
