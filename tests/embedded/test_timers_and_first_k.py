"""Timers (``Sleep``) and first-k fan-in (``Pause(..., until=FirstK(k))``) through the real
worker, on the test kit's in-memory pool (issue 31).

The log's clock is the test's own: the in-memory store's ``wall_clock`` is what the sweeper asks
whether a wait is due (PostgreSQL's clock in a deployment), so a timer an hour away fires when the
test moves that clock past it, and never by waiting in real time. The store counts its sweeps, so
"not before" is seen over sweeps that looked, rather than over an interval of real time.

The peers that "never answer until cancelled" pause on a timer a day away, which no test reaches:
only a cancel ends them (their stream then ends with ``TaskCancelled``). ``ghost`` is served by no
worker: the test holds its request, sees its cancel arrive, and answers it late itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from waystation import App, Call, CallResult, Complete, FirstK, Pause, Permanent, Sleep, TaskContext
from waystation.events import OutboxMessage, Outcome, RecordedEvent
from waystation.events.codec import dumps, loads
from waystation.events.memory import InMemoryEventStore
from waystation.protocol.wire import TYPE_CANCEL, TYPE_RESULT

from .harness import WITHIN, World, eventually, settings

pytestmark = pytest.mark.timeout(60)

MINUTE = 60.0
HOUR = 3600.0
DAY = 86_400.0


class LogClock:
    """The log's wall clock: the real one, moved ahead by the test."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead

    def advance(self, seconds: float) -> None:
        self.ahead += seconds


class SweptStore(InMemoryEventStore):
    """The in-memory log, counting the sweeps that asked it for due waits."""

    def __init__(self, clock: LogClock) -> None:
        super().__init__(wall_clock=clock)
        self.sweeps = 0

    async def claim_expired_calls(self, *args: Any, **kwargs: Any) -> Any:
        self.sweeps += 1
        return await super().claim_expired_calls(*args, **kwargs)


def seen(result: CallResult) -> list[Any]:
    return [result.kind, result.agent, result.outcome, result.value]


def timers_app() -> App:
    app = App()

    @app.agent("sleeper")
    async def sleeper(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Sleep(HOUR)])
        return Complete([seen(r) for r in task.results])

    @app.agent("napper")
    async def napper(task: TaskContext) -> Outcome:
        """A timer beside a peer call: resumes once both have their results."""
        if not task.resumed:
            return Pause([Sleep(HOUR), Call("echo", "hi")])
        return Complete([seen(r) for r in task.results])

    @app.agent("first")
    async def first(task: TaskContext) -> Outcome:
        """Calls ``peers`` (by name), resuming on the first ``k`` successes; the run resumed
        early pauses again, on a timer, and completes with both pauses' results."""
        if task.pause == 0:
            peers = task.input["peers"]
            return Pause(
                [Call(peer, n) for n, peer in enumerate(peers)], until=FirstK(task.input["k"])
            )
        if task.pause == 1:
            return Pause([Sleep(HOUR)], update={"first": [seen(r) for r in task.results]})
        return Complete({"first": task.state["first"], "then": [seen(r) for r in task.results]})

    @app.agent("either")
    async def either(task: TaskContext) -> Outcome:
        """The ghost's answer (an hour's call) or a minute, whichever comes first."""
        if not task.resumed:
            return Pause([Call("ghost", 0, timeout=HOUR), Sleep(MINUTE)], until=FirstK(1))
        return Complete([seen(r) for r in task.results])

    @app.agent("echo")
    async def echo(task: TaskContext) -> Outcome:
        return Complete(task.input)

    @app.agent("stuck")
    async def stuck(task: TaskContext) -> Outcome:
        """Never answers until cancelled."""
        return Pause([Sleep(DAY)])

    @app.agent("fails")
    async def fails(task: TaskContext) -> Outcome:
        raise Permanent("this peer always fails")

    return app


@contextlib.asynccontextmanager
async def timed_world(
    workers: int = 1, **overrides: Any
) -> AsyncIterator[tuple[World, LogClock, SweptStore]]:
    clock = LogClock()
    store = SweptStore(clock)
    w = World(timers_app(), settings(**overrides), store=store)
    await w.open()
    try:
        w.broker.declare_queue(w.names.tasks("ghost"))
        for n in range(workers):
            await w.start_worker(f"w{n + 1}")
        yield w, clock, store
    finally:
        await w.close()


