"""Seeded simulation of task streams: many tasks driven through random lifecycles by the task's
own decide functions and appended to a real :class:`~waystation.events.store.EventStore`, as workers
would.

Used by the projection tests (concurrent writers while a runner follows the log) and by the
rebuild benchmark (a log of realistic streams, fast, without brokers or handlers). Every step is
decided on the folded stream and appended at the version read, like the worker; a writer owns
its tasks, so there are no version conflicts between writers, only interleaving in the log.

A task's lifecycle: start and pause with 1 to 3 calls to peer agents; each call gets a reply
(ok or error, sometimes a duplicate that is ignored for audit), or times out, sometimes after a
deadline extension; once resumed it completes, fails, or pauses again; some are cancelled while
paused, some are left paused, a few complete without pausing (auditing of all tasks), and a few
are cancelled before they ever ran.

With ``waits=True`` a pause also waits for signals and timers, beside its calls or alone, it
records an agent version, and some resume on the first k of their waits (``FirstK``); a
signal waited for is sent (sometimes twice: the second is a duplicate) or times out, a timer
fires, and a task running again sometimes gets a signal before it waits for it, kept for the
next pause that does.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from .chain import recorded_events
from .model import DomainEvent, EventMetadata, NewEvent, RecordedEvent, TaskStarted
from .store import EventStore
from .task import (
    Call,
    Complete,
    FirstK,
    Pause,
    Signal,
    Sleep,
    TaskState,
    decide_cancel,
    decide_extension,
    decide_failure,
    decide_outcome,
    decide_reply,
    decide_signal,
    decide_timeout,
    event_id,
    fold,
)

__all__ = ["SimulatedTask", "simulate"]

AGENTS = ("planner", "writer", "reviewer")
PEERS = ("search", "summarise", "translate", "review")
SIGNALS = ("approval", "webhook")
NOW = 1_700_000_000.0


@dataclass(slots=True)
class SimulatedTask:
    task_id: str
    agent: str
    steps: int = 0
    recorded: list[RecordedEvent] = field(default_factory=list)
    state: TaskState | None = None
    """The task's state after its last append (None before the first)."""


