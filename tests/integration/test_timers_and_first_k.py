"""Timers and first-k fan-in on three worker processes and the real services (issue 31).

A timer is a row of the pending-calls projection in PostgreSQL, nothing held by a worker: it
fires after every worker was SIGKILLed and new ones started, claimed exactly once. A
``FirstK(2)`` pause of three calls resumes on the first two and cancels the third, whose peer
never answers and whose deadline (600 s) no test waits for.

The agents are ``tests/apps/timers.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.lab.harness.clients import RecordingClient
from scripts.lab.harness.processes import WorkerProcess, app_workers, worker_logs
from waystation.events import RecordedEvent
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..apps.timers import HANG_TIMEOUT
from ..support import eventually, start_workers

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.apps.timers:app"
AGENTS = ["napper", "fanout", "quick", "hang"]
WITHIN = 60.0
"""How long a test waits for what it expects: far below the call to hang's deadline."""
assert WITHIN < HANG_TIMEOUT / 5, "a wait as long as hang's deadline would prove nothing"


async def start(settings: Settings, workers: list[WorkerProcess]) -> None:
    names = Names(settings.queue_prefix, settings.reply_shards)
    queues = [q for agent in AGENTS for q in (names.tasks(agent), *names.reply_queues(agent))]
    await start_workers(settings, workers, queues)


def of_type(events: list[RecordedEvent], event_type: str) -> list[RecordedEvent]:
    return [e for e in events if e.event_type == event_type]


async def recorded(store: PostgresEventStore, task_id: str, event_type: str) -> bool:
    return bool(of_type(await store.read_stream(task_id), event_type))


async def test_a_timer_fires_after_every_worker_was_killed_and_new_ones_started(
    settings: Settings, store: PostgresEventStore, extra_agents: list[str], tmp_path: Path
) -> None:
    extra_agents.extend(AGENTS)
    for folder in ("killed", "new"):
        (tmp_path / folder).mkdir()
    with (
        app_workers(settings, APP, tmp_path / "killed") as killed,
        app_workers(settings, APP, tmp_path / "new") as new,
    ):
        await start(settings, killed)
        async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
            task_id = await client.submit("napper", {"seconds": 2})
            await eventually(lambda: recorded(store, task_id, "TaskPaused"), WITHIN, "the pause")
            for worker in killed:
                worker.kill()
            # nothing fired it meanwhile: its wait is still pending, with no worker alive
            assert list(await store.pending_call_deadlines(task_id)) == [f"{task_id}:1:0"]
            await start(settings, new)
            logs = worker_logs([*killed, *new])
            try:
                result = await client.result(task_id, timeout=WITHIN)
            except TimeoutError:
                raise AssertionError(f"no result of {task_id}\n{logs()}") from None
        assert result.ok and result.result == {"slept": ["ok"]}, f"{result}\n{logs()}"
        events = await store.read_stream(task_id)
        claims = [e.data["subtask_id"] for e in of_type(events, "SubtaskClaimed")]
        assert claims == [f"{task_id}:1:0"]
        assert len(client.distinct_results(task_id)) == 1


async def test_first_2_of_3_completes_without_waiting_for_the_third_and_cancels_it(
    settings: Settings, store: PostgresEventStore, extra_agents: list[str], tmp_path: Path
) -> None:
    extra_agents.extend(AGENTS)
    with app_workers(settings, APP, tmp_path) as workers:
        await start(settings, workers)
        logs = worker_logs(workers)
        async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
            # far below the third call's deadline: only resuming on the first two can answer
            result = await client.call("fanout", {}, timeout=WITHIN)
        assert result.ok, f"{result}\n{logs()}"
        assert result.result == [
            ["quick", "ok", 10],
            ["quick", "ok", 20],
            ["hang", "cancelled", None],
        ]
        task_id = result.task_id
        hang = f"{task_id}:1:2"
        (resumed,) = of_type(await store.read_stream(task_id), "TaskResumed")
        assert resumed.data["abandoned"] == [{"subtask_id": hang, "agent": "hang"}]
        # the peer got its cancel: its own stream ends cancelled, and its answer to that comes
        # back to the caller late, recorded for audit and never applied
        await eventually(lambda: recorded(store, hang, "TaskCancelled"), WITHIN, "hang cancelled")
        await eventually(lambda: recorded(store, task_id, "ReplyIgnored"), WITHIN, "hang's answer")
        events = await store.read_stream(task_id)
        (ignored,) = of_type(events, "ReplyIgnored")
        assert (ignored.data["subtask_id"], ignored.data["reason"]) == (hang, "late")
        results = [e.data["subtask_id"] for e in of_type(events, "ResultRecorded")]
        assert hang not in results and len(results) == 2
