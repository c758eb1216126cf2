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
(``workers.brokers.metadata.guard_content_header``). The message then costs itself alone: the
worker dead-letters it (``undecodable-metadata``) and the connection stays up.

Nothing here changes how any other connection of the process reads or writes: only a connection
made with :func:`guarded_connection` goes through it.
"""

from __future__ import annotations

import asyncio
import collections
import struct
from typing import Any

import aio_pika
from aio_pika.abc import AbstractRobustConnection
from aiormq.connection import TCPTransportFactory, TLSTransportFactory, TransportFactory
from yarl import URL

from .metadata import guard_content_header

__all__ = ["GuardedReader", "GuardedTransport", "guarded_connection"]

_HEAD = struct.Struct(">BHI")  # frame type, channel, payload size
_CONTENT_HEADER = 2


class GuardedReader:
    """What aiormq's frame reader reads from: the connection's bytes, a whole frame at a time,
    each content header guarded. It offers what the reader uses of an ``asyncio.StreamReader``
    (``readexactly``, ``read``, ``at_eof``)."""

    def __init__(self, inner: asyncio.StreamReader) -> None:
        self._inner = inner
        self._chunks: collections.deque[bytes] = collections.deque()
        self.guarded = 0
        """Content headers replaced so far."""

    def at_eof(self) -> bool:
        return not self._chunks and self._inner.at_eof()

    async def read(self, n: int = -1) -> bytes:
        if self._chunks:
            return self._chunks.popleft()
        return await self._inner.read(n)

    async def readexactly(self, n: int) -> bytes:
        if not self._chunks:
            await self._next_frame()
        parts = []
        while n > 0:
            if not self._chunks:
                # (a reader that does not read a frame at a time: hand over what comes)
                parts.append(await self._inner.readexactly(n))
                break
            chunk = self._chunks.popleft()
            if len(chunk) > n:
                self._chunks.appendleft(chunk[n:])
                chunk = chunk[:n]
            parts.append(chunk)
            n -= len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _next_frame(self) -> None:
        head = await self._inner.readexactly(_HEAD.size)
        if head.startswith(b"AMQP"):  # the broker's protocol header (a version it refuses)
            self._chunks.append(head)
            return
        frame_type, channel, size = _HEAD.unpack(head)
        rest = await self._inner.readexactly(size + 1)  # the payload and the frame's end
        if frame_type == _CONTENT_HEADER:
            payload = rest[:-1]
            guarded = guard_content_header(payload)
            if guarded is not payload:
                self.guarded += 1
                head = _HEAD.pack(frame_type, channel, len(guarded))
                rest = guarded + rest[-1:]
        self._chunks.append(head)
        self._chunks.append(rest)


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
    url: str, *, client_properties: dict[str, Any]
) -> AbstractRobustConnection:
    """A robust connection to ``url`` whose frames are read through a :class:`GuardedReader`."""
    return await aio_pika.connect_robust(
        url, client_properties=client_properties, connection_class=_GuardedConnection
    )
