"""A handler that raises is told, once per attempt: logged with its traceback, its task, agent and
attempt (WARNING while it will be retried, ERROR when the task fails), and passed to the app's
observers (``App(observers=[...])``, ``TaskObserver.on_failure``), whose own mistakes never
reach the worker. It used to reach the publisher alone, as ``{"type": ..., "message": ...}``.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import orjson
import pytest

from scripts.lab.harness.processes import WorkerProcess
from waystation.agent import App, HandlerFailure, TaskContext, TaskObserver
from waystation.client import Client, TaskResult
from waystation.events import Call, Complete, Outcome, Pause
from waystation.events.postgres import PostgresEventStore
from waystation.policies import Backoff, Permanent
from waystation.runtime.worker import Worker
from waystation.settings import Settings

from ..support import eventually, running_worker, start_example_workers

pytestmark = pytest.mark.integration

QUICK = Backoff(initial=0.05, maximum=0.05)


class Recording:
    """An observer that keeps what it is told."""

    def __init__(self) -> None:
        self.failures: list[HandlerFailure] = []

    def on_failure(self, failure: HandlerFailure) -> None:
        self.failures.append(failure)


class Broken:
    """An observer that raises on every failure it is told of."""

    def __init__(self) -> None:
        self.calls = 0

    def on_failure(self, failure: HandlerFailure) -> None:
        self.calls += 1
        raise RuntimeError("the observer itself is broken")


def app_with(*observers: TaskObserver) -> App:
    app = App(observers=observers)

    @app.agent("broken", retries=2, backoff=QUICK)
    async def broken(task: TaskContext) -> Outcome:
        raise KeyError("n")

    @app.agent("hopeless", retries=4, backoff=QUICK)
    async def hopeless(task: TaskContext) -> Outcome:
        raise Permanent("no use trying again")

    @app.agent("resumer", retries=1, backoff=QUICK)
    async def resumer(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("helper", {})])
        raise ValueError(f"cannot use {task.results[0].value!r}")

    @app.agent("helper")
    async def helper(task: TaskContext) -> Outcome:
        return Complete(41)

    return app


AGENTS = ["broken", "hopeless", "resumer", "helper"]


def failure_records(caplog: pytest.LogCaptureFixture, task_id: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "waystation.observability.observer"
        and getattr(r, "fields", {}).get("task_id") == task_id
    ]


def raised_in(error: BaseException, function: str) -> bool:
    """Whether ``error``'s traceback runs through ``function`` (the handler that raised it)."""
    return any(frame.name == function for frame in traceback.extract_tb(error.__traceback__))


CallWatched = Callable[..., Awaitable[tuple[TaskResult, Worker]]]


@pytest.fixture
def call_watched(
    settings: Settings,
    store: PostgresEventStore,
    extra_agents: list[str],
    caplog: pytest.LogCaptureFixture,
) -> CallWatched:
    """``call(agent, *observers, worker_observers=(), **settings)``: one task of ``agent``
    through a worker (in this process, on the real services) of ``app_with(*observers)``, with
    ``worker_observers`` of its own; its result, and the worker (stopped: its counters stay).
    The test's ``caplog`` keeps its WARNING and ERROR lines."""
    extra_agents.extend(AGENTS)
    caplog.set_level(logging.WARNING)

    async def call(
        agent: str,
        *observers: TaskObserver,
        worker_observers: Sequence[TaskObserver] = (),
        **changes: object,
    ) -> tuple[TaskResult, Worker]:
        config = settings.model_copy(update=changes)
        async with (
            running_worker(
                app_with(*observers), config, store, observers=worker_observers
            ) as worker,
            Client(config.amqp_url, queue_prefix=config.queue_prefix) as client,
        ):
            return await client.call(agent, {}, timeout=30), worker

    return call


