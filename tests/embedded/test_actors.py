"""Who acted, in the log (issue 32): a cancel or a signal that names its actor (the
``x-waystation-actor`` header, ``console:alice``) has it recorded as the ``actor`` of the
metadata of the events it causes, cleaned of what a console must not render, and shown by the
history; the cancels it sends on to peers carry it, so that a Waystation peer records it too; a
dead-letter replay given the log records a ``DeadLettersReplayed`` in the operations stream,
which the audit reads without a false alarm. The same on RabbitMQ and PostgreSQL:
tests/integration/test_actors.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from waystation import App, Call, Complete, Outcome, Pause, Signal, TaskContext
from waystation.client import SignalNotApplied
from waystation.events import (
    OPERATIONS_STREAM,
    AppendResult,
    DeadLettersReplayed,
    RecordedEvent,
    VersionConflict,
    fold,
    parse,
)
from waystation.events.memory import InMemoryEventStore
from waystation.events.operations import append_operation
from waystation.projections.audit import verify_stream
from waystation.projections.history import timeline
from waystation.protocol.actors import MAX_ACTOR
from waystation.testing import InMemoryPool

pytestmark = pytest.mark.timeout(60)

HOSTILE = "console:\x1b[2Jmal\u202elory\u200b\r\n<script>alert(1)</script>\x00\t" + "x" * 400
"""An actor a hostile publisher could send: an escape sequence, a bidirectional override, a
zero-width space, line breaks, markup, a NUL, and far too long."""


def actors_app() -> App:
    app = App()

    @app.agent("approver")
    async def approver(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Signal("approval", timeout=3600)])
        return Complete({"approval": task.results[0].value})

    @app.agent("parent")
    async def parent(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("child", {})])
        return Complete("never: the test cancels it")

    @app.agent("child")
    async def child(task: TaskContext) -> Outcome:
        if not task.resumed:  # waits in the log, so that its cancellation is recorded
            return Pause([Signal("never", timeout=3600)])
        return Complete("never")

    return app


async def until(pool: InMemoryPool, task_id: str, status: str) -> list[RecordedEvent]:
    """The task's stream once its state in the log is ``status``."""
    async with asyncio.timeout(30):
        while True:
            events = await pool.store.read_stream(task_id)
            if fold(task_id, events).status == status:
                return events
            await asyncio.sleep(0.01)


def actors(events: list[RecordedEvent]) -> dict[str, str | None]:
    """Each event type of a stream with the actor its metadata records (the last of a type)."""
    return {e.event_type: e.metadata.get("actor") for e in events}


async def test_a_signal_records_its_actor_on_every_event_it_causes_and_history_shows_it() -> None:
    async with InMemoryPool(actors_app()) as pool:
        task_id = await pool.submit("approver", {})
        await until(pool, task_id, "paused")
        status = await pool.signal(
            task_id,
            "approval",
            {"ok": True},
            agent="approver",
            sender="guest",
            actor="console:alice",
        )
        assert status == "taken"
        assert (await pool.result(task_id)).ok
        events = await until(pool, task_id, "completed")
        assert actors(events) == {
            "TaskStarted": None,  # the task's own, before anyone acted
            "TaskPaused": None,
            # the signal's append, and the run it resumed in place: the signal caused them
            "SignalReceived": "console:alice",
            "SubtaskClaimed": "console:alice",
            "ResultRecorded": "console:alice",
            "TaskResumed": "console:alice",
            "TaskCompleted": "console:alice",
        }
        assert "actor" not in events[0].metadata  # absent, not null: hashed as before
        entries = timeline(events)
        [received] = [e for e in entries if e.event_type == "SignalReceived"]
        assert "signal approval" in received.summary
        assert "from guest (console:alice)" in received.summary
        assert received.acted_by == "console:alice" and received.sender == "guest"
        assert received.to_json()["acted_by"] == "console:alice"
        assert [e.acted_by for e in entries[:2]] == [None, None]
        assert verify_stream(events) == []


