"""What ``waystation.brokers.amqp._private`` assumes of the installed aio-pika and aiormq (the
newest releases pyproject.toml allows, in CI): if an upgrade moves any of it, this fails first.
The behaviour itself is exercised on the real RabbitMQ by the broker contract suite
(consumers restored after a reconnection, acks written)."""

from __future__ import annotations

import asyncio
import inspect
from importlib.metadata import version
from typing import Any

import aiormq
import aiormq.abc
from aio_pika.robust_queue import RobustQueue

from waystation.brokers.amqp._private import remember_consumer, write_frame


def test_the_pins_hold_the_installed_versions() -> None:
    assert version("aio-pika").startswith("10.2.")
    assert version("aiormq").startswith("7.2.")


def test_aio_pikas_robust_queue_restores_the_consumers_it_keeps_by_tag() -> None:
    source = inspect.getsource(RobustQueue)
    assert "self._consumers = {}" in inspect.getsource(RobustQueue.__init__)
    restore = inspect.getsource(RobustQueue.restore)
    assert "self._consumers.items()" in restore and "self.consume(" in restore
    # what it records for a consumer of its own: consume's keyword arguments, by tag
    assert "self._consumers[consumer_tag] = dict(" in source
    signature = inspect.signature(RobustQueue.consume)
    assert {"callback", "no_ack", "exclusive", "arguments"} <= set(signature.parameters)


def test_remember_consumer_records_it_where_restore_reads_it() -> None:
    queue = RobustQueue.__new__(RobustQueue)
    queue._consumers = {}  # (what __init__ sets, without a channel)
    remember_consumer(queue, "tag-1", callback=print, no_ack=False)
    assert queue._consumers == {"tag-1": {"callback": print, "no_ack": False}}


def test_aiormqs_connection_writes_what_its_write_queue_holds() -> None:
    source = inspect.getsource(aiormq.Connection)
    assert "self.write_queue = asyncio.Queue(" in source
    assert "FrameGenerator(self.write_queue)" in source  # its writer drains it to the socket


async def test_write_frame_queues_it_or_waits_for_room() -> None:
    class Channel:
        def __init__(self, room: int) -> None:
            self.connection: Any = type("C", (), {})()
            self.connection.write_queue = asyncio.Queue(maxsize=room)

    frame = aiormq.abc.ChannelFrame.marshall(channel_number=1, frames=[])
    roomy = Channel(room=1)
    assert write_frame(roomy, frame) is None  # type: ignore[arg-type]
    assert roomy.connection.write_queue.get_nowait() is frame
    full = Channel(room=1)
    full.connection.write_queue.put_nowait("ahead")
    waiting = write_frame(full, frame)  # type: ignore[arg-type]
    assert waiting is not None and not waiting.done()
    assert full.connection.write_queue.get_nowait() == "ahead"
    await waiting
    assert full.connection.write_queue.get_nowait() is frame
