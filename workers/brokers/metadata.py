"""AMQP metadata, read and written without trusting it: the rules every backend of the port keeps.

Properties and headers come from publishers Waystation does not control, and go back out on the
copies a worker publishes (a retry, a wait for a slot, a dead letter). Three things here, used by
the AMQP backend (``waystation.brokers.amqp.broker``) and by the in-memory one, which behaves as it
does:

* :func:`guard_content_header` takes a content header frame's payload as it arrived and returns
  it unchanged when it decodes (with what it decodes to), or else a payload that does: the
  properties that decode are kept, the rest dropped, and the headers name what was wrong in
  ``x-waystation-undecodable`` (the worker dead-letters such a message:
  ``undecodable-metadata``), with the raw properties as a byte array in
  ``x-waystation-raw-properties``. A header nested deeper than
  :data:`MAX_DEPTH` counts as undecodable: the decoder would run out of stack.
* :func:`sendable` makes decoded headers into what the client library can encode again: a long
  string that was not UTF-8 (decoded as ``bytes``) becomes a byte array, a double that a single
  float cannot hold becomes its text, anything else it cannot write becomes its ``repr``.
* :func:`check_encodable` refuses, as :class:`~waystation.brokers.port.Unsendable`, an outgoing
message
  whose routing key, properties or headers AMQP cannot encode (a short string over 255 bytes, a
  value of a type AMQP has none for), before anything of it is sent.
"""

from __future__ import annotations

import datetime
import decimal
import struct
from collections.abc import Mapping
from typing import Any

import pamqp.commands
import pamqp.decode
import pamqp.header

from waystation.brokers.amqp import frames
from waystation.brokers.port import Unsendable
from waystation.events import OutboxMessage

__all__ = [
    "HEADER_RAW",
    "HEADER_UNDECODABLE",
    "MAX_DEPTH",
    "MAX_SHORT_STRING",
    "check_encodable",
    "guard_content_header",
    "properties_of",
    "sendable",
]

HEADER_UNDECODABLE = "x-waystation-undecodable"
"""On a delivery whose metadata could not all be decoded: what could not, and why."""
HEADER_RAW = "x-waystation-raw-properties"
"""With it: the properties as they arrived (a byte array, at most :data:`MAX_RAW` bytes)."""
MAX_DEPTH = 64
"""Deepest nesting of tables and arrays in headers that is decoded (a limit of Waystation's)."""
MAX_RAW = 64 * 1024
MAX_SHORT_STRING = 255
"""Bytes of an AMQP short string (message ids, correlation ids, routing keys)."""

_Properties = pamqp.commands.Basic.Properties
_FLOAT = struct.Struct(">f")
_SIZES = {"octet": 1, "timestamp": 8}


# ---- reading ------------------------------------------------------------------------------------


def guard_content_header(payload: bytes) -> tuple[bytes, Any | None]:
    """``payload`` (a content header frame's, without the frame's envelope) when it decodes,
    with what it decodes to (pamqp's ``ContentHeader``); else one that does, with None (see the
    module)."""
    try:
        header = frames.content_header(payload)
        problem = _too_deep(header.properties.headers)
        if problem is None:
            return payload, header
    except Exception as error:  # any failure to decode is this message's alone
        problem = _why(error)
    return _salvaged(payload, problem), None


def _why(error: BaseException) -> str:
    if isinstance(error, RecursionError):
        return "nested too deep to decode"
    cause = error.__cause__ or error.__context__
    text = str(error) or type(error).__name__
    if isinstance(cause, UnicodeDecodeError) or isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 ({text[:200]})"
    return text[:300]


def _too_deep(value: Any, depth: int = 0) -> str | None:
    if depth > MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} levels"
    if isinstance(value, dict):
        values: Any = value.values()
    elif isinstance(value, list):
        values = value
    else:
        return None
    for item in values:
        problem = _too_deep(item, depth + 1)
        if problem is not None:
            return problem
    return None


def _salvaged(payload: bytes, problem: str) -> bytes:
    """A content header that decodes, in place of ``payload``: its body size (the broker's own),
    the properties that decode, and the headers saying what was wrong."""
    body_size = struct.unpack_from(">Q", payload, 4)[0] if len(payload) >= 12 else 0
    problems: list[str] = []
    kept: dict[str, Any] = {}
    try:
        kept, problems = _decode_each(payload[12:])
    except Exception as error:  # the flags themselves are broken: keep nothing
        problems = [f"property flags: {_why(error)}"]
    if not problems:
        problems = [problem]
    headers = sendable(kept.pop("headers", None) or {})
    headers[HEADER_UNDECODABLE] = "; ".join(problems)[:1000]
    headers[HEADER_RAW] = bytearray(payload[12 : 12 + MAX_RAW])
    properties = _Properties(**kept, headers=headers)
    try:
        return pamqp.header.ContentHeader(0, body_size, properties).marshal()
    except Exception:  # what was kept still cannot be written: keep less
        marker = {HEADER_UNDECODABLE: headers[HEADER_UNDECODABLE], HEADER_RAW: headers[HEADER_RAW]}
        return pamqp.header.ContentHeader(0, body_size, _Properties(headers=marker)).marshal()


