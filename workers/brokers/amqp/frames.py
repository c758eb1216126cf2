"""A faster codec for the AMQP frames every message costs, for Waystation's own connections.

aiormq encodes and decodes every frame with ``pamqp.frame.marshal`` and ``unmarshal``, which
walk each method's field list and encode or decode field by field through a table of
functions: a measured share of a worker's CPU (a publish's method frame and content header, a
delivery's three frames, the broker's confirms). :func:`marshal` and :func:`unmarshal` take the
frames of the hot path (``basic.publish``, ``basic.ack`` and ``basic.nack``, ``basic.deliver``,
content headers, bodies) in one pass of ``struct`` calls and give back exactly what pamqp gives:
the same bytes, objects equal field by field (tests compare both ways on generated frames).
Anything else, and any frame that is not plainly well formed (an unexpected type or length, a
value pamqp would refuse or treat in its own way), goes to pamqp's functions unchanged, so
their errors and corner cases stay theirs.

Scoped: :func:`install` puts a dispatcher in pamqp's place (aiormq looks the functions up on
the ``pamqp.frame`` module at each call) that uses this codec only where :func:`ours` says so
(a context variable) and pamqp's own functions everywhere else, so that no other connection of
the process reads or writes differently. The same dispatcher guards the content headers of
Waystation's own connection (``waystation.brokers.metadata.guard_content_header``): one that does
not decode becomes one that does, instead of ending the connection's reader (whether or not
this codec codes the rest). Waystation's AMQP backend opens its connection in such
a context (its reader task inherits it), and marks its own publishes and acks; the deliveries'
handlers run outside it, so a connection a handler opens is pamqp's alone.
(``WAYSTATION_FAST_FRAMES`` turns it off; the layout the codec assumes is checked against
pamqp's own definitions, and with another layout nothing is installed.)

Why one module of some 550 lines: the dispatcher's fast path calls into the codec's own readers and
writers, and the codec is held against pamqp frame by frame (``tests/unit/test_amqp_frames.py``) as
one unit; splitting them would only make those private names cross modules.
"""

from __future__ import annotations

import contextvars
import operator
import re
import struct
from collections.abc import Callable
from typing import Any

import pamqp.body
import pamqp.commands
import pamqp.constants
import pamqp.encode
import pamqp.frame
import pamqp.header

__all__ = [
    "content_header",
    "context",
    "install",
    "installed",
    "marshal",
    "ours",
    "scope",
    "unmarshal",
]

_Basic = pamqp.commands.Basic
_ContentBody = pamqp.body.ContentBody
_ContentHeader = pamqp.header.ContentHeader

_HEAD = struct.Struct(">BHI")  # frame type, channel, payload size
_END = 0xCE
_END_BYTE = b"\xce"
_METHOD, _HEADER, _BODY = 1, 2, 3
_U8 = struct.Struct(">B")
_I8 = struct.Struct(">b")
_I16 = struct.Struct(">h")
_U16 = struct.Struct(">H")
_I32 = struct.Struct(">l")
_U32 = struct.Struct(">L")
_I64 = struct.Struct(">q")
_HEADER_START = struct.Struct(">HHQ")  # class id, weight, body size
_HEADER_START_OUT = struct.Struct(">HxxQ")

_PUBLISH = struct.Struct(">IH")  # method index, ticket
_ACK_OUT = struct.Struct(">BHIIqB")  # a whole basic.ack frame but its end byte
_INDEX_ACK = _Basic.Ack.index
_INDEX_NACK = _Basic.Nack.index
_INDEX_DELIVER = _Basic.Deliver.index
_EXCHANGE_NAME = re.compile(r"^[a-zA-Z0-9-_.:@#,/+ ]*$")
"""pamqp's ``DOMAIN_REGEX['exchange-name']``, which ``Basic.Publish.validate`` applies."""

