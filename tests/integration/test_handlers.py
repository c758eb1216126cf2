"""Handlers people already write: plain ``def`` handlers (run in the worker's thread pool) and
typed payloads (pydantic models for an agent's input and result), against the real services; and
``waystation schema`` with ``--app`` loaded from the current directory, as a subprocess."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel, Field

from scripts.lab.harness.broker import wait_for_consumers
from scripts.lab.harness.clients import RecordingClient
from scripts.lab.harness.processes import worker_environment
from waystation.agent import App, TaskContext
from waystation.events import Call, Complete, Outcome, Pause
from waystation.events.codec import loads
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import counter, dead_letters, eventually, running_worker, stream_types

pytestmark = pytest.mark.integration

WAYSTATION = str(Path(sys.executable).parent / "waystation")


# ---- plain def handlers ------------------------------------------------------------------------


class Blocker:
    """A blocking handler's controls: it says when it is running, and blocks until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []
        self.returned = threading.Event()


def plain_app(blocker: Blocker) -> App:
    app = App()

    @app.agent("sleeper")
    def sleeper(task: TaskContext) -> Outcome:
        blocker.threads.append(threading.current_thread().name)
        blocker.entered.set()
        deadline = time.monotonic() + 120
        while not blocker.release.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)  # blocking code, as a synchronous SDK is
        blocker.returned.set()
        return Complete({"slept": task.input["label"]})

    @app.agent("quick")
    async def quick(task: TaskContext) -> Outcome:
        return Complete({"double": task.input["x"] * 2})

    @app.agent("planner")
    def planner(task: TaskContext) -> Outcome:
        blocker.threads.append(threading.current_thread().name)
        if not task.resumed:
            return Pause([Call("quick", {"x": x}) for x in task.input["xs"]], update={"n": 1})
        return Complete({"sum": sum(r.value["double"] for r in task.results), "n": task.state["n"]})

    return app