async def stream(w: World, task_id: str) -> list[RecordedEvent]:
    return await w.store.read_stream(task_id)


async def until_recorded(w: World, task_id: str, event_type: str, count: int = 1) -> None:
    """Wait until ``task_id``'s stream holds ``count`` events of ``event_type``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN
    while len(found := of_type(await stream(w, task_id), event_type)) < count:
        assert loop.time() < deadline, f"{task_id}: {len(found)} {event_type}, not {count}"
        await asyncio.sleep(0.01)


async def swept(store: SweptStore, times: int) -> None:
    """Wait until the workers asked the log for due waits ``times`` more times."""
    target = store.sweeps + times
    await eventually(lambda: store.sweeps >= target, f"{times} more sweeps")


def of_type(events: list[RecordedEvent], event_type: str) -> list[RecordedEvent]:
    return [e for e in events if e.event_type == event_type]


async def test_a_sleep_resumes_once_it_is_due_and_never_before() -> None:
    async with timed_world() as (w, clock, store):
        task_id = await w.publish("sleeper", {})
        await until_recorded(w, task_id, "TaskPaused")
        # due in an hour on the log's clock: the sweeps that looked left it paused, a minute
        # before it is due too
        for ahead in (0.0, HOUR - 60):
            clock.advance(ahead - clock.ahead)
            await swept(store, 3)
            assert [e.event_type for e in await stream(w, task_id)] == [
                "TaskStarted",
                "TaskPaused",
            ]
        assert task_id not in w.answers
        clock.advance(60)
        answer = await w.answer(task_id)
        assert answer["status"] == "ok", answer
        assert answer["result"] == [["timer", "", "ok", None]]
        events = await stream(w, task_id)
        (paused,) = of_type(events, "TaskPaused")
        (timer,) = paused.data["calls"]
        assert timer["kind"] == "timer"
        assert timer["deadline_at"] == pytest.approx(timer["dispatched_at"] + HOUR)
        claims = [e.data["subtask_id"] for e in of_type(events, "SubtaskClaimed")]
        assert claims == [f"{task_id}:1:0"]


async def test_a_sleep_beside_a_call_waits_for_both_and_the_reply_gathers_for_no_timer() -> None:
    """The call's reply is the only reply the pause will get: it does not wait (``gather``) for
    the timer's, which never comes as a message."""
    async with timed_world(reply_gather_ms=10_000) as (w, clock, store):
        task_id = await w.publish("napper", {})
        await until_recorded(w, task_id, "ResultRecorded")
        (worker,) = w.workers
        assert worker.stats.counters.get("decisions_gathered", 0) == 0
        await swept(store, 3)
        assert of_type(await stream(w, task_id), "TaskResumed") == []
        clock.advance(HOUR)
        answer = await w.answer(task_id)
        assert answer["result"] == [["timer", "", "ok", None], ["call", "echo", "ok", "hi"]]


async def _ghost_called_then_cancelled(w: World, task_id: str) -> OutboxMessage:
    """The call to ``ghost`` (the third of the pause) and then its cancel, as ghost's queue
    holds them; the late reply the test gives it."""
    queue = w.names.tasks("ghost")
    await eventually(lambda: len(w.broker.messages(queue)) == 2, "the call to ghost, its cancel")
    request, cancel = w.broker.messages(queue)
    w.broker.queues[queue].ready.clear()
    assert request.properties["correlation_id"] == f"{task_id}:1:2"
    assert cancel.properties["type"] == TYPE_CANCEL
    assert loads(cancel.body)["task_id"] == f"{task_id}:1:2"
    return OutboxMessage(
        message_id=f"{task_id}:1:2:late",
        routing_key=request.properties["reply_to"],
        body=dumps({"status": "ok", "result": "too late"}),
        properties={"type": TYPE_RESULT, "correlation_id": f"{task_id}:1:2"},
    )


