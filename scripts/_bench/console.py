"""The console's log: a database filled with many paused tasks and one long task, for the
console's pages to be timed on (``scripts/bench --only console``, issue 32) and tested with.

:func:`fill_console_log` writes real streams through the event store's ``append``, each decided
by the task's own decide functions (``waystation.events.task``) on the state folded so far, as a
worker decides, so that every stream has a valid hash chain and satisfies the invariants
``waystation verify`` checks. Then the projections are brought up to date by their real
``catch_up``, and ``paused_tasks`` is analysed so that the planner knows its new rows at once
instead of after autovacuum's next pass.

What the tasks look like, so that the console's filters select what they would in a busy pool:

* agents with skewed shares (:data:`AGENTS`, from 30% down to 3%), peers called among them;
* each task's pause waits for 1 to 4 peer calls (most), a signal alone (an approval, a review, a
  payment or a webhook: :data:`SIGNALS`), a timer alone, or calls with a signal or a timer
  beside them; some resume on the first k (``FirstK``);
* some have part of their results already (a reply, a signal taken, a timer fired), some a
  call's deadline extended; a fifth resumed once and paused again, and a few resumed and are
  running (the projection's ``resumed`` rows);
* deadlines from a minute to a month ahead, measured from the moment of the fill.

A task's whole history is decided first and appended in one statement (one round trip per task,
``writers`` of them at once): the same events a worker would append over several statements.
``paused_since`` is the commit time of each task's last pause, so the ages span the fill's few
tens of seconds: the log has no way to backdate an event, and the console's queries cost what
their selectivity makes them cost, whatever the ages are.

The long task (``big_task_id``) is appended decision by decision, as workers would: pauses of
three waits, each result appended on its own, the last with the resume, then the next pause,
until its stream holds at least ``big_events`` events; it is left paused.

:func:`console_database` makes a fresh database for it (``waystation_bench_console_<random>``,
migrated, dropped afterwards); :func:`fill_console_log` refuses a log that already holds events.

Over 400 lines on purpose: the lifecycles the fill decides and the fill that appends them are one
job, read together.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from scripts.lab.harness.database import with_database
from waystation import migrations
from waystation.events.chain import recorded_events
from waystation.events.model import DomainEvent, EventMetadata, NewEvent, TaskStarted
from waystation.events.postgres import PostgresEventStore
from waystation.events.task import (
    Call,
    FirstK,
    Pause,
    Signal,
    Sleep,
    Wait,
    decide_extension,
    decide_outcome,
    decide_reply,
    decide_signal,
    decide_timeout,
    event_id,
    fold,
)
from waystation.projections.postgres import PROJECTIONS, catch_up, create_engine

__all__ = [
    "AGENTS",
    "SIGNALS",
    "ConsoleLog",
    "console_database",
    "fill_console_log",
    "write_tasks",
]

AGENTS = (
    ("orchestrator", 30),
    ("researcher", 22),
    ("writer", 14),
    ("reviewer", 10),
    ("planner", 8),
    ("translator", 7),
    ("approver", 6),
    ("billing", 3),
)
"""The agents of the tasks and of the peers they call, with their shares in percent."""
SIGNALS = (("approval", 50), ("review", 25), ("payment", 15), ("webhook", 10))
"""The signals a task waits for, with their shares in percent."""

CALL_TIMEOUTS = (60, 300, 900, 3600, 4 * 3600)
SIGNAL_TIMEOUTS = (3600, 86_400, 3 * 86_400, 14 * 86_400)
SLEEPS = (60, 600, 3600, 86_400, 7 * 86_400, 30 * 86_400)
DEPLOYMENT = "console."


@dataclass(frozen=True, slots=True)
class ConsoleLog:
    """What :func:`fill_console_log` wrote."""

    task_ids: tuple[str, ...]
    """A sample of the tasks (random, in no order), for pages that show one task."""
    big_task_id: str
    """The long task: paused, with at least ``big_events`` events."""
    tasks: int
    """Tasks written, the long one included."""
    events: int
    """Events in the log."""
    write_seconds: float
    """Appending every stream."""
    projection_seconds: float
    """Bringing the projections up to date, and analysing ``paused_tasks``."""


@contextlib.asynccontextmanager
async def console_database(admin_url: str) -> AsyncIterator[str]:
    """A migrated database of its own on the server of ``admin_url``, dropped afterwards."""
    url = with_database(admin_url, f"waystation_bench_console_{uuid.uuid4().hex[:8]}")
    await migrations.upgrade(url)
    try:
        yield url
    finally:
        await migrations.drop_database(url)


async def fill_console_log(
    url: str,
    tasks: int = 100_000,
    *,
    writers: int = 8,
    seed: int = 0,
    sample: int = 100,
    big_events: int = 1000,
) -> ConsoleLog:
    """Fill the empty log of the database at ``url`` (migrated here if it is not yet) with
    ``tasks`` tasks, one of them the long task, and bring the projections up to date."""
    await migrations.upgrade(url)
    # the fill's commits need not wait for the disk (the log is a bench's, thrown away after):
    # appends cost what they cost a worker, but for the flush
    store = PostgresEventStore(
        create_async_engine(
            url,
            isolation_level="AUTOCOMMIT",
            pool_size=1,
            max_overflow=0,
            pool_reset_on_return=None,
            connect_args={"server_settings": {"synchronous_commit": "off"}},
        ),
        owns_engine=True,
        hot_pool_size=writers + 1,  # a connection for each writer, and the long task's
    )
    engine = create_engine(url, pool_size=len(PROJECTIONS))
    try:
        async with engine.connect() as connection:
            if await connection.scalar(text("SELECT EXISTS (SELECT 1 FROM events)")):
                raise ValueError(
                    "fill_console_log fills an empty log: this database's already holds events"
                )
        rng = random.Random(seed)
        now = time.time()
        big_task_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        started = time.perf_counter()
        shares = [len(range(w, tasks - 1, writers)) for w in range(writers)]
        await asyncio.gather(
            *(
                write_tasks(store, random.Random(f"{seed}:{w}"), share, now, w)
                for w, share in enumerate(shares)
            ),
            _write_big(store, big_task_id, random.Random(f"{seed}:big"), now, big_events),
        )
        write_seconds = time.perf_counter() - started
        started = time.perf_counter()
        await asyncio.gather(*(_catch_up(engine, name) for name in PROJECTIONS))
        async with engine.connect() as connection:
            await connection.execute(text("ANALYZE paused_tasks"))
            await connection.commit()
            events = int(await connection.scalar(text("SELECT count(*) FROM events")) or 0)
            picked = await connection.execute(
                text("SELECT task_id FROM paused_tasks ORDER BY md5(task_id) LIMIT :n"),
                {"n": sample},
            )
            task_ids = tuple(row[0] for row in picked)
        return ConsoleLog(
            task_ids=task_ids,
            big_task_id=big_task_id,
            tasks=tasks,
            events=events,
            write_seconds=write_seconds,
            projection_seconds=time.perf_counter() - started,
        )
    finally:
        await engine.dispose()
        await store.close()


async def _catch_up(engine: AsyncEngine, name: str) -> None:
    async with engine.connect() as connection:
        await catch_up(connection, PROJECTIONS[name], batch_size=10_000)


class _Stream:
    """One task's stream as it is decided: its state, and the events not appended yet."""

    def __init__(self, task_id: str, worker: str, now: float) -> None:
        self.task_id = task_id
        self.worker = worker
        self.now = now
        self.state = fold(task_id, ())
        self.head = self.state
        """The state the log holds (what the next append goes after)."""
        self.unappended: list[NewEvent] = []
        self.steps = 0

    def decide(self, events: Sequence[DomainEvent]) -> None:
        """Take a decision's events: chained after the ones before, folded into the state."""
        if not events:
            raise AssertionError(f"{self.task_id}: a step of the fill decided nothing")
        key = f"fill:{self.steps}"
        self.steps += 1
        metadata = EventMetadata(
            worker_id=self.worker,
            amqp_user="guest",
            causation_id=key,
            correlation_id=self.task_id,
            trace_id=uuid.uuid5(uuid.NAMESPACE_URL, self.task_id).hex,
            occurred_at=self.now,
            deployment=DEPLOYMENT,
        )
        new = [
            NewEvent.of(event_id(self.task_id, key, i), e, metadata) for i, e in enumerate(events)
        ]
        recorded = recorded_events(self.task_id, self.state.version, new, self.state.last_hash)
        self.state = fold(self.task_id, recorded, start=self.state)
        self.unappended += new

    async def append(self, store: PostgresEventStore) -> None:
        if not self.unappended:
            return
        await store.append(
            self.task_id, self.head.version, self.unappended, prev_hash=self.head.last_hash
        )
        self.head, self.unappended = self.state, []


