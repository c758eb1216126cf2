"""A failing handler: retried up to the delivery limit, then recorded as failed, answered with an
error and dead-lettered (``handler-failed``); an invalid outcome, or one the log cannot store,
fails at once.

The tests run with ``broker_policy="none"``: nothing but the worker itself counts attempts (a
retry is a copy sent back to the queue carrying ``x-waystation-attempts``) and dead-letters, so
what they see is the worker's doing.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from typing import Any

import pytest
from aio_pika.abc import AbstractChannel, AbstractQueue

from scripts.lab.harness.broker import declare_quorum_queue
from scripts.lab.harness.checks import chain_problems
from scripts.lab.harness.clients import RecordingClient
from waystation.agent import App, TaskContext
from waystation.events import Call, Complete, Outcome, Pause
from waystation.events.codec import loads
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import counter, dead_letters, publish_reply, running_worker, stream_types, take

pytestmark = pytest.mark.integration

LIMIT = 3


def failing_app(invocations: Counter[tuple[str, int]]) -> App:
    """Handlers that fail in every way; ``invocations`` counts runs per (task, pause)."""
    app = App()

    @app.agent("broken")
    async def broken(task: TaskContext) -> Outcome:
        invocations[task.task_id, task.pause] += 1
        raise RuntimeError("always broken")

    @app.agent("flaky")
    async def flaky(task: TaskContext) -> Outcome:
        invocations[task.task_id, task.pause] += 1
        if invocations[task.task_id, task.pause] <= 2:
            raise ConnectionError(f"attempt {invocations[task.task_id, task.pause]} failed")
        return Complete({"attempts": invocations[task.task_id, task.pause]})

    @app.agent("empty-pause")
    async def empty_pause(task: TaskContext) -> Outcome:
        invocations[task.task_id, task.pause] += 1
        return Pause([])

    @app.agent("returns-none")
    async def returns_none(task: TaskContext) -> Outcome:
        invocations[task.task_id, task.pause] += 1
        return None  # type: ignore[return-value]

    @app.agent("bad-state")
    async def bad_state(task: TaskContext) -> Outcome:
        invocations[task.task_id, task.pause] += 1
        return Pause([Call("ghost")], update={"when": object()})

    @app.agent("endless-call")
    async def endless_call(task: TaskContext) -> Outcome:
        invocations[task.task_id, task.pause] += 1
        return Pause([Call("ghost", timeout=math.inf)])

    @app.agent("nan-result")
    async def nan_result(task: TaskContext) -> Outcome:
        invocations[task.task_id, task.pause] += 1
        return Complete({"score": math.nan})

    @app.agent("nul-result")
    async def nul_result(task: TaskContext) -> Outcome:
        invocations[task.task_id, task.pause] += 1
        return Complete({"text": "a\x00b"})

    @app.agent("deep-call")
    async def deep_call(task: TaskContext) -> Outcome:
        invocations[task.task_id, task.pause] += 1
        nested: Any = 1
        for _ in range(300):
            nested = [nested]
        return Pause([Call("ghost", nested)])

    @app.agent("bad-resume")
    async def bad_resume(task: TaskContext) -> Outcome:
        """Pauses on ``ghost``; on resume raises, or returns an invalid outcome."""
        invocations[task.task_id, task.pause] += 1
        if not task.resumed:
            return Pause([Call("ghost", {"x": 1})])
        if task.input["how"] == "raise":
            raise ValueError(f"cannot use {task.results[0].value!r}")
        if task.input["how"] == "unstorable":
            return Complete({"total": math.inf})
        return Pause([Call("ghost", timeout=-1)])

    return app


@pytest.fixture
def limited(settings: Settings) -> Settings:
    return settings.model_copy(update={"delivery_limit": LIMIT})


@pytest.fixture
async def ghost(
    amqp_channel: AbstractChannel, settings: Settings, extra_agents: list[str]
) -> AbstractQueue:
    extra_agents.extend(
        [
            "broken",
            "flaky",
            "empty-pause",
            "returns-none",
            "bad-state",
            "endless-call",
            "nan-result",
            "nul-result",
            "deep-call",
            "bad-resume",
            "ghost",
        ]
    )
    return await declare_quorum_queue(amqp_channel, Names(settings.queue_prefix).tasks("ghost"))


async def test_a_handler_that_always_raises_is_retried_to_the_limit_then_failed_for_good(
    limited: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    names = Names(limited.queue_prefix)
    invocations: Counter[tuple[str, int]] = Counter()
    async with (
        running_worker(failing_app(invocations), limited, store) as worker,
        RecordingClient(limited.amqp_url, queue_prefix=limited.queue_prefix) as client,
    ):
        task_id = await client.submit("broken", {"please": "work"})
        result = await client.result(task_id, timeout=20)
        assert result.status == "error"
        assert result.error == {"type": "RuntimeError", "message": "always broken"}
        [dead] = await dead_letters(amqp_channel, names, 1)
        await asyncio.sleep(0.3)  # room for an attempt too many
        assert invocations[task_id, 0] == LIMIT
        assert counter(worker, "handler_retries") == LIMIT - 1
        assert counter(worker, "tasks_failed") == 1
        assert counter(worker, "dead_letter.handler-failed") == 1
    headers = dead.headers or {}
    assert headers["x-waystation-reason"] == "handler-failed"
    assert headers["x-waystation-detail"] == "RuntimeError: always broken"
    assert headers["x-waystation-queue"] == names.tasks("broken")
    assert dead.message_id == task_id and loads(dead.body) == {"please": "work"}
    events = await store.read_stream(task_id)
    assert [e.event_type for e in events] == ["TaskStarted", "TaskFailed"]
    assert events[1].data["error"] == {"type": "RuntimeError", "message": "always broken"}
    assert events[0].data["input"] == {"please": "work"}
    assert chain_problems(events) == []
    assert len(client.distinct_results(task_id)) == 1


async def test_a_handler_that_fails_twice_then_succeeds_completes_normally(
    limited: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    names = Names(limited.queue_prefix)
    invocations: Counter[tuple[str, int]] = Counter()
    async with (
        running_worker(failing_app(invocations), limited, store) as worker,
        RecordingClient(limited.amqp_url, queue_prefix=limited.queue_prefix) as client,
    ):
        result = await client.call("flaky", {}, timeout=20)
        assert result.ok and result.result == {"attempts": 3}
        assert counter(worker, "handler_retries") == 2
        assert counter(worker, "tasks_failed") == 0
    assert invocations[result.task_id, 0] == 3
    # completed without peers, but on a retry: recorded, so that another line of runs of the
    # same task (left by a worker that died between retrying and acking) cannot answer
    # differently; a first delivery that completes writes nothing (G10)
    assert await stream_types(store, result.task_id) == ["TaskStarted", "TaskCompleted"]
    dead = await amqp_channel.declare_queue(names.dead_letter_queue, passive=True)
    assert await dead.get(fail=False) is None
    assert len(client.distinct_results(result.task_id)) == 1


@pytest.mark.parametrize(
    ("agent", "complaint"),
    [
        ("empty-pause", "a pause needs at least one call"),
        ("returns-none", "returned NoneType, not Complete or Pause"),
        ("bad-state", "cannot be stored: a value of type object is not JSON"),
        ("endless-call", "must be a positive number"),
        # outcomes the log cannot store used to fail inside the commit, taken for a transient
        # error, and were retried until the broker dead-lettered them silently
        ("nan-result", "the result cannot be stored: a number is NaN or infinite"),
        ("nul-result", "the result cannot be stored: a string holds a NUL character"),
        ("deep-call", "the input of call 0 cannot be stored: it nests deeper than 128 levels"),
    ],
)
async def test_an_invalid_outcome_fails_at_once_without_retries(
    agent: str,
    complaint: str,
    limited: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    names = Names(limited.queue_prefix)
    invocations: Counter[tuple[str, int]] = Counter()
    async with (
        running_worker(failing_app(invocations), limited, store) as worker,
        RecordingClient(limited.amqp_url, queue_prefix=limited.queue_prefix) as client,
    ):
        result = await client.call(agent, {}, timeout=20)
        [dead] = await dead_letters(amqp_channel, names, 1)
        assert counter(worker, "handler_retries") == 0
    assert invocations[result.task_id, 0] == 1
    assert result.status == "error" and result.error["type"] == "InvalidTransition"
    assert complaint in result.error["message"]
    assert (dead.headers or {})["x-waystation-reason"] == "handler-failed"
    assert await stream_types(store, result.task_id) == ["TaskStarted", "TaskFailed"]
    assert await ghost.get(fail=False) is None, "a call of an invalid outcome was sent"


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "by-message"])
@pytest.mark.parametrize(("how", "runs"), [("raise", LIMIT), ("invalid", 1), ("unstorable", 1)])
async def test_a_failure_in_a_resumed_run_fails_the_task_after_its_retries(
    how: str,
    runs: int,
    in_place: bool,
    limited: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    """A resumed run that raises is retried up to the delivery limit, counting a first run in
    place; an invalid outcome fails at once. Both end with TaskFailed and an error result."""
    limited = limited.model_copy(update={"resume_in_place": in_place})
    names = Names(limited.queue_prefix)
    invocations: Counter[tuple[str, int]] = Counter()
    async with (
        running_worker(failing_app(invocations), limited, store) as worker,
        RecordingClient(limited.amqp_url, queue_prefix=limited.queue_prefix) as client,
    ):
        task_id = await client.submit("bad-resume", {"how": how})
        [request] = await take(ghost, 1)
        await publish_reply(amqp_channel, request, {"status": "ok", "result": 41}, message_id="r")
        result = await client.result(task_id, timeout=20)
        # an invalid outcome in place fails in the reply's own append: no resume message exists
        # to dead-letter (the reply itself was fine)
        dead_lettered = not (in_place and how != "raise")
        dead = (await dead_letters(amqp_channel, names, 1))[0] if dead_lettered else None
        await asyncio.sleep(0.3)
        assert counter(worker, "tasks_failed") == 1
        assert counter(worker, "resumes_handed_over") == (1 if in_place and how == "raise" else 0)
    assert invocations[task_id, 0] == 1 and invocations[task_id, 1] == runs
    assert result.status == "error"
    expected: dict[str, Any] = (
        {"type": "ValueError", "message": "cannot use 41"}
        if how == "raise"
        else {"type": "InvalidTransition"}
    )
    assert expected.items() <= result.error.items(), result.error
    if dead is not None:
        headers = dead.headers or {}
        assert headers["x-waystation-reason"] == "handler-failed"
        assert dead.type == "resume" and loads(dead.body) == {"task_id": task_id, "pause": 1}
    else:
        dead_letter_queue = await amqp_channel.declare_queue(names.dead_letter_queue, passive=True)
        assert await dead_letter_queue.get(fail=False) is None
    events = await store.read_stream(task_id)
    assert [e.event_type for e in events] == [
        "TaskStarted",
        "TaskPaused",
        "SubtaskClaimed",
        "ResultRecorded",
        "TaskResumed",
        "TaskFailed",
    ]
    assert events[-1].data["error"] == result.error
    assert chain_problems(events) == []
    assert await store.pending_call_deadlines(task_id) == {}
    assert len(client.distinct_results(task_id)) == 1
