"""The transport of Waystation's own AMQP connections: frames read defensively.

aiormq decodes each frame in its connection's reader task; a frame it cannot decode ends that
task, and the whole connection with it (every delivery in flight goes back to its queue, every
handler running on one is cancelled), at each redelivery of the same message. A publisher
controls one kind of frame a consumer reads: the content header of its message, whose properties
and headers it writes as it likes (a ``message_id`` that is not UTF-8, a header table nested
thousands deep).

So the connections Waystation opens read through :class:`GuardedTransport`, an aiormq transport
factory (aiormq's public ``transport_factory``): it hands aiormq's reader the same bytes, frame
by frame, except a content header that does not decode, which it replaces by one that does
(``waystation.brokers.metadata.guard_content_header``). The message then costs itself alone: the
worker dead-letters it (``undecodable-metadata``) and the connection stays up.

Nothing here changes how any other connection of the process reads or writes: only a connection
made with :func:`guarded_connection` goes through it. (The worker's own connection needs no
wrapper: the frames' dispatcher of ``waystation.brokers.amqp.frames`` guards its content headers as
it decodes them, at no cost to its other frames. This transport serves the connections that do not
go through that dispatcher: the client's, the command line's.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import struct
from collections.abc import Awaitable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractRobustConnection
from aio_pika.connection import make_url
from aiormq.connection import TCPTransportFactory, TLSTransportFactory, TransportFactory
from yarl import URL

from waystation.brokers.metadata import guard_content_header

__all__ = ["CONNECT_TIMEOUT", "GuardedReader", "GuardedTransport", "guarded_connection"]

CONNECT_TIMEOUT = 15.0
"""Seconds an attempt to open a connection may take, the AMQP handshake included: a server that
accepts and never answers (another service on that port, a broker that hangs) fails it as
``TimeoutError``, rather than keeping a command (or a worker's start) waiting for ever."""

_HEAD = struct.Struct(">BHI")  # frame type, channel, payload size
_CONTENT_HEADER = 2


class GuardedReader:
    """What aiormq's frame reader reads from: the connection's bytes as they come, but for each
    content header, read whole and guarded first. It offers what that reader uses of an
    ``asyncio.StreamReader`` (``readexactly``, ``read``, ``at_eof``), and relies on how it
    reads: a frame's first byte alone, then the rest of its envelope, then its payload."""

    def __init__(self, inner: asyncio.StreamReader) -> None:
        self._inner = inner
        self._guarded: collections.deque[bytes] = collections.deque()
        """What is left to hand over of a guarded content header frame."""
        self._next = 0
        """Which read of a frame comes next: its type (0), the rest of its envelope (1), its
        payload with the frame's end (2)."""
        self.guarded = 0
        """Content headers replaced so far."""

    def at_eof(self) -> bool:
        return not self._guarded and self._inner.at_eof()

    async def read(self, n: int = -1) -> bytes:
        if self._guarded:
            return self._guarded.popleft()
        return await self._inner.read(n)

    def readexactly(self, n: int) -> Awaitable[bytes]:
        # Not a coroutine itself: a frame's envelope and payload are the inner reader's own
        # awaitables, handed over as they are (a layer of coroutine per read is a measured share
        # of a worker's CPU); only a frame's first byte is looked at.
        if self._guarded:
            return self._handed(n)
        if self._next or n != 1:
            self._next = (self._next + 1) % 3
            return self._inner.readexactly(n)
        return self._first()

    async def _first(self) -> bytes:
        data = await self._inner.readexactly(1)
        if data == b"\x02":
            await self._guard_header(data)
            return self._take(1)
        self._next = 1
        return data

    async def _handed(self, n: int) -> bytes:
        return self._take(n)

    def _take(self, n: int) -> bytes:
        chunk = self._guarded.popleft()
        if len(chunk) > n:
            self._guarded.appendleft(chunk[n:])
            chunk = chunk[:n]
        elif len(chunk) < n:  # (a reader that does not read a frame at a time)
            raise asyncio.IncompleteReadError(chunk, n)
        return chunk

    async def _guard_header(self, first: bytes) -> None:
        """Read a content header frame whole (its type byte ``first`` read) and queue it as it
        will be handed over: guarded."""
        rest = await self._inner.readexactly(_HEAD.size - 1)
        _, channel, size = _HEAD.unpack(first + rest)
        framed = await self._inner.readexactly(size + 1)  # the payload and the frame's end
        payload = framed[:-1]
        guarded, header = guard_content_header(payload)
        if header is None:
            self.guarded += 1
            rest = _HEAD.pack(_CONTENT_HEADER, channel, len(guarded))[1:]
            framed = guarded + framed[-1:]
        self._guarded.extend((first, rest, framed))


class GuardedTransport(TransportFactory):
    """aiormq's own TCP or TLS transport, read through a :class:`GuardedReader`."""

    def __init__(self) -> None:
        self._tcp = TCPTransportFactory()
        self._tls = TLSTransportFactory()

    async def create(
        self, url: URL, **kwargs: Any
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        plain = self._tls if url.scheme == "amqps" else self._tcp
        reader, writer = await plain.create(url, **kwargs)
        guarded: Any = GuardedReader(reader)
        return guarded, writer


class _GuardedConnection(aio_pika.RobustConnection):
    """aio-pika's robust connection, each of its (re)connections on a :class:`GuardedTransport`
    (aio-pika hands ``kwargs`` to ``aiormq.connect``, which takes the factory)."""

    def __init__(self, url: URL, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.kwargs["transport_factory"] = GuardedTransport()


async def guarded_connection(
    url: str, *, client_properties: dict[str, Any], reader: bool = True
) -> AbstractRobustConnection:
    """A robust connection to ``url`` whose frames are read through a :class:`GuardedReader`;
    with ``reader=False``, aio-pika's own (for a connection whose content headers the frames'
    dispatcher guards: opened in ``waystation.brokers.amqp.frames.context``)."""
    connection_class = _GuardedConnection if reader else aio_pika.RobustConnection
    connection = connection_class(make_url(url), client_properties=client_properties)
    try:
        await connection.connect(timeout=CONNECT_TIMEOUT)
    except BaseException:
        # aio-pika's reconnection task outlives a first attempt that is cancelled (a signal
        # while connecting) or fails with what it does not count as a connection error: it
        # tries again every 5 s, and the process never ends. Closing it ends that task.
        with contextlib.suppress(Exception):
            await connection.close()
        raise
    return connection
