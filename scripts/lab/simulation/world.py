"""One simulated run: real workers, a publisher, a canceller and a plain AMQP peer, under faults.

:func:`run` builds the world a :class:`~.scenario.Scenario` describes on a
:class:`~.loop.VirtualLoop`, lets it go until every task has answered and nothing
moves any more (or until a bound of virtual time), and returns what was observed:
the log, what each publisher received, what the broker kept and dead-lettered, and what a
projection following the log built along the way. ``.invariants`` judges it.

Signals come from the world's own sender (:meth:`_World._signal`), which reads the log as a
person watching the task would (when did its wait open, when does it time out), sends at the
moment its :class:`~.scenario.SignalSpec` draws, and keeps every answer; the orchestrator keeps
what each resumed run of it saw (``seen``), for ``.waits`` to hold against the log.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from waystation.agent import App, TaskContext
from waystation.brokers.amqp.topology import policy_definition
from waystation.brokers.memory import InMemoryBroker, InMemoryConnection, StoredMessage
from waystation.brokers.port import BrokerUnavailable, Delivery
from waystation.events import (
    Call,
    CallResult,
    Complete,
    FirstK,
    OutboxMessage,
    Outcome,
    Pause,
    Position,
    RecordedEvent,
    Signal,
    Sleep,
    Wait,
)
from waystation.events.codec import canonical, dumps, loads
from waystation.events.memory import InMemoryEventStore
from waystation.policies import Permanent
from waystation.protocol.wire import (
    CONTENT_TYPE,
    TYPE_CANCEL,
    TYPE_PROGRESS,
    TYPE_RESULT,
    TYPE_SIGNAL,
    TYPE_TASK,
    Names,
)
from waystation.runtime.worker import Worker
from waystation.settings import Settings

from .faults import ACTOR, Chronicle, FaultPlan, FaultyBroker, FaultyStore, Process, Trace
from .hostile import hostile_message, odd_headers
from .hostile import properties as hostile_properties
from .loop import EPOCH, Stalled, VirtualLoop
from .scenario import MAX_MESSAGE, REFUSED_RETRY, Hostile, Scenario, SignalSpec, TaskSpec

__all__ = ["Observed", "fingerprint", "run"]

PREFIX = "sim."
RESULTS = "sim.results"
CANCELS = "sim.cancels"
SIGNALS = "sim.signals"
"""Where the senders of signals hear what became of them."""
GONE = "sim.gone"
"""The reply queue of a publisher that left: no such queue exists."""
FULL = "sim.full."
"""The reply queues of publishers that let them fill (``x-overflow: reject-publish``), each
holding one message until its publisher drains it."""
QUIET_CHECK = 2.0
QUIET_GRACE = 10.0
"""Virtual seconds a quiet world must stay quiet: late replies, duplicates, the relay."""
HORIZON = 900.0
"""Virtual seconds after which a run that has not settled counts as stuck."""
SETTLE_BOUND = 120.0
"""Virtual seconds past the last deadline within which every task must have finished."""
WATCH = 0.25
"""Virtual seconds between two looks of a signal's sender at its task's stream."""
WATCH_LIMIT = 300.0
"""Virtual seconds a signal's sender waits for the moment it sends at; then it sends anyway."""

Seen = tuple[tuple[str, str, str, str, str | None], ...]
"""What a resumed run was given, result by result: (wait, outcome, value as canonical JSON,
kind, name)."""
Logged = tuple[tuple[str, str, str], ...]
"""The results of a pause the log held when a run resumed from it began: (wait, outcome, value
as canonical JSON), ``cancelled`` for a wait its resume gave up."""


class Go(BaseModel):
    """The orchestrator's model of its signals: a payload that does not fit is refused."""

    n: int


_BASE_SETTINGS: Settings | None = None


def _base_settings() -> Settings:
    global _BASE_SETTINGS
    if _BASE_SETTINGS is None:
        _BASE_SETTINGS = Settings(
            queue_prefix=PREFIX,
            broker_policy="none",
            concurrency=4,
            outbox_delay=2.0,
            outbox_poll_interval=1.0,
            sweep_interval=1.0,
            default_call_timeout=10.0,
            max_call_duration=120.0,
            shutdown_grace=2.0,
            metrics_port=0,
            max_message_bytes=MAX_MESSAGE,
            refused_retry_seconds=REFUSED_RETRY,
        )
    return _BASE_SETTINGS


