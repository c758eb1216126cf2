"""The demo's checks, each printed as it is made (``ok`` or ``FAIL``): every result correct and
one per task; the event log (per task exactly one TaskResumed, one TaskCompleted and 3
SubtaskClaimed, every hash chain, no stream but the tasks' and those of researchers' tasks run
again after the kill); ``waystation verify``; the ``paused_tasks`` projection caught up, nothing
paused, identical to a rebuild; every process still running exits 0 on SIGTERM. And, for
information, what the workers' logs say of the recovery."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import text

from scripts.lab.harness.checks import unplanned_streams
from scripts.lab.harness.processes import log_problems, stop_all
from waystation.events import GENESIS_HASH, EventStore, chain_hash
from waystation.events.postgres import PostgresEventStore
from waystation.example import expected_total
from waystation.projections.postgres import projection_status

from . import PROJECTION, TASKS, WORKERS, K
from .drive import Driven
from .output import Output
from .setup import Demo

CATCH_UP_TIMEOUT = 20.0
"""How long the projection runner may take to apply the whole log once the results are in."""


@dataclass
class Checked:
    """What the checks found, for the summary."""

    wrong: list[tuple[int, Any]]
    """(n, result) of each wrong result."""
    lost: int
    duplicated: int
    """Tasks with a step recorded more than once."""
    taken_over: int
    """Tasks the killed worker paused that another worker completed."""
    verified: tuple[bool, str]
    projection: tuple[bool, str]
    codes: dict[str, int | None]
    """Exit codes on SIGTERM, by process."""
    stopped_ok: bool


async def check_all(demo: Demo, driven: Driven, failures: list[str]) -> Checked:
    """Every check, in turn; what failed is added to ``failures``."""
    task_ids, results = driven.task_ids, driven.results
    duplicate_messages, done = driven.duplicate_messages, driven.done
    broker_before, broker_after = driven.broker_before, driven.broker_after
    demo.say(
        ("all results in" if done == TASKS else f"{done} results in")
        + "; checking them, the event log and the projection"
    )
    wrong = [
        (task_ids[t], r)
        for t, r in results.items()
        if not r.ok or r.result != {"n": task_ids[t], "total": expected_total(task_ids[t], K)}
    ]
    demo.out.check(
        failures,
        not wrong,
        f"all {len(results)} results correct (total = expected_total(n, {K}))",
        f"{len(wrong)} wrong results, e.g. {wrong[:3]}",
    )
    lost = len(task_ids) - len(results)
    demo.out.check(
        failures,
        len(results) == len(task_ids) == TASKS,
        f"{len(results)} distinct results for {len(task_ids)} submitted tasks "
        f"({duplicate_messages} duplicate result messages ignored by the client)",
        f"{len(results)} distinct results for {len(task_ids)} submitted tasks",
    )
    duplicated, taken_over = await check_log(demo, list(task_ids), failures)
    verified = await check_verify(demo, failures)
    projection = await check_projection(demo, failures)

    stopping = [p for p in demo.processes() if p.alive()]
    codes = stop_all(stopping, timeout=30)
    demo.say(
        "stopped with SIGTERM: " + ", ".join(f"{name} exit {code}" for name, code in codes.items())
    )
    stopped_ok = all(code == 0 for code in codes.values()) and len(codes) == WORKERS + 1
    demo.out.check(
        failures,
        stopped_ok,
        f"every surviving worker and the projection runner exited 0 ({len(codes)} processes)",
        f"exit codes on SIGTERM {codes}",
    )
    recovery = _recovery_lines(sorted(demo.logs.glob("worker*.log")))
    if broker_before and broker_after:
        recovery["messages RabbitMQ redelivered (broker-wide counter)"] = (
            broker_after["redelivered"] - broker_before["redelivered"]
        )
    demo.note(
        "recovery seen in the worker logs: "
        + (", ".join(f"{what}: {n}" for what, n in recovery.items()) or "none")
    )
    problems, first = log_problems(sorted(demo.logs.glob("*.log")))
    demo.note(f"process logs: {problems} warning/error lines" + (":" if first else ""))
    for line in first:
        demo.note(f"  {line}")
    return Checked(wrong, lost, duplicated, taken_over, verified, projection, codes, stopped_ok)


async def check_log(demo: Demo, task_ids: list[str], failures: list[str]) -> tuple[int, int]:
    """The event log's checks (:func:`check_streams`) on the demo's database."""
    store = PostgresEventStore.from_url(demo.database_url, pool_size=4)
    try:
        others = await _other_streams(store, task_ids)
        killed_id = f"demo-{demo.killed.name}" if demo.killed else None
        return await check_streams(demo.out, store, task_ids, others, killed_id, failures)
    finally:
        await store.close()


async def check_streams(
    out: Output,
    store: EventStore,
    task_ids: list[str],
    others: dict[str, list[str]],
    killed_id: str | None,
    failures: list[str],
) -> tuple[int, int]:
    """The event log's checks, on any store: every task's stream as the plan says, its hash
    chain, and no stream (``others``: the event types of every stream but the tasks') but the
    tasks' and those of researchers' tasks run again after the kill; (tasks with a step
    recorded more than once, tasks the killed worker ``killed_id`` paused that another worker
    completed)."""
    counts: collections.Counter[str] = collections.Counter()
    bad_counts: list[str] = []
    broken_chains: list[str] = []
    moved = taken_over = duplicated = 0
    writers: collections.Counter[str] = collections.Counter()
    for task_id in task_ids:
        events = await store.read_stream(task_id)
        types = collections.Counter(e.event_type for e in events)
        counts.update(types)
        duplicated += (
            types["TaskCompleted"] > 1 or types["TaskResumed"] > 1 or types["SubtaskClaimed"] > K
        )
        if (types["TaskCompleted"], types["TaskResumed"], types["SubtaskClaimed"]) != (1, 1, K):
            bad_counts.append(f"{task_id}: {dict(types)}")
        previous = GENESIS_HASH
        for event in events:
            if event.prev_hash != previous or chain_hash(previous, event.hash_body()) != event.hash:
                broken_chains.append(f"{task_id} v{event.stream_version}")
                break
            previous = event.hash
        by_type = {e.event_type: e.metadata.get("worker_id") for e in events}
        writers.update(str(e.metadata.get("worker_id")) for e in events)
        if by_type.get("TaskPaused") != by_type.get("TaskCompleted"):
            moved += 1
            taken_over += by_type.get("TaskPaused") == killed_id
    out.check(
        failures,
        not bad_counts,
        f"every task's stream has exactly 1 TaskCompleted, 1 TaskResumed and {K} SubtaskClaimed",
        f"{len(bad_counts)} streams with other counts, e.g. {bad_counts[:3]}",
    )
    out.check(
        failures,
        not broken_chains,
        f"hash chains of all {len(task_ids)} streams verify",
        f"{len(broken_chains)} broken hash chains, e.g. {broken_chains[:3]}",
    )
    unplanned = unplanned_streams(task_ids, others, K, rounds=1)
    out.check(
        failures,
        not unplanned,
        f"the log holds {len(task_ids) + len(others)} streams: one per task, and "
        f"{len(others)} of researchers' tasks run again after the kill (each started and "
        "completed once; a first run records nothing)",
        f"{len(unplanned)} streams of no task and of no researcher's task run again, "
        f"e.g. {unplanned[:3]}",
    )
    out.note(f"events: {dict(sorted(counts.items()))}")
    out.note(f"events written per worker: {dict(sorted(writers.items()))}")
    out.note(
        f"tasks paused on one worker and completed on another: {moved} "
        f"({taken_over} paused by the killed worker)"
    )
    return duplicated, taken_over


async def check_verify(demo: Demo, failures: list[str]) -> tuple[bool, str]:
    """``waystation verify`` of the whole log: (it exited 0, its summary line)."""
    code, output = await demo.cli("verify")
    summary = output.strip().splitlines()[-1] if output.strip() else "(no output)"
    demo.out.check(
        failures,
        code == 0,
        f"waystation verify: {summary}",
        f"waystation verify exited {code}: {output.strip()[-2000:]}",
    )
    return code == 0, summary if code == 0 else f"exit {code}: {summary}"


async def check_projection(demo: Demo, failures: list[str]) -> tuple[bool, str]:
    """The runner applied the whole log, no task is still paused, and the live table equals
    a rebuild from position zero; (all that held, what to show)."""
    deadline = time.monotonic() + CATCH_UP_TIMEOUT
    while True:
        statuses = await projection_status(demo._engine())
        behind = next(s.behind for s in statuses if s.name == PROJECTION)
        paused = await demo.paused_now()
        if (behind == 0 and paused == 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    caught_up = behind == 0 and paused == 0
    demo.out.check(
        failures,
        caught_up,
        f"the {PROJECTION} projection applied the whole log: no task still paused",
        f"the {PROJECTION} projection after {CATCH_UP_TIMEOUT:.0f}s: {behind} events behind, "
        f"{paused} tasks still paused",
    )
    code, output = await demo.cli("projections", "rebuild", PROJECTION, "--check")
    lines = output.strip().splitlines()
    demo.out.check(
        failures,
        code == 0,
        f"waystation projections rebuild {PROJECTION} --check: "
        + (lines[-1].strip() if lines else "(no output)"),
        f"waystation projections rebuild {PROJECTION} --check exited {code}: "
        f"{output.strip()[-2000:]}",
    )
    ok = caught_up and code == 0
    return ok, (
        f"{paused} paused, {behind} behind, rebuild --check "
        + ("identical" if code == 0 else f"exit {code}")
    )


async def _other_streams(store: PostgresEventStore, task_ids: list[str]) -> dict[str, list[str]]:
    """The event types of every stream but the tasks', by stream id."""
    async with store.engine.connect() as connection:
        rows = await connection.execute(
            text(
                "SELECT stream_id, event_type FROM events "
                "WHERE NOT (stream_id = ANY(CAST(:ids AS text[]))) "
                "ORDER BY stream_id, stream_version"
            ),
            {"ids": task_ids},
        )
        streams: dict[str, list[str]] = {}
        for stream_id, event_type in rows:
            streams.setdefault(stream_id, []).append(event_type)
        return streams


_RECOVERY = {
    "outbox messages republished by the relay": re.compile(rb"outbox relay published (\d+)"),
    "redeliveries recognised": re.compile(
        rb"redelivered after its checkpoint|already recorded by another"
    ),
    "resumes already done": re.compile(rb"resume of .* already done"),
    "replies not applied (duplicate or late)": re.compile(rb"not applied: "),
}


def _recovery_lines(paths: list[Path]) -> dict[str, int]:
    """What the workers logged about redeliveries and the outbox relay (INFO lines)."""
    found: collections.Counter[str] = collections.Counter()
    for path in paths:
        with contextlib.suppress(OSError), open(path, "rb") as log:
            for line in log:
                for what, pattern in _RECOVERY.items():
                    match = pattern.search(line)
                    if match:
                        found[what] += int(match.group(1)) if match.groups() else 1
    return dict(found)
