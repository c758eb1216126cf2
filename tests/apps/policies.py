"""Agents with policies, for tests that run them in worker processes (``--app
tests.apps.policies:app``). Each run appends one line to ``$POLICY_RUNS`` (a file): the task id,
the wall-clock start and end of the run and the worker's pid, so a test can see every run of
every process."""

from __future__ import annotations

import asyncio
import os
import time

from waystation import App, Backoff, Permanent, TaskContext
from waystation.events import Complete, Outcome

app = App()


def _runs_so_far(task_id: str) -> int:
    path = os.environ.get("POLICY_RUNS")
    if not path or not os.path.exists(path):
        return 0
    with open(path) as runs:
        return sum(1 for line in runs if line.split()[0] == task_id)


def _record(task_id: str, started: float) -> None:
    path = os.environ["POLICY_RUNS"]
    with open(path, "a") as runs:  # one short line per write: appended whole
        runs.write(f"{task_id} {started:.6f} {time.time():.6f} {os.getpid()}\n")


@app.agent("flaky", retries=3, backoff=Backoff(initial=1.0, factor=2.0, maximum=10.0))
async def flaky(task: TaskContext) -> Outcome:
    """Fails its first two runs, then completes."""
    started = time.time()
    earlier = _runs_so_far(task.task_id)
    _record(task.task_id, started)
    if earlier < 2:
        raise ConnectionError(f"run {earlier + 1} failed")
    return Complete({"runs": earlier + 1})


@app.agent("slow", retries=1, backoff=Backoff(initial=0.2), time_limit=1.0)
async def slow(task: TaskContext) -> Outcome:
    """Never finishes within its time limit."""
    started = time.time()
    try:
        await asyncio.sleep(60)
    finally:
        _record(task.task_id, started)
    return Complete({})


@app.agent("refuses", retries=5)
async def refuses(task: TaskContext) -> Outcome:
    _record(task.task_id, time.time())
    raise Permanent("this input will never work")
