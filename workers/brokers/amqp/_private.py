"""The only places Waystation reaches into aio-pika's and aiormq's undocumented parts.

Both serve the worker's hot path (docs/performance.md): a consumer that takes aiormq's
deliveries as they are, and acks written as one frame. aio-pika and aiormq are pinned to the
releases these were read from (pyproject.toml), and ``tests/unit/test_amqp_private.py`` checks
each assumption against the installed versions.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aio_pika
import aiormq.abc

__all__ = ["remember_consumer", "write_frame"]


def remember_consumer(queue: aio_pika.RobustQueue, tag: str, **consumer: Any) -> None:
    """Record a consumer where aio-pika's robust queue keeps the consumers it restores after a
    reconnection (``RobustQueue._consumers``: tag -> ``consume``'s keyword arguments)."""
    queue._consumers[tag] = consumer


def write_frame(
    channel: aiormq.abc.AbstractChannel, frame: aiormq.abc.ChannelFrame
) -> asyncio.Future[None] | None:
    """Hand ``frame`` to the writer of ``channel``'s connection (aiormq's
    ``Connection.write_queue``, which its writer task drains to the socket). None when it was
    queued at once; when the queue is full, the future of putting it there (the writer is
    behind: it waits for room, as aiormq itself would)."""
    queue: asyncio.Queue[Any] = channel.connection.write_queue  # type: ignore[attr-defined]
    try:
        queue.put_nowait(frame)
    except asyncio.QueueFull:
        return asyncio.ensure_future(queue.put(frame))
    return None