@dataclass
class Observed:
    """Everything a run produced, for the invariants."""

    scenario: Scenario
    log: list[RecordedEvent]
    results: dict[str, list[bytes]]
    """Every result body each task's publisher received, in arrival order."""
    cancel_answers: dict[str, list[Any]]
    published: list[StoredMessage]
    """Every message the broker took, with its fate."""
    dead_letters: list[StoredMessage]
    leftovers: dict[str, int]
    """Messages still in a queue (dead-letter queue aside) or unsettled at the end."""
    outbox_left: int
    projected: dict[str, tuple[str, int]]
    """The paused-tasks projection built incrementally: task id to (status, pause)."""
    settled_at: float | None
    """Virtual seconds after the start when everything had settled (None: it never did)."""
    last_deadline: float
    """Virtual seconds after the start of the latest call deadline in the log."""
    stalled: str | None
    reads: dict[str, list[tuple[float, int]]]
    """When workers read each stream (virtual seconds since the epoch), and in which asyncio
    task."""
    trace: list[str]
    crashes: int
    drops: int
    duplicated: int
    returned: int
    """Deliveries the broker took back unsettled (their worker crashed or was cut off)."""
    late_runs: list[str]
    failed_runs: dict[tuple[str, int], int]
    """Runs of each (task, pause) whose handler raised."""
    runs: dict[tuple[str, int], int]
    """Runs of each (task, pause), whatever their end."""
    storage_failures_injected: bool
    counters: dict[str, int] = field(default_factory=dict)
    full_queues: dict[str, str] = field(default_factory=dict)
    """Each task whose publisher's reply queue was full for a while, to that queue."""
    drained: dict[str, float] = field(default_factory=dict)
    """When each of those queues was drained (virtual seconds after the start)."""
    hostile_sent: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Each hostile message's tag, to what it was and the queue it went to."""
    permanent_raised: dict[tuple[str, int], float] = field(default_factory=dict)
    """(task, pause) whose run raised ``Permanent``, to when it first did (loop time)."""
    retryable_failed: dict[tuple[str, int], int] = field(default_factory=dict)
    """Runs of each (task, pause) that raised an error worth trying again (not ``Permanent``)."""
    signals_sent: dict[str, list[float]] = field(default_factory=dict)
    """Each signal's id, to when each copy of it went to the broker (loop time)."""
    signal_answers: dict[str, list[Any]] = field(default_factory=dict)
    """Each signal's id, to every answer its sender received, in arrival order."""
    seen: dict[tuple[str, int], list[Seen]] = field(default_factory=dict)
    """(task, pause) to what each run resumed from that pause was given (a run in place whose
    append found the stream moved on among them: its outcome is not recorded)."""
    logged: dict[tuple[str, int], list[Logged]] = field(default_factory=dict)
    """(task, pause) to what the log held of that pause's results when each of those runs
    began, in the same order."""
    pending: dict[str, str] = field(default_factory=dict)
    """The pending waits left at the end (the store's ``pending_calls``): wait to task."""
    chronicle: Chronicle = field(default_factory=Chronicle)
    """Every commit, every publish of a worker that reached the broker and every ack a worker
    sent, in the order they happened."""


class _Oracle:
    """A peer that is not Waystation: answers requests on its queue, well or badly."""

    def __init__(self, world: _World, connection: InMemoryConnection) -> None:
        self.world = world
        self.connection = connection

    async def handle(self, delivery: Delivery) -> None:
        await self.connection.ack(delivery)
        if delivery.type == TYPE_CANCEL or not delivery.reply_to:
            return
        subtask = delivery.correlation_id or ""
        rng = random.Random(f"{self.world.scenario.seed}:{subtask}")
        x = loads(delivery.body).get("x", 0)
        behaviour = rng.choice(
            ("once",) * 6 + ("twice", "different", "never", "never", "late", "progress", "error")
        )
        timeout = 30.0
        delay = rng.uniform(0.0, 2.0)
        self.world.spawn(self._answer(delivery, subtask, x, behaviour, delay, timeout, rng))

    async def _answer(
        self,
        request: Delivery,
        subtask: str,
        x: Any,
        behaviour: str,
        delay: float,
        timeout: float,
        rng: random.Random,
    ) -> None:
        reply_to = request.reply_to or ""
        if behaviour == "never":
            return
        if behaviour == "progress":
            await asyncio.sleep(delay)
            await self.world.send(reply_to, {"extend_by": 20.0}, subtask, TYPE_PROGRESS, "p1")
            delay += rng.uniform(0, 15)
        if behaviour == "late":
            delay += timeout + rng.uniform(0, 20)
        await asyncio.sleep(delay)
        value = x * 10 if isinstance(x, int) else 0
        body: Any = {"status": "ok", "result": {"answer": value}}
        if behaviour == "error":
            # half of them with a NUL the log cannot store: the call then fails at once (an
            # unstorable-reply error) and the reply is dead-lettered. (Drawn last, so that every
            # other behaviour draws what it drew before.)
            message = "no\u0000" if rng.random() < 0.5 else "no"
            body = {"status": "error", "error": {"type": "oracle", "message": message}}
        await self.world.send(reply_to, body, subtask, TYPE_RESULT, f"{subtask}/a")
        if behaviour in ("twice", "different"):
            await asyncio.sleep(rng.uniform(0, 3))
            if behaviour == "different":
                body = {"status": "ok", "result": {"answer": value + 1}}
            await self.world.send(reply_to, body, subtask, TYPE_RESULT, f"{subtask}/b")


