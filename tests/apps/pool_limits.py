"""Agents with pool limits, for tests that run them in worker processes (``--app
tests.apps.pool_limits:app``). Each run appends lines to ``$POOL_RUNS`` (a file all processes
share): ``start <task> <time> <pid>`` as it starts and ``end <task> <time> <pid>`` as it ends
(wall-clock times), so a test can see every run of every process, a run cut short by a SIGKILL
included."""

from __future__ import annotations

import asyncio
import os
import time

import asyncpg

from waystation import App, Rate, TaskContext
from waystation.events import Complete, Outcome

app = App()

METERED = Rate(3, per=3.0)


def _line(what: str, task_id: str, *extra: str) -> None:
    with open(os.environ["POOL_RUNS"], "a") as runs:  # one short line per write: appended whole
        runs.write(" ".join([what, task_id, f"{time.time():.6f}", str(os.getpid()), *extra]))
        runs.write("\n")


def _started_before(task_id: str) -> bool:
    with open(os.environ["POOL_RUNS"]) as runs:
        return sum(1 for line in runs if line.split()[:2] == ["start", task_id]) > 1


@app.agent("gate", concurrency=2, retries=0)
async def gate(task: TaskContext) -> Outcome:
    """Two runs at once in the pool; no retries, so a wait that counted as an attempt would
    fail the task."""
    _line("start", task.task_id)
    await asyncio.sleep(float(task.input["seconds"]))
    _line("end", task.task_id)
    return Complete({"ran": task.task_id})


@app.agent("holder", concurrency=1)
async def holder(task: TaskContext) -> Outcome:
    """One run at once; with ``{"hold": true}`` its first run never ends (its worker is killed)."""
    _line("start", task.task_id)
    if task.input.get("hold") and not _started_before(task.task_id):
        await asyncio.sleep(3600)
    _line("end", task.task_id)
    return Complete({})


@app.agent("metered", rate=METERED)
async def metered(task: TaskContext) -> Outcome:
    """At most 3 starts per 3 s in the pool. Also records when the pool admitted the run: the
    database's time its rate slot was taken (``pool_slots.taken_at``), the instant the limit is
    counted at; the run's own start is a moment later. (The slot's row names this task until
    another start takes it, 3 s later at the soonest.)"""
    _line("start", task.task_id, str(await _admitted_at(task.task_id)))
    _line("end", task.task_id)
    return Complete({})


async def _admitted_at(task_id: str) -> float:
    url = os.environ["WAYSTATION_DATABASE_URL"].replace("postgresql+asyncpg://", "postgresql://")
    connection = await asyncpg.connect(url)
    try:
        found = await connection.fetchval(
            """SELECT extract(epoch FROM taken_at)::float8 FROM pool_slots
               WHERE deployment = $1 AND agent = 'metered' AND kind = 'starts' AND task_id = $2""",
            os.environ["WAYSTATION_QUEUE_PREFIX"],
            task_id,
        )
    finally:
        await connection.close()
    return float("nan") if found is None else float(found)
