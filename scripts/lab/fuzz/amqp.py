"""AMQP 0-9-1 written by hand: the values a hostile publisher can send, and a raw client.

Client libraries refuse to write what a broken or hostile publisher may still put on the wire:
pamqp (under aio-pika) encodes ``str`` only, as UTF-8, at most 255 bytes in a short string,
and computes every length. The encoders here take raw bytes and write them as they are, so a
short string can be anything of 0 to 255 bytes, a table key need not be UTF-8, a type tag can
be one nobody knows, and a caller that wants a length to lie writes it itself.

:class:`RawClient` speaks just enough of the protocol over asyncio streams: the handshake (pamqp
marshals those method frames), one channel in confirm mode, ``basic.publish`` of a content
header given as bytes, ``basic.get`` and ``basic.ack``. What the broker makes of a publish is
a :class:`Verdict`: confirmed, nacked, returned, or the channel or connection it closed (with
its code and text); the client reopens what the broker closed at its next call. What it gets
from a queue is a :class:`Letter`, read by a lenient reader that never fails on what it reads
(a value it cannot read is kept as raw bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse

import pamqp.commands
import pamqp.frame

__all__ = [
    "PROPERTIES",
    "Letter",
    "RawClient",
    "Verdict",
    "array",
    "content_header",
    "frame",
    "longstr",
    "nested",
    "property_flags",
    "read_content_header",
    "shortstr",
    "table",
]

U8 = struct.Struct(">B")
U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
I8 = struct.Struct(">b")
I16 = struct.Struct(">h")
I32 = struct.Struct(">i")
I64 = struct.Struct(">q")
F32 = struct.Struct(">f")
F64 = struct.Struct(">d")

FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT = 1, 2, 3, 8
FRAME_END = b"\xce"
BASIC = 60

PROPERTIES: tuple[tuple[str, int, str], ...] = (
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
    ("type", 0x0020, "shortstr"),
    ("user_id", 0x0010, "shortstr"),
    ("app_id", 0x0008, "shortstr"),
    ("cluster_id", 0x0004, "shortstr"),
)
"""The properties of class Basic in the order of their flags (bit 15 down to bit 2; bit 0 says
that another flag word follows, bit 1 is unused)."""

FLAG_OF = {name: flag for name, flag, _ in PROPERTIES}


# ---- writing values ----------------------------------------------------------------------------


def shortstr(raw: bytes) -> bytes:
    """A short string of exactly these bytes (0 to 255 of them, UTF-8 or not)."""
    if len(raw) > 255:
        raise ValueError(f"a short string holds at most 255 bytes, not {len(raw)}")
    return U8.pack(len(raw)) + raw


def longstr(raw: bytes) -> bytes:
    """A long string (or any length-prefixed payload) of exactly these bytes."""
    return U32.pack(len(raw)) + raw


def table(items: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A field table's bytes (its length first) from (key, value) pairs: each key is raw bytes,
    each value a field value already encoded, type tag included. Keys may repeat."""
    return longstr(b"".join(shortstr(key) + value for key, value in items))


def array(values: Iterable[bytes]) -> bytes:
    """A field array's bytes (its length first) from field values already encoded."""
    return longstr(b"".join(values))


def nested(depth: int, leaf: bytes, *, container: bytes = b"F", key: bytes = b"n") -> bytes:
    """A field value (type tag first) that is ``depth`` tables (``F``, each holding one entry
    under ``key``) or arrays (``A``) one inside the other around the field value ``leaf``.

    Built without recursion, in one pass, so that thousands of levels cost nothing."""
    prefixes: list[bytes] = []
    size = len(leaf)
    for _ in range(depth):
        if container == b"F":
            size += 1 + len(key)
            prefixes.append(b"F" + U32.pack(size) + shortstr(key))
        elif container == b"A":
            prefixes.append(b"A" + U32.pack(size))
        else:
            raise ValueError(f"container must be F or A, not {container!r}")
        size += 5
    return b"".join(reversed(prefixes)) + leaf


def property_flags(names: Iterable[str]) -> int:
    """The flag word that says these properties are present."""
    flags = 0
    for name in names:
        flags |= FLAG_OF[name]
    return flags


