"""Interceptors (``App(interceptors=[...])``) around every handler run, on the real worker over the
in-memory pool: the order they run in, on first runs and on resumes (in place and by message),
and that what one returns or raises is taken exactly as the handler's own."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from waystation import (
    App,
    Backoff,
    Call,
    Complete,
    Interceptor,
    Outcome,
    Pause,
    Permanent,
    TaskContext,
)
from waystation.agent import CallNext
from waystation.runtime.worker import Worker
from waystation.testing import InMemoryPool

QUICK = Backoff(initial=0.01, factor=1.0, maximum=0.01)


class Recording(Interceptor):
    """Writes down each run it wraps, before and after the rest of the chain."""

    def __init__(self, name: str, seen: list[tuple[Any, ...]]) -> None:
        self.name = name
        self.seen = seen

    async def run(self, task: TaskContext, call_next: CallNext) -> Outcome:
        self.seen.append((self.name, "before", task.agent, task.pause, task.task_id))
        outcome = await call_next(task)
        self.seen.append((self.name, "after", task.agent, task.pause, task.task_id))
        return outcome


def _calling_app(seen: list[tuple[Any, ...]]) -> App:
    app = App(interceptors=[Recording("outer", seen), Recording("inner", seen)])

    @app.agent("parent")
    async def parent(task: TaskContext) -> Outcome:
        seen.append(("handler", "-", task.agent, task.pause, task.task_id))
        if not task.resumed:
            return Pause([Call("child", {"x": task.input["x"]})])
        return Complete(task.results[0].value + 1)

    @app.agent("child")
    def child(task: TaskContext) -> Outcome:  # plain def: runs in a thread
        seen.append(("handler", threading.current_thread().name, task.agent, 0, ""))
        return Complete(task.input["x"] * 10)

    return app


def _around(agent: str, pause: int, task_id: str) -> list[tuple[Any, ...]]:
    return [
        ("outer", "before", agent, pause, task_id),
        ("inner", "before", agent, pause, task_id),
        ("handler", "-", agent, pause, task_id),
        ("inner", "after", agent, pause, task_id),
        ("outer", "after", agent, pause, task_id),
    ]


@pytest.mark.parametrize("in_place", [True, False], ids=["resumed-in-place", "resumed-by-message"])
async def test_interceptors_wrap_first_and_resumed_runs_in_the_order_declared(
    in_place: bool,
) -> None:
    seen: list[tuple[Any, ...]] = []
    async with InMemoryPool(_calling_app(seen), workers=2, resume_in_place=in_place) as pool:
        task_id = await pool.submit("parent", {"x": 4})
        answer = await pool.result(task_id)
        assert answer.ok, answer.error
        assert answer.result == 41
        await pool.join()
    parent = [entry for entry in seen if entry[2] == "parent"]
    assert parent == _around("parent", 0, task_id) + _around("parent", 1, task_id)
    (child_task,) = {entry[4] for entry in seen if entry[2] == "child" and entry[0] != "handler"}
    child = [entry for entry in seen if entry[2] == "child"]
    assert [entry[:2] for entry in child] == [
        ("outer", "before"),
        ("inner", "before"),
        ("handler", child[2][1]),
        ("inner", "after"),
        ("outer", "after"),
    ]
    # the plain handler ran in the worker's thread pool, its interceptors around it
    assert child[2][1].startswith("waystation-handler")
    assert child_task.startswith(task_id)  # a sub-task id of the parent's first pause


class Failing(Interceptor):
    """Raises after the handler returned, as an interceptor that translates an outcome would."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.runs = 0

    async def run(self, task: TaskContext, call_next: CallNext) -> Outcome:
        self.runs += 1
        await call_next(task)
        raise self.error


@pytest.mark.parametrize(
    ("error", "runs"),
    [(RuntimeError("the interceptor broke"), 3), (Permanent("the interceptor gave up"), 1)],
    ids=["retried", "permanent"],
)
async def test_an_interceptor_that_raises_fails_the_run_under_the_agents_retry_policy(
    error: Exception, runs: int
) -> None:
    failing = Failing(error)
    app = App(interceptors=[failing])
    handled = 0

    @app.agent("flaky", retries=2, backoff=QUICK)
    async def flaky(task: TaskContext) -> Outcome:
        nonlocal handled
        handled += 1
        return Complete("never recorded")

    async with InMemoryPool(app) as pool:
        answer = await pool.call("flaky", {})
        await pool.join()
        assert answer.status == "error"
        assert answer.error is not None
        assert answer.error["type"] == type(error).__name__
        assert answer.error["message"] == str(error)
        # the first run and the agent's two retries, as for a raising handler; none for Permanent
        assert failing.runs == handled == runs
        (letter,) = pool.dead_letters()
        assert letter.header_view()["x-waystation-reason"] == "handler-failed"


