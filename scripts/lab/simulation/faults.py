"""The fault layer: each simulated worker process reaches the store and the broker through it.

A :class:`Process` is one incarnation of a worker. Its calls go through :class:`FaultyStore` and
:class:`FaultyBroker`, which add latency, fail storage calls with every transient class
PostgreSQL really returns, and crash the process at step boundaries: before and after an append
commits, before and after a publish and its confirm, before and after an ack. A crash is what a
SIGKILL is: the process's broker connection dies (its unsettled deliveries go back to their
queues, its unconfirmed publishes are kept or lost), every task it runs is cancelled, and any
call it still attempts fails, so nothing it does after the crash reaches the world.

A :class:`Chronicle` notes, in one order, what the processes did that the world can see: every
append that committed, every publish that reached the broker, every ack a worker sent. The
invariants hold the log against it (``.reality``).
"""

from __future__ import annotations

import asyncio
import contextvars
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from waystation.brokers.memory import InMemoryConnection
from waystation.brokers.port import Broker, BrokerUnavailable, Delivery, DeliveryHandler
from waystation.events import (
    AppendResult,
    EventStore,
    ExpiredCall,
    NewEvent,
    OutboxEntry,
    OutboxMessage,
    RecordedEvent,
    StoreUnavailable,
)
from waystation.events.store import Position
from waystation.protocol.wire import Names

__all__ = [
    "ACTOR",
    "TRANSIENT",
    "Acked",
    "Chronicle",
    "FaultPlan",
    "FaultyBroker",
    "FaultyStore",
    "Process",
    "Refused",
    "Sent",
    "Trace",
]

ACTOR: contextvars.ContextVar[Process | None] = contextvars.ContextVar("actor", default=None)
"""The simulated process a task belongs to (every task it creates inherits it)."""

TRANSIENT = (
    "connection lost",
    "pool checkout timeout",
    "53300 too many connections",
    "57014 query cancelled",
    "40001 serialization failure",
    "40P01 deadlock detected",
)
"""The transient failures of a PostgreSQL statement (all surface as ``StoreUnavailable``)."""

STEPS = (
    "append.before",
    "append.after",
    "publish.before",
    "publish.after",
    "confirm.after",
    "ack.before",
    "ack.after",
)
"""The step boundaries at which a process can crash."""


class Trace:
    """A step-by-step account of a run (kept only when asked for: it costs time)."""

    def __init__(self, clock: Callable[[], float], enabled: bool) -> None:
        self.clock = clock
        self.enabled = enabled
        self.lines: list[str] = []

    def __call__(self, who: str, what: str) -> None:
        if self.enabled:
            self.lines.append(f"{self.clock():14.3f} {who:>8} {what}")


@dataclass(frozen=True, slots=True)
class Sent:
    """A publish of a worker that the broker took (routed or not), ``seq``-th in the chronicle,
    at the loop's time ``at``."""

    seq: int
    worker: str
    message: OutboxMessage
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class Refused:
    """A publish of a worker that the broker refused (a nack, a size), ``seq``-th in the
    chronicle, at the loop's time ``at``."""

    seq: int
    worker: str
    message: OutboxMessage
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class Acked:
    """An ack a worker sent (the broker may still lose it in a drop), ``seq``-th in the
    chronicle: the moment the worker took the delivery's effect for durable."""

    seq: int
    worker: str
    delivery: Delivery


def _now() -> float:
    return asyncio.get_running_loop().time()


@dataclass
class Chronicle:
    """What the processes did that the world can see, numbered in the order it happened.

    Each note is taken in the same step of the loop as the thing it notes (the in-memory store
    commits and the in-memory broker takes a publish without awaiting), so the numbers order
    commits, publishes and acks exactly, even when they share a moment of the virtual clock."""

    commits: dict[int, int] = field(default_factory=dict)
    """Global position of each event committed, to its number."""
    sent: list[Sent] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    acked: list[Acked] = field(default_factory=list)
    seq: int = 0

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def committed(self, events: Iterable[RecordedEvent]) -> None:
        seq = self._next()
        for event in events:
            self.commits[event.global_position] = seq

    def publish(self, worker: str, message: OutboxMessage) -> None:
        self.sent.append(Sent(self._next(), worker, message, _now()))

    def refuse(self, worker: str, message: OutboxMessage, reason: str) -> None:
        self.refused.append(Refused(self._next(), worker, message, reason, _now()))

    def ack(self, worker: str, delivery: Delivery) -> None:
        self.acked.append(Acked(self._next(), worker, delivery))


