"""Who acted: the free-text actor a cancel or a signal names (``x-waystation-actor``), cleaned.

The AMQP ``user_id`` RabbitMQ checks names a connection, not a person: a console that serves many
people through one connection names each in this header (``console:alice``, ``cli:root``). A
worker reads it on those two messages only (:func:`actor_of`) and records it as the ``actor`` of
the metadata of the events they cause; it trusts it no further than the publisher's right to
publish. The cancels a cancelled task sends its pending peers carry it on (:func:`with_actor`),
so that a Waystation peer records its own cancellation as that actor's too.

The header is hostile input (any publisher may send anything) and a console renders it, so what
the log records is bounded and printable: :func:`clean_actor`. The client cleans it the same way
before sending, so that what it sends is what the log records.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from waystation.events import OutboxMessage
from waystation.protocol.wire import HEADER_ACTOR, TYPE_CANCEL

__all__ = ["MAX_ACTOR", "actor_of", "clean_actor", "with_actor"]

MAX_ACTOR = 128
"""Characters of an actor kept (:func:`clean_actor`); the rest is cut off."""


def clean_actor(value: Any) -> str | None:
    """An actor as the log records it: text (bytes decoded, anything else refused), without
    control or format characters (escapes, zero-width and bidirectional marks: a console
    renders it), each run of white space (a line break too) one space, trimmed, at most
    :data:`MAX_ACTOR` characters; None when nothing is left. The header is hostile input:
    whatever it holds, this never raises."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="replace")
    if not isinstance(value, str):
        return None
    kept = "".join(
        " " if char.isspace() else char
        for char in value[: MAX_ACTOR * 4]
        if char.isspace() or unicodedata.category(char)[0] != "C"
    )
    cleaned = " ".join(kept.split())[:MAX_ACTOR].strip()
    return cleaned or None


def actor_of(headers: Mapping[str, Any] | None) -> str | None:
    """The cleaned actor a message names in its ``x-waystation-actor`` header, if any."""
    return clean_actor(headers.get(HEADER_ACTOR)) if headers else None


def with_actor(messages: Sequence[OutboxMessage], actor: str) -> list[OutboxMessage]:
    """``messages`` (what a decision implies), their cancels to peers naming ``actor``."""
    return [
        replace(
            message,
            properties={
                **message.properties,
                "headers": {**(message.properties.get("headers") or {}), HEADER_ACTOR: actor},
            },
        )
        if message.properties.get("type") == TYPE_CANCEL
        else message
        for message in messages
    ]
