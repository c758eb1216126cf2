"""Agents that wait on timers and on the first k of their calls, for tests that run them in worker
processes (``--app tests.apps.timers:app``): ``napper`` sleeps, ``fanout`` resumes on the first
two of three calls, the third to ``hang``, which never answers until it is cancelled."""

from __future__ import annotations

from waystation import App, Call, Complete, FirstK, Outcome, Pause, Sleep, TaskContext

app = App()

HANG_TIMEOUT = 600.0
"""The deadline of the call to ``hang``: far beyond any test, which never waits for it."""


@app.agent("napper")
async def napper(task: TaskContext) -> Outcome:
    if not task.resumed:
        return Pause([Sleep(task.input["seconds"])])
    return Complete({"slept": [r.outcome for r in task.results]})


@app.agent("fanout")
async def fanout(task: TaskContext) -> Outcome:
    if not task.resumed:
        calls = [Call("quick", 1), Call("quick", 2), Call("hang", 3, timeout=HANG_TIMEOUT)]
        return Pause(calls, until=FirstK(2))
    return Complete([[r.agent, r.outcome, r.value] for r in task.results])


@app.agent("quick")
async def quick(task: TaskContext) -> Outcome:
    return Complete(task.input * 10)


@app.agent("hang")
async def hang(task: TaskContext) -> Outcome:
    """Never answers until cancelled: it waits a day."""
    return Pause([Sleep(86_400)])