# Basic.Properties in pamqp's order: (attribute, flag, AMQP type)
_PROPERTIES: tuple[tuple[str, int, str], ...] = (
    ("content_type", 0x8000, "shortstr"),
    ("content_encoding", 0x4000, "shortstr"),
    ("headers", 0x2000, "table"),
    ("delivery_mode", 0x1000, "octet"),
    ("priority", 0x0800, "octet"),
    ("correlation_id", 0x0400, "shortstr"),
    ("reply_to", 0x0200, "shortstr"),
    ("expiration", 0x0100, "shortstr"),
    ("message_id", 0x0080, "shortstr"),
    ("timestamp", 0x0040, "timestamp"),
    ("message_type", 0x0020, "shortstr"),
    ("user_id", 0x0010, "shortstr"),
    ("app_id", 0x0008, "shortstr"),
    ("cluster_id", 0x0004, "shortstr"),
)
_METHOD_FIELDS: dict[type[Any], tuple[tuple[str, str], ...]] = {
    _Basic.Publish: (
        ("ticket", "short"),
        ("exchange", "shortstr"),
        ("routing_key", "shortstr"),
        ("mandatory", "bit"),
        ("immediate", "bit"),
    ),
    _Basic.Deliver: (
        ("consumer_tag", "shortstr"),
        ("delivery_tag", "longlong"),
        ("redelivered", "bit"),
        ("exchange", "shortstr"),
        ("routing_key", "shortstr"),
    ),
    _Basic.Ack: (("delivery_tag", "longlong"), ("multiple", "bit")),
    _Basic.Nack: (("delivery_tag", "longlong"), ("multiple", "bit"), ("requeue", "bit")),
}


_property_values = operator.attrgetter(*(name for name, _, _ in _PROPERTIES))
_PROPERTY_KINDS = tuple((flag, kind) for _, flag, kind in _PROPERTIES)
_LENGTH = tuple(bytes((n,)) for n in range(256))
"""One byte for each length a short string may have."""


class _Unusual(Exception):
    """This frame is not one the fast path takes: pamqp's functions handle it."""


_pamqp_marshal: Callable[[Any, int], bytes] = pamqp.frame.marshal
_pamqp_unmarshal: Callable[[bytes], tuple[int, int, Any]] = pamqp.frame.unmarshal


# ---- encoding ----------------------------------------------------------------------------------


def marshal(frame_value: Any, channel_id: int) -> bytes:
    """``pamqp.frame.marshal``, faster for a publish's frames and acks."""
    kind = type(frame_value)
    try:
        if kind is _ContentBody:
            value = frame_value.value
            if type(value) is bytes:
                return _frame(_BODY, channel_id, value)
        elif kind is _ContentHeader:
            start = _HEADER_START_OUT.pack(_Basic.frame_id, frame_value.body_size)
            return _frame(_HEADER, channel_id, start + _properties(frame_value.properties))
        elif kind is _Basic.Publish:
            return _frame(_METHOD, channel_id, _publish(frame_value))
        elif kind is _Basic.Ack:
            multiple = frame_value.multiple
            if type(multiple) is bool:
                tag = frame_value.delivery_tag
                ack = _ACK_OUT.pack(_METHOD, channel_id, 13, _INDEX_ACK, tag, multiple)
                return ack + _END_BYTE
    except (_Unusual, struct.error, TypeError, ValueError, AttributeError):
        pass  # pamqp says what is wrong with it, or encodes what is unusual its own way
    return _pamqp_marshal(frame_value, channel_id)


def _frame(frame_type: int, channel_id: int, payload: bytes) -> bytes:
    return b"".join((_HEAD.pack(frame_type, channel_id, len(payload)), payload, _END_BYTE))


def _short(value: Any) -> bytes:
    if type(value) is not str:
        raise _Unusual
    encoded = value.encode()
    if len(encoded) > 255:
        raise _Unusual
    return _LENGTH[len(encoded)] + encoded


def _publish(frame: Any) -> bytes:
    exchange, mandatory, immediate = frame.exchange, frame.mandatory, frame.immediate
    if (
        frame.ticket != 0
        or type(exchange) is not str
        or len(exchange) > 127
        or not _EXCHANGE_NAME.fullmatch(exchange)
        or type(mandatory) is not bool
        or type(immediate) is not bool
    ):
        raise _Unusual
    return b"".join(
        (
            _PUBLISH.pack(_Basic.Publish.index, 0),
            _short(exchange),
            _short(frame.routing_key),
            _U8.pack(mandatory | immediate << 1),
        )
    )


