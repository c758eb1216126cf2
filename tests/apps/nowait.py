"""Agents for publishers that do not wait (issue 30, item 5), run by a worker in the process of
``tests/integration/test_publishers_that_do_not_wait.py``; ``waystation agents --app
tests.apps.nowait:app`` lists them.

Each handler writes when it started into :data:`STARTED` and waits, before it answers, for
:func:`release`: the test lets them answer only once their publishers have gone, so that each
answer surely finds no queue."""

from __future__ import annotations

import asyncio
import time

from waystation import App, TaskContext
from waystation.events import Complete, Outcome

app = App()

STARTED: dict[str, float] = {}
"""Task id to the wall-clock time its first run started."""
_released = asyncio.Event()


def reset() -> None:
    """Forget the runs, and hold the next ones until :func:`release` (a test's own loop)."""
    global _released
    STARTED.clear()
    _released = asyncio.Event()


def release() -> None:
    """Let every run held, and every run to come, answer."""
    _released.set()


async def _held(task: TaskContext) -> Outcome:
    STARTED.setdefault(task.task_id, time.time())
    await _released.wait()
    return Complete({"echo": task.input})


@app.agent("leaf")
async def leaf(task: TaskContext) -> Outcome:
    """Calls no peer: by default its outcome is not recorded (G10)."""
    return await _held(task)


@app.agent("keeper", keep_results=True)
async def keeper(task: TaskContext) -> Outcome:
    """Calls no peer, and keeps its results: every outcome is recorded in the log."""
    return await _held(task)
