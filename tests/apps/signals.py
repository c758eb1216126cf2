"""Agents that wait for signals (issue 31), served by the worker processes and the in-process
workers of ``tests/integration/test_signals.py``; ``waystation agents --app tests.apps.signals:app``
lists them.

``approver`` waits for a typed ``approval`` (declared, so every worker checks its payload, not
only the one that paused) and completes with what came and who sent it; ``twice`` waits for
``first``, then for ``second``, so that a ``second`` sent early is kept for its wait."""

from __future__ import annotations

from pydantic import BaseModel

from waystation import App, Complete, Outcome, Pause, Signal, TaskContext

app = App(version="signals-test")

AGENTS = ("approver", "twice")
"""The agents of this app, whose queues a test deletes afterwards."""


class Approval(BaseModel):
    approved: bool
    note: str = ""


@app.agent("approver", signals={"approval": Approval})
async def approver(task: TaskContext) -> Outcome:
    if not task.resumed:
        return Pause([Signal("approval", timeout=3600)])
    answer = task.results[0]
    return Complete({"approval": answer.value, "by": answer.sender, "outcome": answer.outcome})


@app.agent("twice")
async def twice(task: TaskContext) -> Outcome:
    if task.pause == 0:
        return Pause([Signal("first", timeout=3600)])
    if task.pause == 1:
        return Pause([Signal("second", timeout=3600)], update={"first": task.results[0].value})
    return Complete([task.state["first"], task.results[0].value])