class _World:
    def __init__(self, scenario: Scenario, loop: VirtualLoop, trace: Trace) -> None:
        self.scenario = scenario
        self.loop = loop
        self.trace = trace
        self.rng = random.Random(f"{scenario.seed}:world")
        self.start = loop.time()
        faults = scenario.faults
        latency_rng = random.Random(f"{scenario.seed}:latency")

        def latency(_: str) -> float:
            if "latency" not in faults:
                return 0.0005
            if latency_rng.random() < 0.02:
                return latency_rng.uniform(0.1, 2.0)  # a stall: GC, a slow disk, a busy node
            return latency_rng.expovariate(1 / 0.004)

        self.latency = latency
        self.store = InMemoryEventStore(clock=loop.time, wall_clock=loop.time)
        _, policy = policy_definition(Names(PREFIX), scenario.delivery_limit)
        limit = policy["delivery-limit"]
        assert isinstance(limit, int)
        self.broker = InMemoryBroker(
            delivery_limit=limit,  # the broker's policy, as the workers would set it
            counting=scenario.counting,
            latency=latency,
            rng=random.Random(f"{scenario.seed}:broker"),
            duplicate_rate=scenario.duplicate_rate if "duplicate" in faults else 0.0,
            keep_ledger=True,
            nack_rate=scenario.nack_rate if "refuse" in faults else 0.0,
            max_message_bytes=scenario.broker_max_bytes if "refuse" in faults else None,
        )
        self.plan = FaultPlan(
            storage_failure_rate=scenario.storage_failure_rate if "storage" in faults else 0.0,
            crash_rate=scenario.crash_rate if "crash" in faults else 0.0,
            max_crashes=scenario.max_crashes if "crash" in faults else 0,
            rng=random.Random(f"{scenario.seed}:faults"),
        )
        self.names = Names(PREFIX)
        self.app = self._app()
        self.runs: dict[tuple[str, int], int] = defaultdict(int)
        self.late_runs: list[str] = []
        self.failed_runs: dict[tuple[str, int], int] = defaultdict(int)
        """Resumed handler runs that began when their task was already finished in the log."""
        self.results: dict[str, list[bytes]] = defaultdict(list)
        self.cancel_answers: dict[str, list[Any]] = defaultdict(list)
        self.workers: dict[int, tuple[Process, Worker]] = {}
        self.every_worker: list[Worker] = []
        """Every incarnation that ever ran (their counters add up)."""
        self.incarnations: dict[int, int] = defaultdict(int)
        self.background: set[asyncio.Task[Any]] = set()
        self.projected: dict[str, tuple[str, int]] = {}
        self.streams: dict[str, list[RecordedEvent]] = defaultdict(list)
        self.cursor = Position()
        self.reads: dict[str, list[tuple[float, int]]] = {}
        self.chronicle = Chronicle()
        self.full_queues: dict[str, str] = {}
        """Each task whose publisher's reply queue is full for a while, to that queue."""
        self.drained: dict[str, float] = {}
        """When each of those queues was drained (virtual seconds after the start)."""
        self.hostile_sent: dict[str, tuple[str, str]] = {}
        """Each hostile message's tag, to what it was and the queue it went to."""
        self.permanent_raised: dict[tuple[str, int], float] = {}
        self.retryable_failed: dict[tuple[str, int], int] = defaultdict(int)
        """(task, pause) whose run raised ``Permanent``, to when it first did (loop time)."""
        self.signals_sent: dict[str, list[float]] = defaultdict(list)
        self.signal_answers: dict[str, list[Any]] = defaultdict(list)
        self.seen: dict[tuple[str, int], list[Seen]] = defaultdict(list)
        self.logged: dict[tuple[str, int], list[Logged]] = defaultdict(list)
        self.sending = 0
        """Signals not sent yet."""
        self.finishing = False
        self.own = self.broker.connection("simulation", reconnect_after=0.5)

    # ---- the agents --------------------------------------------------------------------------

    def _app(self) -> App:
        app = App()
        world = self

        @app.agent("orchestrator", signals={"go0": Go, "go1": Go, "go2": Go})
        async def orchestrator(task: TaskContext) -> Outcome:
            spec = task.input
            world.runs[(task.task_id, task.pause)] += 1
            seen = _seen(task.results)
            if task.pause:
                world.seen[(task.task_id, task.pause)].append(seen)
                world.logged[(task.task_id, task.pause)].append(world.logged_results(task))
            if task.pause and world.finished_in_log(task.task_id):
                world.late_runs.append(f"{task.task_id} resumed from pause {task.pause}")
            if world.runs[(task.task_id, task.pause)] <= spec.get("fails", 0):
                world.failed_runs[(task.task_id, task.pause)] += 1
                world.retryable_failed[(task.task_id, task.pause)] += 1
                raise RuntimeError(f"flaky run {world.runs[(task.task_id, task.pause)]}")
            if spec.get("permanent") and task.pause == 1:
                world.failed_runs[(task.task_id, task.pause)] += 1
                world.permanent_raised.setdefault((task.task_id, task.pause), world.loop.time())
                raise Permanent("no use trying again")
            if spec.get("slow"):
                await asyncio.sleep(spec["slow"])
            total = int(task.state.get("total", 0))
            failed = int(task.state.get("failed", 0))
            for result in task.results:
                if result.ok and isinstance(result.value, dict):
                    # a peer's answer, or a signal's payload
                    total += int(result.value.get("answer", result.value.get("n", 0)))
                elif not result.ok:
                    failed += 1
            rounds = spec.get("rounds", [])
            bad = spec.get("bad")
            if task.pause < len(rounds):
                calls = [_wait(kind, x, spec["timeout"], bad) for kind, x in rounds[task.pause]]
                until = (spec.get("until") or [])[task.pause : task.pause + 1]
                update: dict[str, Any] = {"total": total, "failed": failed}
                if task.pause:
                    update["seen"] = fingerprint(seen)
                if bad == "nul":
                    update["note"] = "a\u0000b"
                return Pause(
                    calls, update=update, until=FirstK(until[0]) if until and until[0] else None
                )
            result: Any = {"total": total, "failed": failed}
            if task.pause:
                result["seen"] = fingerprint(seen)
            if bad == "nan":
                result["total"] = math.nan
            elif bad == "deep":
                for _ in range(300):
                    result = [result]
            elif bad == "object":
                result["when"] = object()
            if spec.get("big") and isinstance(result, dict):
                result["pad"] = "x" * spec["big"]
            return Complete(result)

        @app.agent("researcher")
        async def researcher(task: TaskContext) -> Outcome:
            spec = task.input if isinstance(task.input, dict) else {}
            world.runs[(task.task_id, 0)] += 1
            if world.runs[(task.task_id, 0)] <= spec.get("fails", 0):
                world.failed_runs[(task.task_id, 0)] += 1
                raise RuntimeError("flaky researcher")
            if spec.get("slow"):
                await asyncio.sleep(spec["slow"])
            x = spec.get("x", 0)
            return Complete({"answer": x * x if isinstance(x, int) else 0})

        return app

    def logged_results(self, task: TaskContext) -> Logged:
        """The results of ``task``'s latest pause the log holds right now."""
        logged = []
        for event in self.store._streams.get(task.task_id, []):
            data = event.data
            if data.get("pause") != task.pause:
                continue
            if event.event_type == "ResultRecorded":
                value = canonical(data.get("value")).decode()
                logged.append((data["subtask_id"], data["outcome"], value))
            elif event.event_type == "TaskResumed":
                logged.extend(
                    (c["subtask_id"], "cancelled", "null") for c in data.get("abandoned", ())
                )
        return tuple(logged)

    def finished_in_log(self, task_id: str) -> bool:
        """Whether the log holds a terminal event of ``task_id`` right now."""
        events = self.store._streams.get(task_id, [])
        return any(e.event_type in ("TaskCompleted", "TaskFailed", "TaskCancelled") for e in events)

    # ---- the world's own actors ------------------------------------------------------------

    def spawn(self, coroutine: Any) -> None:
        task = self.loop.create_task(coroutine)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def send(
        self, queue: str, body: Any, correlation_id: str, kind: str, message_id: str, **extra: Any
    ) -> None:
        message = OutboxMessage(
            message_id=message_id,
            routing_key=queue,
            body=dumps(body),
            properties={
                "type": kind,
                "correlation_id": correlation_id,
                "content_type": CONTENT_TYPE,
                **extra,
            },
        )
        for _ in range(100):  # the world's own connection may be reconnecting: retry
            try:
                await self.own.publish(message)
                return
            except Exception as error:
                if type(error).__name__ == "Unroutable":
                    return
                await asyncio.sleep(0.5)

    async def _collect(self, delivery: Delivery) -> None:
        await self.own.ack(delivery)
        task_id = delivery.correlation_id or ""
        if delivery.queue == RESULTS or delivery.queue.startswith(FULL):
            self.results[task_id].append(delivery.body)
        elif delivery.queue == SIGNALS:
            self.signal_answers[task_id].append(loads(delivery.body))
        else:
            self.cancel_answers[task_id.removeprefix("cancel:")].append(loads(delivery.body))

    def answered(self, spec: TaskSpec) -> bool:
        """Whether ``spec``'s publisher got its answer, or can no longer get one: it left, or its
        full queue refused the answer until it was dead-lettered (``refused``)."""
        if spec.gone or spec.task_id in self.results:
            return True
        return spec.task_id in self.full_queues and any(
            letter.properties.get("correlation_id") == spec.task_id
            and letter.headers.get("x-waystation-reason") == "refused"
            for letter in self.broker.messages(self.names.dead_letter_queue)
        )

    async def _drain(self, spec: TaskSpec) -> None:
        """The publisher of a full reply queue comes back and drains it."""
        assert spec.full_until is not None
        await asyncio.sleep(spec.full_until)
        queue = self.full_queues[spec.task_id]
        self.trace("world", f"drain {queue}")
        for message in self.broker.queues[queue].ready:
            message.fate = "acked"  # (the blocker, taken by its publisher)
        self.broker.queues[queue].ready.clear()
        self.drained[spec.task_id] = self.loop.time() - self.start
        await self.own.consume(queue, self._collect, prefetch=100)

    async def _hostile(self, at: float, where: str, what: Hostile, tag: str) -> None:
        """A publisher sends metadata no client library should write."""
        await asyncio.sleep(at)
        queue = f"{PREFIX}{where}"
        body, properties = hostile_message(tag, what)
        self.trace("world", f"hostile {what} {tag} -> {queue}")
        self.hostile_sent[tag] = (what, queue)
        self.broker.enqueue_raw(queue, body, properties)

    async def _submit(self, spec: TaskSpec) -> None:
        await asyncio.sleep(spec.at)
        faults = self.scenario.faults
        if spec.agent == "researcher":
            body: Any = {"x": spec.x, "fails": spec.fails, "slow": spec.slow}
        else:
            body = {
                "rounds": [[list(call) for call in calls] for calls in spec.rounds],
                "timeout": spec.timeout,
                "fails": spec.fails if "handler" in faults else 0,
                "slow": spec.slow,
                "bad": spec.bad,
                "until": list(spec.until),
                "big": spec.big if "refuse" in faults else 0,
                "permanent": spec.permanent and "handler" in faults,
            }
        reply_to = GONE if spec.gone else self.full_queues.get(spec.task_id, RESULTS)
        self.trace("world", f"submit {spec.task_id}")
        if spec.odd_header and "hostile" in faults:
            # its publisher's library wrote a header no other can write back as it is
            properties = hostile_properties(
                message_id=spec.task_id.encode(),
                correlation_id=spec.task_id.encode(),
                reply_to=reply_to.encode(),
                message_type=TYPE_TASK.encode(),
                headers=odd_headers(),
            )
            self.broker.enqueue_raw(self.names.tasks(spec.agent), dumps(body), properties)
            return
        await self.send(
            self.names.tasks(spec.agent),
            body,
            spec.task_id,
            TYPE_TASK,
            spec.task_id,
            reply_to=reply_to,
        )

    async def _cancel(self, spec: TaskSpec) -> None:
        assert spec.cancel_at is not None
        await asyncio.sleep(max(0.0, spec.cancel_at))
        self.trace("world", f"cancel {spec.task_id}")
        await self.send(
            self.names.tasks(spec.agent),
            {"task_id": spec.task_id, "reason": "simulated"},
            f"cancel:{spec.task_id}",
            TYPE_CANCEL,
            f"cancel:{spec.task_id}",
            reply_to=GONE if spec.gone else CANCELS,
        )

    async def _signal(self, spec: TaskSpec, signal: SignalSpec) -> None:
        """Send ``signal`` to ``spec``'s task at the moment it draws, as often as it draws, as
        a sender that watches the task (``Client.signal``) would: the answer comes to
        ``SIGNALS``."""
        try:
            await asyncio.sleep(spec.at)
            at = await self._moment(spec, signal)
            await asyncio.sleep(max(0.0, at + signal.delay - self.loop.time()))
            for copy in range(signal.copies):
                if copy:
                    await asyncio.sleep(signal.spread)
                self.trace("world", f"signal {signal.name} {signal.signal_id} -> {spec.task_id}")
                self.signals_sent[signal.signal_id].append(self.loop.time())
                await self.send(
                    self.names.tasks(spec.agent),
                    {"task_id": spec.task_id, "name": signal.name, "payload": signal.payload},
                    signal.signal_id,
                    TYPE_SIGNAL,
                    signal.signal_id,
                    reply_to=SIGNALS,
                )
        finally:
            self.sending -= 1

    async def _moment(self, spec: TaskSpec, signal: SignalSpec) -> float:
        """The moment (loop time) ``signal.when`` counts from, as the log shows it; a task that
        finishes before it (or answers without a stream) gives the moment that is seen."""
        if signal.when == "no-stream":
            return self.loop.time()
        if signal.when == "racing-cancel" and spec.cancel_at is not None:
            if "cancel" in self.scenario.faults:
                return self.start + spec.cancel_at
        limit = self.loop.time() + WATCH_LIMIT
        while self.loop.time() < limit:
            events = self.store._streams.get(spec.task_id, [])
            if signal.when == "early":
                if signal.pause == 1 or _paused(events, signal.pause - 1) is not None:
                    return self.loop.time()
            elif signal.when in ("late", "racing-timeout", "on-time", "racing-cancel"):
                paused = _paused(events, signal.pause)
                if paused is not None:
                    if signal.when == "on-time" or signal.when == "racing-cancel":
                        return self.loop.time()
                    return _deadline(paused, signal.name) or self.loop.time()
            if self.finished_in_log(spec.task_id) or self.answered(spec):
                return self.loop.time()
            await asyncio.sleep(WATCH)
        return self.loop.time()

    async def _drop(self, at: float) -> None:
        await asyncio.sleep(at)
        alive = [p for p, _ in self.workers.values() if p.alive and p.connection]
        if alive:
            victim = self.rng.choice(alive)
            self.trace("world", f"drop the broker connection of {victim.name}")
            assert victim.connection is not None
            victim.connection.drop()

    async def _follow_projection(self) -> None:
        """A projection of paused tasks, built from the log in batches of random sizes."""
        from .invariants import apply_feed

        rng = random.Random(f"{self.scenario.seed}:projection")
        while True:
            await asyncio.sleep(rng.uniform(0.5, 5.0))
            batch = await self.store.read_all(self.cursor, limit=rng.randint(1, 50))
            if batch:
                apply_feed(self.projected, self.streams, batch)
                self.cursor = Position.of(batch[-1])

    # ---- worker processes --------------------------------------------------------------------

    async def start_worker(self, index: int) -> None:
        incarnation = self.incarnations[index]
        self.incarnations[index] += 1
        name = f"w{index}" + ("'" * incarnation)
        process = Process(name, self.plan, self.trace)
        skew = self.scenario.skews[index] if "skew" in self.scenario.faults else 0.0
        connection = self.broker.connection(name, reconnect_after=self.rng.uniform(0.2, 3.0))
        broker = FaultyBroker(connection, process, self.chronicle)
        store = FaultyStore(self.store, process, self.latency, self.reads, self.chronicle)
        settings = _base_settings().model_copy(
            update={
                "worker_id": name,
                "delivery_limit": self.scenario.delivery_limit,
                "resume_in_place": self.scenario.resume_in_place,
                "audit_all_tasks": self.scenario.audit_all_tasks,
            }
        )
        loop = self.loop
        worker = Worker(self.app, settings, store, broker=broker, clock=lambda: loop.time() + skew)
        process.on_crash = self._on_crash
        self.workers[index] = (process, worker)
        self.every_worker.append(worker)
        token = ACTOR.set(process)
        try:
            await worker.start()
        except asyncio.CancelledError:
            if process.alive:
                raise
        except BrokerUnavailable:
            # its connection dropped while it started: the process exits, and its supervisor
            # (compose, Kubernetes) starts it again
            self.trace(name, "start failed: the broker connection dropped")
            process.crash()
        finally:
            ACTOR.reset(token)

    def _on_crash(self, process: Process) -> None:
        if self.finishing:
            return
        index = next(i for i, (p, _) in self.workers.items() if p is process)
        delay = self.rng.uniform(0.5, 5.0)

        async def restart() -> None:
            await asyncio.sleep(delay)
            if not self.finishing:
                await self.start_worker(index)

        self.loop.call_soon(self.spawn, restart())

    # ---- the run -----------------------------------------------------------------------------

    def quiet(self) -> bool:
        """Every task answered, nothing queued, unsettled, unpublished or pending."""
        if not all(self.answered(spec) for spec in self.scenario.tasks):
            return False
        for name, queue in self.broker.queues.items():
            if name != self.names.dead_letter_queue and queue.ready:
                return False
        if self.broker.unsettled() or self.broker.waiting or self.sending:
            return False
        return self.store_quiet()

    def store_quiet(self) -> bool:
        inner = self.store
        return not inner._outbox and not inner._pending

    async def main(self) -> float | None:
        token = ACTOR.set(None)
        try:
            await self.own.connect()
            await self.own.declare(self.names, ["orchestrator", "researcher", "oracle"])
            for queue in (RESULTS, CANCELS, SIGNALS):
                self.broker.declare_queue(queue)
                await self.own.consume(queue, self._collect, prefetch=100)
            oracle = _Oracle(self, self.own)
            await self.own.consume(self.names.tasks("oracle"), oracle.handle, prefetch=100)
        finally:
            ACTOR.reset(token)
        for index in range(self.scenario.workers):
            await self.start_worker(index)
        for spec in self.scenario.tasks:
            if spec.full_until is not None and "refuse" in self.scenario.faults:
                queue = f"{FULL}{spec.task_id}"
                self.full_queues[spec.task_id] = queue
                self.broker.declare_queue(queue, max_length=1)
                self.broker.enqueue([queue], OutboxMessage("blocker", queue, b"{}"))
                self.spawn(self._drain(spec))
            self.spawn(self._submit(spec))
            if spec.cancel_at is not None and "cancel" in self.scenario.faults:
                self.spawn(self._cancel(spec))
            if "signals" in self.scenario.faults:
                for signal in spec.signals:
                    self.sending += 1
                    self.spawn(self._signal(spec, signal))
        if "hostile" in self.scenario.faults:
            for n, (at, where, what) in enumerate(self.scenario.hostile):
                self.spawn(self._hostile(at, where, what, f"h{self.scenario.seed}-{n}"))
        if "drop" in self.scenario.faults:
            for at in self.scenario.drops:
                self.spawn(self._drop(at))
        self.spawn(self._follow_projection())
        settled_at: float | None = None
        while self.loop.time() - self.start < HORIZON:
            await asyncio.sleep(QUIET_CHECK)
            if self.quiet():
                # let late replies, duplicates and republished rows arrive, then look again
                await asyncio.sleep(QUIET_GRACE)
                if self.quiet():
                    settled_at = self.loop.time() - self.start
                    break
        self.finishing = True
        await self.catch_up()
        return settled_at

    async def catch_up(self) -> None:
        """Let the projection read the rest of the log."""
        from .invariants import apply_feed

        while batch := await self.store.read_all(self.cursor, limit=100):
            apply_feed(self.projected, self.streams, batch)
            self.cursor = Position.of(batch[-1])


