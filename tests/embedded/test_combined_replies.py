"""Replies to one task that wait for its stream's lock on one worker are recorded in one append
(``Recorder.append_decision``, ``combine``), and fall back to one append each when they cannot be:
a conflict after reading the log, the same reply twice.

Each test holds the stream's lock itself while the replies arrive, so that they are certain to
wait for it together, however fast the machine."""

from __future__ import annotations

import contextlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from waystation.agent import App, TaskContext
from waystation.events import (
    Call,
    Complete,
    NewEvent,
    OutboxMessage,
    Outcome,
    Pause,
    RecordedEvent,
    ReplyIgnored,
)
from waystation.events.codec import dumps
from waystation.events.model import EventMetadata
from waystation.runtime.worker import Worker

from .harness import World, eventually, settings, world

pytestmark = pytest.mark.timeout(60)

CALLS = 3


def ghost_app() -> App:
    """``boss`` calls ``ghost`` three times; nobody serves ``ghost`` but the test."""
    app = App()

    @app.agent("boss")
    async def boss(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("ghost", {"n": n}) for n in range(CALLS)])
        return Complete(sorted(r.value for r in task.results))

    return app


async def _replies(w: World) -> list[OutboxMessage]:
    """The ghost calls' replies, each the call's number times ten, unpublished yet."""
    queue = w.names.tasks("ghost")
    await eventually(lambda: len(w.broker.messages(queue)) == CALLS, "the ghost calls")
    requests = list(w.broker.queues[queue].ready)
    w.broker.queues[queue].ready.clear()
    return [
        OutboxMessage(
            message_id=f"{request.properties['correlation_id']}:reply",
            routing_key=request.properties["reply_to"],
            body=dumps(
                {"status": "ok", "result": 10 * int(request.properties["correlation_id"][-1])}
            ),
            properties={"type": "result", "correlation_id": request.properties["correlation_id"]},
        )
        for request in requests
    ]


@contextlib.asynccontextmanager
async def _boss_paused(
    gather_ms: float = 0.0,
) -> AsyncIterator[tuple[World, Worker, str, list[OutboxMessage]]]:
    """One worker, a ``boss`` task paused on its ghost calls, and their replies unpublished."""
    async with world(ghost_app(), settings(reply_gather_ms=gather_ms)) as w:
        w.broker.declare_queue(w.names.tasks("ghost"))
        worker = await w.start_worker("w1")
        task_id = await w.publish("boss", {})
        yield w, worker, task_id, await _replies(w)


async def _arrive_together(
    w: World, worker: Worker, task_id: str, replies: list[OutboxMessage]
) -> None:
    """Publish ``replies`` while the test holds the task's stream lock on ``worker``, and let go
    only once all of them wait for it."""
    recorder = worker.recorder
    async with recorder.locks.hold(task_id):
        for reply in replies:
            await w.publisher.publish(reply)
        await eventually(
            lambda: recorder.waiting(task_id) == len(replies),
            "every reply waiting for the stream's lock",
        )


async def _answered_once(w: World, task_id: str, replies: list[OutboxMessage]) -> None:
    """The task answered once, with every reply's value; each call claimed once, one resume."""
    assert (await w.answer(task_id))["result"] == [0, 10, 20]
    await eventually(lambda: w.broker.unsettled() == 0, "every reply acked")
    events = await w.store.read_stream(task_id)
    claims = Counter(e.data["subtask_id"] for e in events if e.event_type == "SubtaskClaimed")
    assert claims == {r.properties["correlation_id"]: 1 for r in replies}
    assert [e.event_type for e in events].count("TaskResumed") == 1
    assert len(w.answers[task_id]) == 1, w.answers[task_id]


async def test_replies_waiting_together_are_recorded_in_one_append() -> None:
    async with _boss_paused() as (w, worker, task_id, replies):
        await _arrive_together(w, worker, task_id, replies)
        await _answered_once(w, task_id, replies)
        events = await w.store.read_stream(task_id)
        # the claims, results, the resume and the resumed run's completion: one transaction
        tail = [e for e in events if e.stream_version > 2]
        assert [e.event_type for e in tail] == [
            *["SubtaskClaimed", "ResultRecorded"] * CALLS,
            "TaskResumed",
            "TaskCompleted",
        ]
        assert len({e.tx_id for e in tail}) == 1, [(e.event_type, e.tx_id) for e in tail]
        counters = worker.stats.counters
        assert counters.get("decisions_combined") == CALLS, counters
        assert counters.get("version_conflicts", 0) == 0, counters
        assert counters.get("resumed_in_place") == 1, counters