def content_header(properties: bytes, body_size: int, *, class_id: int = BASIC) -> bytes:
    """The payload of a content header frame: class, weight (0), body size, then
    ``properties``: the flag word(s) and the property values, written by the caller."""
    return U16.pack(class_id) + U16.pack(0) + U64.pack(body_size) + properties


def frame(frame_type: int, channel: int, payload: bytes) -> bytes:
    return struct.pack(">BHI", frame_type, channel, len(payload)) + payload + FRAME_END


# ---- reading what comes back, leniently --------------------------------------------------------


class _Unreadable(Exception):
    pass


@dataclass(frozen=True)
class Unread:
    """A value the lenient reader did not read (too deep, an unknown tag, a length past the
    end): its raw bytes, from where reading stopped."""

    why: str
    raw: bytes = field(repr=False)


MAX_READ_DEPTH = 64
"""Tables and arrays nested deeper than this are kept as :class:`Unread` bytes."""


def _short_at(data: bytes, at: int, end: int) -> tuple[bytes, int]:
    if at >= end:
        raise _Unreadable("a short string past the end")
    stop = at + 1 + data[at]
    if stop > end:
        raise _Unreadable("a short string longer than what is left")
    return data[at + 1 : stop], stop


def _sized(data: bytes, at: int, end: int) -> tuple[bytes, int]:
    if at + 4 > end:
        raise _Unreadable("a length past the end")
    (length,) = U32.unpack_from(data, at)
    stop = at + 4 + length
    if stop > end:
        raise _Unreadable(f"a length of {length} past the end")
    return data[at + 4 : stop], stop


_FIXED: dict[int, tuple[struct.Struct, Any]] = {
    ord("t"): (U8, bool),
    ord("b"): (I8, None),
    ord("B"): (U8, None),
    ord("s"): (I16, None),
    ord("U"): (I16, None),
    ord("u"): (U16, None),
    ord("I"): (I32, None),
    ord("i"): (U32, None),
    ord("l"): (I64, None),
    ord("L"): (U64, None),
    ord("f"): (F32, None),
    ord("d"): (F64, None),
    ord("T"): (U64, None),
}


def _value_at(data: bytes, at: int, end: int, depth: int) -> tuple[Any, int]:
    if at >= end:
        raise _Unreadable("a field value past the end")
    tag = data[at]
    at += 1
    fixed = _FIXED.get(tag)
    if fixed is not None:
        reader, convert = fixed
        if at + reader.size > end:
            raise _Unreadable(f"{chr(tag)} past the end")
        (value,) = reader.unpack_from(data, at)
        return (convert(value) if convert else value), at + reader.size
    if tag in (ord("S"), ord("x")):
        return _sized(data, at, end)
    if tag == ord("D"):
        if at + 5 > end:
            raise _Unreadable("D past the end")
        return (data[at], U32.unpack_from(data, at + 1)[0]), at + 5
    if tag in (ord("V"), 0):
        return None, at
    if tag in (ord("F"), ord("A")):
        inner, stop = _sized(data, at, end)
        if depth >= MAX_READ_DEPTH:
            return Unread("nested too deep to read", inner), stop
        if tag == ord("F"):
            return _table_of(inner, depth + 1), stop
        return _array_of(inner, depth + 1), stop
    raise _Unreadable(f"unknown type tag {bytes([tag])!r}")


def _table_of(data: bytes, depth: int = 0) -> dict[str, Any]:
    """A table's entries (keys decoded with backslash escapes where they are not UTF-8; a
    repeated key keeps its last value); what cannot be read is kept under ``"(unread)"``."""
    found: dict[str, Any] = {}
    at = 0
    while at < len(data):
        start = at
        try:
            key, at = _short_at(data, at, len(data))
            found[key.decode(errors="backslashreplace")], at = _value_at(data, at, len(data), depth)
        except (_Unreadable, struct.error) as error:
            found["(unread)"] = Unread(str(error), data[start:])
            break
    return found


def _array_of(data: bytes, depth: int) -> list[Any]:
    found: list[Any] = []
    at = 0
    while at < len(data):
        try:
            value, at = _value_at(data, at, len(data), depth)
        except (_Unreadable, struct.error) as error:
            found.append(Unread(str(error), data[at:]))
            break
        found.append(value)
    return found


