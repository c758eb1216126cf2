"""The chaos run's drive: the tasks planned, then kept ``--in-flight`` at a time, their results
through the collector's durable reply queue (a task answered through a full queue is submitted
beside the window, to its queue, drained ``--full-hold`` seconds late or only once the run is
over); the last ``--in-flight`` held back until every fault has landed; progress lines until
every result of the window is in; then settling: until the outbox and every queue are empty.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from scripts.lab.harness.broker import busy_queues

from . import FULL_QUEUES, NEVER_DRAINED, PREFIX, ROUNDS, K
from .plan import padding, plan_tasks, task_mix
from .setup import Chaos

STALL_LIMIT = 180.0
"""Once every task is submitted: how long without a new result before the rest count as lost."""
SETTLE_WITHIN = 120.0
"""How long the run may take to settle once every result is in, beyond what the rows refused
for ``--refused-retry`` seconds need (their last wait is up to a minute)."""


@dataclass
class FullQueue:
    """A reply queue of the run that rejects publishes, kept full until drained."""

    name: str
    opened: float
    """Its first task's submission (elapsed seconds)."""
    tasks: int = 0
    drained: float | None = None
    """When its consumer started (elapsed seconds)."""


def plan_inputs(chaos: Chaos) -> tuple[dict[str, dict[str, Any]], Counter[str]]:
    """Each task's input by task id, its kind recorded (a pure function of the seed); and how
    many tasks of each kind."""
    args = chaos.args
    rng = random.Random(args.seed)
    kinds = plan_tasks(args.tasks, args.in_flight, task_mix(args), args.seed)
    inputs: dict[str, dict[str, Any]] = {}
    for n, kind in enumerate(kinds):
        task_id = f"chaos-{args.seed}-{n}"
        spec: dict[str, Any] = {
            "n": n,
            "k": K,
            "rounds": ROUNDS,
            "work_ms": round(rng.uniform(*args.work_ms), 1),
        }
        if padding(kind, args):
            spec["pad"] = padding(kind, args)
        inputs[task_id] = spec
        chaos.kinds[task_id] = kind
    mix = Counter(kinds)
    chaos.windowed = sum(not kind.startswith("full-") for kind in kinds)
    print(
        f"  and the broker says no: {mix['full-drained']} tasks answered through full "
        f"reply queues (reject-publish, length {args.full_length}) drained after "
        f"{args.full_hold:.0f}s, {mix['full-never']} through one never drained (refused "
        f"for {args.refused_retry:.0f}s, then dead letters); {mix['over-worker']} results "
        f"over the workers' {args.max_message_bytes} bytes, {mix['over-broker']} over the "
        f"broker's {args.broker_max_message_size or 'limit (left alone)'}; hostile "
        f"metadata at {args.hostile_rate:g}/s",
        flush=True,
    )
    return inputs, mix


async def submit_all(chaos: Chaos, inputs: dict[str, dict[str, Any]]) -> None:
    """Keep ``--in-flight`` tasks outstanding; hold the tail back until every fault landed.
    A task answered through a full queue is submitted beside the window, to its queue."""
    assert chaos.collector is not None
    hold_from = len(inputs) - chaos.args.in_flight
    try:
        for index, (task_id, spec) in enumerate(inputs.items()):
            if index == hold_from and not chaos.faults_done.is_set():
                chaos.say(f"{index} submitted; the last {len(inputs) - index} wait for the faults")
                await chaos.faults_done.wait()
            kind = chaos.kinds[task_id]
            if kind.startswith("full-"):
                await submit(chaos, task_id, spec, await full_queue_for(chaos, kind))
                chaos.submitted += 1
                continue
            await chaos.collector.wait_answered(chaos.window_submitted - chaos.args.in_flight + 1)
            await submit(chaos, task_id, spec)
            chaos.submitted += 1
            chaos.window_submitted += 1
    finally:
        chaos.submitting = False


async def full_queue_for(chaos: Chaos, kind: str) -> str:
    """The full queue a task of ``kind`` is answered through: the one never drained, or the
    drained one of the moment (a new one once it has taken tasks for ``--full-hold``
    seconds; each is drained that long after its first task)."""
    assert chaos.collector is not None
    if kind == "full-never":
        return NEVER_DRAINED
    now = chaos.elapsed()
    if not chaos.full_queues or now - chaos.full_queues[-1].opened >= chaos.args.full_hold:
        queue = FullQueue(f"{FULL_QUEUES}{len(chaos.full_queues) + 1}", now)
        await chaos.retrying(
            f"filling {queue.name}",
            lambda: chaos.collector_().full_queue(queue.name, chaos.args.full_length),
        )
        chaos.full_queues.append(queue)
        drainer = asyncio.create_task(drain_later(chaos, queue))
        chaos.drainers.add(drainer)
    chaos.full_queues[-1].tasks += 1
    return chaos.full_queues[-1].name


async def drain_later(chaos: Chaos, queue: FullQueue) -> None:
    assert chaos.collector is not None
    await asyncio.sleep(max(0.0, queue.opened + chaos.args.full_hold - chaos.elapsed()))
    await chaos.retrying(f"draining {queue.name}", lambda: chaos.collector_().drain(queue.name))
    queue.drained = chaos.elapsed()