async def test_first_1_of_3_resumes_on_the_first_ok_cancels_the_others_and_ignores_them_late() -> (
    None
):
    async with timed_world(workers=2) as (w, clock, _):
        task_id = await w.publish("first", {"peers": ["stuck", "echo", "ghost"], "k": 1})
        # the first ok resumed the task; the run in place paused again, on a timer
        await until_recorded(w, task_id, "TaskPaused", 2)
        events = await stream(w, task_id)
        (resumed,) = of_type(events, "TaskResumed")
        assert [c["subtask_id"] for c in resumed.data["abandoned"]] == [
            f"{task_id}:1:0",
            f"{task_id}:1:2",
        ]
        # each peer given up is told: stuck's own stream ends cancelled, ghost gets a cancel
        await until_recorded(w, f"{task_id}:1:0", "TaskCancelled")
        late_reply = await _ghost_called_then_cancelled(w, task_id)
        # their answers come late: recorded for audit, never applied
        await w.publisher.publish(late_reply)
        await until_recorded(w, task_id, "ReplyIgnored", 2)
        clock.advance(HOUR)
        answer = await w.answer(task_id)
        assert answer["status"] == "ok", answer
        assert answer["result"] == {
            "first": [
                ["call", "stuck", "cancelled", None],
                ["call", "echo", "ok", 1],
                ["call", "ghost", "cancelled", None],
            ],
            "then": [["timer", "", "ok", None]],
        }
        events = await stream(w, task_id)
        ignored = {e.data["subtask_id"]: e.data for e in of_type(events, "ReplyIgnored")}
        assert set(ignored) == {f"{task_id}:1:0", f"{task_id}:1:2"}
        assert {i["reason"] for i in ignored.values()} == {"late"}
        assert ignored[f"{task_id}:1:2"]["outcome"] == "ok"  # a success, and still too late
        results = [e.data["subtask_id"] for e in of_type(events, "ResultRecorded")]
        assert results == [f"{task_id}:1:1", f"{task_id}:2:0"]
        assert len(w.answers[task_id]) == 1


async def test_first_2_of_3_resumes_once_two_failures_leave_k_out_of_reach() -> None:
    async with timed_world(workers=2) as (w, clock, _):
        task_id = await w.publish("first", {"peers": ["fails", "fails", "stuck"], "k": 2})
        await until_recorded(w, task_id, "TaskPaused", 2)
        (resumed,) = of_type(await stream(w, task_id), "TaskResumed")
        assert [c["subtask_id"] for c in resumed.data["abandoned"]] == [f"{task_id}:1:2"]
        await until_recorded(w, f"{task_id}:1:2", "TaskCancelled")
        clock.advance(HOUR)
        answer = await w.answer(task_id)
        first = answer["result"]["first"]
        assert [r[:3] for r in first] == [
            ["call", "fails", "error"],
            ["call", "fails", "error"],
            ["call", "stuck", "cancelled"],
        ]
        assert answer["result"]["then"] == [["timer", "", "ok", None]]


async def test_first_1_of_a_call_and_a_timer_resumes_when_the_timer_fires() -> None:
    """The sweeper decides this resume (the timer's result is its first success): the call is
    given up and cancelled there, and the resumed run goes by resume message."""
    async with timed_world(workers=2) as (w, clock, store):
        task_id = await w.publish("either", {})
        ghost = w.names.tasks("ghost")
        await eventually(lambda: len(w.broker.messages(ghost)) == 1, "the call to ghost")
        await swept(store, 3)
        assert of_type(await stream(w, task_id), "TaskResumed") == []
        clock.advance(2 * MINUTE)  # the timer is due, the call's deadline far ahead
        answer = await w.answer(task_id)
        assert answer["result"] == [["call", "ghost", "cancelled", None], ["timer", "", "ok", None]]
        (resumed,) = of_type(await stream(w, task_id), "TaskResumed")
        assert resumed.data["abandoned"] == [{"subtask_id": f"{task_id}:1:0", "agent": "ghost"}]
        await eventually(lambda: len(w.broker.messages(ghost)) == 2, "the cancel of the call")
        cancel = w.broker.messages(ghost)[1]
        assert cancel.properties["type"] == TYPE_CANCEL
        assert loads(cancel.body)["task_id"] == f"{task_id}:1:0"
