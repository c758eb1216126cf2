"""What a chaos run reads from the broker and the workers.

* :class:`ChaosCollector`: the durable result collector of the tests, which also says how many
  tasks have a result and waits for more; its messages carry their ``redelivered`` flag, so
  that a result the broker delivered again (the collector's ack was lost with its connection)
  is told apart from one a worker published twice; and the run's full queues and the queue of
  the hostile messages' answers;
* :func:`probe_health`: one worker's ``/healthz`` (healthy, and messages in its handlers);
* :func:`counter_values`: a counter of a worker's ``/metrics`` by label.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aio_pika
import aiohttp
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from scripts.lab.harness.clients import DurableResultCollector
from waystation.events.codec import dumps, loads
from waystation.protocol.wire import CONTENT_TYPE, TYPE_TASK

# ---- a worker's counters -------------------------------------------------------------------


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def counter_values(exposition: str, name: str) -> dict[str, float]:
    """The samples of counter ``name`` (``..._total``) in a Prometheus text exposition, by the
    value of their first label ("" when they have none)."""
    values: dict[str, float] = {}
    for line in exposition.splitlines():
        sample = _SAMPLE.match(line.strip())
        if sample is None or sample["name"] != f"{name}_total":
            continue
        labels = sample["labels"] or ""
        label = labels.split("=", 1)[1].split(",", 1)[0].strip('"') if "=" in labels else ""
        try:
            values[label] = values.get(label, 0.0) + float(sample["value"])
        except ValueError:
            continue
    return values


# ---- results -------------------------------------------------------------------------------

FILLER_TYPE = "chaos-filler"
"""The type of the messages that keep a full queue full (the run's, not results)."""


class ChaosCollector(DurableResultCollector):
    """:class:`~scripts.lab.harness.clients.DurableResultCollector` that can wait until a number of
    tasks have their result, and that also answers for the run's other queues, each on its
    robust channel (restored with its consumers when the connection comes back):

    * full queues (:meth:`full_queue`): a classic queue of ``x-max-length`` that rejects
      publishes, declared and filled with that many fillers; :meth:`drain` consumes it (fillers
      dropped, results recorded as any other, counted in ``through_full``);
    * the queue where hostile messages' errors come back (:meth:`keep_answers`).

    The results of the tasks in ``uncounted`` (those answered through a full queue) are kept
    but not counted by :meth:`answered`: the run's window of tasks in flight leaves them out."""

    def __init__(self, amqp_url: str, *, queue_prefix: str) -> None:
        super().__init__(amqp_url, queue_prefix=queue_prefix, queue_name="chaos-results")
        self._arrived = asyncio.Condition()
        self.uncounted: set[str] = set()
        self._counted: set[str] = set()
        self.through_full: Counter[str] = Counter()
        """Per task, result messages that came through a full queue."""
        self.fillers_taken = 0
        self.answers: list[tuple[str | None, bytes]] = []
        """(correlation id, body) of every answer to a hostile message."""
        self._queues: dict[str, AbstractQueue] = {}

    async def _on_result(self, message: AbstractIncomingMessage) -> None:
        await super()._on_result(message)
        if message.correlation_id is not None and message.correlation_id not in self.uncounted:
            self._counted.add(message.correlation_id)
        async with self._arrived:
            self._arrived.notify_all()

    def answered(self) -> int:
        """Tasks with a result so far, those in ``uncounted`` aside."""
        return len(self._counted)

    async def wait_answered(self, count: int) -> None:
        """Until at least ``count`` tasks (``uncounted`` aside) have a result."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: len(self._counted) >= count)

    async def submit_to(self, agent: str, input: Any, task_id: str, reply_to: str) -> None:
        """Submit a task as :meth:`submit` does, its result due on ``reply_to`` instead."""
        assert self._channel is not None
        await self._channel.default_exchange.publish(
            aio_pika.Message(
                dumps(input),
                message_id=task_id,
                correlation_id=task_id,
                reply_to=reply_to,
                type=TYPE_TASK,
                content_type=CONTENT_TYPE,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=self.names.tasks(agent),
            mandatory=True,
        )

    async def full_queue(self, name: str, length: int) -> None:
        """Declare ``name``, a durable classic queue of at most ``length`` messages that rejects
        publishes past that (``x-overflow: reject-publish``), and fill it (again: it tops up
        what a call cut short by a dropped connection left)."""
        assert self._channel is not None
        queue = await self._channel.declare_queue(
            name,
            durable=True,
            arguments={
                "x-queue-type": "classic",
                "x-max-length": length,
                "x-overflow": "reject-publish",
            },
        )
        self._queues[name] = queue
        there = int(queue.declaration_result.message_count or 0)  # (filled before a drop)
        for number in range(there, length):
            await self._channel.default_exchange.publish(
                aio_pika.Message(
                    b"{}",
                    type=FILLER_TYPE,
                    correlation_id=f"filler-{number}",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=name,
                mandatory=True,
            )

    async def drain(self, name: str) -> None:
        """Start consuming the full queue ``name``: from now on it is drained as results come."""
        await self._queues[name].consume(self._on_full)

    async def _on_full(self, message: AbstractIncomingMessage) -> None:
        if message.type == FILLER_TYPE:
            self.fillers_taken += 1
            await self._ack(message)
            return
        self.through_full[message.correlation_id or ""] += 1
        await self._on_result(message)

    async def keep_answers(self, name: str) -> None:
        """Declare ``name`` (a durable quorum queue) and keep every message that comes to it."""
        assert self._channel is not None
        queue = await self._channel.declare_queue(
            name, durable=True, arguments={"x-queue-type": "quorum"}
        )
        self._queues[name] = queue
        await queue.consume(self._on_answer)

    async def _on_answer(self, message: AbstractIncomingMessage) -> None:
        self.answers.append((message.correlation_id, bytes(message.body)))
        await self._ack(message)


# ---- a worker's health ---------------------------------------------------------------------


@dataclass(frozen=True)
class Health:
    healthy: bool
    in_flight: int | None
    """Messages in the worker's handlers right now (None when it did not say)."""


async def probe_health(session: aiohttp.ClientSession, port: int) -> Health:
    """``GET /healthz`` of the worker listening on ``port`` (unhealthy when it does not answer)."""
    try:
        async with session.get(
            f"http://127.0.0.1:{port}/healthz", timeout=aiohttp.ClientTimeout(total=3)
        ) as response:
            body = loads(await response.read())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return Health(False, None)
    in_flight = body.get("in_flight") if isinstance(body, dict) else None
    return Health(response.status == 200, in_flight if isinstance(in_flight, int) else None)