@dataclass
class FaultPlan:
    """How often each fault strikes (per call); drawn from the run's generator."""

    storage_failure_rate: float = 0.0
    crash_rate: float = 0.0
    crash_steps: frozenset[str] = frozenset(STEPS)
    max_crashes: int = 0
    crashes: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def crash_now(self, step: str) -> bool:
        if self.crashes >= self.max_crashes or step not in self.crash_steps:
            return False
        if self.rng.random() < self.crash_rate:
            self.crashes += 1
            return True
        return False

    def storage_failure(self) -> str | None:
        if self.storage_failure_rate and self.rng.random() < self.storage_failure_rate:
            return self.rng.choice(TRANSIENT)
        return None


class Process:
    """One incarnation of a simulated worker process."""

    def __init__(self, name: str, plan: FaultPlan, trace: Trace) -> None:
        self.name = name
        self.plan = plan
        self.trace = trace
        self.alive = True
        self.tasks: dict[asyncio.Task[Any], None] = {}
        """Every task it runs, in creation order (a set's order would vary from run to run)."""
        self.connection: InMemoryConnection | None = None
        self.on_crash: Callable[[Process], None] | None = None

    def adopt(self, task: asyncio.Task[Any]) -> None:
        self.tasks[task] = None
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self.tasks.pop(task, None)

    def check(self) -> None:
        """A dead process does nothing more: whatever it still attempts ends here."""
        if not self.alive:
            raise asyncio.CancelledError(f"{self.name} is dead")

    def step(self, step: str) -> None:
        """A step boundary: the process may crash here."""
        self.check()
        if self.plan.crash_now(step):
            self.trace(self.name, f"CRASH at {step}")
            self.crash()
            raise asyncio.CancelledError(f"{self.name} crashed at {step}")

    def crash(self) -> None:
        if not self.alive:
            return
        self.alive = False
        if self.connection is not None:
            self.connection.kill()
        current = asyncio.current_task()
        for task in list(self.tasks):
            if task is not current:
                task.cancel()
        if self.on_crash is not None:
            self.on_crash(self)


class FaultyStore(EventStore):
    """A process's way to the shared store: latency, transient failures, crashes."""

    def __init__(
        self,
        inner: EventStore,
        process: Process,
        latency: Callable[[str], float],
        reads: dict[str, list[tuple[float, int]]],
        chronicle: Chronicle,
    ) -> None:
        self.inner = inner
        self.process = process
        self.latency = latency
        self.reads = reads
        self.chronicle = chronicle
        """When each stream was read (the loop's time as the read ran), and by which asyncio
        task (its ``id``), for the invariants."""

    async def _enter(self, operation: str) -> None:
        self.process.check()
        await asyncio.sleep(self.latency(operation))
        self.process.check()
        failure = self.process.plan.storage_failure()
        if failure is not None and failure != "connection lost":
            self.process.trace(self.process.name, f"store {operation}: {failure}")
            raise StoreUnavailable(f"simulated: {failure}")

    def _lost(self, operation: str) -> None:
        """After the statement ran: the connection may still drop before its answer arrives."""
        if self.process.plan.storage_failure() == "connection lost":
            self.process.trace(self.process.name, f"store {operation}: connection lost after")
            raise StoreUnavailable("simulated: connection lost")

    async def append(
        self,
        stream_id: str,
        expected_version: int,
        events: Sequence[NewEvent],
        *,
        prev_hash: bytes,
        outbox: Sequence[OutboxMessage] = (),
        outbox_delay: float = 5.0,
    ) -> AppendResult:
        await self._enter("append")
        self.process.step("append.before")
        result = await self.inner.append(
            stream_id,
            expected_version,
            events,
            prev_hash=prev_hash,
            outbox=outbox,
            outbox_delay=outbox_delay,
        )
        if not result.duplicate:
            self.chronicle.committed(result.recorded)
        self.process.trace(
            self.process.name,
            f"append {stream_id} v{expected_version}+{len(events)} "
            f"[{', '.join(e.event_type for e in events)}]"
            f"{' duplicate' if result.duplicate else ''}",
        )
        self.process.step("append.after")
        self._lost("append")
        return result

    async def read_stream(self, stream_id: str, *, after: int = 0) -> list[RecordedEvent]:
        await self._enter("read")
        self.reads.setdefault(stream_id, []).append(
            (asyncio.get_running_loop().time(), id(asyncio.current_task()))
        )
        return await self.inner.read_stream(stream_id, after=after)

    async def read_all(
        self, after: Position = Position(), limit: int = 1000
    ) -> list[RecordedEvent]:
        await self._enter("read")
        return await self.inner.read_all(after, limit)

    async def claim_outbox(
        self, limit: int = 100, lease: float = 30.0, *, deployment: str | None = None
    ) -> list[OutboxEntry]:
        await self._enter("claim")
        return await self.inner.claim_outbox(limit, lease, deployment=deployment)

    async def delete_outbox(self, ids: Sequence[int]) -> None:
        await self._enter("delete")
        await self.inner.delete_outbox(ids)
        self._lost("delete")

    async def outbox_size(self, *, deployment: str | None = None) -> int:
        await self._enter("read")
        return await self.inner.outbox_size(deployment=deployment)

    async def outbox_oldest(self, *, deployment: str | None = None) -> float | None:
        await self._enter("read")
        return await self.inner.outbox_oldest(deployment=deployment)

    async def retry_outbox(
        self, ids: Sequence[int], delay: float, *, refused: str | None = None
    ) -> None:
        await self._enter("claim")
        await self.inner.retry_outbox(ids, delay, refused=refused)
        self._lost("claim")

    async def replace_outbox(self, outbox_id: int, message: OutboxMessage) -> None:
        await self._enter("claim")
        await self.inner.replace_outbox(outbox_id, message)
        self._lost("claim")

    async def claim_expired_calls(
        self, limit: int = 100, lease: float = 30.0, *, deployment: str | None = None
    ) -> list[ExpiredCall]:
        await self._enter("claim")
        claimed = await self.inner.claim_expired_calls(limit, lease, deployment=deployment)
        if claimed:
            self.process.trace(
                self.process.name, f"claim {', '.join(c.subtask_id for c in claimed)}"
            )
        self._lost("claim")
        return claimed

    async def pending_call_deadlines(self, task_id: str) -> dict[str, float]:
        await self._enter("read")
        return await self.inner.pending_call_deadlines(task_id)