def _properties(properties: Any) -> bytes:
    if type(properties) is not _Basic.Properties:
        raise _Unusual
    flags = 0
    parts = [b""]  # the flags go first
    for value, (flag, kind) in zip(_property_values(properties), _PROPERTY_KINDS, strict=True):
        if value is None or value == "":
            continue
        flags |= flag
        if kind == "shortstr":
            parts.append(_short(value))
        elif kind == "octet":
            if type(value) is not int:
                raise _Unusual
            parts.append(_U8.pack(value))  # (beyond a byte: struct.error, pamqp's to refuse)
        elif kind == "table":
            parts.append(_table(value))
        else:
            raise _Unusual
    parts[0] = _U16.pack(flags)
    return b"".join(parts)


def _table(table: Any) -> bytes:
    """A field table of strings and integers, as ``pamqp.encode.field_table`` writes it."""
    if type(table) is not dict or pamqp.encode.DEPRECATED_RABBITMQ_SUPPORT:
        raise _Unusual
    parts = []
    for key, value in sorted(table.items()):
        if type(key) is not str:
            raise _Unusual
        encoded = key.encode()
        if len(encoded) > 128:  # pamqp truncates it, with a warning
            raise _Unusual
        parts.append(_LENGTH[len(encoded)])
        parts.append(encoded)
        if type(value) is str:
            text = value.encode()
            parts.append(b"S" + _U32.pack(len(text)))
            parts.append(text)
        elif type(value) is int:
            parts.append(_integer(value))
        else:
            raise _Unusual
    data = b"".join(parts)
    return _U32.pack(len(data)) + data


def _integer(value: int) -> bytes:
    if -128 <= value <= 127:
        return b"b" + _I8.pack(value)
    if -32768 <= value <= 32767:
        return b"s" + _I16.pack(value)
    if 0 <= value <= 65535:
        return b"u" + _U16.pack(value)
    if -2147483648 <= value <= 2147483647:
        return b"I" + _I32.pack(value)
    if 0 <= value <= 4294967295:
        return b"i" + _U32.pack(value)
    if -9223372036854775808 <= value <= 9223372036854775807:
        return b"l" + _I64.pack(value)
    raise _Unusual


# ---- decoding ----------------------------------------------------------------------------------


def unmarshal(data_in: bytes) -> tuple[int, int, Any]:
    """``pamqp.frame.unmarshal``, faster for deliveries and confirms."""
    try:
        frame_type, channel_id, size = _HEAD.unpack_from(data_in)
        end = 7 + size
        if size and len(data_in) > end and data_in[end] == _END and data_in[:4] != b"AMQP":
            if frame_type == _BODY:
                return end + 1, channel_id, _ContentBody(data_in[7:end])
            if frame_type == _HEADER:
                return end + 1, channel_id, _content_header(data_in, 7, end)
            if frame_type == _METHOD:
                return end + 1, channel_id, _method(data_in, 7, end)
    except (_Unusual, struct.error, ValueError, IndexError):
        pass
    return _pamqp_unmarshal(data_in)


def _method(data: bytes, at: int, end: int) -> Any:
    (index,) = _U32.unpack_from(data, at)
    at += 4
    method: Any
    if index == _INDEX_DELIVER:
        method = _Basic.Deliver()
        method.consumer_tag, at = _read_short(data, at, end)
        (method.delivery_tag,) = _I64.unpack_from(data, at)
        if at + 9 > end:
            raise _Unusual
        method.redelivered = bool(data[at + 8] & 1)
        method.exchange, at = _read_short(data, at + 9, end)
        method.routing_key, at = _read_short(data, at, end)
    elif index == _INDEX_ACK or index == _INDEX_NACK:
        method = _Basic.Ack() if index == _INDEX_ACK else _Basic.Nack()
        if at + 9 > end:
            raise _Unusual
        (method.delivery_tag,) = _I64.unpack_from(data, at)
        bits = data[at + 8]
        method.multiple = bool(bits & 1)
        if index == _INDEX_NACK:
            method.requeue = bool(bits & 2)
        at += 9
    else:
        raise _Unusual
    if at != end:
        raise _Unusual
    return method


def _read_short(data: bytes, at: int, end: int) -> tuple[str, int]:
    stop = at + 1 + data[at]
    if stop > end:
        raise _Unusual
    return data[at + 1 : stop].decode(), stop


