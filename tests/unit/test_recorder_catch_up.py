"""A worker that holds a stream up to some version reads the log only from after it
(``Recorder.load_events``, ``known``): after a copy that turned out stale, and before a resumed
run, which never runs on the cached copy alone. The log is append-only, so what the worker held
stays as it was; a copy that does not link up with what follows it is read again whole."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

from waystation.events import (
    GENESIS_HASH,
    DomainEvent,
    NewEvent,
    RecordedEvent,
    ReplyIgnored,
    TaskCompleted,
    TaskResumed,
    TaskStarted,
    TaskState,
    event_id,
)
from waystation.events.memory import InMemoryEventStore
from waystation.observability.observer import Observer
from waystation.protocol.wire import Names
from waystation.runtime.faults import FaultPlan
from waystation.runtime.recorder import Cause, Recorder

TASK = "t-1"


class ReadsRecorded(InMemoryEventStore):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[int] = []

    async def read_stream(self, stream_id: str, *, after: int = 0) -> list[RecordedEvent]:
        self.reads.append(after)
        return await super().read_stream(stream_id, after=after)


async def _stream_of_four(store: InMemoryEventStore) -> list[RecordedEvent]:
    events = [
        TaskStarted(agent="boss", input={}),
        *(
            ReplyIgnored(subtask_id=f"{TASK}:9:{n}", reason="unknown-call", outcome="ok")
            for n in range(3)
        ),
    ]
    version, prev = 0, GENESIS_HASH
    for event in events:
        new = NewEvent.of(uuid.uuid4(), event, {"worker_id": "elsewhere"})
        result = await store.append(TASK, version, [new], prev_hash=prev)
        version, prev = result.version, result.last_hash
    return await store.read_stream(TASK)


def recorder_on(store: InMemoryEventStore, **options: Any) -> Recorder:
    """A recorder on ``store`` for decisions that append nothing (``options``: the Recorder's)."""
    return Recorder(
        store,
        Names(prefix="catch-up."),
        Observer(),
        worker_id="w-1",
        clock=lambda: 0.0,
        outbox_delay=1.0,
        faults=FaultPlan(),
        **options,
    )


async def test_a_known_copy_is_caught_up_from_the_log_after_its_last_version() -> None:
    store = ReadsRecorded()
    log = await _stream_of_four(store)
    recorder = recorder_on(store)
    store.reads.clear()
    state, history, from_cache = await recorder.load_events(TASK, known=log[:2])
    assert store.reads == [2]
    assert history == log and not from_cache and state.version == 4
    assert history[0] is log[0] and history[1] is log[1]  # what it held, as it held it
    _, history, _ = await recorder.load_events(TASK, known=log)
    assert store.reads == [2, 4] and history == log  # nothing newer
    assert recorder.observer.stats.counters["stream_catch_ups"] == 2


async def test_a_known_copy_that_does_not_link_up_is_read_again_whole() -> None:
    store = ReadsRecorded()
    log = await _stream_of_four(store)
    recorder = recorder_on(store)
    store.reads.clear()
    wrong = [log[0], dataclasses.replace(log[1], hash=bytes(32))]
    _, history, _ = await recorder.load_events(TASK, known=wrong)
    assert store.reads == [2, 0]
    assert history == log
    assert "stream_catch_ups" not in recorder.observer.stats.counters


def _nothing_to_do(seen: list[int]) -> Callable[[TaskState], list[DomainEvent]]:
    def decide(state: TaskState) -> list[DomainEvent]:
        seen.append(state.version)
        return []

    return decide


async def test_a_copy_the_log_finds_current_keeps_what_was_decided_on_it() -> None:
    # nothing to do, says the worker's copy: only the log can say so, and when it holds
    # nothing newer, the decision taken on the copy stands (not folded and decided again)
    store = ReadsRecorded()
    log = await _stream_of_four(store)
    recorder = recorder_on(store)
    recorder.cache.put(TASK, log, finished=False)
    store.reads.clear()
    seen: list[int] = []
    applied = await recorder.append_decision(
        TASK, _nothing_to_do(seen), key=lambda _: "k", cause=Cause(), step="reply"
    )
    assert applied.events == [] and applied.state.version == 4
    assert store.reads == [4] and seen == [4]


async def test_a_copy_the_log_finds_stale_is_decided_again_on_what_the_read_found() -> None:
    store = ReadsRecorded()
    log = await _stream_of_four(store)
    recorder = recorder_on(store)
    recorder.cache.put(TASK, log[:2], finished=False)
    store.reads.clear()
    seen: list[int] = []
    applied = await recorder.append_decision(
        TASK, _nothing_to_do(seen), key=lambda _: "k", cause=Cause(), step="reply"
    )
    assert applied.state.version == 4
    assert store.reads == [2] and seen == [2, 4]  # one read: the one that found the copy stale


def test_a_part_takes_events_made_for_it_and_makes_the_rest() -> None:
    """``part(..., made=)``: the first events as made already (the run resumed in place made
    them under the decision's key), the rest made under the same key; made events that are not
    the decision's own (another type) are not taken: all are made anew, with the same ids."""
    recorder = recorder_on(InMemoryEventStore())
    state = TaskState(TASK, version=2)
    events = [TaskResumed(pause=1), TaskCompleted(result=1)]
    cause = Cause(message_id="m")
    made = recorder.new_events(state, events[:1], "reply:s", cause)
    part = recorder.part(state, events, "reply:s", cause, made=made)
    assert part.new_events[0] is made[0]
    assert [e.event_id for e in part.new_events] == [
        event_id(TASK, "reply:s", index) for index in range(2)
    ]
    other = recorder.new_events(state, [TaskCompleted(result=2)], "reply:s", cause)
    anew = recorder.part(state, events, "reply:s", cause, made=other)
    assert anew.new_events[0] is not other[0]
    assert [e.event_type for e in anew.new_events] == ["TaskResumed", "TaskCompleted"]
    assert [e.event_id for e in anew.new_events] == [e.event_id for e in part.new_events]