async def submit(
    chaos: Chaos, task_id: str, spec: dict[str, Any], reply_to: str | None = None
) -> None:
    """Publish one task, again (same task id) if its confirm was lost with a connection."""
    assert chaos.collector is not None
    deadline = time.monotonic() + 120
    while True:
        try:
            publish: Awaitable[Any]
            if reply_to is None:
                publish = chaos.collector.submit("orchestrator", spec, task_id=task_id)
            else:
                publish = chaos.collector.submit_to("orchestrator", spec, task_id, reply_to)
            await asyncio.wait_for(publish, 30)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            chaos.submit_retries.append(task_id)
            await asyncio.sleep(0.5)


async def follow(
    chaos: Chaos,
    submitter: asyncio.Task[None],
    injector: asyncio.Task[None],
    hostile: asyncio.Task[None],
) -> None:
    """Progress lines until every result of the window is in, or nothing came for
    STALL_LIMIT seconds."""
    last_line = last_count = 0.0
    last_change = time.monotonic()
    while True:
        await asyncio.sleep(0.25)
        for task in (submitter, injector, hostile):
            error = task.exception() if task.done() else None
            if error is not None:
                raise error
        chaos.replace_crashed()
        done = chaos.results_in()
        if done != last_count:
            last_count, last_change = done, time.monotonic()
        if time.monotonic() - last_line >= chaos.args.progress_every:
            last_line = time.monotonic()
            await progress_line(chaos, done)
        if done >= chaos.windowed and submitter.done():
            await progress_line(chaos, done)
            return
        if submitter.done() and injector.done() and time.monotonic() - last_change > STALL_LIMIT:
            chaos.fail(f"no new result for {STALL_LIMIT:.0f}s with {done} of {chaos.windowed} in")
            return


async def progress_line(chaos: Chaos, done: int) -> None:
    assert chaos.collector is not None
    paused = await chaos.paused_now()
    alive = sum(w.alive() for w in chaos.slots)
    full = sum(1 for t in chaos.collector.through_full if t in chaos.kinds)
    oldest = chaos.outbox_oldest_last
    chaos.say(
        f"results {done:>5}/{chaos.windowed}, submitted {chaos.submitted:>5}, in flight "
        f"{chaos.window_submitted - done:>3}, paused {'?' if paused is None else paused:>3}, "
        f"workers alive {alive}/{len(chaos.slots)}, faults {len(chaos.faults)}; through full "
        f"queues {full}, hostile sent {len(chaos.hostile)}, outbox oldest "
        f"{'?' if oldest is None else f'{oldest:.0f}s'}"
    )


async def settle(chaos: Chaos) -> None:
    """Until nothing can still happen: the outbox and every queue (the results' and the
    full ones' too) empty, twice in a row. The queue never drained is drained once the
    outbox is empty (every result refused there has become a dead letter)."""
    assert chaos.collector is not None
    chaos.say(
        f"every result of the window in; waiting for the outbox and the queues to empty "
        f"(a result refused for {chaos.args.refused_retry:.0f}s becomes a dead letter)"
    )
    deadline = time.monotonic() + SETTLE_WITHIN + chaos.args.refused_retry + 60
    quiet = 0
    never_drained = any(kind == "full-never" for kind in chaos.kinds.values())
    state: dict[str, int] = {}
    while quiet < 2:
        if time.monotonic() > deadline:
            chaos.fail(f"the run did not settle within {deadline - chaos.started:.0f}s: {state}")
            return
        await asyncio.sleep(0.5)
        state = await pending(chaos)
        chaos.left = state
        if never_drained and "outbox" not in state and await never_drained_finished(chaos):
            chaos.say(
                f"the outbox is empty: draining {NEVER_DRAINED} (at "
                f"{chaos.elapsed():.0f}s; its results were refused since)"
            )
            await chaos.retrying(
                f"draining {NEVER_DRAINED}", lambda: chaos.collector_().drain(NEVER_DRAINED)
            )
            never_drained = False
            continue
        quiet = quiet + 1 if not state and not never_drained else 0
    chaos.settled = True
    chaos.say("settled: the outbox and every queue are empty, nothing unacked")


async def never_drained_finished(chaos: Chaos) -> bool:
    """Whether every task answered through the queue never drained has finished in the log
    (its result written to the outbox in the same transaction)."""
    ids = [t for t, kind in chaos.kinds.items() if kind == "full-never"]
    try:
        async with chaos.engine_().connect() as connection:
            finished = await connection.scalar(
                text(
                    "SELECT count(DISTINCT stream_id) FROM events WHERE stream_id = "
                    "ANY(CAST(:ids AS text[])) AND event_type IN ('TaskCompleted', "
                    "'TaskFailed', 'TaskCancelled')"
                ),
                {"ids": ids},
            )
    except Exception:
        return False
    return int(finished or 0) == len(ids)


async def pending(chaos: Chaos) -> dict[str, int]:
    """What is still waiting: outbox rows, and messages (ready or unacked) per queue (the
    queue never drained aside until it is drained)."""
    waiting: dict[str, int] = {}
    try:
        async with chaos.engine_().connect() as connection:
            waiting["outbox"] = int(
                await connection.scalar(text("SELECT count(*) FROM outbox")) or 0
            )
    except Exception:
        waiting["outbox"] = -1  # unreadable: not settled
    for name, (ready, unacked) in (await busy_queues(chaos.amqp_url, PREFIX)).items():
        waiting[name] = ready + unacked
    return {what: n for what, n in waiting.items() if n}