def read_content_header(payload: bytes) -> tuple[int, dict[str, Any]]:
    """(body size, properties) of a content header frame's payload. Short strings are kept as
    bytes; the headers as a dict (see :func:`_table_of`); what cannot be read is kept under
    ``"(unread)"``."""
    (body_size,) = U64.unpack_from(payload, 4)
    (flags,) = U16.unpack_from(payload, 12)
    at = 14
    properties: dict[str, Any] = {}
    for name, flag, kind in PROPERTIES:
        if not flags & flag:
            continue
        try:
            if kind == "shortstr":
                properties[name], at = _short_at(payload, at, len(payload))
            elif kind == "octet":
                properties[name], at = payload[at], at + 1
            elif kind == "timestamp":
                (properties[name],) = U64.unpack_from(payload, at)
                at += 8
            else:
                inner, at = _sized(payload, at, len(payload))
                properties[name] = _table_of(inner)
        except (_Unreadable, struct.error, IndexError) as error:
            properties["(unread)"] = Unread(f"{name}: {error}", payload[at:])
            break
    return body_size, properties


@dataclass(frozen=True)
class Letter:
    """A message got from a queue: its content header as sent by whoever published it, read
    leniently, and its body."""

    header: bytes = field(repr=False)
    properties: dict[str, Any]
    body: bytes

    @property
    def headers(self) -> dict[str, Any]:
        headers = self.properties.get("headers")
        return headers if isinstance(headers, dict) else {}

    def header_text(self, name: str) -> str | None:
        """A header that is a string (long or short), as text; None when absent or another
        type."""
        value = self.headers.get(name)
        if isinstance(value, bytes):
            return value.decode(errors="backslashreplace")
        return None


# ---- the raw client ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What the broker made of one publish."""

    outcome: str
    """``confirmed``, ``nacked``, ``returned``, ``channel-closed``, ``connection-closed``,
    ``dropped`` (the socket closed without a word) or ``no-answer`` (within the time given)."""
    code: int | None = None
    text: str = ""

    @property
    def accepted(self) -> bool:
        """The broker took the message into its queue (confirmed, not returned)."""
        return self.outcome == "confirmed"

    def __str__(self) -> str:
        if self.code is None:
            return self.outcome + (f": {self.text}" if self.text else "")
        return f"{self.outcome} {self.code}: {self.text}"