def run(scenario: Scenario, *, trace: bool = False) -> Observed:
    """Run ``scenario`` to its end on a fresh virtual loop and return what was observed."""
    loop = VirtualLoop(random.Random(f"{scenario.seed}:scheduler"))
    recorder = Trace(lambda: loop.time() - EPOCH, trace)
    world = _World(scenario, loop, recorder)

    def task_factory(
        loop: asyncio.AbstractEventLoop, coro: Any, *, context: Any = None
    ) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, context=context)
        actor = context.get(ACTOR) if context is not None else ACTOR.get()
        if actor is not None:
            actor.adopt(task)
        return task

    loop.set_task_factory(task_factory)  # type: ignore[arg-type]
    logging_level = logging.getLogger().level
    if not trace:
        logging.disable(logging.CRITICAL)
    stalled: str | None = None
    settled_at: float | None = None
    try:
        settled_at = loop.run_until_complete(world.main())
    except Stalled as error:
        stalled = str(error)
    finally:
        if not trace:
            logging.disable(logging.NOTSET)
        logging.getLogger().setLevel(logging_level)
        _shutdown(loop, world)
    return _observe(world, settled_at, stalled)


def _shutdown(loop: VirtualLoop, world: _World) -> None:
    """Cancel everything still running and close the loop (the run is over)."""
    world.finishing = True
    for process, _ in world.workers.values():
        process.alive = False
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        try:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        except Stalled:
            pass
    loop.close()


