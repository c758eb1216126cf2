"""Pool limits (``waystation.runtime.limits``) on the in-memory broker, store and slots: a
concurrency counted across workers, waiting that burns no attempt, a limited agent's resume
travelling as a message, and the copy a worker leaves when it dies between parking a task and acking
it."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

import pytest

from waystation.agent import App, TaskContext
from waystation.brokers.memory import InMemoryBroker
from waystation.events import Call, Complete, OutboxMessage, Outcome, Pause
from waystation.events.codec import dumps
from waystation.events.memory import InMemoryEventStore
from waystation.protocol.wire import CONTENT_TYPE, HEADER_WAITS
from waystation.runtime.worker import Worker

from .harness import RESULTS, World, eventually, settings, world

pytestmark = pytest.mark.timeout(60)


@dataclass
class Observed:
    running: int = 0
    most: int = 0
    runs: Counter[str] = field(default_factory=Counter)
    release: asyncio.Event = field(default_factory=asyncio.Event)


def limited_app(seen: Observed) -> App:
    app = App()

    @app.agent("gate", concurrency=1, retries=1)
    async def gate(task: TaskContext) -> Outcome:
        seen.running += 1
        seen.most = max(seen.most, seen.running)
        seen.runs[task.task_id] += 1
        try:
            if task.input.get("hold"):
                await seen.release.wait()
            else:
                await asyncio.sleep(0.02)
            if task.input.get("fail_first") and seen.runs[task.task_id] == 1:
                raise ConnectionError("the first run fails")
        finally:
            seen.running -= 1
        return Complete({"runs": seen.runs[task.task_id]})

    @app.agent("boss", concurrency=1)
    async def boss(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("helper", {"x": 2})])
        return Complete(task.results[0].value)

    @app.agent("helper")
    async def helper(task: TaskContext) -> Outcome:
        return Complete({"y": task.input["x"] * 10})

    return app


def waits(w: World) -> int:
    return sum(
        count
        for worker in w.workers
        for name, count in worker.stats.counters.items()
        if name.startswith("limit_waits.")
    )


async def types_of(w: World, task_id: str) -> list[str]:
    return [e.event_type for e in await w.store.read_stream(task_id)]


async def test_a_concurrency_is_counted_across_workers() -> None:
    seen = Observed()
    async with world(limited_app(seen)) as w:
        for name in ("w1", "w2", "w3"):
            await w.start_worker(name)
        ids = [await w.publish("gate", {}) for _ in range(8)]
        for task_id in ids:
            assert (await w.answer(task_id))["status"] == "ok"
        assert seen.most == 1
        assert all(seen.runs[task_id] == 1 for task_id in ids)
        assert all(len(w.answers[task_id]) == 1 for task_id in ids)
        assert waits(w) > 0
        # a task that waited is recorded (its copy may have a twin), the others are not (G10)
        recorded = [await types_of(w, task_id) for task_id in ids]
        assert set(map(tuple, recorded)) <= {(), ("TaskStarted", "TaskCompleted")}
        assert ("TaskStarted", "TaskCompleted") in set(map(tuple, recorded))


async def test_waiting_burns_no_attempt() -> None:
    seen = Observed()
    async with world(limited_app(seen)) as w:
        await w.start_worker("w1")
        await w.start_worker("w2")
        holding = await w.publish("gate", {"hold": True})
        await eventually(lambda: seen.running == 1, "the slot to be taken")
        flaky = await w.publish("gate", {"fail_first": True})
        await eventually(lambda: waits(w) >= 3, "the second task to wait three times")
        assert seen.runs[flaky] == 0
        seen.release.set()
        assert (await w.answer(holding))["result"] == {"runs": 1}
        # retries=1: two runs in all, the first failing; had its waits been counted as
        # attempts, it would have failed at its first run
        answer = await w.answer(flaky)
        assert answer["status"] == "ok" and answer["result"] == {"runs": 2}, answer


async def test_a_limited_agents_resume_travels_as_a_message_and_takes_its_slot() -> None:
    seen = Observed()
    async with world(limited_app(seen)) as w:
        worker = await w.start_worker()
        task_id = await w.publish("boss", {})
        assert (await w.answer(task_id))["result"] == {"y": 20}
        assert worker.stats.counters.get("resumed_in_place", 0) == 0
        assert "TaskCompleted" in await types_of(w, task_id)


async def test_a_copy_left_by_a_worker_that_died_after_parking_it_is_answered_once() -> None:
    """A worker parked a task (its waiting copy confirmed), then died before acking the
    original: both come back. One run's outcome is recorded; the publisher hears once."""
    seen = Observed()
    async with world(limited_app(seen)) as w:
        holder, held = await w.taken_by_a_holder(w.names.tasks("gate"))
        task_id = await w.publish("gate", {})
        await eventually(lambda: bool(held), "the first holder to take the task")
        [original] = held
        await holder.publish(
            OutboxMessage(
                message_id=task_id,
                routing_key=w.names.tasks("gate"),
                body=dumps({}),
                properties={
                    "type": "task",
                    "correlation_id": task_id,
                    "reply_to": RESULTS,
                    "content_type": CONTENT_TYPE,
                    "headers": {**original.headers, HEADER_WAITS: 1},
                },
            )
        )
        holder.kill()  # before its ack: the original is redelivered beside its copy
        await w.start_worker()
        assert (await w.answer(task_id))["status"] == "ok"
        await eventually(
            lambda: (
                not (
                    w.broker.unsettled()
                    or w.broker.waiting
                    or w.broker.messages(w.names.tasks("gate"))
                    or w.broker.messages(RESULTS)
                )
            ),
            "both copies to be settled and every answer received",
        )
        assert w.answers[task_id] == [w.answers[task_id][0]]
        assert await types_of(w, task_id) == ["TaskStarted", "TaskCompleted"]


async def test_a_worker_with_a_limited_agent_needs_the_pools_slots() -> None:
    app = limited_app(Observed())
    broker = InMemoryBroker()
    with pytest.raises(ValueError, match=r"declare a concurrency or a rate: pass the pool's"):
        Worker(app, settings(), InMemoryEventStore(), broker=broker.connection("w"))
