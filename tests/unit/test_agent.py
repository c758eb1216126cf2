"""Registering agents: plain and async handlers, input and result models, and how a handler's
outcome is put into JSON form."""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from typing import Any

import pytest
from pydantic import BaseModel, Field, ValidationError

from waystation.agent import App, TaskContext
from waystation.events import Call, Complete, InvalidTransition, Outcome, Pause
from waystation.observability.logs import current_context, log_context
from waystation.runtime.flows.base import Steps, invalid_fields, typed_input


class Order(BaseModel):
    item: str
    quantity: int = Field(ge=1)


class Receipt(BaseModel):
    item: str
    on: date


def context(value: Any = None) -> TaskContext:
    return TaskContext(task_id="t", agent="a", input=value)


def flows(threads: ThreadPoolExecutor | None = None) -> Steps:
    """Steps with only what ``run_handler`` uses."""
    return Steps(*([None] * 10), threads)  # type: ignore[arg-type, call-arg]


def test_a_coroutine_function_is_async_and_a_plain_function_is_blocking() -> None:
    app = App()

    @app.agent("async")
    async def asynchronous(task: TaskContext) -> Outcome:
        return Complete()

    @app.agent("plain")
    def plain(task: TaskContext) -> Outcome:
        return Complete()

    class Callable:
        async def __call__(self, task: TaskContext) -> Outcome:
            return Complete()

    app.agent("object")(Callable())
    app.agent("partial")(functools.partial(asynchronous))
    assert {name: spec.blocking for name, spec in app.agents.items()} == {
        "async": False,
        "plain": True,
        "object": False,
        "partial": False,
    }
    assert plain(context()) == Complete(), "the decorator returns the function itself"


@pytest.mark.parametrize("given", [dict, Order(item="x", quantity=1), "Order"])
def test_input_and_result_take_only_pydantic_models(given: Any) -> None:
    app = App()
    with pytest.raises(TypeError, match="takes a pydantic model"):
        app.agent("a", input=given)
    with pytest.raises(TypeError, match="takes a pydantic model"):
        app.agent("a", result=given)


def test_the_models_are_kept_on_the_spec() -> None:
    app = App()
    app.agent("shop", input=Order, result=Receipt)(lambda task: Complete())
    spec = app["shop"]
    assert (spec.input_model, spec.result_model) == (Order, Receipt)
    assert app.agents["shop"].input_model is Order


def test_an_invalid_input_names_every_wrong_field() -> None:
    app = App()
    app.agent("shop", input=Order)(lambda task: Complete())
    assert typed_input(app["shop"], {"item": "x", "quantity": 2}) == Order(item="x", quantity=2)
    with pytest.raises(ValidationError) as raised:
        typed_input(app["shop"], {"quantity": 0})
    assert invalid_fields(raised.value) == (
        "item: Field required; quantity: Input should be greater than or equal to 1"
    )
    untyped = App()
    untyped.agent("any")(lambda task: Complete())
    assert typed_input(untyped["any"], [1]) == [1]


def test_a_plain_handler_runs_in_the_pool_and_its_models_come_out_as_json() -> None:
    app = App()
    ran_in: list[str] = []
    logged_as: list[dict[str, str]] = []

    @app.agent("shop", input=Order, result=Receipt)
    def shop(task: TaskContext) -> Outcome:
        ran_in.append(threading.current_thread().name)
        logged_as.append(current_context())
        return Complete(Receipt(item=task.input.item, on=date(2026, 11, 23)))

    @app.agent("fanout")
    def fanout(task: TaskContext) -> Outcome:
        return Pause([Call("shop", Order(item="y", quantity=3)), Call("shop", {"raw": 1})])

    @app.agent("sloppy", result=Receipt)
    async def sloppy(task: TaskContext) -> Outcome:
        return Complete({"item": "z"})

    @app.agent("dict-result", result=Receipt)
    async def dict_result(task: TaskContext) -> Outcome:
        return Complete({"item": "z", "on": "2026-11-23"})

    async def scenario() -> None:
        with ThreadPoolExecutor(1, thread_name_prefix="pool") as pool:
            runner = flows(pool)
            order = Order(item="x", quantity=1)
            with log_context(task_id="t-1"):
                assert await runner.run_handler(app["shop"], context(order)) == Complete(
                    {"item": "x", "on": "2026-11-23"}
                )
            assert await runner.run_handler(app["fanout"], context()) == Pause(
                [Call("shop", {"item": "y", "quantity": 3}), Call("shop", {"raw": 1})]
            )
            with pytest.raises(InvalidTransition, match="not a valid Receipt: on: Field required"):
                await runner.run_handler(app["sloppy"], context())
            assert await runner.run_handler(app["dict-result"], context()) == Complete(
                {"item": "z", "on": "2026-11-23"}
            )
        assert ran_in == ["pool_0"]
        assert logged_as == [{"task_id": "t-1"}], "the run logs with its task's context"

    asyncio.run(scenario())


async def test_without_interceptors_the_handler_is_called_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No interceptor declared: a run goes straight to the handler, never through the chain."""

    async def no_chain(*_: Any) -> Any:
        raise AssertionError("a run without interceptors went through the chain")

    monkeypatch.setattr(Steps, "_intercepted", no_chain)
    app = App()

    @app.agent("echo")
    async def echo(task: TaskContext) -> Outcome:
        return Complete(task.input)

    runner = flows()
    assert runner.interceptors == ()
    assert await runner.run_handler(app["echo"], context("hi")) == Complete("hi")


def test_an_app_takes_observers_with_a_plain_on_failure_and_refuses_others() -> None:
    class Told:
        def on_failure(self, failure: Any) -> None:
            return None

    class Awaiting:
        async def on_failure(self, failure: Any) -> None:
            return None

    told = Told()
    assert App(observers=[told]).observers == (told,)
    with pytest.raises(TypeError, match=r"plain \(not async\) method on_failure"):
        App(observers=[Awaiting()])
    with pytest.raises(TypeError, match=r"plain \(not async\) method on_failure"):
        App(observers=[object()])
    with pytest.raises(TypeError, match="takes instances, not the class Told"):
        App(observers=[Told])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="a list of observers"):
        App(observers=told)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name", ["", "two words", "tab\there", "x<script>", 'q"uote', "a=b", "é", "new\nline"]
)
def test_an_agent_name_its_queue_cannot_have_is_refused_where_it_is_declared(name: str) -> None:
    app = App()
    with pytest.raises(ValueError, match="agent names are letters, digits"):

        @app.agent(name)
        async def handler(task: TaskContext) -> Outcome:
            return Complete(None)


@pytest.mark.parametrize("name", ["researcher", "a.b-c_d", "team:agent@1#x,y/z+w"])
def test_an_agent_name_amqp_allows_is_taken(name: str) -> None:
    app = App()

    @app.agent(name)
    async def handler(task: TaskContext) -> Outcome:
        return Complete(None)

    assert name in app.agents