def _observe(world: _World, settled_at: float | None, stalled: str | None) -> Observed:
    store = world.store
    log = list(store._all)
    broker = world.broker
    leftovers = {
        name: len(queue.ready)
        for name, queue in broker.queues.items()
        if queue.ready and name != world.names.dead_letter_queue
    }
    unsettled = broker.unsettled()
    if unsettled:
        leftovers["(unsettled)"] = unsettled
    deadlines = [
        float(call["deadline_at"])
        for event in log
        if event.event_type == "TaskPaused"
        for call in event.data["calls"]
    ] + [float(e.data["deadline_at"]) for e in log if e.event_type == "DeadlineExtended"]
    return Observed(
        scenario=world.scenario,
        log=log,
        results=dict(world.results),
        cancel_answers=dict(world.cancel_answers),
        published=list(broker.ledger),
        dead_letters=broker.messages(world.names.dead_letter_queue),
        leftovers=leftovers,
        outbox_left=len(store._outbox),
        projected=dict(world.projected),
        settled_at=settled_at,
        last_deadline=max(deadlines, default=world.start) - world.start,
        stalled=stalled,
        reads=world.reads,
        trace=world.trace.lines,
        crashes=world.plan.crashes,
        drops=len(world.scenario.drops) if "drop" in world.scenario.faults else 0,
        duplicated=world.broker.duplicated,
        returned=world.broker.returned,
        late_runs=world.late_runs,
        failed_runs=dict(world.failed_runs),
        runs=dict(world.runs),
        storage_failures_injected=world.plan.storage_failure_rate > 0,
        counters=_counters(world),
        chronicle=world.chronicle,
        full_queues=dict(world.full_queues),
        drained=dict(world.drained),
        hostile_sent=dict(world.hostile_sent),
        permanent_raised=dict(world.permanent_raised),
        retryable_failed=dict(world.retryable_failed),
        signals_sent=dict(world.signals_sent),
        signal_answers=dict(world.signal_answers),
        seen=dict(world.seen),
        logged=dict(world.logged),
        pending={wait: entry[0] for wait, entry in store._pending.items()},
    )