async def test_a_plain_def_handler_that_blocks_does_not_stall_the_worker(
    settings: Settings, store: PostgresEventStore, extra_agents: list[str]
) -> None:
    """While a plain handler is blocked in time.sleep, the same worker runs other tasks to
    completion and stays healthy (its event loop, and so its broker heartbeats, go on)."""
    extra_agents.extend(["sleeper", "quick", "planner"])
    blocker = Blocker()
    try:
        async with (
            running_worker(plain_app(blocker), settings, store) as worker,
            RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
        ):
            sleeping = await client.submit("sleeper", {"label": "a"})
            await eventually(blocker.entered.is_set, 20, "the blocking handler to start")
            for x in range(3):
                quick = await client.call("quick", {"x": x}, timeout=20)
                assert quick.ok and quick.result == {"double": 2 * x}
            assert not blocker.returned.is_set(), "the blocking handler finished meanwhile"
            health = await worker.health()
            assert health.healthy and health.detail["state"] == "serving", health.detail
            assert health.detail["in_flight"] >= 1
            blocker.release.set()
            slept = await client.result(sleeping, timeout=20)
            assert slept.ok and slept.result == {"slept": "a"}
    finally:
        blocker.release.set()  # a failed test must not leave its thread blocked
    assert [name.startswith("waystation-handler") for name in blocker.threads] == [True]
    assert await stream_types(store, sleeping) == []  # G10 holds for plain handlers too


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "by-message"])
async def test_a_plain_def_handler_pauses_and_resumes_in_the_thread_pool(
    in_place: bool, settings: Settings, store: PostgresEventStore, extra_agents: list[str]
) -> None:
    extra_agents.extend(["sleeper", "quick", "planner"])
    settings = settings.model_copy(update={"resume_in_place": in_place})
    blocker = Blocker()
    async with (
        running_worker(plain_app(blocker), settings, store),
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        result = await client.call("planner", {"xs": [1, 2, 3]}, timeout=30)
    assert result.ok and result.result == {"sum": 12, "n": 1}
    assert len(blocker.threads) == 2
    assert all(name.startswith("waystation-handler") for name in blocker.threads)
    types = await stream_types(store, result.task_id)
    assert types[:2] == ["TaskStarted", "TaskPaused"] and types[-1] == "TaskCompleted"


# ---- typed payloads ----------------------------------------------------------------------------


class Question(BaseModel):
    text: str
    times: int = Field(ge=1)


class Answer(BaseModel):
    words: list[str]
    at: datetime


class Seen(BaseModel):
    """What a typed handler saw, handed back through the results."""

    input_type: str
    resumed_input_type: str | None = None
    peer: Any = None


def typed_app(seen: dict[str, str]) -> App:
    app = App()

    @app.agent("typed", input=Question, result=Answer)
    async def typed(task: TaskContext) -> Outcome:
        seen[task.task_id] = type(task.input).__name__
        question: Question = task.input
        words = question.text.split() * question.times
        return Complete(Answer(words=words, at=datetime(2026, 11, 23, 6, 0, tzinfo=UTC)))

    @app.agent("wrong-result", input=Question, result=Answer)
    async def wrong_result(task: TaskContext) -> Outcome:
        seen[task.task_id] = type(task.input).__name__
        return Complete({"words": "not a list"})

    @app.agent("typed-caller", input=Question, result=Seen)
    def typed_caller(task: TaskContext) -> Outcome:
        """Calls ``typed`` with its own input, a model as the call's input; answers with what
        it saw on both runs and the peer's result (left as JSON)."""
        if not task.resumed:
            return Pause([Call("typed", task.input)], update={"first": type(task.input).__name__})
        [reply] = task.results
        return Complete(
            Seen(
                input_type=task.state["first"],
                resumed_input_type=type(task.input).__name__,
                peer=reply.value if reply.ok else reply.error,
            )
        )

    return app


@pytest.fixture
def typed_agents(extra_agents: list[str]) -> list[str]:
    extra_agents.extend(["typed", "wrong-result", "typed-caller"])
    return extra_agents


async def test_a_typed_handler_gets_its_input_model_and_its_result_model_goes_out_as_json(
    settings: Settings, store: PostgresEventStore, typed_agents: list[str]
) -> None:
    seen: dict[str, str] = {}
    async with (
        running_worker(typed_app(seen), settings, store),
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        result = await client.call("typed", {"text": "a b", "times": 2}, timeout=20)
    assert result.ok, result.error
    assert result.result == {"words": ["a", "b", "a", "b"], "at": "2026-11-23T06:00:00Z"}
    assert seen[result.task_id] == "Question"


@pytest.mark.parametrize(
    ("body", "complaints"),
    [
        ({"text": "hi", "times": 0}, ["times: Input should be greater than or equal to 1"]),
        ({"text": "hi"}, ["times: Field required"]),
        ({"text": 3, "times": "x"}, ["text: Input should be a valid string", "times: "]),
        ([1, 2], ["Input should be a valid dictionary or instance of Question"]),
    ],
    ids=["out-of-range", "missing", "two-fields", "not-an-object"],
)
async def test_an_invalid_input_is_dead_lettered_before_the_handler_runs_and_its_publisher_told(
    body: Any,
    complaints: list[str],
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    typed_agents: list[str],
) -> None:
    names = Names(settings.queue_prefix)
    seen: dict[str, str] = {}
    async with (
        running_worker(typed_app(seen), settings, store) as worker,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        result = await client.call("typed", body, timeout=20)
        [dead] = await dead_letters(amqp_channel, names, 1)
        assert counter(worker, "dead_letter.invalid-input") == 1
        assert counter(worker, "handler_retries") == 0
    assert result.status == "error" and result.error["type"] == "invalid-input"
    for complaint in complaints:
        assert complaint in result.error["message"], result.error["message"]
    headers = dead.headers or {}
    assert headers["x-waystation-reason"] == "invalid-input"
    assert complaints[0] in str(headers["x-waystation-detail"])
    assert headers["x-waystation-queue"] == names.tasks("typed")
    assert dead.message_id == result.task_id and loads(dead.body) == body
    assert result.task_id not in seen, "the handler ran on an invalid input"
    assert await stream_types(store, result.task_id) == []


async def test_a_result_that_does_not_fit_the_result_model_fails_at_once(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    typed_agents: list[str],
) -> None:
    names = Names(settings.queue_prefix)
    seen: dict[str, str] = {}
    async with (
        running_worker(typed_app(seen), settings, store) as worker,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        result = await client.call("wrong-result", {"text": "x", "times": 1}, timeout=20)
        [dead] = await dead_letters(amqp_channel, names, 1)
        assert counter(worker, "handler_retries") == 0
    assert result.status == "error" and result.error["type"] == "InvalidTransition"
    assert "not a valid Answer: words: Input should be a valid list" in result.error["message"]
    assert "at: Field required" in result.error["message"]
    assert (dead.headers or {})["x-waystation-reason"] == "handler-failed"
    assert await stream_types(store, result.task_id) == ["TaskStarted", "TaskFailed"]


async def test_a_typed_plain_handler_calls_with_a_model_and_gets_its_input_model_on_resume(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    typed_agents: list[str],
) -> None:
    """A call's input given as a model goes out as its JSON form; the caller's input is a model
    on its first run and again on its resumed run; the peer's result reaches it as JSON."""
    names = Names(settings.queue_prefix)
    seen: dict[str, str] = {}
    async with (
        running_worker(typed_app(seen), settings, store),
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        result = await client.call("typed-caller", {"text": "x y", "times": 2}, timeout=20)
    assert result.ok, result.error
    assert result.result == {
        "input_type": "Question",
        "resumed_input_type": "Question",
        "peer": {"words": ["x", "y", "x", "y"], "at": "2026-11-23T06:00:00Z"},
    }
    dead = await amqp_channel.declare_queue(names.dead_letter_queue, passive=True)
    assert await dead.get(fail=False) is None


async def test_a_call_with_an_invalid_input_resumes_its_caller_with_an_invalid_input_error(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    typed_agents: list[str],
) -> None:
    names = Names(settings.queue_prefix)
    seen: dict[str, str] = {}
    app = typed_app(seen)

    @app.agent("sloppy-caller")
    async def sloppy_caller(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("typed", {"text": "x", "times": -1})])
        [reply] = task.results
        return Complete({"outcome": reply.outcome, "error": reply.error})

    typed_agents.append("sloppy-caller")
    async with (
        running_worker(app, settings, store),
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        result = await client.call("sloppy-caller", {}, timeout=20)
        [dead] = await dead_letters(amqp_channel, names, 1)
    assert result.ok, result.error
    assert result.result["outcome"] == "error"
    assert result.result["error"]["type"] == "invalid-input"
    assert "times: Input should be greater than or equal to 1" in result.result["error"]["message"]
    assert (dead.headers or {})["x-waystation-reason"] == "invalid-input"
    assert seen == {}, "the peer's handler ran on an invalid input"


# ---- waystation schema, --app from the current directory --------------------------------------

MODULE = """
from pydantic import BaseModel, Field

from waystation import App, Complete, TaskContext


class Question(BaseModel):
    text: str
    times: int = Field(default=1, ge=1)


class Answer(BaseModel):
    words: list[str]


app = App()


@app.agent("splitter", input=Question, result=Answer)
def splitter(task: TaskContext) -> Complete:
    return Complete(Answer(words=task.input.text.split() * task.input.times))


@app.agent("untyped")
async def untyped(task: TaskContext) -> Complete:
    return Complete(task.input)
"""


def run_in(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``waystation ARGS`` run from ``directory``, with nothing of it on PYTHONPATH."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(
        [WAYSTATION, *args], env=env, cwd=directory, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "mymod.py").write_text(textwrap.dedent(MODULE))
    return tmp_path


def test_schema_prints_the_json_schema_of_an_agents_input_and_result(app_dir: Path) -> None:
    shown = run_in(app_dir, "schema", "--app", "mymod:app", "splitter")
    assert shown.returncode == 0, shown.stderr
    document = orjson.loads(shown.stdout)
    assert document["agent"] == "splitter"
    assert document["input"]["title"] == "Question"
    assert document["input"]["required"] == ["text"]
    assert document["input"]["properties"]["times"] == {
        "default": 1,
        "minimum": 1,
        "title": "Times",
        "type": "integer",
    }
    assert document["result"]["title"] == "Answer"
    assert document["result"]["properties"]["words"]["type"] == "array"


def test_schema_of_an_agent_without_models_is_null_on_both_sides(app_dir: Path) -> None:
    shown = run_in(app_dir, "schema", "--app", "mymod:app", "untyped")
    assert shown.returncode == 0, shown.stderr
    assert orjson.loads(shown.stdout) == {"agent": "untyped", "input": None, "result": None}


def test_schema_of_an_unknown_agent_exits_2_naming_the_agents_there_are(app_dir: Path) -> None:
    shown = run_in(app_dir, "schema", "--app", "mymod:app", "nobody")
    assert shown.returncode == 2
    assert shown.stdout == ""
    assert "no agent 'nobody'" in shown.stderr and "splitter, untyped" in shown.stderr


def test_schema_refuses_an_attribute_that_is_not_an_app(app_dir: Path) -> None:
    shown = run_in(app_dir, "schema", "--app", "mymod:Question", "splitter")
    assert shown.returncode == 2
    assert "'mymod:Question' is a ModelMetaclass, not a waystation App" in shown.stderr


def test_app_is_imported_from_the_current_directory_only(app_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shown = run_in(elsewhere, "schema", "--app", "mymod:app", "splitter")
    assert shown.returncode == 2
    assert "cannot load app 'mymod:app'" in shown.stderr


async def test_a_worker_serves_an_app_from_its_current_directory(
    app_dir: Path, settings: Settings, extra_agents: list[str]
) -> None:
    """``waystation worker --app mymod:app`` run from the module's directory serves its agents:
    a plain handler with typed payloads, end to end in a real worker process."""
    extra_agents.extend(["splitter", "untyped"])
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(worker_environment(settings, WAYSTATION_BROKER_POLICY="none"))
    log = (app_dir / "worker.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        WAYSTATION,
        "worker",
        "--app",
        "mymod:app",
        env=env,
        cwd=app_dir,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        await wait_for_consumers(
            settings.amqp_url,
            [Names(settings.queue_prefix).tasks("splitter")],
            1,
            alive=lambda: process.returncode is None,
        )
        async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
            result = await client.call("splitter", {"text": "a b", "times": 2}, timeout=60)
            invalid = await client.call("splitter", {"times": 2}, timeout=60)
    finally:
        process.terminate()
        code = await asyncio.wait_for(process.wait(), 30)
        log.close()
    assert result.ok and result.result == {"words": ["a", "b", "a", "b"]}, result.error
    assert invalid.status == "error" and invalid.error["type"] == "invalid-input"
    assert "text: Field required" in invalid.error["message"]
    assert code == 0, (app_dir / "worker.log").read_text()[-3000:]
