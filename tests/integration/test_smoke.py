"""The slice works end to end against the real services: fan out, pause, resume, complete."""

from __future__ import annotations

from waystation.client import Client
from waystation.events.postgres import PostgresEventStore
from waystation.example import app, expected_total
from waystation.settings import Settings

from ..support import published_everything, running_worker


async def test_an_orchestrator_fans_out_pauses_resumes_and_answers(
    settings: Settings, store: PostgresEventStore
) -> None:
    async with (
        running_worker(app, settings, store),
        Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        result = await client.call("orchestrator", {"n": 4, "k": 3}, timeout=20)
        assert result.ok and result.result == {"n": 4, "total": expected_total(4, 3)}
        stream = [e.event_type for e in await store.read_stream(result.task_id)]
        assert stream == ["TaskStarted", "TaskPaused"] + [
            "SubtaskClaimed",
            "ResultRecorded",
        ] * 3 + [
            "TaskResumed",
            "TaskCompleted",
        ]
        # published outbox rows are forgotten in the background
        await published_everything(store, [result.task_id])
