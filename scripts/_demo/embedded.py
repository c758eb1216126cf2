"""The demo without services: the same story in one process, on the public test kit
(``waystation.testing.InMemoryPool``): 3 workers of the example app on the in-memory broker and
log, 500 fan-out tasks submitted at a pace with the progress shown, one worker killed in the
middle of a burst and replaced, then the checks: every result, the log (the same stream checks as
the real demo's, and every stream through ``verify_stream``, what ``waystation verify`` runs),
nothing left in the queues or the outbox, the survivors stopped.

What it does not show, and says so: RabbitMQ and PostgreSQL (the in-memory backends pass the same
contract suites, but they are not the servers), separate processes (the kill drops the worker's
connection and cancels its tasks, as a SIGKILL would, in the same process), the projection
runner and the metrics endpoints.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from waystation.client import TaskResult
from waystation.example import app as example_app
from waystation.example import expected_total
from waystation.projections.audit import verify_stream
from waystation.runtime.worker import Worker
from waystation.testing import InMemoryPool

from . import PREFIX, TASKS, WORK_MS, WORKERS, K
from .check import check_streams
from .drive import BURST, KILL_AFTER, RESULT_TIMEOUT, SUBMIT_PER_S
from .output import Line, Output

_TERMINAL = frozenset({"TaskCompleted", "TaskFailed", "TaskCancelled"})
HOLDING = 5
"""Paused tasks the victim holds when it is killed (unless the burst ends first)."""

SIMULATED = (
    "embedded: one process, the in-memory broker and log standing in for RabbitMQ and "
    "PostgreSQL; the kill drops a worker's connection and stops its tasks as SIGKILL would, "
    "but no process dies; no projection runner, no metrics endpoints"
)


@dataclass
class Embedded:
    """What an embedded run holds."""

    out: Output
    pool: InMemoryPool
    task_ids: dict[str, int] = field(default_factory=dict)
    """Each submitted task's ``n``, by task id."""
    results: dict[str, TaskResult] = field(default_factory=dict)
    killed: Worker | None = None
    replacement: Worker | None = None
    log_lines: list[str] = field(default_factory=list)
    """Warnings and errors the workers logged."""
    summary: list[Line] = field(default_factory=list)
    waiting: list[asyncio.Task[TaskResult]] = field(default_factory=list)
    """A wait for each task's result."""

    async def cleanup(self) -> None:
        for waiting in self.waiting:
            waiting.cancel()
        await self.pool.close()


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(f"{record.name} {record.levelname} {record.getMessage()}")


def embedded(out: Output) -> Embedded:
    return Embedded(out, InMemoryPool(example_app, workers=0, queue_prefix=PREFIX))


async def run(demo: Embedded) -> list[str]:
    """Everything; the list of failed checks (empty when all held)."""
    out, pool = demo.out, demo.pool
    out.print(
        f"Waystation demo, embedded: {WORKERS} workers, {TASKS} orchestrator tasks fanning out "
        f"to {K} researchers ({WORK_MS} ms of work each), one worker killed mid-run."
    )
    out.say(SIMULATED)
    logging.getLogger().addHandler(_Collect(demo.log_lines))
    await pool.start()
    for _ in range(WORKERS):
        await pool.add_worker()
    out.say(
        f"{WORKERS} workers consuming ({', '.join(w.settings.worker_id for w in pool.workers)})"
    )
    failures: list[str] = []
    submitter = asyncio.create_task(_submit_all(demo))
    try:
        await _follow(demo, submitter, failures)
    finally:
        if not submitter.done():
            submitter.cancel()
    await _check(demo, failures)
    return failures


async def _submit_all(run: Embedded) -> None:
    """Submit at a pace, but a burst of ``BURST`` at once; in the burst, kill a worker once it
    holds ``HOLDING`` paused tasks (or at its end), and start a replacement. One process runs
    it all: the tasks of the burst are worked on as they are submitted, and a kill at a fixed
    moment after it could find the victim idle."""
    pool = run.pool
    victim = pool.workers[1]
    for n in range(TASKS):
        task_id = await pool.submit("orchestrator", {"n": n, "k": K, "work_ms": WORK_MS})
        run.task_ids[task_id] = n
        waiting = asyncio.create_task(pool.result(task_id, TASKS / SUBMIT_PER_S + RESULT_TIMEOUT))
        waiting.add_done_callback(lambda done, task_id=task_id: _keep(run, task_id, done))
        run.waiting.append(waiting)
        in_burst = KILL_AFTER - BURST < n + 1 <= KILL_AFTER
        if (
            in_burst
            and run.killed is None
            and (n + 1 == KILL_AFTER or len(await _paused_by(run, victim)) >= HOLDING)
        ):
            holding = await _paused_by(run, victim)
            pool.kill(victim)
            run.killed = victim
            run.out.say(
                f"submitted {n + 1}/{TASKS} (in a burst of {BURST} at once): killed "
                f"{victim.settings.worker_id} mid-run, holding {len(holding)} paused tasks"
            )
            run.replacement = await pool.add_worker()
            run.out.say(f"started {run.replacement.settings.worker_id} in its place")
        if not in_burst:
            await asyncio.sleep(1 / SUBMIT_PER_S)