async def test_a_resumed_run_whose_interceptor_raises_is_retried_then_completes() -> None:
    class FailsOnceOnResume(Interceptor):
        failed = False

        async def run(self, task: TaskContext, call_next: CallNext) -> Outcome:
            if task.resumed and not self.failed:
                self.failed = True
                raise RuntimeError("not this time")
            return await call_next(task)

    app = App(interceptors=[FailsOnceOnResume()])

    @app.agent("parent", retries=1, backoff=QUICK)
    async def parent(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("child", {})])
        return Complete([r.value for r in task.results])

    @app.agent("child")
    async def child(task: TaskContext) -> Outcome:
        return Complete("done")

    async with InMemoryPool(app) as pool:
        answer = await pool.call("parent", {})
        await pool.join()
        assert answer.ok, answer.error
        assert answer.result == ["done"]
        assert pool.dead_letters() == []


async def test_an_interceptor_that_returns_without_calling_next_short_circuits_the_handler() -> (
    None
):
    class Cached(Interceptor):
        async def run(self, task: TaskContext, call_next: CallNext) -> Outcome:
            if task.input.get("cached"):
                return Complete({"from": "cache"})
            return await call_next(task)

    app = App(interceptors=[Cached()])
    handled: list[Any] = []

    @app.agent("lookup")
    async def lookup(task: TaskContext) -> Outcome:
        handled.append(task.input)
        return Complete({"from": "handler"})

    async with InMemoryPool(app) as pool:
        assert (await pool.call("lookup", {"cached": True})).result == {"from": "cache"}
        assert handled == []
        assert (await pool.call("lookup", {"cached": False})).result == {"from": "handler"}
        assert handled == [{"cached": False}]
        await pool.join()


async def test_what_an_interceptor_returns_is_checked_and_bounded_as_the_handlers_own() -> None:
    class Wrong(Interceptor):
        async def run(self, task: TaskContext, call_next: CallNext) -> Outcome:
            if task.agent == "wrong":
                return "not an outcome"  # type: ignore[return-value]
            if task.agent == "slow":
                await asyncio.sleep(5)  # the agent's time limit bounds the interceptor too
            return await call_next(task)

    app = App(interceptors=[Wrong()])

    @app.agent("wrong", retries=3, backoff=QUICK)
    @app.agent("slow", retries=0, time_limit=0.1)
    async def handler(task: TaskContext) -> Outcome:
        return Complete(None)

    async with InMemoryPool(app) as pool:
        wrong = await pool.call("wrong", {})
        assert wrong.error is not None and wrong.error["type"] == "InvalidTransition"
        assert "returned str, not Complete or Pause" in wrong.error["message"]
        slow = await pool.call("slow", {})
        assert slow.error is not None and slow.error["type"] == "TimeLimitExceeded"
        await pool.join()
        assert len(pool.dead_letters()) == 2


def test_interceptors_are_checked_when_the_app_is_declared() -> None:
    class NoRun:
        pass

    class PlainRun:
        def run(self, task: TaskContext, call_next: CallNext) -> Outcome:
            return Complete()

    for wrong in (NoRun(), PlainRun(), Recording):
        with pytest.raises(TypeError, match="interceptor"):
            App(interceptors=[wrong])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="a list of interceptors"):
        App(interceptors=Recording("one", []))  # type: ignore[arg-type]
    assert App().interceptors == ()


async def test_a_workers_own_interceptors_run_inside_the_apps() -> None:
    seen: list[tuple[Any, ...]] = []
    app = App(interceptors=[Recording("app", seen)])

    @app.agent("echo")
    async def echo(task: TaskContext) -> Outcome:
        seen.append(("handler", "-", task.agent, task.pause, task.task_id))
        return Complete(task.input)

    async with InMemoryPool(app, workers=0) as pool:
        worker = Worker(
            app,
            pool.settings.model_copy(update={"worker_id": "own"}),
            pool.store,
            broker=pool.broker.connection("own"),
            interceptors=[Recording("worker", seen)],
        )
        await worker.start()
        pool.workers.append(worker)  # stopped with the pool
        task_id = await pool.submit("echo", "hi")
        assert (await pool.result(task_id)).result == "hi"
        await pool.join()
    assert [entry[:2] for entry in seen] == [
        ("app", "before"),
        ("worker", "before"),
        ("handler", "-"),
        ("worker", "after"),
        ("app", "after"),
    ]
