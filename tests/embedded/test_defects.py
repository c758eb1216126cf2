"""Defects of issue 11 (section 4) that the in-memory backends can steer exactly, each a case
that failed before its fix: attempts under RabbitMQ 4.3's counting, a cancel landing before a
task's first run, a stale stream cache running a handler late, an answer whose publisher is
gone, and bounded checkpoint samples."""

from __future__ import annotations

from collections import Counter

import pytest

from waystation.agent import App, TaskContext
from waystation.events import (
    Call,
    Complete,
    EventMetadata,
    NewEvent,
    OutboxMessage,
    Outcome,
    Pause,
    decide_cancel,
    event_id,
    fold,
)
from waystation.events.codec import dumps
from waystation.observability.observer import CHECKPOINT_SAMPLES, WorkerStats

from .harness import World, eventually, world

pytestmark = pytest.mark.timeout(60)


def counting_app(runs: Counter[tuple[str, int]]) -> App:
    app = App()

    @app.agent("broken")
    async def broken(task: TaskContext) -> Outcome:
        runs[task.task_id, task.pause] += 1
        raise RuntimeError("always broken")

    @app.agent("quick")
    async def quick(task: TaskContext) -> Outcome:
        runs[task.task_id, task.pause] += 1
        return Complete({"answer": 42})

    @app.agent("boss")
    async def boss(task: TaskContext) -> Outcome:
        runs[task.task_id, task.pause] += 1
        if not task.resumed:
            return Pause([Call("ghost", {"q": 1})])
        return Complete([r.value for r in task.results])

    return app


async def types_of(world: World, task_id: str) -> list[str]:
    return [e.event_type for e in await world.store.read_stream(task_id)]


@pytest.mark.parametrize("counting", ["classic", "4.3"])
async def test_attempts_are_counted_by_waystation_whatever_the_broker_counts(
    counting: str,
) -> None:
    """RabbitMQ 4.3 no longer counts a requeue in ``x-delivery-count``, so a handler
    that always raises was retried forever. Retries now carry their own count."""
    runs: Counter[tuple[str, int]] = Counter()
    async with world(counting_app(runs), counting=counting) as w:
        await w.start_worker()
        task_id = await w.publish("broken", {})
        answer = await w.answer(task_id)
        assert answer["status"] == "error", answer
        assert runs[task_id, 0] == 3  # the delivery limit of these settings
        assert await types_of(w, task_id) == ["TaskStarted", "TaskFailed"]
        [letter] = w.broker.messages(w.names.dead_letter_queue)
        assert letter.headers["x-waystation-reason"] == "handler-failed"


async def test_a_redelivered_task_cancelled_before_it_was_recorded_tells_its_publisher() -> None:
    """A task cancelled before its first run was recorded, then redelivered (its first holder
    died), used to be acked silently: its publisher never heard anything."""
    runs: Counter[tuple[str, int]] = Counter()
    async with world(counting_app(runs)) as w:
        holder, held = await w.taken_by_a_holder(w.names.tasks("quick"))
        task_id = await w.publish("quick", {})
        await eventually(lambda: bool(held), "the first holder to take the task")
        await holder.cancel_consumers()
        await w.start_worker()
        await w.publish("quick", {"task_id": task_id}, kind="cancel", message_id="cancel-1")
        assert (await w.answer("cancel-1"))["result"]["status"] == "cancelled"
        holder.kill()  # the task goes back to its queue, redelivered
        answer = await w.answer(task_id)
        assert answer["status"] == "cancelled", answer
        assert runs[task_id, 0] == 0
        assert w.answers[task_id] == [answer]


async def test_a_task_cancelled_before_it_ran_answers_cancelled_not_ok() -> None:
    """A task that completes without peers used to publish ``ok`` after the canceller had been
    told ``cancelled``."""
    runs: Counter[tuple[str, int]] = Counter()
    async with world(counting_app(runs)) as w:
        await w.start_worker()
        task_id = "cancelled-first"
        await w.publish("quick", {"task_id": task_id}, kind="cancel", message_id="cancel-1")
        assert (await w.answer("cancel-1"))["result"]["status"] == "cancelled"
        await w.publish("quick", {}, message_id=task_id)
        answer = await w.answer(task_id)
        assert answer["status"] == "cancelled", answer
        await eventually(lambda: w.broker.unsettled() == 0, "the task to be settled")
        assert w.answers[task_id] == [answer]
        assert await types_of(w, task_id) == ["TaskCancelled"]