def _content_header(data: bytes, at: int, end: int) -> Any:
    if at + 14 > end:
        raise _Unusual
    header = _ContentHeader()
    header.class_id, header.weight, header.body_size = _HEADER_START.unpack_from(data, at)
    (flags,) = _U16.unpack_from(data, at + 12)
    if flags & 1:  # a second flag word: no property of Basic uses one
        raise _Unusual
    at += 14
    properties = header.properties
    value: Any
    for name, flag, kind in _PROPERTIES:
        if not flags & flag:
            continue
        if kind == "shortstr":
            value, at = _read_short(data, at, end)
        elif kind == "octet":
            if at >= end:
                raise _Unusual
            value, at = data[at], at + 1
        elif kind == "table":
            value, at = _read_table(data, at, end)
        else:
            raise _Unusual
        setattr(properties, name, value)
    if at != end:
        raise _Unusual
    return header


_TABLE_VALUES: dict[int, tuple[struct.Struct, Callable[[Any], Any] | None]] = {
    ord("b"): (_I8, None),
    ord("B"): (_U8, None),
    ord("s"): (_I16, None),
    ord("u"): (_U16, None),
    ord("I"): (_I32, None),
    ord("i"): (_U32, None),
    ord("l"): (_I64, None),
    ord("L"): (_I64, None),
    ord("t"): (_U8, bool),
}


def _read_table(data: bytes, at: int, end: int) -> tuple[dict[str, Any], int]:
    """A field table as ``pamqp.decode.field_table`` reads it, for strings, integers,
    booleans, voids, tables and arrays of these."""
    (length,) = _U32.unpack_from(data, at)
    at += 4
    stop = at + length
    if stop > end:
        raise _Unusual
    table: dict[str, Any] = {}
    while at < stop:
        key, at = _read_short(data, at, stop)
        table[key], at = _read_value(data, at, stop)
    if at != stop:
        raise _Unusual
    return table, stop


def _read_value(data: bytes, at: int, stop: int) -> tuple[Any, int]:
    if at >= stop:
        raise _Unusual
    kind = data[at]
    at += 1
    if kind == 83:  # "S"
        (length,) = _U32.unpack_from(data, at)
        end = at + 4 + length
        if end > stop:
            raise _Unusual
        raw = data[at + 4 : end]
        try:
            return raw.decode(), end
        except UnicodeDecodeError:  # pamqp gives such a string as bytes
            return raw, end
    number = _TABLE_VALUES.get(kind)
    if number is not None:
        reader, convert = number
        if at + reader.size > stop:
            raise _Unusual
        (value,) = reader.unpack_from(data, at)
        return (convert(value) if convert else value), at + reader.size
    if kind == 86 or kind == 0:  # "V", or a NUL seen in the wild: void
        return None, at
    if kind == 70:  # "F"
        return _read_table(data, at, stop)
    if kind == 65:  # "A"
        (length,) = _U32.unpack_from(data, at)
        at += 4
        end = at + length
        if end > stop:
            raise _Unusual
        items = []
        while at < end:
            item, at = _read_value(data, at, end)
            items.append(item)
        if at != end:
            raise _Unusual
        return items, end
    raise _Unusual  # floats, decimals, timestamps, byte arrays: pamqp's


# ---- installing --------------------------------------------------------------------------------


def _layout_matches() -> bool:
    """Whether pamqp defines the frames as this codec reads and writes them."""
    properties = _Basic.Properties
    if list(properties.__slots__) != [name for name, _, _ in _PROPERTIES]:
        return False
    for name, flag, kind in _PROPERTIES:
        if properties.flags.get(name) != flag or properties.amqp_type(name) != kind:
            return False
    for method, fields in _METHOD_FIELDS.items():
        if list(method.__slots__) != [name for name, _ in fields]:
            return False
        if any(method.amqp_type(name) != kind for name, kind in fields):
            return False
    return (
        _Basic.frame_id == 60
        and pamqp.constants.FRAME_END == _END
        and pamqp.constants.DOMAIN_REGEX["exchange-name"].pattern == _EXCHANGE_NAME.pattern
    )


