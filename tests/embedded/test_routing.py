"""Reply routing on the in-memory backends (``waystation.runtime.routing``): a parent's replies come
back to the worker that paused it, and to another worker when that one is gone."""

from __future__ import annotations

import pytest

from waystation.agent import App, TaskContext
from waystation.events import Call, Complete, OutboxMessage, Outcome, Pause
from waystation.events.codec import dumps

from .harness import World, eventually, world

pytestmark = pytest.mark.timeout(60)


def fan_out_app() -> App:
    app = App()

    @app.agent("boss")
    async def boss(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("helper", {"n": n}) for n in range(3)] + [Call("ghost", {})])
        return Complete(sum(r.value or 0 for r in task.results))

    @app.agent("helper")
    async def helper(task: TaskContext) -> Outcome:
        return Complete(task.input["n"])

    return app


async def _ghost_request(w: World) -> OutboxMessage:
    """The ``ghost`` call nobody serves, answered by the test."""
    queue = w.names.tasks("ghost")
    await eventually(lambda: len(w.broker.messages(queue)) == 1, "the ghost call")
    (request,) = w.broker.queues[queue].ready
    w.broker.queues[queue].ready.clear()
    return OutboxMessage(
        message_id=f"{request.properties['correlation_id']}:reply",
        routing_key=request.properties["reply_to"],
        body=dumps({"status": "ok", "result": 10}),
        properties={"type": "result", "correlation_id": request.properties["correlation_id"]},
    )


async def test_a_parents_replies_are_recorded_by_the_worker_that_paused_it() -> None:
    async with world(fan_out_app()) as w:
        w.broker.declare_queue(w.names.tasks("ghost"))
        workers = [await w.start_worker("w1"), await w.start_worker("w2")]
        pausers = set()
        for _ in range(8):
            task_id = await w.publish("boss", {})
            reply = await _ghost_request(w)
            await w.publisher.publish(reply)
            assert (await w.answer(task_id))["result"] == 13
            events = await w.store.read_stream(task_id)
            (paused,) = [e for e in events if e.event_type == "TaskPaused"]
            pauser = paused.metadata["worker_id"]
            pausers.add(pauser)
            home = next(x for x in workers if x.settings.worker_id == pauser).routes.homes["boss"]
            assert reply.routing_key == w.names.reply_shard("boss", home)
            recorders = {
                e.metadata["worker_id"] for e in events if e.event_type == "ResultRecorded"
            }
            assert recorders == {pauser}, f"{task_id}: paused by {pauser}, replies by {recorders}"
        assert pausers == {"w1", "w2"}, "the tasks queue gave every parent to one worker"
        assert workers[0].routes.homes["boss"] != workers[1].routes.homes["boss"]
        conflicts = sum(x.stats.counters.get("version_conflicts", 0) for x in workers)
        assert conflicts == 0


async def test_the_replies_of_a_dead_workers_pause_go_to_another_worker() -> None:
    async with world(fan_out_app()) as w:
        w.broker.declare_queue(w.names.tasks("ghost"))
        first = await w.start_worker("w1")
        task_id = await w.publish("boss", {})
        reply = await _ghost_request(w)  # paused by w1 (the only worker), replies on its shard
        assert reply.routing_key == w.names.reply_shard("boss", first.routes.homes["boss"])
        await eventually(lambda: w.broker.unsettled() == 0, "the helpers' replies recorded")
        second = await w.start_worker("w2")
        first.broker.kill()  # type: ignore[attr-defined]
        await w.publisher.publish(reply)
        assert (await w.answer(task_id))["result"] == 13
        events = await w.store.read_stream(task_id)
        (completed,) = [e for e in events if e.event_type == "TaskCompleted"]
        assert completed.metadata["worker_id"] == second.settings.worker_id
