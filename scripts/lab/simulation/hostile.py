"""Raw AMQP properties, as a publisher writes them that no client library should: what the
simulation's hostile publishers send (``InMemoryBroker.enqueue_raw`` delivers them as the AMQP
backend would decode them).

Each message carries a tag in its body (``{"hostile": tag}``, or the same cut short: not JSON),
so that its fate can be found: every one must end as a dead letter with a reason.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from .scenario import Hostile

__all__ = ["hostile_message", "properties"]

# the property flags, in the order pamqp reads them
_CONTENT_TYPE = 0x8000
_HEADERS = 0x2000
_CORRELATION_ID = 0x0400
_REPLY_TO = 0x0200
_MESSAGE_ID = 0x0080
_TYPE = 0x0020


def _short(value: bytes) -> bytes:
    return bytes((len(value),)) + value


def _table(entries: Mapping[bytes, bytes]) -> bytes:
    """A field table of already encoded values (a type tag and its bytes each)."""
    body = b"".join(_short(key) + value for key, value in entries.items())
    return struct.pack(">I", len(body)) + body


def _long_string(value: bytes) -> bytes:
    return b"S" + struct.pack(">I", len(value)) + value


def _nested(depth: int) -> bytes:
    table = struct.pack(">I", 0)
    for _ in range(depth):
        table = _table({b"k": b"F" + table})
    return table


def properties(
    *,
    message_id: bytes | None = None,
    correlation_id: bytes | None = None,
    reply_to: bytes | None = None,
    message_type: bytes | None = None,
    headers: bytes | None = None,
    content_type: bytes | None = b"application/json",
) -> bytes:
    """Property bytes (flags first), each value written as given: a header table already
    encoded, short strings as raw bytes (UTF-8 or not)."""
    flags = 0
    parts = []
    for flag, value, encoded in (
        (_CONTENT_TYPE, content_type, lambda v: _short(v)),
        (_HEADERS, headers, lambda v: v),
        (_CORRELATION_ID, correlation_id, lambda v: _short(v)),
        (_REPLY_TO, reply_to, lambda v: _short(v)),
        (_MESSAGE_ID, message_id, lambda v: _short(v)),
        (_TYPE, message_type, lambda v: _short(v)),
    ):
        if value is not None:
            flags |= flag
            parts.append(encoded(value))
    return struct.pack(">H", flags) + b"".join(parts)


ODD = _long_string(b"\xff\xfe odd")
"""A header value that is a long string, not UTF-8 (decoded as bytes)."""


def odd_headers() -> bytes:
    return _table({b"x-odd": ODD})


def hostile_message(tag: str, what: Hostile) -> tuple[bytes, bytes]:
    """(body, properties) of a hostile message tagged ``tag``."""
    body = b'{"hostile": "%s"}' % tag.encode()
    id_ = tag.encode()
    if what == "not-utf8-id":
        return body, properties(message_id=b"\xff\xfe" + id_, correlation_id=id_)
    if what == "deep-headers":
        return body, properties(message_id=id_, correlation_id=id_, headers=_nested(2000))
    if what == "odd-header-bad-json":
        return body[:-2], properties(message_id=id_, correlation_id=id_, headers=odd_headers())
    if what == "unknown-type-tag":
        headers = _table({b"x-what": b"Z\x00\x00\x00\x01"})
        return body, properties(message_id=id_, correlation_id=id_, headers=headers)
    raise ValueError(what)