def _counters(world: _World) -> dict[str, int]:
    total: dict[str, int] = defaultdict(int)
    for worker in world.every_worker:
        for name, value in worker.stats.counters.items():
            total[name] += value
    return dict(total)


def _wait(kind: str, x: int, timeout: float, bad: str | None) -> Wait:
    """The orchestrator's wait of a round's ``(kind, x)`` (``.scenario.TaskSpec.rounds``)."""
    if kind == "signal":
        return Signal(f"go{x}", timeout=timeout)
    if kind == "sleep":
        return Sleep(x)
    return Call(kind, {"x": math.inf if bad == "inf" else x}, timeout=timeout)


def fingerprint(seen: Seen) -> str:
    """A short digest of what a resumed run was given, which it records with its outcome (in
    its next pause's state, or its result), so that the run whose outcome the log holds can be
    told from runs in place whose append found the stream moved on."""
    return hashlib.sha256(canonical([list(result) for result in seen])).hexdigest()[:16]


def _seen(results: Sequence[CallResult]) -> Seen:
    return tuple(
        (r.subtask_id, r.outcome, canonical(r.value).decode(), r.kind, r.name) for r in results
    )


def _paused(events: Sequence[RecordedEvent], pause: int) -> RecordedEvent | None:
    """The ``TaskPaused`` of ``pause`` among ``events``, if it is there yet."""
    return next(
        (e for e in events if e.event_type == "TaskPaused" and e.data["pause"] == pause), None
    )


def _deadline(paused: RecordedEvent, name: str) -> float | None:
    """When the first wait of ``paused`` on the signal ``name`` times out (loop time); None
    when it has none (a signal nothing waits for)."""
    return next(
        (
            float(wait["deadline_at"])
            for wait in paused.data["calls"]
            if wait.get("kind") == "signal" and wait.get("name") == name
        ),
        None,
    )
