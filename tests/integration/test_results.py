"""Results that can be found again, and the state size limit (issue 14, sections 4 and 5).

* A resent task id whose task has finished is answered from the log, with the result body its
  first publisher got, and its handler does not run again; a task that completed without calling
  peers is not in the log (G10), so its resend runs again.
* ``waystation result TASK_ID`` (run as a subprocess) prints the recorded outcome.
* ``Client.result(task_id, agent=...)`` finds the result of a task another client submitted,
  through a ``query`` message a worker answers from the log.
* A pause whose state would be larger than ``WAYSTATION_MAX_STATE_BYTES`` fails its task at once.

Workers run in this process; the test plays the peer ``ghost`` with a plain aio-pika channel.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import orjson
import pytest
from aio_pika.abc import AbstractChannel, AbstractQueue

from scripts.lab.harness.broker import declare_quorum_queue
from scripts.lab.harness.clients import RecordingClient
from waystation.agent import App, TaskContext
from waystation.events import Call, Complete, Outcome, Pause
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import counter, dead_letters, eventually, publish_reply, running_worker, take
from .test_cli import run_cli

pytestmark = pytest.mark.integration


def results_app(runs: Counter[str]) -> App:
    app = App()

    @app.agent("asker")
    async def asker(task: TaskContext) -> Outcome:
        """Calls ``helper`` once, then completes with what it answered."""
        if not task.resumed:
            runs["asker"] += 1
            return Pause([Call("helper", task.input)], update={"asked": True})
        return Complete({"got": task.results[0].value})

    @app.agent("helper")
    async def helper(task: TaskContext) -> Outcome:
        """Completes at once, calling no peer (so, as a root task, it records nothing)."""
        runs["helper"] += 1
        return Complete(task.input)

    @app.agent("broken")
    async def broken(task: TaskContext) -> Any:
        """Returns what is not an outcome: the task fails for good, at once."""
        runs["broken"] += 1
        return "not an outcome"

    @app.agent("waiter")
    async def waiter(task: TaskContext) -> Outcome:
        """Calls ``ghost`` (the test plays it), then completes with its answer."""
        if not task.resumed:
            runs["waiter"] += 1
            return Pause([Call("ghost", task.input)])
        return Complete(task.results[0].value)

    @app.agent("hoarder")
    async def hoarder(task: TaskContext) -> Outcome:
        """Keeps ``first`` bytes in its state at its first pause, ``second`` more at its next."""
        runs[f"hoarder:{task.pause}"] += 1
        if task.pause == 0:
            return Pause([Call("helper", 1)], update={"first": "x" * task.input["first"]})
        if task.pause == 1:
            return Pause([Call("helper", 2)], update={"second": "y" * task.input["second"]})
        return Complete(sorted(task.state))

    return app


AGENTS = ["asker", "helper", "broken", "waiter", "ghost", "hoarder"]


@pytest.fixture
async def ghost(
    amqp_channel: AbstractChannel, settings: Settings, extra_agents: list[str]
) -> AbstractQueue:
    extra_agents.extend(AGENTS)
    return await declare_quorum_queue(amqp_channel, Names(settings.queue_prefix).tasks("ghost"))


async def cli(settings: Settings, *args: str) -> tuple[int, Any, str]:
    """Run ``waystation ARGS`` as a subprocess: exit code, its stdout as JSON, its stderr."""
    done = await asyncio.to_thread(run_cli, settings, *args)
    return done.returncode, orjson.loads(done.stdout) if done.stdout.strip() else None, done.stderr


async def test_a_resent_finished_task_is_answered_from_the_log_and_not_run_again(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    runs: Counter[str] = Counter()
    async with (
        running_worker(results_app(runs), settings, store) as worker,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as first,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as other,
    ):
        # completed (it paused, so the log holds it)
        done = await first.submit("asker", {"q": 1})
        assert (await first.result(done, 60)).result == {"got": {"q": 1}}
        # failed for good
        failed = await first.submit("broken", None)
        failure = await first.result(failed, 60)
        assert failure.status == "error" and failure.error["type"] == "InvalidTransition"
        # cancelled during its pause
        cancelled = await first.submit("waiter", {"w": 1})
        await take(ghost, 1)
        assert await first.cancel("waiter", cancelled, reason="no longer", timeout=60) == (
            "cancelled"
        )
        assert (await first.result(cancelled, 60)).status == "cancelled"
        assert runs == Counter(asker=1, helper=1, broken=1, waiter=1)

        # another publisher resends each id: answered from the log, the same body, not run again
        for task_id, agent in ((done, "asker"), (failed, "broken"), (cancelled, "waiter")):
            await other.submit(agent, {"resent": True}, task_id=task_id)
            answer = await other.result(task_id, 60)
            assert other.bodies(task_id) == first.bodies(task_id)[:1], agent
            assert answer.task_id == task_id
        assert runs == Counter(asker=1, helper=1, broken=1, waiter=1), "a handler ran again"
        # (counted once the broker confirmed the answer, which may be after the client has it)
        await eventually(
            lambda: counter(worker, "results_answered_from_log") == 3, 30, "the count of answers"
        )

        # the first publisher resending to its own queue asked again: it is answered again
        await first.submit("asker", {"q": 1}, task_id=done)
        await eventually(lambda: len(first.bodies(done)) == 2, 30, "the second answer")
        assert first.bodies(done)[0] == first.bodies(done)[1]
        assert first.duplicates == 1
        assert runs["asker"] == 1

        # a task that completed without calling peers wrote nothing (G10): a resend runs it again
        plain = await first.submit("helper", "v1")
        assert (await first.result(plain, 60)).result == "v1"
        await other.submit("helper", "v2", task_id=plain)
        assert (await other.result(plain, 60)).result == "v2"
        assert runs["helper"] == 3
        assert await store.read_stream(plain) == []
        await eventually(
            lambda: counter(worker, "results_answered_from_log") == 4, 30, "the count of answers"
        )


async def test_the_result_command_prints_what_the_log_records(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    runs: Counter[str] = Counter()
    async with (
        running_worker(results_app(runs), settings, store),
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        done = await client.submit("asker", [1, 2])
        await client.result(done, 60)
        failed = await client.submit("broken", None)
        await client.result(failed, 60)
        paused = await client.submit("waiter", "w")
        (request,) = await take(ghost, 1)
        plain = await client.submit("helper", "h")
        await client.result(plain, 60)

        code, printed, _ = await cli(settings, "result", done)
        assert code == 0
        assert printed == {
            "task_id": done,
            "status": "ok",
            "result": {"got": [1, 2]},
            "error": None,
        }
        code, printed, _ = await cli(settings, "result", done, "--json")
        assert code == 0
        assert printed == {
            "task_id": done,
            "status": "completed",
            "outcome": orjson.loads(client.bodies(done)[0]),
        }

        code, printed, _ = await cli(settings, "result", failed)
        assert code == 1
        assert printed["status"] == "error"
        assert printed["error"]["type"] == "InvalidTransition"

        code, printed, stderr = await cli(settings, "result", paused)
        assert code == 3, stderr
        assert printed == {"task_id": paused, "status": "pending"}
        assert "paused" in stderr
        code, printed, _ = await cli(settings, "result", paused, "--json")
        assert (code, printed["status"], printed["outcome"]) == (3, "paused", None)

        code, printed, stderr = await cli(settings, "result", plain)
        assert code == 2 and printed is None
        assert "not in the event log" in stderr
        code, printed, _ = await cli(settings, "result", plain, "--json")
        assert (code, printed) == (2, {"task_id": plain, "status": "unknown", "outcome": None})

        # cancelled
        assert await client.cancel("waiter", paused, reason="enough", timeout=60) == "cancelled"
        code, printed, _ = await cli(settings, "result", paused)
        assert code == 1
        assert printed == {
            "task_id": paused,
            "status": "cancelled",
            "result": None,
            "error": {"type": "cancelled", "message": "enough"},
        }
        await publish_reply(amqp_channel, request, {"status": "ok", "result": "late"})


async def test_a_client_finds_the_result_of_a_task_it_did_not_submit(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    runs: Counter[str] = Counter()
    async with (
        running_worker(results_app(runs), settings, store) as worker,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as publisher,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as stranger,
    ):
        task_id = await publisher.submit("waiter", {"x": 1})
        (request,) = await take(ghost, 1)
        found = await stranger.lookup("waiter", task_id)
        assert (found.status, found.result) == ("paused", None)
        # any agent's queue will do: every worker reads the same log
        assert (await stranger.lookup("helper", task_id)).status == "paused"
        assert (await stranger.lookup("helper", "no-such-task")).status == "unknown"

        waiting = asyncio.create_task(stranger.result(task_id, 60, agent="waiter", poll=0.1))
        await eventually(lambda: counter(worker, "queries_answered") >= 4, 30, "a poll")
        assert not waiting.done()
        await publish_reply(amqp_channel, request, {"status": "ok", "result": "from ghost"})
        answer = await waiting
        assert (answer.status, answer.result) == ("ok", "from ghost")
        assert (await publisher.result(task_id, 60)).result == "from ghost"
        assert stranger.bodies(task_id) == [], "the stranger was never sent the task's result"
        # kept: asking again needs no query
        asked = counter(worker, "queries_answered")
        assert (await stranger.result(task_id, 1, agent="waiter")).result == "from ghost"
        assert counter(worker, "queries_answered") == asked

        # a task it did not submit and that is not in the log: only the timeout ends the wait
        with pytest.raises(TimeoutError):
            await stranger.result("never-submitted", 1, agent="waiter", poll=0.1)
        assert runs["waiter"] == 1


async def test_a_pause_past_the_state_limit_fails_its_task_at_once(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    runs: Counter[str] = Counter()
    limited = settings.model_copy(update={"max_state_bytes": 1000})
    async with (
        running_worker(results_app(runs), limited, store) as worker,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        fits = await client.submit("hoarder", {"first": 300, "second": 300})
        assert (await client.result(fits, 60)).result == ["first", "second"]

        at_once = await client.submit("hoarder", {"first": 2000, "second": 0})
        failure = await client.result(at_once, 60)
        assert failure.status == "error"
        assert failure.error["type"] == "StateTooLarge"
        assert "2012 bytes, more than the 1000 allowed" in failure.error["message"]
        assert "WAYSTATION_MAX_STATE_BYTES" in failure.error["message"]

        later = await client.submit("hoarder", {"first": 500, "second": 600})
        failure = await client.result(later, 60)
        assert failure.status == "error" and failure.error["type"] == "StateTooLarge"
        assert "more than the 1000 allowed" in failure.error["message"]

        # the first run's message is dead-lettered; the failure in a resumed run is recorded
        # with the reply that resumed it, which is acked
        (letter,) = await dead_letters(amqp_channel, Names(settings.queue_prefix), 1, 30)
        assert letter.message_id == at_once
        assert letter.headers["x-waystation-reason"] == "handler-failed"
        assert counter(worker, "handler_retries") == 0, "a state too large is never retried"
    assert runs["hoarder:0"] == 3 and runs["hoarder:1"] == 2 and runs["hoarder:2"] == 1
    assert [e.event_type for e in await store.read_stream(at_once)] == [
        "TaskStarted",
        "TaskFailed",
    ]
    later_types = [e.event_type for e in await store.read_stream(later)]
    assert later_types[0] == "TaskStarted" and later_types[-1] == "TaskFailed"
    assert later_types.count("TaskPaused") == 1
