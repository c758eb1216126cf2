"""Publishers that do not wait are normal (issue 30, item 5), on the real broker and database.

* A result whose publisher's reply queue is gone (``submit --no-wait``, a client that submitted
  and closed) is counted in ``waystation_results_undelivered_total`` (by agent) and logged at
  debug: no dead letter, nothing at ERROR, so compose's ``WaystationDeadLetters`` does not fire.
  A reply to an agent's own reply queue that no queue takes stays a dead letter (``unroutable``).
* An agent declared with ``keep_results=True`` records the outcome of a task that calls no peers:
  ``waystation result`` and ``Client.result(task_id, agent=...)`` find it after its publisher left.
* ``Client.submit(..., delay=s)`` and ``waystation submit --delay s`` reach the agent's queue only
  after ``s`` seconds, waiting in the broker's wait queue.

Workers run in this process with ``tests/apps/nowait.py``; the ``waystation`` command runs as a
subprocess.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aio_pika
import orjson
import pytest
from aio_pika.abc import AbstractChannel

from scripts.lab.harness.broker import queue_depth
from tests.apps import nowait
from waystation.client import Client
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.runtime.worker import Worker
from waystation.settings import Settings

from ..support import dead_letters, eventually, running_worker, stream_types
from .test_cli import run_cli

pytestmark = pytest.mark.integration

AGENTS = ["leaf", "keeper"]


@pytest.fixture(autouse=True)
def held_runs(extra_agents: list[str]) -> Iterator[None]:
    """Every run waits for the test to release it; the agents' queues are deleted after."""
    extra_agents.extend(AGENTS)
    nowait.reset()
    yield
    nowait.release()


def metric(worker: Worker, name: str) -> float:
    """The sum of every series of the counter ``name`` (``_total``) the worker exports."""
    return sum(
        sample.value
        for family in worker.observer.metrics.registry.collect()
        for sample in family.samples
        if sample.name == f"{name}_total"
    )


def undelivered(worker: Worker, agent: str) -> float:
    registry = worker.observer.metrics.registry
    value = registry.get_sample_value("waystation_results_undelivered_total", {"agent": agent})
    return value or 0.0


async def cli(settings: Settings, *args: str) -> tuple[int, Any, str]:
    """``waystation ARGS`` as a subprocess: its exit code, stdout as JSON, and stderr; neither
    output holds a traceback."""
    done = await asyncio.to_thread(run_cli, settings, *args)
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    printed = orjson.loads(done.stdout) if done.stdout.strip() else None
    return done.returncode, printed, done.stderr


async def submit_and_leave(settings: Settings, agent: str, payload: Any) -> str:
    """Submit a task from a client that closes at once (its reply queue goes with it)."""
    async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        return await client.submit(agent, payload)


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_result_whose_publisher_did_not_wait_is_counted_undelivered_not_dead_lettered(
    settings: Settings,
    store: PostgresEventStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="waystation")
    names = Names(settings.queue_prefix)
    async with running_worker(nowait.app, settings, store) as worker:
        left = [await submit_and_leave(settings, "leaf", {"n": n}) for n in range(2)]
        code, printed, stderr = await cli(settings, "submit", "leaf", '{"n": 2}', "--no-wait")
        assert code == 0, stderr
        left.append(printed["task_id"])
        # every publisher is gone before any handler answers
        await eventually(lambda: set(left) <= set(nowait.STARTED), 60, "the three runs")
        nowait.release()
        await eventually(lambda: undelivered(worker, "leaf") == 3, 60, "3 results undelivered")
        assert worker.stats.counters.get("results_undelivered") == 3
        assert metric(worker, "waystation_dead_letters") == 0
        assert not [name for name in worker.stats.counters if name.startswith("dead_letter")]
        assert await queue_depth(settings.amqp_url, names.dead_letter_queue) == 0
    assert errors(caplog) == []
    told = [r for r in caplog.records if "not delivered" in r.getMessage()]
    assert len(told) == 3 and {r.levelno for r in told} == {logging.DEBUG}


async def test_a_reply_to_an_agents_reply_queue_no_queue_takes_is_still_a_dead_letter(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
) -> None:
    """Only a publisher's queue may go away normally: a Waystation agent's reply queue is the
    deployment's own (a paused task waits on it), and an answer it cannot take is kept."""
    names = Names(settings.queue_prefix)
    nowait.release()
    async with running_worker(nowait.app, settings, store) as worker:
        task_id = str(uuid.uuid4())
        await amqp_channel.default_exchange.publish(
            aio_pika.Message(
                b'"x"',
                message_id=task_id,
                reply_to=names.replies("nobody"),
                type="task",
                content_type="application/json",
            ),
            routing_key=names.tasks("leaf"),
            mandatory=True,
        )
        (letter,) = await dead_letters(amqp_channel, names, 1, within=60)
        assert letter.headers["x-waystation-reason"] == "unroutable"
        assert letter.headers["x-waystation-queue"] == names.replies("nobody")
        assert letter.correlation_id == task_id
        assert metric(worker, "waystation_dead_letters") == 1
        assert undelivered(worker, "leaf") == 0


