"""A resumed run in place that fails follows the agent's own policy, as every other run does
(it used to be handed over to a resume message whatever the policy said): a ``Permanent`` error,
or an agent with ``retries=0``, fails the task after that one run, and a run that may be retried
waits its backoff in the broker before the next one."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from waystation.agent import App, TaskContext
from waystation.events import Call, Complete, Outcome, Pause
from waystation.policies import Backoff, Permanent

from .harness import settings, world

pytestmark = pytest.mark.timeout(60)

BACKOFF = 1.5


def app_of(runs: Counter[int], ran_at: list[float], *, error: Exception, retries: int) -> App:
    app = App()

    @app.agent("boss", retries=retries, backoff=Backoff(initial=BACKOFF, maximum=BACKOFF))
    async def boss(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("quick", {})])
        runs[task.pause] += 1
        ran_at.append(asyncio.get_running_loop().time())
        if runs[task.pause] <= 1:
            raise error
        return Complete({"runs": runs[task.pause]})

    @app.agent("quick")
    async def quick(task: TaskContext) -> Outcome:
        return Complete({"answer": 1})

    return app


@pytest.mark.parametrize(
    ("error", "retries"),
    [(Permanent("no use trying again"), 3), (RuntimeError("flaky"), 0)],
    ids=["permanent", "no-retries"],
)
async def test_a_resumed_run_in_place_that_may_not_be_retried_runs_once(
    error: Exception, retries: int
) -> None:
    runs: Counter[int] = Counter()
    async with world(app_of(runs, [], error=error, retries=retries), settings()) as w:
        await w.start_worker()
        task_id = await w.publish("boss", {})
        answer = await w.answer(task_id)
        assert answer["status"] == "error", answer
        assert answer["error"]["type"] == type(error).__name__
        assert runs[1] == 1
        types = [e.event_type for e in await w.store.read_stream(task_id)]
        assert types[-2:] == ["TaskResumed", "TaskFailed"]


async def test_a_resumed_run_in_place_that_failed_is_retried_after_its_backoff() -> None:
    runs: Counter[int] = Counter()
    ran_at: list[float] = []
    async with world(app_of(runs, ran_at, error=RuntimeError("flaky"), retries=2)) as w:
        await w.start_worker()
        task_id = await w.publish("boss", {})
        answer = await w.answer(task_id)
        assert answer == {"status": "ok", "result": {"runs": 2}, "task_id": task_id}
        assert runs[1] == 2
        first, second = ran_at
        assert second - first >= BACKOFF
