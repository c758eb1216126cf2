"""An agent that asks a person, for the console's approvals (issue 32), served by the in-process
workers of ``tests/integration/test_console_approvals.py``.

``expenses`` waits for a typed ``decision`` (declared, so every worker checks its payload: a
field the console's form cannot tell is wrong, an amount over the limit, is refused by the
worker and named), and completes with what came, who sent it, and the claim it kept in its
state. ``memo`` waits for an untyped ``comment``, any JSON, and completes with it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from waystation import App, Complete, Outcome, Pause, Signal, TaskContext

app = App(version="approvals-test")

AGENTS = ("expenses", "memo")
"""The agents of this app, whose queues a test deletes afterwards."""


class Decision(BaseModel):
    """A manager's answer to an expense claim."""

    verdict: Literal["approve", "reject"] = Field(description="approve pays the claim")
    amount: int = Field(ge=0, le=10_000, description="what to pay, in euros")
    note: str = ""
    tags: list[str] = []


@app.agent("expenses", signals={"decision": Decision})
async def expenses(task: TaskContext) -> Outcome:
    if not task.resumed:
        return Pause([Signal("decision", timeout=3600)], update={"claim": task.input})
    answer = task.results[0]
    return Complete({"decision": answer.value, "by": answer.sender, "claim": task.state["claim"]})


@app.agent("memo")
async def memo(task: TaskContext) -> Outcome:
    if not task.resumed:
        return Pause([Signal("comment", timeout=3600)])
    return Complete(task.results[0].value)