async def test_an_agent_that_keeps_results_is_found_after_its_publisher_left(
    settings: Settings,
    store: PostgresEventStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="waystation")
    async with running_worker(nowait.app, settings, store) as worker:
        kept = await submit_and_leave(settings, "keeper", {"k": 1})
        code, printed, stderr = await cli(settings, "submit", "keeper", '{"k": 2}', "--no-wait")
        assert code == 0, stderr
        kept_by_cli = printed["task_id"]
        plain = await submit_and_leave(settings, "leaf", {"p": 1})
        await eventually(
            lambda: {kept, kept_by_cli, plain} <= set(nowait.STARTED), 60, "the three runs"
        )
        nowait.release()
        # the recorded results went through the outbox, to publishers that are gone
        await eventually(lambda: undelivered(worker, "keeper") == 2, 60, "2 kept undelivered")
        await eventually(lambda: undelivered(worker, "leaf") == 1, 60, "the plain one")
        assert await stream_types(store, kept) == ["TaskStarted", "TaskCompleted"]
        assert await stream_types(store, plain) == []  # G10 stays the default

        for task_id, payload in ((kept, {"k": 1}), (kept_by_cli, {"k": 2})):
            code, printed, stderr = await cli(settings, "result", task_id)
            assert code == 0, stderr
            assert printed == {
                "task_id": task_id,
                "status": "ok",
                "result": {"echo": payload},
                "error": None,
            }
            async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as later:
                found = await later.result(task_id, 60, agent="keeper")
            assert found.ok and found.result == {"echo": payload}

        code, _, stderr = await cli(settings, "result", plain)
        assert code == 2 and "not in the event log" in stderr
        assert metric(worker, "waystation_dead_letters") == 0
    assert errors(caplog) == []


async def test_waystation_agents_shows_which_agents_keep_their_results(settings: Settings) -> None:
    code, printed, stderr = await cli(
        settings, "agents", "--app", "tests.apps.nowait:app", "--json"
    )
    assert code == 0, stderr
    kept = {row["agent"]: row["keep_results"] for row in printed["agents"]}
    assert kept == {"leaf": False, "keeper": True}
    done = await asyncio.to_thread(run_cli, settings, "agents", "--app", "tests.apps.nowait:app")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[1:]}
    assert rows["keeper"].split()[-3:] == ["all", "-", "-"]
    assert rows["leaf"].split()[-4:] == ["if", "paused", "-", "-"]


async def test_a_delayed_submit_runs_only_after_its_delay(
    settings: Settings, store: PostgresEventStore
) -> None:
    nowait.release()
    async with (
        running_worker(nowait.app, settings, store),
        Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        submitted = time.time()
        delayed = await client.submit("leaf", "later", delay=2)
        now = await client.submit("leaf", "now")
        assert (await client.result(delayed, 60)).result == {"echo": "later"}
        assert (await client.result(now, 60)).ok
        # (the broker expires it 2 s after it took it, which was after ``submitted``; 50 ms
        # spare for the broker's clock against this one)
        assert nowait.STARTED[delayed] >= submitted + 1.95, nowait.STARTED[delayed] - submitted
        # the undelayed task, submitted after it, ran first
        assert nowait.STARTED[now] < nowait.STARTED[delayed]

        with pytest.raises(ValueError, match="delay"):
            await client.submit("leaf", "never", delay=-1)
        with pytest.raises(ValueError, match="delay"):
            await client.submit("leaf", "never", delay=float("nan"))
        with pytest.raises(LookupError, match="nobody"):
            await client.submit("nobody", "never", delay=1)


async def test_submit_delay_on_the_command_line(
    settings: Settings, store: PostgresEventStore
) -> None:
    nowait.release()
    async with running_worker(nowait.app, settings, store):
        before = time.time()
        code, printed, stderr = await cli(
            settings, "submit", "leaf", '"later"', "--delay", "2", "--timeout", "60"
        )
        assert code == 0, stderr
        assert printed["status"] == "ok" and printed["result"] == {"echo": "later"}
        assert nowait.STARTED[printed["task_id"]] >= before + 1.95

        code, printed, stderr = await cli(settings, "submit", "leaf", "1", "--delay", "-1")
        assert code == 2 and printed is None
        assert "--delay" in stderr and "delay must be" in stderr