class _Writer:
    def __init__(
        self,
        store: EventStore,
        rng: random.Random,
        prefix: str,
        deployment: str,
        waits: bool = False,
    ):
        self.store = store
        self.waits = waits
        self.agent_version = f"{deployment}-2" if waits else None
        self.rng = rng
        self.prefix = prefix
        self.metadata = EventMetadata(worker_id=prefix, deployment=deployment)

    async def _append(
        self, task: SimulatedTask, state: TaskState, events: Sequence[DomainEvent], key: str
    ) -> None:
        """Append at the version read and keep the stream as recorded (no re-read: the writer
        owns the task, and the links are the ones every backend computes)."""
        metadata = self.metadata.model_copy(
            update={"causation_id": key, "correlation_id": state.task_id}
        )
        new = [
            NewEvent.of(event_id(state.task_id, key, i), e, metadata) for i, e in enumerate(events)
        ]
        await self.store.append(state.task_id, state.version, new, prev_hash=state.last_hash)
        task.recorded += recorded_events(state.task_id, state.version, new, state.last_hash)

    async def step(self, task: SimulatedTask) -> bool:
        """Take one step of ``task``'s lifecycle; False once it is over."""
        rng = self.rng
        state = task.state or fold(task.task_id, ())  # a writer owns its tasks: no re-read
        key = f"{task.task_id}:{task.steps}"
        task.steps += 1
        events: list[DomainEvent]
        if state.status == "new":
            start = TaskStarted(agent=task.agent, input={"n": task.steps}, reply_to="sim.replies")
            roll = rng.random()
            if roll < 0.03:
                events = decide_cancel(state, "cancelled before it ran")
            elif roll < 0.08:
                events = decide_outcome(
                    state,
                    Complete("quick"),
                    now=NOW,
                    default_timeout=30,
                    start=start,
                    record_completion=True,
                )
            else:
                events = decide_outcome(
                    state,
                    self._pause(),
                    now=NOW,
                    default_timeout=30,
                    start=start,
                    agent_version=self.agent_version,
                )
        elif state.status == "paused":
            events = self._on_paused(state)
        elif state.status == "resumed":
            roll = rng.random()
            if self.waits and roll < 0.1:  # a signal before its wait: kept for the next one
                events = decide_signal(
                    state,
                    rng.choice(SIGNALS),
                    {"early": task.steps},
                    signal_id=f"early-{key}",
                    sender="sim",
                )
            elif roll < 0.6:
                events = decide_outcome(state, Complete({"ok": True}), now=NOW, default_timeout=30)
            elif roll < 0.7:
                events = decide_failure(state, {"type": "boom"})
            else:
                events = decide_outcome(
                    state,
                    self._pause(),
                    now=NOW,
                    default_timeout=30,
                    agent_version=self.agent_version,
                )
        else:
            return False
        if events:
            await self._append(task, state, events, key)
        task.state = fold(task.task_id, task.recorded)
        return not task.state.finished

    def _pause(self) -> Pause:
        rng = self.rng
        waits = [self._wait() for _ in range(rng.randint(1, 3))]
        until = None
        if self.waits and len(waits) > 1 and rng.random() < 0.3:
            until = FirstK(rng.randint(1, len(waits) - 1))
        return Pause(waits, update={"step": rng.randrange(100)}, until=until)

    def _wait(self) -> Call | Signal | Sleep:
        rng = self.rng
        roll = rng.random() if self.waits else 0.0
        if roll > 0.8:
            return Sleep(rng.choice((1, 3600)))
        if roll > 0.6:
            return Signal(rng.choice(SIGNALS), timeout=rng.choice((None, 60)))
        peer = rng.choice(PEERS)
        return Call(peer, {"q": rng.randrange(1000)}, timeout=rng.choice((None, 5, 60)))

    def _on_paused(self, state: TaskState) -> list[DomainEvent]:
        rng = self.rng
        outstanding = state.outstanding
        roll = rng.random()
        if roll < 0.04:
            return decide_cancel(state, "operator cancel")
        call = rng.choice(outstanding)
        if call.kind == "timer":
            return decide_timeout(state, call.subtask_id, now=math.inf)
        if call.kind == "signal" and roll >= 0.18:
            signal_id = f"signal-{call.subtask_id}"
            if roll < 0.22 and state.signals:  # one sent again: a duplicate, which changes nothing
                signal_id = rng.choice(sorted(state.signals))
            return decide_signal(
                state, call.name or "", {"ok": roll}, signal_id=signal_id, sender="sim"
            )
        if roll < 0.10:
            return decide_extension(
                state, call.subtask_id, extend_by=120, now=NOW + 1, max_duration=3600
            )
        if roll < 0.18:
            return decide_timeout(state, call.subtask_id, now=math.inf)
        if roll < 0.22 and state.claims:  # a duplicate of a reply already applied: audit only
            claimed = rng.choice(sorted(state.claims))
            return decide_reply(state, claimed, outcome="ok", value=1, message_id="dup")
        failed = rng.random() < 0.1
        return decide_reply(
            state,
            call.subtask_id,
            outcome="error" if failed else "ok",
            value=rng.randrange(100),
            error={"type": "peer"} if failed else None,
            message_id=f"m-{call.subtask_id}",
        )


async def simulate(
    store: EventStore,
    *,
    tasks: int,
    writers: int = 8,
    seed: int = 0,
    prefix: str = "sim",
    leave_paused: float = 0.1,
    in_flight: int = 20,
    waits: bool = False,
) -> list[SimulatedTask]:
    """Drive ``tasks`` tasks through their lifecycles with ``writers`` concurrent writers, each
    stepping up to ``in_flight`` of its tasks in random turns (so streams interleave in the log).
    A share ``leave_paused`` of the tasks stops at its first pause; ``waits``: pauses wait for
    signals and timers too, some on the first k of their waits (the module docstring says how).
    Returns every task with its final state."""
    everything: list[SimulatedTask] = []

    async def writer(index: int) -> None:
        rng = random.Random(f"{seed}:{index}")
        mine = [
            SimulatedTask(f"{prefix}-{seed}-{index}-{n}", rng.choice(AGENTS))
            for n in range(index, tasks, writers)
        ]
        everything.extend(mine)
        write = _Writer(store, rng, f"{prefix}-writer-{index}", prefix, waits)
        waiting = list(reversed(mine))
        running: list[SimulatedTask] = []
        stop_at_pause = {t.task_id for t in mine if rng.random() < leave_paused}
        while waiting or running:
            while waiting and len(running) < in_flight:
                running.append(waiting.pop())
            task = rng.choice(running)
            going = await write.step(task)
            parked = (
                task.task_id in stop_at_pause
                and task.state is not None
                and (task.state.status == "paused")
            )
            if not going or parked:
                running.remove(task)

    await asyncio.gather(*(writer(i) for i in range(writers)))
    return everything
