"""Decisions a stream expects more of wait for the others, at most ``gather_seconds``, and are
then recorded together (``Recorder.append_decision``, ``gather``): the count of them, the
window, a cancelled one and a stopping worker each end the wait. The windows here are either
far longer than any test (so only the count or a cancellation can end the wait) or short, where
the test only waits for the outcome, never for an amount of time."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Literal

import pytest

from waystation.events import (
    GENESIS_HASH,
    Call,
    DomainEvent,
    FirstK,
    NewEvent,
    Pause,
    RecordedEvent,
    Signal,
    Sleep,
    TaskStarted,
    TaskState,
    decide_outcome,
    decide_reply,
    fold,
)
from waystation.events.chain import recorded_events
from waystation.events.memory import InMemoryEventStore
from waystation.runtime import combining, streams
from waystation.runtime.flows.reply import replies_awaited
from waystation.runtime.recorder import Applied, Cause, Recorder

from .test_recorder_catch_up import recorder_on

pytestmark = pytest.mark.timeout(60)

TASK = "t-1"
FOREVER = 3600.0


async def _recorder(gather_seconds: float, *, stopping: bool = False) -> Recorder:
    """A recorder holding a copy of a one-event stream, as after its own append."""
    store = InMemoryEventStore()
    new = NewEvent.of(uuid.uuid4(), TaskStarted(agent="boss", input={}), {"worker_id": "w-1"})
    await store.append(TASK, 0, [new], prev_hash=GENESIS_HASH)
    recorder = recorder_on(store, stopping=lambda: stopping, gather_seconds=gather_seconds)
    recorder.cache.put(TASK, await store.read_stream(TASK), finished=False)
    return recorder


def _decision(
    recorder: Recorder, seen: list[TaskState], expected: int = 3
) -> asyncio.Task[Applied]:
    """A combinable decision that finds nothing to do (so it appends nothing), and says the
    stream expects ``expected`` of its kind."""

    def decide(state: TaskState) -> list:  # type: ignore[type-arg]
        seen.append(state)
        return []

    return asyncio.create_task(
        recorder.append_decision(
            TASK,
            decide,
            key=lambda _: "unused",
            cause=Cause(),
            step="reply",
            combine=True,
            gather=lambda state: expected if state.exists else 0,
        )
    )


async def _until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(6000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


async def _two_waiting() -> tuple[
    Recorder, list[TaskState], asyncio.Task[Applied], asyncio.Task[Applied]
]:
    """A recorder whose stream expects 3 decisions, with 2 of them waiting (an hour's window),
    the states they decided on (none yet), and the two."""
    recorder = await _recorder(FOREVER)
    seen: list[TaskState] = []
    first = _decision(recorder, seen)
    await _until(lambda: recorder.waiting(TASK) == 1, "the first waiting")
    second = _decision(recorder, seen)
    await _until(lambda: recorder.waiting(TASK) == 2, "the second waiting")
    return recorder, seen, first, second


async def test_decisions_wait_until_the_expected_count_has_arrived() -> None:
    recorder, seen, first, second = await _two_waiting()
    for _ in range(20):
        await asyncio.sleep(0)
    assert not first.done() and not second.done() and seen == []  # gathering: nothing decided
    third = _decision(recorder, seen)
    applied = await asyncio.gather(first, second, third)
    assert all(a.events == [] for a in applied)
    assert recorder.observer.stats.counters["decisions_gathered"] == 3


async def test_the_copy_counted_on_is_folded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = await _recorder(FOREVER)
    folds: list[int] = []

    def counted(task_id: str, events: Sequence[RecordedEvent]) -> TaskState:
        folds.append(len(events))
        return fold(task_id, events)

    monkeypatch.setattr(streams, "fold", counted)
    monkeypatch.setattr(combining, "fold", counted)
    seen: list[TaskState] = []
    decisions = [_decision(recorder, seen) for _ in range(3)]
    await asyncio.gather(*decisions)
    # counted on while gathering, and decided on the same copy: one fold, not two
    assert folds == [1] and len(seen) == 3


async def test_a_decision_whose_siblings_do_not_come_goes_on_after_the_window() -> None:
    recorder = await _recorder(0.05)
    seen: list[TaskState] = []
    applied = await _decision(recorder, seen)
    assert applied.events == [] and seen
    assert recorder.observer.stats.counters["decisions_gathered"] == 1


async def test_the_gathering_decision_cancelled_lets_the_others_go_on() -> None:
    recorder, _, first, second = await _two_waiting()
    first.cancel()
    applied = await second  # only the cancellation can end its wait: the window is an hour
    assert applied.events == []
    with pytest.raises(asyncio.CancelledError):
        await first
    assert recorder.waiting(TASK) == 0


async def test_a_waiting_decision_cancelled_does_not_end_the_others_wait() -> None:
    recorder, seen, first, second = await _two_waiting()
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    for _ in range(20):
        await asyncio.sleep(0)
    assert not first.done()  # still gathering
    third = _decision(recorder, seen)
    fourth = _decision(recorder, seen)
    await asyncio.gather(first, third, fourth)


async def test_nothing_waits_while_the_worker_stops_or_when_one_is_expected() -> None:
    recorder = await _recorder(FOREVER, stopping=True)
    await _decision(recorder, [])
    assert "decisions_gathered" not in recorder.observer.stats.counters
    recorder = await _recorder(FOREVER)
    await _decision(recorder, [], expected=1)
    assert "decisions_gathered" not in recorder.observer.stats.counters


async def test_nothing_waits_for_more_than_a_consumer_can_hold_at_once() -> None:
    # with a prefetch of 2, the third of 3 replies cannot arrive before the first are settled
    recorder = await _recorder(FOREVER)
    recorder.combiner.gather_limit = 2
    await _decision(recorder, [], expected=3)
    assert "decisions_gathered" not in recorder.observer.stats.counters
    recorder = await _recorder(FOREVER)
    recorder.combiner.gather_limit = 3
    decisions = [_decision(recorder, [], expected=3) for _ in range(3)]
    await asyncio.gather(*decisions)
    assert recorder.observer.stats.counters["decisions_gathered"] == 3


async def test_without_a_copy_of_the_stream_nothing_waits() -> None:
    recorder = await _recorder(FOREVER)
    recorder.cache.take(TASK)
    await _decision(recorder, [])
    assert "decisions_gathered" not in recorder.observer.stats.counters


def _after(state: TaskState, events: Sequence[DomainEvent]) -> TaskState:
    """``state`` once ``events`` are recorded."""
    made = [NewEvent.of(uuid.uuid4(), event, {"worker_id": "w-1"}) for event in events]
    recorded = recorded_events(state.task_id, state.version, made, state.last_hash)
    return fold(state.task_id, recorded, start=state)


def _paused(*waits: Call | Signal | Sleep, until: FirstK | None = None) -> TaskState:
    new = TaskState(task_id=TASK)
    start = TaskStarted(agent="boss", input={})
    pause = Pause(list(waits), until=until)
    return _after(new, decide_outcome(new, pause, now=1000.0, default_timeout=60.0, start=start))


def _replied(state: TaskState, index: int, outcome: Literal["ok", "error"]) -> TaskState:
    subtask = f"{TASK}:{state.pause}:{index}"
    return _after(state, decide_reply(state, subtask, outcome=outcome, message_id=subtask))


def test_a_reply_gathers_only_for_the_replies_its_pause_can_still_take() -> None:
    """What the reply flow gathers for (``replies_awaited``): a timer or a signal never sends a
    reply, a ``FirstK`` pause takes no more than the successes it lacks, and once it resumed
    early the replies to the waits it gave up come late, with nothing to wait for."""
    assert replies_awaited(_paused(Sleep(60), Call("peer"), Signal("go"))) == 1
    three = _paused(Call("a"), Call("b"), Call("c"), until=FirstK(2))
    assert replies_awaited(three) == 2
    assert replies_awaited(_replied(three, 0, "error")) == 2
    one_ok = _replied(three, 0, "ok")
    assert replies_awaited(one_ok) == 1
    resumed = _replied(one_ok, 1, "ok")
    assert resumed.status == "resumed" and resumed.abandoned
    assert replies_awaited(resumed) == 0
