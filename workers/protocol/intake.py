"""Checking an incoming message before anything uses it (G9).

``inspect`` either returns the parsed body or a :class:`Rejection` with a machine-readable
reason. Reasons (the ``x-waystation-reason`` header of the dead letter):

==========================  ==============================================================
``too-large``               body over ``WAYSTATION_MAX_MESSAGE_BYTES``
``headers-too-large``       headers over ``WAYSTATION_MAX_HEADER_BYTES`` (as JSON)
``invalid-utf8``            body is not UTF-8
``invalid-json``            body is UTF-8 but not JSON
``unstorable``              JSON the log cannot store: a NUL character (``\\u0000``), nesting
                            deeper than 128 levels, an integer beyond 64 bits. A peer's reply
                            of this kind fails its call at once (an ``unstorable-reply`` error)
``invalid-property``        a property or trace header the log cannot store (a NUL character)
``wrong-shape``             JSON, but not what this message type carries
``missing-property``        a required AMQP property is absent (``message_id`` on a task or a
                            signal, ``correlation_id`` on a reply)
``unknown-message-type``    a ``type`` this queue does not take
``malformed-correlation-id``  a reply whose correlation id names no sub-task
``unknown-task``            a reply or progress report for a task the log does not know
``invalid-input``           a task whose input does not fit its agent's input model (the
                            detail names each wrong field); its publisher is told
``handler-failed``          the handler raised on every allowed attempt, or returned an
                            outcome that cannot be recorded
``delivery-limit``          delivered more times than the delivery limit without being settled
                            (its workers died holding it); a task's publisher is told
``unroutable``              a message no queue takes: a call, a cancel for a peer, a reply to an
                            agent's reply queue (a result to a publisher's queue that is gone is
                            no dead letter: counted as undelivered, ``Settler.undelivered``)
``undecodable-metadata``    properties or headers that could not be decoded (a short string
                            that is not UTF-8, a header table nested too deep, lengths that
                            lie): the detail names each, ``x-waystation-raw-properties`` keeps
                            them as they came
``ignored-replies-limit``   a reply that would be recorded as ignored (a duplicate, a late
                            one, one for a call never made) to a task whose stream already
                            holds ``MAX_IGNORED_REPLIES`` (100) of them
``id-too-long``             a task whose id is longer than ``MAX_TASK_ID_BYTES`` (200 bytes):
                            the ids Waystation derives from it could not be sent; its
                            publisher is told
``too-large``, ``unencodable``, ``refused``  a message Waystation published that the broker will
                            not take (``waystation.runtime.flows.undeliverable``): over its size
                            limit, not encodable in AMQP, or refused (a full queue) for
                            ``WAYSTATION_REFUSED_RETRY_SECONDS``
==========================  ==============================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from waystation.brokers.metadata import HEADER_UNDECODABLE
from waystation.brokers.port import Delivery
from waystation.events.codec import unstorable
from waystation.protocol.wire import HEADER_ROOT, HEADER_TRACE, HEADER_TRACEPARENT

__all__ = ["Rejection", "inspect"]


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: str
    detail: str


def _header_size(headers: Any) -> int:
    try:
        return len(orjson.dumps(headers, default=repr))
    except TypeError:
        return len(repr(headers))


def inspect(delivery: Delivery, *, max_body: int, max_headers: int) -> Any | Rejection:
    """The JSON body of ``delivery``, or why it cannot be used."""
    undecodable = delivery.headers.get(HEADER_UNDECODABLE)
    if undecodable is not None:
        return Rejection("undecodable-metadata", f"could not decode {undecodable}"[:1000])
    size = len(delivery.body)
    if size > max_body:
        return Rejection("too-large", f"body of {size} bytes is over the {max_body}-byte limit")
    if delivery.headers and _header_size(delivery.headers) > max_headers:
        return Rejection("headers-too-large", f"headers are over the {max_headers}-byte limit")
    try:
        delivery.body.decode("utf-8")
    except UnicodeDecodeError as error:
        return Rejection("invalid-utf8", f"body is not UTF-8: {error}")
    for name in ("message_id", "correlation_id", "reply_to", "type"):
        value = getattr(delivery, name)
        if isinstance(value, str) and "\x00" in value:
            return Rejection("invalid-property", f"{name} holds a NUL character")
    for header in (HEADER_TRACE, HEADER_TRACEPARENT, HEADER_ROOT):
        value = delivery.headers.get(header)
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        if isinstance(value, str) and "\x00" in value:
            return Rejection("invalid-property", f"header {header} holds a NUL character")
    try:
        body = orjson.loads(delivery.body)
    except orjson.JSONDecodeError as error:
        return Rejection("invalid-json", f"body is not JSON: {error}")
    problem = unstorable(body)
    if problem is not None:
        return Rejection("unstorable", f"the log cannot store this body: {problem}")
    return body
