"""The example app: an ``orchestrator`` that fans out to K ``researcher`` peers and sums.

Input of the orchestrator: ``{"n": int, "k": int = 3, "work_ms": float = 0, "rounds": int = 1}``.
Each round it calls K researchers with ``x = n + i`` (i < K) and pauses; a researcher answers
``x * x`` after ``work_ms`` of simulated work. After the last round it completes with
``{"n": n, "total": <sum of every answer>}``, which :func:`expected_total` predicts, so tests and
demos can check every result.
"""

from __future__ import annotations

import asyncio

from waystation.agent import App, TaskContext
from waystation.events import Call, Complete, Outcome, Pause

__all__ = ["app", "expected_total"]

app = App()


def expected_total(n: int, k: int = 3, rounds: int = 1) -> int:
    return rounds * sum((n + i) ** 2 for i in range(k))


@app.agent("orchestrator")
async def orchestrator(task: TaskContext) -> Outcome:
    spec = task.input
    k, rounds = int(spec.get("k", 3)), int(spec.get("rounds", 1))
    total = int(task.state.get("total", 0)) + sum(r.value["answer"] for r in task.results if r.ok)
    if task.pause < rounds:
        calls = [
            Call("researcher", {"x": spec["n"] + i, "work_ms": spec.get("work_ms", 0)})
            for i in range(k)
        ]
        return Pause(calls, update={"total": total, "round": task.pause + 1})
    return Complete({"n": spec["n"], "total": total})


@app.agent("researcher")
async def researcher(task: TaskContext) -> Outcome:
    work_ms = float(task.input.get("work_ms", 0))
    if work_ms > 0:
        await asyncio.sleep(work_ms / 1000)
    x = int(task.input["x"])
    return Complete({"answer": x * x})