def _decode_each(data: bytes) -> tuple[dict[str, Any], list[str]]:
    """Each property that decodes, and what is wrong with the rest; one that cannot even be
    skipped (its length unknown) ends the reading."""
    flags, at = 0, 0
    for word in range(4):  # a flag word ends with bit 0 clear; Basic's properties need one
        (partial,) = struct.unpack_from(">H", data, at)
        flags |= partial << (16 * word)
        at += 2
        if not partial & 1:
            break
    else:
        raise ValueError("too many property flag words")
    kept: dict[str, Any] = {}
    problems: list[str] = []
    for name in _Properties.__slots__:
        if not flags & _Properties.flags[name]:
            continue
        kind = _Properties.amqp_type(name)
        size = _size_of(kind, data, at)
        chunk = data[at : at + size] if size is not None else data[at:]
        if size is not None and len(chunk) < size:
            problems.append(f"{name}: truncated")
            break
        try:
            consumed, value = pamqp.decode.by_type(chunk, kind)
            if name == "headers":
                problem = _too_deep(value)
                if problem is not None:
                    raise ValueError(problem)
            kept[name] = value
        except Exception as error:  # this property alone is lost
            problems.append(f"{name}: {_why(error)}")
            consumed = size if size is not None else len(chunk)
        if size is None:
            break  # (a kind of unknown length: nothing after it can be found)
        at += consumed if consumed else size
    kept.pop("cluster_id", None)  # AMQP says it must be empty; pamqp refuses to write one
    if kept.get("delivery_mode") not in (None, 1, 2):
        problems.append(f"delivery_mode: {kept.pop('delivery_mode')!r} is not 1 or 2")
    return kept, problems


def _size_of(kind: str, data: bytes, at: int) -> int | None:
    """Bytes the property at ``at`` takes, read from its own length; None when unknown."""
    try:
        if kind == "shortstr":
            return 1 + data[at]
        if kind == "table":
            return 4 + int(struct.unpack_from(">I", data, at)[0])
    except (IndexError, struct.error):
        return None
    return _SIZES.get(kind)


# ---- writing ------------------------------------------------------------------------------------


def sendable(headers: Mapping[str, Any]) -> dict[str, Any]:
    """``headers`` as the client library can encode them again (see the module)."""
    return {str(key): _sendable_value(value, 0) for key, value in headers.items()}


def _sendable_value(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, (bool, str, bytearray, decimal.Decimal)):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**63 else str(value)
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, float):
        try:
            if _FLOAT.unpack(_FLOAT.pack(value))[0] == value:
                return value
        except (OverflowError, struct.error):
            pass
        return repr(value)  # a double a single float cannot hold (pamqp writes floats single)
    if isinstance(value, datetime.datetime):
        return value
    if depth >= MAX_DEPTH:
        return "(nested too deep)"
    if isinstance(value, Mapping):
        return {str(k): _sendable_value(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_sendable_value(v, depth + 1) for v in value]
    return repr(value)


def properties_of(message: OutboxMessage) -> _Properties:
    """The AMQP properties ``message`` is published with (persistent)."""
    given = message.properties
    return _Properties(
        message_id=message.message_id or None,
        correlation_id=given.get("correlation_id"),
        reply_to=given.get("reply_to"),
        message_type=given.get("type"),
        content_type=given.get("content_type"),
        headers=given.get("headers") or None,
        user_id=given.get("user_id"),
        delivery_mode=2,
    )


def check_encodable(message: OutboxMessage) -> None:
    """Raise :class:`~waystation.brokers.port.Unsendable` (``unencodable``) when AMQP cannot carry
    ``message``'s routing key, properties or headers (what the client library would refuse)."""
    problem: str | None = None
    if len(message.routing_key.encode()) > MAX_SHORT_STRING:
        problem = f"routing key of {len(message.routing_key.encode())} bytes (AMQP allows 255)"
    elif len(message.exchange.encode()) > MAX_SHORT_STRING:
        problem = "exchange name over 255 bytes"
    else:
        try:
            pamqp.header.ContentHeader(0, len(message.body), properties_of(message)).marshal()
        except (TypeError, ValueError, OverflowError, struct.error, RecursionError) as error:
            problem = str(error) or type(error).__name__
    if problem is not None:
        raise Unsendable(message.message_id, f"cannot be encoded: {problem}", reason="unencodable")