class FaultyBroker(Broker):
    """A process's broker connection, with crashes at the publish and ack boundaries."""

    def __init__(self, inner: InMemoryConnection, process: Process, chronicle: Chronicle) -> None:
        self.inner = inner
        self.process = process
        self.chronicle = chronicle
        process.connection = inner
        inner.on_sent = self._sent
        inner.on_refused = self._refused

    def _sent(self, message: OutboxMessage) -> None:
        """The broker took a publish (its confirm is on its way back): noted, then the process
        may crash before the confirm arrives."""
        self.chronicle.publish(self.process.name, message)
        self.process.step("publish.after")

    def _refused(self, message: OutboxMessage, reason: str) -> None:
        """The broker refused a publish (its nack is on its way back): noted, as above."""
        self.chronicle.refuse(self.process.name, message, reason)
        self.process.step("publish.after")

    async def connect(self) -> None:
        self.process.check()
        await self.inner.connect()

    async def close(self) -> None:
        await self.inner.close()

    @property
    def connected(self) -> bool:
        return self.inner.connected

    async def declare(self, names: Names, agents: Iterable[str]) -> None:
        self.process.check()
        await self.inner.declare(names, agents)

    async def consume(
        self, queue: str, handler: DeliveryHandler, *, prefetch: int, priority: int = 0
    ) -> None:
        self.process.check()
        await self.inner.consume(queue, handler, prefetch=prefetch, priority=priority)

    async def cancel_consumers(self) -> None:
        await self.inner.cancel_consumers()

    @property
    def consumers(self) -> int:
        return self.inner.consumers

    async def publish(self, message: OutboxMessage) -> None:
        self.process.step("publish.before")
        try:
            await self.inner.publish(message)
        except BrokerUnavailable:
            self.process.check()
            raise
        finally:
            self.process.trace(
                self.process.name, f"publish {message.message_id} -> {message.routing_key}"
            )
        self.process.step("confirm.after")

    async def publish_later(self, message: OutboxMessage, delay: float) -> None:
        self.process.step("publish.before")
        try:
            await self.inner.publish_later(message, delay)
        except BrokerUnavailable:
            self.process.check()
            raise
        finally:
            self.process.trace(
                self.process.name,
                f"publish {message.message_id} -> {message.routing_key} in {delay:.2f}s",
            )
        self.process.step("confirm.after")

    async def ack(self, delivery: Delivery) -> None:
        self.process.step("ack.before")
        self.chronicle.ack(self.process.name, delivery)
        await self.inner.ack(delivery)
        self.process.trace(self.process.name, f"ack {delivery.message_id} on {delivery.queue}")
        self.process.step("ack.after")

    async def requeue(self, delivery: Delivery) -> None:
        self.process.step("ack.before")
        await self.inner.requeue(delivery)
        self.process.trace(self.process.name, f"requeue {delivery.message_id} on {delivery.queue}")

    def settleable(self, delivery: Delivery) -> bool:
        return self.inner.settleable(delivery)