async def _paused_by(run: Embedded, worker: Worker) -> list[str]:
    """The tasks not yet answered whose last pause ``worker`` recorded."""
    paused = []
    for task_id in [t for t in run.task_ids if t not in run.results]:
        events = await run.pool.store.read_stream(task_id)
        pauses = [e for e in events if e.event_type == "TaskPaused"]
        if events and events[-1].event_type not in _TERMINAL and pauses:
            paused += (
                [task_id]
                if pauses[-1].metadata.get("worker_id") == worker.settings.worker_id
                else []
            )
    return paused


def _keep(run: Embedded, task_id: str, done: asyncio.Task[TaskResult]) -> None:
    if not done.cancelled() and done.exception() is None:
        run.results[task_id] = done.result()


async def _follow(run: Embedded, submitter: asyncio.Task[None], failures: list[str]) -> None:
    deadline = time.monotonic() + TASKS / SUBMIT_PER_S + RESULT_TIMEOUT
    with run.out.progress(TASKS) as show:
        while True:
            await asyncio.sleep(0.2)
            done = len(run.results)
            show(done, len(run.task_ids), await _paused(run), len(run.pool.workers))
            if submitter.done():
                submitter.result()  # raise its error, if any
                if done == TASKS:
                    return
            if time.monotonic() > deadline:
                failures.append(f"only {done} of {TASKS} results in time")
                return


async def _paused(run: Embedded) -> int:
    """Tasks paused on their peers, from the log: a stream that has not finished."""
    paused = 0
    for task_id in list(run.task_ids):
        last = await run.pool.store.last_event(task_id)
        paused += last is not None and last.event_type not in _TERMINAL
    return paused


async def _check(run: Embedded, failures: list[str]) -> None:
    out, pool, task_ids, results = run.out, run.pool, run.task_ids, run.results
    out.say(f"{len(results)} results in; checking them and the log")
    wrong = [
        (n, r.result)
        for t, n in task_ids.items()
        if (r := results.get(t)) is not None
        and (not r.ok or r.result != {"n": n, "total": expected_total(n, K)})
    ]
    out.check(
        failures,
        not wrong,
        f"all {len(results)} results correct (total = expected_total(n, {K}))",
        f"{len(wrong)} wrong results, e.g. {wrong[:3]}",
    )
    lost = len(task_ids) - len(results)
    out.check(
        failures,
        lost == 0 and len(task_ids) == TASKS,
        f"{len(results)} results for {len(task_ids)} submitted tasks",
        f"{lost} of {len(task_ids)} submitted tasks without a result",
    )
    streams = await _streams(pool)
    ids = list(task_ids)
    others = {
        s: [e.event_type for e in events] for s, events in streams.items() if s not in task_ids
    }
    killed_id = run.killed.settings.worker_id if run.killed else None
    duplicated, taken_over = await check_streams(out, pool.store, ids, others, killed_id, failures)
    problems = [p for events in streams.values() for p in verify_stream(events)]
    events = sum(len(e) for e in streams.values())
    verified = f"{len(streams)} streams, {events} events verified, {len(problems)} problem(s)"
    out.check(
        failures,
        not problems,
        f"verify_stream (what waystation verify runs) on every stream: {verified}",
        f"verify_stream: {verified}, e.g. {[str(p) for p in problems[:3]]}",
    )
    try:
        await pool.join(timeout=RESULT_TIMEOUT)
        idle = True
    except TimeoutError as problem:
        idle = False
        failures.append(str(problem))
    out.check(
        failures,
        idle,
        "nothing left: no message in the queues or unsettled, no outbox row",
        "the pool was not idle (above)",
    )
    out.note(
        f"deliveries returned to their queues by the kill: {pool.broker.returned}; "
        f"warnings and errors logged: {len(run.log_lines)}" + (":" if run.log_lines else "")
    )
    for line in run.log_lines[:5]:
        out.note(f"  {line}")
    moved = (
        f"{run.killed.settings.worker_id} -> {run.replacement.settings.worker_id}"
        if run.killed and run.replacement
        else "none"
    )
    run.summary = [
        Line("tasks submitted", str(len(task_ids)), len(task_ids) == TASKS),
        Line("completed correctly", str(len(results) - len(wrong)), not wrong and lost == 0),
        Line("lost", str(lost), lost == 0),
        Line("duplicated", str(duplicated), duplicated == 0),
        Line("log verified (verify_stream)", verified, not problems),
        Line(
            "killed -> replaced",
            f"{moved}, {taken_over} of its paused tasks moved",
            moved != "none",
        ),
        Line("nothing left to do", "queues and outbox empty" if idle else "no", idle),
        Line("simulated", "in-memory broker and log, one process (no RabbitMQ, PostgreSQL)"),
    ]


async def _streams(pool: InMemoryPool) -> dict[str, list[Any]]:
    """Every stream of the log, by id, its events in order."""
    by_stream: dict[str, list[Any]] = collections.defaultdict(list)
    for event in await pool.store.read_all(limit=1_000_000):
        by_stream[event.stream_id].append(event)
    return by_stream