async def test_a_stale_cached_stream_never_runs_a_handler_late() -> None:
    """A worker deciding from its own stale copy of a stream used to run the resumed handler of
    a task another worker had already cancelled (the append then failed, too late)."""
    runs: Counter[tuple[str, int]] = Counter()
    async with world(counting_app(runs)) as w:
        w.broker.declare_queue(w.names.tasks("ghost"))
        await w.start_worker()
        task_id = await w.publish("boss", {})
        await eventually(lambda: len(w.broker.messages(w.names.tasks("ghost"))) == 1, "the call")
        # another worker cancels the task: appended straight to the log, this worker's cached
        # copy of the stream knows nothing of it
        events = await w.store.read_stream(task_id)
        state = fold(task_id, events)
        metadata = EventMetadata(worker_id="another", deployment=w.names.prefix)
        await w.store.append(
            task_id,
            state.version,
            [
                NewEvent.of(event_id(task_id, "cancel", i), e, metadata)
                for i, e in enumerate(decide_cancel(state, "elsewhere"))
            ],
            prev_hash=state.last_hash,
        )
        # the last reply comes to this worker, which wrote the stream last
        await w.publisher.publish(
            _reply(w, f"{task_id}:1:0", {"status": "ok", "result": "late"}, "r-1")
        )
        await eventually(
            lambda: w.broker.unsettled() == 0 and not w.broker.messages(w.names.replies("boss")),
            "the reply to be settled",
        )
        assert await types_of(w, task_id) == [
            "TaskStarted",
            "TaskPaused",
            "TaskCancelled",
            "ReplyIgnored",
        ]
        assert runs[task_id, 1] == 0, "the resumed handler ran for a cancelled task"


def _reply(w: World, subtask: str, body: object, message_id: str) -> OutboxMessage:
    return OutboxMessage(
        message_id=message_id,
        routing_key=w.names.replies("boss"),
        body=dumps(body),
        properties={"type": "result", "correlation_id": subtask},
    )


@pytest.mark.parametrize("kind", ["task", "cancel"])
async def test_an_answer_whose_publisher_is_gone_is_counted_undelivered_not_rerun(
    kind: str,
) -> None:
    """An answer to a reply queue that no longer exists (the mandatory publish is returned)
    used to re-run the handler until the delivery limit; then it was kept as a dead letter,
    which made every publisher that does not wait raise the dead-letter alert. It is counted as
    undelivered now (issue 30, item 5)."""
    runs: Counter[tuple[str, int]] = Counter()
    async with world(counting_app(runs)) as w:
        worker = await w.start_worker()
        if kind == "task":
            message_id = await w.publish("quick", {}, reply_to="mem.gone")
        else:
            message_id = await w.publish(
                "quick", {"task_id": "t"}, kind="cancel", reply_to="mem.gone"
            )
        await eventually(lambda: worker.stats.counters.get("results_undelivered") == 1, "the count")
        await eventually(lambda: w.broker.unsettled() == 0, "the message to be settled")
        assert not w.broker.messages(w.names.dead_letter_queue)
        assert not w.broker.messages(w.names.tasks("quick"))
        if kind == "task":
            assert runs[message_id, 0] == 1


def test_the_checkpoint_samples_a_worker_keeps_are_bounded() -> None:
    """``WorkerStats.checkpoint_seconds`` used to grow with every checkpoint, forever."""
    stats = WorkerStats()
    for n in range(CHECKPOINT_SAMPLES + 10):
        stats.checkpoint_seconds.append(float(n))
    assert len(stats.checkpoint_seconds) == CHECKPOINT_SAMPLES
    assert stats.to_json()["checkpoint_seconds"][0] == 10.0
