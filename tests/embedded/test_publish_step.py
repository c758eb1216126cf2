"""The publish step (``waystation.runtime.publishing``) sends what every kind of work committed,
as soon as that work's flow returns: with the relay's delay set to an hour, every answer below
arrives only if the pipeline itself sent the messages its appends committed. A path that left
its messages to the relay would stall its task here, and count ``outbox_relayed``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from waystation import App, Call, Complete, Pause, Permanent, TaskContext
from waystation.events import TaskStarted, event_id
from waystation.events.codec import GENESIS_HASH
from waystation.events.memory import InMemoryEventStore
from waystation.runtime.publishing import PublishStep
from waystation.runtime.recorder import Cause
from waystation.testing import InMemoryPool

HOUR = 3600.0


def _app(hold: asyncio.Event) -> App:
    app = App()

    @app.agent("parent")  # resumed in place, its replies combined
    async def parent(task: TaskContext) -> Any:
        if task.pause == 0:
            return Pause([Call("child", n) for n in range(3)])
        return Complete(sum(r.value for r in task.results))

    @app.agent("limited", concurrency=1)  # resumed by a resume message (pool limits)
    async def limited(task: TaskContext) -> Any:
        if task.pause == 0:
            return Pause([Call("child", 5)])
        return Complete(task.results[0].value)

    @app.agent("patient")  # its call times out: the sweeper records it
    async def patient(task: TaskContext) -> Any:
        if task.pause == 0:
            return Pause([Call("stuck", None, timeout=0.2)])
        return Complete(task.results[0].outcome)

    @app.agent("child")
    async def child(task: TaskContext) -> Any:
        return Complete(task.input * 10)

    @app.agent("stuck")
    async def stuck(task: TaskContext) -> Any:
        await hold.wait()
        return Complete(None)

    @app.agent("caller-of-broken")  # a call that fails for good: its failure answers the caller
    async def caller_of_broken(task: TaskContext) -> Any:
        if task.pause == 0:
            return Pause([Call("broken", None)])
        return Complete(task.results[0].outcome)

    @app.agent("broken")
    async def broken(task: TaskContext) -> Any:
        raise Permanent("never")

    return app


async def test_every_kind_of_work_sends_what_it_committed_without_the_relay() -> None:
    hold = asyncio.Event()
    async with InMemoryPool(_app(hold), workers=2, outbox_delay=HOUR) as pool:
        answers = await asyncio.gather(
            pool.call("parent", None),
            pool.call("limited", None),
            pool.call("patient", None),
            pool.call("caller-of-broken", None),
        )
        hold.set()
        assert [a.result for a in answers] == [30, 50, "timeout", "error"]
        await pool.join()
        relayed = [w.stats.counters.get("outbox_relayed", 0) for w in pool.workers]
        assert relayed == [0, 0]
        counted = [w.stats.counters for w in pool.workers]
        assert sum(c.get("resumed_in_place", 0) for c in counted) >= 1, counted


async def test_an_append_outside_a_collecting_scope_is_refused_before_anything_is_written() -> None:
    async with InMemoryPool(App(), workers=1) as pool:
        recorder = pool.workers[0].recorder
        store = pool.store
        assert isinstance(store, InMemoryEventStore)
        started = TaskStarted(agent="child", input=1)

        with pytest.raises(RuntimeError, match="collecting"):
            await recorder.commit(
                await recorder.load("t-outside"), [started], "run", Cause(), step="pause"
            )
        assert await store.read_stream("t-outside") == []

        publishing: PublishStep = pool.workers[0].publishing
        with publishing.collecting() as committed:
            assert await recorder.commit(
                await recorder.load("t-inside"), [started], "run", Cause(), step="pause"
            )
        assert [a.step for a in committed.appends] == ["pause"]
        stream = await store.read_stream("t-inside")
        assert [e.event_id for e in stream] == [event_id("t-inside", "run", 0)]
        assert stream[0].prev_hash == GENESIS_HASH