async def test_a_cancel_records_its_actor_cleaned_and_the_cancelled_peer_records_it_too() -> None:
    async with InMemoryPool(actors_app()) as pool:
        task_id = await pool.submit("parent", {})
        paused = await until(pool, task_id, "paused")
        child_id = parse(paused[-1]).calls[0].subtask_id  # type: ignore[attr-defined]
        await until(pool, child_id, "paused")

        status = await pool.cancel("parent", task_id, reason="stale", actor=HOSTILE)
        assert status == "cancelled"
        events = await until(pool, task_id, "cancelled")
        actor = events[-1].metadata["actor"]
        # what a console renders: printable, one line, bounded; the words themselves kept
        assert actor == ("console:[2Jmallory <script>alert(1)</script> " + "x" * 400)[:MAX_ACTOR]
        assert len(actor) == MAX_ACTOR
        assert all(c.isprintable() for c in actor)
        assert "\u202e" not in actor and "\u200b" not in actor
        assert actors(events)["TaskPaused"] is None
        [entry] = [e for e in timeline(events) if e.event_type == "TaskCancelled"]
        assert entry.summary.startswith(f"cancelled by {actor}: stale")

        # the cascade: the peer's own cancellation names the same actor
        child = await until(pool, child_id, "cancelled")
        assert child[-1].event_type == "TaskCancelled"
        assert child[-1].metadata["actor"] == actor
        assert verify_stream(events) == [] and verify_stream(child) == []


async def test_an_actor_that_cleans_to_nothing_or_is_not_text_records_none() -> None:
    async with InMemoryPool(actors_app()) as pool:
        task_id = await pool.submit("approver", {})
        await until(pool, task_id, "paused")
        assert await pool.cancel("approver", task_id, actor="\x1b\u202e \r\n") == "cancelled"
        events = await until(pool, task_id, "cancelled")
        assert "actor" not in events[-1].metadata
        assert timeline(events)[-1].summary == "cancelled"


async def test_a_replay_record_reads_as_history_and_verifies_clean() -> None:
    store = InMemoryEventStore()
    for count, actor in ((2, "cli:root"), (1, "console:bob")):
        event = DeadLettersReplayed(
            actor=actor,
            reason="handler-failed",
            count=count,
            message_ids=(*(f"m-{n}" for n in range(count - 1)), None),
            queues=("test.approver",),
        )
        recorded = await append_operation(store, event, actor=actor, deployment="test.")
        assert recorded is not None and recorded.metadata["actor"] == actor
    events = await store.read_stream(OPERATIONS_STREAM)
    assert [e.stream_version for e in events] == [1, 2]
    assert verify_stream(events) == []
    assert fold(OPERATIONS_STREAM, events).status == "new"  # no task's state comes of it
    summaries = [entry.summary for entry in timeline(events)]
    assert summaries == [
        "replayed 2 dead letter(s) of reason handler-failed to test.approver by cli:root",
        "replayed 1 dead letter(s) of reason handler-failed to test.approver by console:bob",
    ]
    assert parse(events[1]) == DeadLettersReplayed(
        actor="console:bob",
        reason="handler-failed",
        count=1,
        message_ids=(None,),
        queues=("test.approver",),
    )


class Interleaving(InMemoryEventStore):
    """A log whose readers yield after reading a stream's end, so that replays at the same
    moment all read the same end and conflict; counts the conflicts."""

    conflicts = 0

    async def last_event(self, stream_id: str) -> RecordedEvent | None:
        last = await super().last_event(stream_id)
        await asyncio.sleep(0)
        return last

    async def append(self, *args: Any, **kwargs: Any) -> AppendResult:
        try:
            return await super().append(*args, **kwargs)
        except VersionConflict:
            self.conflicts += 1
            raise


async def test_replays_at_the_same_moment_each_append_their_own_record() -> None:
    store = Interleaving()
    event = DeadLettersReplayed(actor="a", count=1, message_ids=("m",), queues=("q",))
    await asyncio.gather(*(append_operation(store, event, actor=f"a-{n}") for n in range(8)))
    assert store.conflicts > 0  # they did race, and each went through again
    events = await store.read_stream(OPERATIONS_STREAM)
    assert sorted(str(e.metadata["actor"]) for e in events) == [f"a-{n}" for n in range(8)]
    assert verify_stream(events) == []


async def test_the_operations_stream_cannot_be_cancelled_or_signalled_as_a_task() -> None:
    async with InMemoryPool(actors_app()) as pool:
        before = await pool.store.read_stream(OPERATIONS_STREAM)
        with pytest.raises(RuntimeError, match="stream of operations"):
            await pool.cancel("approver", OPERATIONS_STREAM, actor="console:mallory")
        with pytest.raises(SignalNotApplied, match="stream of operations"):
            await pool.signal(OPERATIONS_STREAM, "approval", agent="approver")
        assert await pool.store.read_stream(OPERATIONS_STREAM) == before == []
        assert [letter.headers.get("x-waystation-reason") for letter in pool.dead_letters()] == [
            "wrong-shape",
            "wrong-shape",
        ]
