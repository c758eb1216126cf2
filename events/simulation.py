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

With ``waits=True`` (issue 31) the lifecycles use every kind of wait, so that the projections,
and rebuilds of them, see every event: a pause records an agent version and sometimes waits for
a signal or a timer beside its calls (now and then for a signal alone), and sometimes resumes on
the first k (``FirstK``). A signal's wait takes a signal (some sent again with the same id,
which changes nothing; some refused as invalid first) or times out; a timer fires. A first-k
pause resumes with its open waits abandoned, and some of their late replies come after. While a
task runs, a signal may come before the wait that takes it: it is kept, and the next pause
mostly waits on its name and takes it at once. Without it, the log is what it was before waits
had kinds (what the rebuild benchmark compares across versions).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from .chain import recorded_events
from .model import (
    DomainEvent,
    EventMetadata,
    NewEvent,
    PendingCall,
    RecordedEvent,
    TaskStarted,
)
from .store import EventStore
from .task import (
    Call,
    Complete,
    FirstK,
    Pause,
    Signal,
    Sleep,
    TaskState,
    Wait,
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
        self.rng = rng
        self.prefix = prefix
        self.metadata = EventMetadata(worker_id=prefix, deployment=deployment)
        self.waits = waits
        self.agent_version = f"{deployment}-2" if waits else None

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
                events = self._paused(state, start)
        elif state.status == "paused":
            events = self._on_paused(state, key)
        elif state.status == "resumed":
            roll = rng.random()
            if self.waits and roll < 0.08:  # a signal before the wait that takes it: kept
                events = self._signal(state, rng.choice(SIGNALS), key)
            elif self.waits and roll < 0.13 and state.abandoned:  # late, to a wait given up
                late = rng.choice(sorted(state.abandoned))
                events = decide_reply(state, late, outcome="ok", value=1, message_id=f"late-{key}")
            elif roll < 0.6:
                events = decide_outcome(state, Complete({"ok": True}), now=NOW, default_timeout=30)
            elif roll < 0.7:
                events = decide_failure(state, {"type": "boom"})
            else:
                events = self._paused(state)
        else:
            return False
        if events:
            await self._append(task, state, events, key)
        task.state = fold(task.task_id, task.recorded)
        return not task.state.finished

    def _paused(self, state: TaskState, start: TaskStarted | None = None) -> list[DomainEvent]:
        pause = self._pause(state)
        return decide_outcome(
            state, pause, now=NOW, default_timeout=30, start=start, agent_version=self.agent_version
        )

    def _pause(self, state: TaskState) -> Pause:
        """1 to 3 calls; with ``waits``, sometimes with a signal (on the name of one the task
        keeps, mostly, when it keeps any) or a timer, in any order; sometimes a signal alone;
        sometimes resumed on the first k."""
        rng = self.rng
        waits: list[Wait] = [
            Call(rng.choice(PEERS), {"q": rng.randrange(1000)}, timeout=rng.choice((None, 5, 60)))
            for _ in range(rng.randint(1, 3))
        ]
        if not self.waits:
            return Pause(waits, update={"step": rng.randrange(100)})
        roll = rng.random()
        if state.kept and roll < 0.7:
            waits.append(Signal(state.signals[rng.choice(state.kept)].name))
        elif roll < 0.05:
            waits = [Signal(rng.choice(SIGNALS), timeout=rng.choice((None, 600)))]
        elif roll < 0.25:
            waits.append(Signal(rng.choice(SIGNALS), timeout=rng.choice((None, 600))))
        elif roll < 0.40:
            waits.append(Sleep(rng.choice((0, 30, 3600))))
        rng.shuffle(waits)
        until = None
        if len(waits) > 1 and rng.random() < 0.25:
            until = FirstK(rng.randint(1, len(waits)))
        return Pause(waits, update={"step": rng.randrange(100)}, until=until)

    def _on_paused(self, state: TaskState, key: str) -> list[DomainEvent]:
        rng = self.rng
        outstanding = state.outstanding
        roll = rng.random()
        if roll < 0.04:
            return decide_cancel(state, "operator cancel")
        wait = rng.choice(outstanding)
        if wait.kind == "timer":  # the sweeper finds it due: it fires
            return decide_timeout(state, wait.subtask_id, now=math.inf)
        if wait.kind == "signal":
            return self._on_signal_wait(state, wait, key)
        if roll < 0.10:
            return decide_extension(
                state, wait.subtask_id, extend_by=120, now=NOW + 1, max_duration=3600
            )
        if roll < 0.18:
            return decide_timeout(state, wait.subtask_id, now=math.inf)
        if roll < 0.22 and state.claims:  # a duplicate of a reply already applied: audit only
            claimed = rng.choice(sorted(state.claims))
            return decide_reply(state, claimed, outcome="ok", value=1, message_id="dup")
        if self.waits and roll < 0.26:  # a signal: taken by a wait open on its name, else kept
            return self._signal(state, rng.choice(SIGNALS), key)
        failed = rng.random() < 0.1
        return decide_reply(
            state,
            wait.subtask_id,
            outcome="error" if failed else "ok",
            value=rng.randrange(100),
            error={"type": "peer"} if failed else None,
            message_id=f"m-{wait.subtask_id}",
        )

    def _on_signal_wait(self, state: TaskState, wait: PendingCall, key: str) -> list[DomainEvent]:
        rng = self.rng
        roll = rng.random()
        if roll < 0.1:
            return self._signal(state, wait.name or "", key, invalid="approved: field required")
        if roll < 0.2 and state.signals:  # one sent again with its id: [], applied once
            again = state.signals[rng.choice(sorted(state.signals))]
            return decide_signal(state, again.name, again.payload, signal_id=again.signal_id)
        if roll < 0.3:
            return decide_timeout(state, wait.subtask_id, now=math.inf)
        return self._signal(state, wait.name or "", key)

    def _signal(
        self, state: TaskState, name: str, key: str, invalid: str | None = None
    ) -> list[DomainEvent]:
        """A signal ``name`` with an id of its own (the step's key), sent by an operator."""
        payload = None if invalid else {"approved": self.rng.random() < 0.8}
        return decide_signal(
            state, name, payload, signal_id=f"sig-{key}", sender="operator", invalid=invalid
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
    A share ``leave_paused`` of the tasks stops at its first pause; ``waits``: the lifecycles use
    signals, timers and first-k pauses too (the module docstring says how). Returns every task
    with its final state."""
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