class _Closed(Exception):
    """The broker closed the channel or the connection (or the socket went away)."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(str(verdict))
        self.verdict = verdict


class RawClient:
    """One AMQP connection to ``url`` (``amqp://user:password@host:port/vhost``) with one
    channel in confirm mode, speaking raw frames. Opened on first use and again after the broker
    closed it; use one instance from one task at a time."""

    def __init__(self, url: str, *, name: str = "waystation fuzzer") -> None:
        parsed = urlparse(url)
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 5672
        self.user = unquote(parsed.username or "guest")
        self.password = unquote(parsed.password or "guest")
        self.vhost = unquote(parsed.path[1:]) if len(parsed.path) > 1 else "/"
        self.name = name
        self.frame_max = 131072
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._channel = 0
        """The open channel's number; 0 when none is open."""
        self._next_channel = 1
        self._published = 0
        """Publishes on the open channel: the delivery tag of the last one."""
        self.connections_opened = 0

    # ---- connection and channel ----

    async def _open_connection(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._writer.write(b"AMQP\x00\x00\x09\x01")
        start = await self._expect(pamqp.commands.Connection.Start, 0)
        del start
        self._send(
            0,
            pamqp.commands.Connection.StartOk(
                client_properties={
                    "connection_name": self.name,
                    "product": "waystation frame fuzzer",
                    "capabilities": {"publisher_confirms": True},
                },
                mechanism="PLAIN",
                response=f"\0{self.user}\0{self.password}",
            ),
        )
        tune = await self._expect(pamqp.commands.Connection.Tune, 0)
        self.frame_max = tune.frame_max or self.frame_max
        self._send(
            0,
            pamqp.commands.Connection.TuneOk(
                channel_max=tune.channel_max, frame_max=self.frame_max, heartbeat=0
            ),
        )
        self._send(0, pamqp.commands.Connection.Open(virtual_host=self.vhost))
        await self._expect(pamqp.commands.Connection.OpenOk, 0)
        self._next_channel = 1
        self.connections_opened += 1

    async def _open_channel(self) -> None:
        number = self._next_channel
        self._next_channel = number % 2000 + 1
        self._send(number, pamqp.commands.Channel.Open())
        await self._expect(pamqp.commands.Channel.OpenOk, number)
        self._send(number, pamqp.commands.Confirm.Select())
        await self._expect(pamqp.commands.Confirm.SelectOk, number)
        self._channel = number
        self._published = 0

    async def _ready(self) -> int:
        """The open channel's number, opening the connection and the channel as needed."""
        if self._writer is None:
            await self._open_connection()
        if not self._channel:
            await self._open_channel()
        return self._channel

    async def close(self) -> None:
        writer, self._writer, self._reader, self._channel = self._writer, None, None, 0
        if writer is None:
            return
        with contextlib.suppress(Exception):
            writer.write(
                frame(
                    FRAME_METHOD,
                    0,
                    _method_bytes(pamqp.commands.Connection.Close(200, "fuzzer done", 0, 0)),
                )
            )
            await asyncio.wait_for(writer.drain(), 2)
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 2)

    def _drop(self) -> None:
        writer, self._writer, self._reader, self._channel = self._writer, None, None, 0
        if writer is not None:
            writer.close()

    # ---- frames ----

    def _send(self, channel: int, method: Any) -> None:
        assert self._writer is not None
        self._writer.write(frame(FRAME_METHOD, channel, _method_bytes(method)))

    async def _frame(self) -> tuple[int, int, bytes]:
        """The next frame (type, channel, payload); heartbeats are skipped. Raises _Closed
        when the broker closes the channel or the connection, answering its close first."""
        assert self._reader is not None
        while True:
            try:
                head = await self._reader.readexactly(7)
                frame_type, channel, size = struct.unpack(">BHI", head)
                payload = await self._reader.readexactly(size + 1)
            except (asyncio.IncompleteReadError, ConnectionError) as error:
                self._drop()
                raise _Closed(
                    Verdict("dropped", None, str(error) or type(error).__name__)
                ) from None
            payload = payload[:-1]
            if frame_type == FRAME_HEARTBEAT:
                continue
            if frame_type == FRAME_METHOD:
                method = _method_of(head + payload + FRAME_END)
                if isinstance(method, pamqp.commands.Connection.Close):
                    with contextlib.suppress(Exception):
                        self._send(0, pamqp.commands.Connection.CloseOk())
                    self._drop()
                    raise _Closed(
                        Verdict("connection-closed", method.reply_code, method.reply_text)
                    )
                if isinstance(method, pamqp.commands.Channel.Close):
                    with contextlib.suppress(Exception):
                        self._send(channel, pamqp.commands.Channel.CloseOk())
                    if channel == self._channel:
                        self._channel = 0
                    raise _Closed(Verdict("channel-closed", method.reply_code, method.reply_text))
            return frame_type, channel, payload

    async def _expect(self, kind: type[Any], channel: int) -> Any:
        while True:
            frame_type, on, payload = await self._frame()
            if frame_type == FRAME_METHOD and on == channel:
                method = _method_of(frame(FRAME_METHOD, on, payload))
                if isinstance(method, kind):
                    return method
            # anything else (a late confirm, a return) is of no interest here

    async def _content(self, channel: int) -> tuple[bytes, bytes]:
        """The content header payload and the body that follow a delivery or a return."""
        frame_type, _, header = await self._frame()
        if frame_type != FRAME_HEADER:
            raise _Closed(Verdict("dropped", None, f"frame type {frame_type} after a delivery"))
        (size,) = U64.unpack_from(header, 4)
        parts: list[bytes] = []
        got = 0
        while got < size:
            frame_type, _, payload = await self._frame()
            parts.append(payload)
            got += len(payload)
        return header, b"".join(parts)

    # ---- what the fuzzer does ----

    async def publish(
        self,
        routing_key: str,
        header: bytes,
        body: bytes,
        *,
        exchange: str = "",
        mandatory: bool = True,
        within: float = 10.0,
    ) -> Verdict:
        """Publish ``body`` with the content header payload ``header`` (written as given:
        see :func:`content_header`) and wait for the broker's verdict."""
        try:
            channel = await self._ready()
            pieces = [
                frame(
                    FRAME_METHOD,
                    channel,
                    _method_bytes(
                        pamqp.commands.Basic.Publish(
                            exchange=exchange, routing_key=routing_key, mandatory=mandatory
                        )
                    ),
                ),
                frame(FRAME_HEADER, channel, header),
            ]
            step = self.frame_max - 8
            pieces += [
                frame(FRAME_BODY, channel, body[at : at + step]) for at in range(0, len(body), step)
            ]
            assert self._writer is not None
            self._published += 1
            tag = self._published
            self._writer.write(b"".join(pieces))
            with contextlib.suppress(ConnectionError):
                await self._writer.drain()  # (what the broker said is read below)
            return await asyncio.wait_for(self._verdict(channel, tag), within)
        except _Closed as closed:
            return closed.verdict
        except TimeoutError:
            self._drop()  # nobody knows what state it is in
            return Verdict("no-answer", None, f"nothing within {within}s")
        except ConnectionError as error:
            self._drop()
            return Verdict("dropped", None, str(error))

    async def _verdict(self, channel: int, tag: int) -> Verdict:
        returned: Verdict | None = None
        while True:
            frame_type, on, payload = await self._frame()
            if frame_type != FRAME_METHOD or on != channel:
                continue
            method = _method_of(frame(FRAME_METHOD, on, payload))
            if isinstance(method, pamqp.commands.Basic.Return):
                await self._content(on)
                returned = Verdict("returned", method.reply_code, method.reply_text)
            elif isinstance(method, pamqp.commands.Basic.Ack | pamqp.commands.Basic.Nack):
                if method.delivery_tag == tag or (method.multiple and method.delivery_tag >= tag):
                    if isinstance(method, pamqp.commands.Basic.Nack):
                        return Verdict("nacked")
                    return returned or Verdict("confirmed")

    async def get(self, queue: str) -> Letter | None:
        """Take one message from ``queue`` (and ack it), or None when it is empty."""
        channel = await self._ready()
        self._send(channel, pamqp.commands.Basic.Get(queue=queue, no_ack=False))
        while True:
            frame_type, on, payload = await self._frame()
            if frame_type != FRAME_METHOD or on != channel:
                continue
            method = _method_of(frame(FRAME_METHOD, on, payload))
            if isinstance(method, pamqp.commands.Basic.GetEmpty):
                return None
            if isinstance(method, pamqp.commands.Basic.GetOk):
                header, body = await self._content(channel)
                tag = int(method.delivery_tag or 0)
                self._send(channel, pamqp.commands.Basic.Ack(delivery_tag=tag))
                _, properties = read_content_header(header)
                return Letter(header, properties, body)

    async def drain(self, queue: str, limit: int = 10_000) -> list[Letter]:
        """Every message in ``queue`` now (at most ``limit``), taken and acked."""
        letters: list[Letter] = []
        while len(letters) < limit:
            letter = await self.get(queue)
            if letter is None:
                break
            letters.append(letter)
        return letters


def _method_bytes(method: Any) -> bytes:
    """A method frame's payload: its class and method ids, then its arguments (pamqp)."""
    return U32.pack(method.index) + bytes(method.marshal())


_CLOSES = {
    U32.unpack(U16.pack(10) + U16.pack(50))[0]: pamqp.commands.Connection.Close,
    U32.unpack(U16.pack(20) + U16.pack(40))[0]: pamqp.commands.Channel.Close,
}


def _method_of(data: bytes) -> Any:
    """The method of a whole method frame. A close is read here: its reply text may quote what
    the publisher sent (a ``user_id`` that is not UTF-8), which pamqp cannot decode."""
    (index,) = U32.unpack_from(data, 7)
    close = _CLOSES.get(index)
    if close is None:
        return pamqp.frame.unmarshal(data)[2]
    (code,) = U16.unpack_from(data, 11)
    text, at = _short_at(data, 13, len(data) - 1)
    class_id, method_id = struct.unpack_from(">HH", data, at)
    return close(code, text.decode(errors="backslashreplace"), class_id, method_id)