def _weighted(rng: random.Random, choices: Sequence[tuple[str, int]]) -> str:
    return rng.choices([c for c, _ in choices], weights=[w for _, w in choices])[0]


def _pause(rng: random.Random, step: int) -> Pause:
    """A pause as the module docstring mixes them."""

    def call() -> Call:
        peer = _weighted(rng, AGENTS)
        return Call(peer, {"q": rng.randrange(10_000)}, timeout=rng.choice(CALL_TIMEOUTS))

    def signal() -> Signal:
        return Signal(_weighted(rng, SIGNALS), timeout=rng.choice(SIGNAL_TIMEOUTS))

    roll = rng.random()
    waits: list[Wait]
    if roll < 0.55:
        waits = [call() for _ in range(rng.randint(1, 4))]
    elif roll < 0.70:
        waits = [signal()]
    elif roll < 0.82:
        waits = [Sleep(rng.choice(SLEEPS))]
    else:
        waits = [call() for _ in range(rng.randint(1, 3))]
        waits.append(signal() if rng.random() < 0.6 else Sleep(rng.choice(SLEEPS)))
        rng.shuffle(waits)
    until = (
        FirstK(rng.randint(1, len(waits) - 1)) if len(waits) > 2 and rng.random() < 0.2 else None
    )
    return Pause(waits, update={"step": step, "topic": f"t{rng.randrange(500)}"}, until=until)