_NOT_OURS, _GUARDED, _FAST = 0, 1, 2
_OURS: contextvars.ContextVar[int] = contextvars.ContextVar("waystation_frames", default=_NOT_OURS)
"""Whose frames are made or read here: another connection's (pamqp's, unguarded), or
Waystation's own, whose content headers are guarded, coded by pamqp (``_GUARDED``) or by this
codec (``_FAST``)."""

_guard: Callable[[bytes], tuple[bytes, Any | None]] | None = None
"""``waystation.brokers.metadata.guard_content_header``, set by :func:`install`."""


def ours() -> bool:
    """Whether the frames made or read here are Waystation's own, for the codec to do."""
    return _OURS.get() == _FAST


class scope:  # (lower case: used as ``with scope():``)
    """Within the block (in this task), frames are Waystation's own, for the codec (``on``), or
    not. (A class: a generator-based context manager costs several times as much, on every
    publish.)"""

    __slots__ = ("_mode", "_token")

    def __init__(self, on: bool = True) -> None:
        self._mode = _FAST if on else _NOT_OURS

    def __enter__(self) -> None:
        self._token = _OURS.set(self._mode)

    def __exit__(self, *_: object) -> None:
        _OURS.reset(self._token)


def context(on: bool = True, *, guarded: bool = False) -> contextvars.Context:
    """A copy of the current context whose frames are Waystation's own, for the codec (``on``),
    or, with ``guarded`` alone, read with their content headers guarded and coded by pamqp:
    what a task created in it, and every task it creates, inherits (a connection opened in it
    reads its frames so). The guard needs :func:`install`."""
    copied = contextvars.copy_context()
    copied.run(_OURS.set, _FAST if on else _GUARDED if guarded else _NOT_OURS)
    return copied


def _dispatched_marshal(frame_value: Any, channel_id: int) -> bytes:
    if _OURS.get() == _FAST:
        return marshal(frame_value, channel_id)
    return _pamqp_marshal(frame_value, channel_id)


def _dispatched_unmarshal(data_in: bytes) -> tuple[int, int, Any]:
    mode = _OURS.get()
    if mode:
        if data_in[:1] == b"\x02":
            guarded = _guarded_header(data_in)
            if guarded is not None:
                return guarded
        if mode == _FAST:
            return unmarshal(data_in)
    return _pamqp_unmarshal(data_in)


def _guarded_header(data_in: bytes) -> tuple[int, int, Any] | None:
    """A content header frame of Waystation's own connection, decoded through the guard: as it
    is when it decodes, else what the guard salvaged of it (the worker dead-letters such a
    message), so that the connection never fails on it. None when the frame's envelope is not
    plainly whole (pamqp says what is wrong)."""
    if len(data_in) < 8 or _guard is None:
        return None
    _, channel_id, size = _HEAD.unpack_from(data_in)
    end = 7 + size
    if len(data_in) != end + 1 or data_in[end] != _END:
        return None
    guarded, header = _guard(data_in[7:end])
    if header is None:
        header = content_header(guarded)
    return end + 1, channel_id, header


def install() -> bool:
    """Put the dispatcher in pamqp's place (idempotent): where the frames are Waystation's own
    (:func:`context`), content headers guarded (``waystation.brokers.metadata``) and this codec
    where asked for; pamqp's own functions everywhere else. False, and nothing changed, when
    pamqp's frame layout is not the one this codec knows."""
    global _guard
    if installed():
        return True
    if not _layout_matches():
        return False
    from waystation.brokers.metadata import (
        guard_content_header,  # (it uses this module: imported once here)
    )

    _guard = guard_content_header
    pamqp.frame.marshal = _dispatched_marshal
    pamqp.frame.unmarshal = _dispatched_unmarshal
    return True


def installed() -> bool:
    return (
        pamqp.frame.marshal is _dispatched_marshal
        and pamqp.frame.unmarshal is _dispatched_unmarshal
    )


def content_header(payload: bytes) -> Any:
    """A content header frame's payload decoded (this codec's fast path, else pamqp's own),
    or pamqp's error."""
    try:
        return _content_header(payload, 0, len(payload))
    except (_Unusual, struct.error, ValueError, IndexError):
        header = _ContentHeader()
        header.unmarshal(payload)
        return header