async def test_replies_arriving_one_by_one_are_gathered_into_one_append() -> None:
    # a window far longer than the test's steps: only the third reply's arrival ends the wait
    async with _boss_paused(gather_ms=10_000) as (w, worker, task_id, replies):
        recorder = worker.recorder
        for arrived, reply in enumerate(replies[:-1], start=1):
            await w.publisher.publish(reply)
            await eventually(lambda n=arrived: recorder.waiting(task_id) == n, "waiting")
        assert w.broker.unsettled() == CALLS - 1  # neither recorded nor acked yet
        await w.publisher.publish(replies[-1])
        await _answered_once(w, task_id, replies)
        tail = [e for e in await w.store.read_stream(task_id) if e.stream_version > 2]
        assert tail[-2:][0].event_type == "TaskResumed"
        assert len({e.tx_id for e in tail}) == 1, [(e.event_type, e.tx_id) for e in tail]
        counters = worker.stats.counters
        assert counters.get("decisions_gathered") == CALLS, counters
        assert counters.get("decisions_combined") == CALLS, counters


async def test_the_same_reply_twice_in_one_wait_claims_its_call_once() -> None:
    async with _boss_paused() as (w, worker, task_id, replies):
        twice = replies[0]
        await _arrive_together(w, worker, task_id, [twice, *replies[1:2], twice])
        await eventually(lambda: w.broker.unsettled() == 0, "the three replies acked")
        await w.publisher.publish(replies[2])
        await _answered_once(w, task_id, replies)


async def test_replies_decided_on_a_stale_copy_are_decided_again_on_the_log() -> None:
    async with _boss_paused() as (w, worker, task_id, replies):
        recorder = worker.recorder
        reads: list[int] = []
        read_stream = w.store.read_stream

        async def spied(stream_id: str, *, after: int = 0) -> list[RecordedEvent]:
            if stream_id == task_id:
                reads.append(after)
            return await read_stream(stream_id, after=after)

        async with recorder.locks.hold(task_id):
            # another writer appends meanwhile: the worker's cached copy of the stream is stale
            head = (await w.store.read_stream(task_id))[-1]
            w.store.read_stream = spied  # type: ignore[method-assign]
            audit = ReplyIgnored(subtask_id=f"{task_id}:9:9", reason="unknown-call", outcome="ok")
            metadata = EventMetadata(worker_id="elsewhere", occurred_at=0.0)
            await w.store.append(
                task_id,
                head.stream_version,
                [NewEvent.of(uuid.uuid4(), audit, metadata)],
                prev_hash=head.hash,
            )
            # two of the three: a batch that does not resume is decided on the cached copy
            for reply in replies[:2]:
                await w.publisher.publish(reply)
            await eventually(
                lambda: recorder.waiting(task_id) == 2,
                "both replies waiting for the stream's lock",
            )
        await eventually(lambda: w.broker.unsettled() == 0, "both replies acked")
        await w.publisher.publish(replies[2])
        await w.answer(task_id)
        w.store.read_stream = read_stream  # type: ignore[method-assign]
        await _answered_once(w, task_id, replies)
        counters = worker.stats.counters
        # decided on the stale copy first, which conflicts; then once more on the log, together
        assert counters.get("version_conflicts") == 1, counters
        assert counters.get("decisions_combined") == 2, counters
        # the log was read only from after what the worker held: after the stale copy (the
        # pause), and before the resumed run after its own append of the two replies (a handler
        # never runs on the cached copy alone), which found nothing newer
        two_replies = 2 * 2  # a claim and a result each
        assert reads == [head.stream_version, head.stream_version + 1 + two_replies], reads
        assert counters.get("stream_catch_ups") == 2, counters


@pytest.mark.parametrize("together", [True, False], ids=["combined", "one-by-one"])
async def test_every_event_of_a_resume_in_place_is_made_once(
    together: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run resumed in place folds its resume events made as they will be appended (the
    decision's own ids and metadata), and the append takes those same events (chained already)
    instead of making and chaining them again: one event made per event recorded, whether the
    replies were combined or came alone."""
    made: list[str] = []
    original = NewEvent.of

    def counting(event_id: uuid.UUID, event: Any, metadata: Any) -> NewEvent:
        made.append(event.event_type)
        return original(event_id, event, metadata)

    async with _boss_paused() as (w, worker, task_id, replies):
        monkeypatch.setattr(NewEvent, "of", counting)
        if together:
            await _arrive_together(w, worker, task_id, replies)
        else:
            for answered, reply in enumerate(replies, start=1):
                await w.publisher.publish(reply)
                await eventually(
                    lambda n=answered: (
                        w.broker.unsettled() == 0
                        and worker.stats.counters.get("settled_ack", 0) >= 1 + n
                    ),
                    "the reply acked",
                )
        await _answered_once(w, task_id, replies)
        tail = [e for e in await w.store.read_stream(task_id) if e.stream_version > 2]
        assert tail[-2].event_type == "TaskResumed"
        assert worker.stats.counters.get("resumed_in_place") == 1
        assert made == [e.event_type for e in tail]