def _result(stream: _Stream, rng: random.Random, subtask: str) -> None:
    """The result of one open wait: a reply, the signal it waits for, the timer firing."""
    state = stream.state
    wait = next(c for c in state.calls if c.subtask_id == subtask)
    if wait.kind == "timer":
        stream.decide(decide_timeout(state, subtask, now=math.inf))
    elif wait.kind == "signal":
        stream.decide(
            decide_signal(
                state,
                wait.name or "",
                {"approved": rng.random() < 0.8},
                signal_id=f"signal:{uuid.UUID(int=rng.getrandbits(128), version=4)}",
                sender="operator",
            )
        )
    else:
        failed = rng.random() < 0.1
        stream.decide(
            decide_reply(
                state,
                subtask,
                outcome="error" if failed else "ok",
                value=None if failed else {"answer": rng.randrange(1000)},
                error={"type": "peer", "message": "no answer"} if failed else None,
                message_id=f"reply:{subtask}",
            )
        )


def _paused(stream: _Stream, rng: random.Random) -> None:
    """Pause the task (its first run, or a resumed one)."""
    state = stream.state
    start = None
    if state.status == "new":
        agent = _weighted(rng, AGENTS)
        start = TaskStarted(
            agent=agent, input={"request": f"r{rng.randrange(100_000)}"}, reply_to="console.replies"
        )
    stream.decide(
        decide_outcome(
            state,
            _pause(rng, state.pause + 1),
            now=stream.now,
            default_timeout=300,
            start=start,
            agent_version="console-1",
        )
    )


def _task(task_id: str, rng: random.Random, worker: str, now: float) -> _Stream:
    """One task's whole history (the module docstring says which)."""
    stream = _Stream(task_id, worker, now)
    _paused(stream, rng)
    if rng.random() < 0.2:  # every wait of its first pause ended: it resumed
        while stream.state.status == "paused":
            _result(stream, rng, stream.state.outstanding[0].subtask_id)
        if rng.random() < 0.1:
            return stream  # running again, not yet paused
        _paused(stream, rng)
    roll = rng.random()
    if roll < 0.3:  # part of its results are in
        for wait in stream.state.outstanding[:-1]:
            if rng.random() < 0.5 and stream.state.status == "paused":
                _result(stream, rng, wait.subtask_id)
        if stream.state.status == "resumed":  # a FirstK pause that has its k: it paused again
            _paused(stream, rng)
    elif roll < 0.35:
        calls = [c for c in stream.state.outstanding if c.kind == "call"]
        if calls:
            ahead = calls[0].deadline_at - now + 3600  # an hour more than it had
            stream.decide(
                decide_extension(
                    stream.state, calls[0].subtask_id, extend_by=ahead, now=now, max_duration=86_400
                )
            )
    return stream


async def write_tasks(
    store: PostgresEventStore, rng: random.Random, tasks: int, now: float, writer: int = 0
) -> list[str]:
    """Write ``tasks`` tasks as the fill does, each in one append (one writer's share); their
    ids. Tests use it to add tasks to a filled log."""
    worker = f"console-fill-{writer}"
    written = []
    for _ in range(tasks):
        task_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        await _task(task_id, rng, worker, now).append(store)
        written.append(task_id)
    return written


async def _write_big(
    store: PostgresEventStore, task_id: str, rng: random.Random, now: float, events: int
) -> None:
    """The long task: a decision per append, until its stream has ``events`` events."""
    stream = _Stream(task_id, "console-fill-big", now)

    def pause() -> None:
        state = stream.state
        start = None
        if state.status == "new":
            start = TaskStarted(agent="orchestrator", input={"request": "long"}, reply_to=None)
        waits: list[Wait] = [Call("researcher", {"q": state.pause}, timeout=3600) for _ in range(2)]
        waits.append(Signal("review", timeout=86_400) if state.pause % 5 == 4 else Call("writer"))
        stream.decide(
            decide_outcome(
                state,
                Pause(waits, update={"round": state.pause + 1}),
                now=now,
                default_timeout=300,
                start=start,
                agent_version="console-1",
            )
        )

    pause()
    await stream.append(store)
    while stream.state.version < events:
        while stream.state.status == "paused":
            _result(stream, rng, stream.state.outstanding[0].subtask_id)
            await stream.append(store)
        pause()
        await stream.append(store)