async def test_every_failed_attempt_is_logged_with_its_traceback_and_told_to_the_observers(
    call_watched: CallWatched, caplog: pytest.LogCaptureFixture
) -> None:
    recording, broken = Recording(), Broken()
    # the broken observer first: the one after it is told all the same
    result, _ = await call_watched("broken", broken, recording)
    assert result.status == "error" and result.error == {"type": "KeyError", "message": "'n'"}
    told = [f for f in recording.failures if f.task_id == result.task_id]
    assert [(f.attempt, f.attempts, f.will_retry) for f in told] == [
        (1, 3, True),
        (2, 3, True),
        (3, 3, False),
    ]
    assert all(f.agent == "broken" and f.pause == 0 for f in told)
    assert [f.retry_in is not None for f in told] == [True, True, False]
    assert all(isinstance(f.error, KeyError) and raised_in(f.error, "broken") for f in told)
    assert broken.calls == 3, "a broken observer is still told of every failure"

    records = failure_records(caplog, result.task_id)
    assert [(r.levelname, r.fields["attempt"]) for r in records] == [  # type: ignore[attr-defined]
        ("WARNING", 1),
        ("WARNING", 2),
        ("ERROR", 3),
    ]
    for record in records:
        assert record.exc_info is not None and record.exc_info[1] is not None
        assert raised_in(record.exc_info[1], "broken")
        assert record.fields["agent"] == "broken"  # type: ignore[attr-defined]
    ignored = [r for r in caplog.records if "failed in on_failure" in r.getMessage()]
    assert len(ignored) == 3 and all(r.exc_info for r in ignored)


async def test_a_permanent_error_is_logged_and_told_once(
    call_watched: CallWatched, caplog: pytest.LogCaptureFixture
) -> None:
    recording, the_workers = Recording(), Recording()
    result, _ = await call_watched("hopeless", recording, worker_observers=[the_workers])
    assert result.status == "error" and result.error["type"] == "Permanent"
    [told] = [f for f in recording.failures if f.task_id == result.task_id]
    assert (told.attempt, told.attempts, told.will_retry) == (1, 5, False)
    assert the_workers.failures == [told], "a Worker's own observers are told too"
    [record] = failure_records(caplog, result.task_id)
    assert record.levelname == "ERROR" and record.exc_info is not None


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "by-message"])
async def test_a_resumed_run_that_raises_is_logged_and_told_with_its_pause(
    in_place: bool, call_watched: CallWatched, caplog: pytest.LogCaptureFixture
) -> None:
    recording = Recording()
    result, worker = await call_watched("resumer", recording, resume_in_place=in_place)
    # in place, the first failed run hands the task over to a resume message, which fails again
    assert worker.stats.counters.get("resumes_handed_over", 0) == (1 if in_place else 0)
    assert result.status == "error" and result.error["message"] == "cannot use 41"
    told = [f for f in recording.failures if f.task_id == result.task_id]
    assert [(f.attempt, f.will_retry, f.pause) for f in told] == [(1, True, 1), (2, False, 1)]
    assert all(raised_in(f.error, "resumer") for f in told)
    records = failure_records(caplog, result.task_id)
    assert [r.levelname for r in records] == ["WARNING", "ERROR"]
    assert all(r.exc_info is not None for r in records)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_worker_logs_each_failed_attempt_as_a_json_line_with_its_traceback(
    settings: Settings, tmp_path: Path
) -> None:
    """The newcomer's case: the example app's orchestrator without its ``n``, in a worker
    process with the default delivery limit (5 attempts), its log JSON lines (a file)."""
    log_path = tmp_path / "worker.log"
    worker = WorkerProcess.with_settings(settings, log_path)
    try:
        await start_example_workers(settings, [worker])
        async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
            result = await client.call("orchestrator", {"k": 2}, timeout=60)
        assert result.error == {"type": "KeyError", "message": "'n'"}

        def failures() -> list[dict[str, object]]:
            lines = [
                orjson.loads(line)
                for line in log_path.read_bytes().splitlines()
                if line.startswith(b"{")
            ]
            return [
                line
                for line in lines
                if line.get("logger") == "waystation.observability.observer"
                and line.get("task_id") == result.task_id
            ]

        await eventually(lambda: len(failures()) >= 5, 30, "five failure lines")
    finally:
        code = worker.stop()
    assert code == 0
    found = failures()
    assert [(line["level"], line["attempt"]) for line in found] == [
        ("WARNING", 1),
        ("WARNING", 2),
        ("WARNING", 3),
        ("WARNING", 4),
        ("ERROR", 5),
    ]
    for line in found:
        assert line["agent"] == "orchestrator" and line["attempts"] == 5
        exception = str(line["exception"])
        assert exception.startswith("Traceback (most recent call last)")
        assert "in orchestrator\n" in exception and exception.endswith("KeyError: 'n'")
