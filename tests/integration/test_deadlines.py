"""Deadlines (G6): every call has one, expiry is recorded once, the peer is told to cancel, and
progress reports move a deadline up to a maximum. Workers run in this process; the test plays the
peer ``ghost`` (no worker serves it) with a plain aio-pika channel."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import Any

import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from scripts.lab.harness.broker import declare_quorum_queue
from scripts.lab.harness.checks import chain_problems
from scripts.lab.harness.clients import RecordingClient
from waystation.agent import App, TaskContext
from waystation.events import Call, Complete, ExpiredCall, Outcome, Pause
from waystation.events.codec import dumps, loads
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import (
    counter,
    eventually,
    publish_raw,
    publish_reply,
    running_worker,
    stream_types,
    take,
)

pytestmark = pytest.mark.integration

SWEEP = 0.5
TIMEOUT_ERROR = {"type": "timeout", "message": "no reply before the call's deadline"}


def ghost_app(*, default_timeout: float | None = None) -> App:
    """``boss`` calls ``ghost`` once per entry of ``input["timeouts"]`` (None: no own timeout)
    and completes with ``[outcome, value, error]`` of each call."""
    app = App()

    @app.agent("boss", default_timeout=default_timeout)
    async def boss(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause(
                [Call("ghost", {"i": i}, timeout=t) for i, t in enumerate(task.input["timeouts"])]
            )
        return Complete([[r.outcome, r.value, r.error] for r in task.results])

    @app.agent("plain")
    async def plain(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("ghost", {"plain": True})])
        return Complete(None)

    return app


@pytest.fixture
def fast(settings: Settings) -> Settings:
    return settings.model_copy(update={"sweep_interval": SWEEP})


@pytest.fixture
async def ghost(
    amqp_channel: AbstractChannel, settings: Settings, extra_agents: list[str]
) -> AbstractQueue:
    extra_agents.extend(["boss", "plain", "ghost"])
    return await declare_quorum_queue(amqp_channel, Names(settings.queue_prefix).tasks("ghost"))


async def paused_calls(store: PostgresEventStore, task_id: str) -> list[dict[str, Any]]:
    [paused] = [e for e in await store.read_stream(task_id) if e.event_type == "TaskPaused"]
    return list(paused.data["calls"])


def cancel_of(message: AbstractIncomingMessage) -> tuple[str, str | None, Any]:
    return (message.type or "", message.message_id, loads(message.body))


async def progress(
    channel: AbstractChannel, request: AbstractIncomingMessage, extend_by: float, n: int
) -> None:
    """A ``progress`` report for ``request``, as a peer sends it."""
    assert request.reply_to
    await publish_raw(
        channel,
        request.reply_to,
        dumps({"extend_by": extend_by}),
        type="progress",
        correlation_id=request.correlation_id,
        message_id=f"{request.correlation_id}:progress:{n}",
        content_type="application/json",
    )


@pytest.mark.timeout(180)
async def test_a_peer_that_never_answers_times_out_and_is_told_to_cancel(
    fast: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    async with (
        running_worker(ghost_app(), fast, store) as worker,
        RecordingClient(fast.amqp_url, queue_prefix=fast.queue_prefix) as client,
    ):
        task_id = await client.submit("boss", {"timeouts": [1]})
        [request] = await take(ghost, 1)
        subtask = f"{task_id}:1:0"
        assert request.correlation_id == subtask
        [call] = await paused_calls(store, task_id)
        assert call["deadline_at"] - call["dispatched_at"] == pytest.approx(1.0)
        assert set(await store.pending_call_deadlines(task_id)) == {subtask}

        result = await client.result(task_id, timeout=60)
        received = time.time()
        assert result.ok and result.result == [["timeout", None, TIMEOUT_ERROR]]
        # not before the deadline (how long after depends on the machine: no bound here)
        assert call["deadline_at"] <= received, received - call["deadline_at"]

        # the peer is told, once, that the call is no longer wanted
        [cancel] = await take(ghost, 1)
        assert cancel_of(cancel) == (
            "cancel",
            f"{subtask}:cancel",
            {"task_id": subtask, "reason": "timeout"},
        )

        # its answer, when it finally comes, is recorded as late and changes nothing
        await publish_reply(
            amqp_channel, request, {"status": "ok", "result": "finally"}, message_id="late"
        )

        async def audited() -> bool:
            return "ReplyIgnored" in await stream_types(store, task_id)

        await eventually(audited, 30, "the late reply to be audited")
        assert counter(worker, "timeouts") == 1

    events = await store.read_stream(task_id)
    assert [e.event_type for e in events] == [
        "TaskStarted",
        "TaskPaused",
        "SubtaskClaimed",
        "ResultRecorded",
        "TaskResumed",
        "TaskCompleted",
        "ReplyIgnored",
    ]
    claim, recorded = events[2], events[3]
    assert claim.data["message_id"] is None
    assert claim.metadata["causation_id"] == f"deadline:{subtask}"
    assert recorded.data["outcome"] == "timeout"
    assert recorded.metadata["occurred_at"] >= call["deadline_at"]
    assert events[-1].data == {
        "subtask_id": subtask,
        "reason": "late",
        "message_id": "late",
        "outcome": "ok",
    }
    assert chain_problems(events) == []
    assert await store.pending_call_deadlines(task_id) == {}
    assert len(client.distinct_results(task_id)) == 1


@pytest.mark.timeout(180)
async def test_a_reply_after_its_timeout_is_not_applied_while_the_task_waits_for_the_rest(
    fast: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    async with (
        running_worker(ghost_app(), fast, store),
        RecordingClient(fast.amqp_url, queue_prefix=fast.queue_prefix) as client,
    ):
        # the second call's deadline is far beyond anything this test waits for
        task_id = await client.submit("boss", {"timeouts": [0.5, 600]})
        requests = {m.correlation_id: m for m in await take(ghost, 2)}
        quick, slow = requests[f"{task_id}:1:0"], requests[f"{task_id}:1:1"]

        async def timed_out() -> bool:
            return "ResultRecorded" in await stream_types(store, task_id)

        await eventually(timed_out, 30, "the first call's timeout")
        await publish_reply(amqp_channel, quick, {"status": "ok", "result": "late"}, message_id="q")

        async def audited() -> bool:
            return "ReplyIgnored" in await stream_types(store, task_id)

        await eventually(audited, 30, "the late reply to be audited")
        assert set(await store.pending_call_deadlines(task_id)) == {f"{task_id}:1:1"}
        await publish_reply(amqp_channel, slow, {"status": "ok", "result": "slow"}, message_id="s")
        result = await client.result(task_id, timeout=60)
    assert result.result == [["timeout", None, TIMEOUT_ERROR], ["ok", "slow", None]]
    types = await stream_types(store, task_id)
    assert types == [
        "TaskStarted",
        "TaskPaused",
        "SubtaskClaimed",
        "ResultRecorded",
        "ReplyIgnored",
        "SubtaskClaimed",
        "ResultRecorded",
        "TaskResumed",
        "TaskCompleted",
    ]


class StaleSweepStore(PostgresEventStore):
    """A sweeper that sees every call of ``calls`` past its deadline on every sweep, claimed or
    not, leased or not: as if each of its reads were taken just before the others committed (a
    lease that ran out while its holder was still at work, a stalled worker waking up). Only
    the log's version check stands between it and a second record of the same timeout."""

    calls: dict[str, tuple[str, float]]
    """subtask -> (task id, deadline)"""
    handed_out: Counter[str]

    async def claim_expired_calls(
        self, limit: int = 100, lease: float = 30.0, *, deployment: str | None = None
    ) -> list[ExpiredCall]:
        now = time.time()
        expired = [
            ExpiredCall(subtask_id=subtask, task_id=task_id, agent="ghost")
            for subtask, (task_id, deadline) in self.calls.items()
            if deadline <= now
        ]
        self.handed_out.update(c.subtask_id for c in expired)
        return expired


@pytest.mark.timeout(180)
async def test_two_workers_sweeping_the_same_expired_calls_record_each_timeout_once(
    fast: Settings,
    database_url: str,
    ghost: AbstractQueue,
) -> None:
    tasks, k = 10, 2
    stores = [StaleSweepStore.from_url(database_url, pool_size=8) for _ in range(2)]
    calls: dict[str, tuple[str, float]] = {}
    for store in stores:
        store.calls, store.handed_out = calls, Counter()
    app = ghost_app()
    try:
        async with (
            running_worker(app, fast.model_copy(update={"worker_id": "sweeper-a"}), stores[0]) as a,
            running_worker(app, fast.model_copy(update={"worker_id": "sweeper-b"}), stores[1]) as b,
            RecordingClient(fast.amqp_url, queue_prefix=fast.queue_prefix) as client,
        ):
            task_ids = [await client.submit("boss", {"timeouts": [0.5] * k}) for _ in range(tasks)]
            requests = await take(ghost, tasks * k)
            for task_id in task_ids:
                for call in await paused_calls(stores[0], task_id):
                    calls[call["subtask_id"]] = (task_id, call["deadline_at"])
            answers = await asyncio.gather(*(client.result(t, timeout=60) for t in task_ids))
            results = dict(zip(task_ids, answers, strict=True))
            # the cancels; a request may come again among them when a relay republished it
            # (its first publish was confirmed later than the outbox delay, on a busy machine)
            cancels: list[Any] = []
            repeated: list[Any] = []
            while len(cancels) < tasks * k:
                [message] = await take(ghost, 1, within=30)
                (cancels if message.type == "cancel" else repeated).append(message)
            requested = {m.message_id for m in requests}
            assert all(m.message_id in requested for m in repeated), repeated

            def swept_twice() -> bool:
                # each sweeper really went for every call, more than once: later sweeps over
                # calls already recorded are what this test is about
                return all(
                    set(store.handed_out) == set(calls) and min(store.handed_out.values()) >= 2
                    for store in stores
                )

            await eventually(swept_twice, 30, "both sweepers to take every call twice")
            stats = {w.settings.worker_id: dict(w.stats.counters) for w in (a, b)}
        assert sum(counter(w, "timeouts") for w in (a, b)) == tasks * k, stats
        for task_id in task_ids:
            assert results[task_id].result == [["timeout", None, TIMEOUT_ERROR]] * k
            events = await stores[0].read_stream(task_id)
            types = Counter(e.event_type for e in events)
            claims = Counter(
                e.data["subtask_id"] for e in events if e.event_type == "SubtaskClaimed"
            )
            assert claims == Counter(f"{task_id}:1:{i}" for i in range(k)), types
            assert (types["ResultRecorded"], types["TaskResumed"], types["TaskCompleted"]) == (
                k,
                1,
                1,
            ), types
            assert chain_problems(events) == []
            assert len(client.distinct_results(task_id)) == 1
        assert Counter(loads(m.body)["task_id"] for m in cancels) == Counter(list(calls))
        print(f"two sweepers: {stats}")
    finally:
        for store in stores:
            await store.close()


@pytest.mark.timeout(300)
async def test_progress_extends_a_deadline_up_to_the_maximum_from_dispatch(
    fast: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    # deadlines far enough ahead that each report certainly arrives before the one it moves
    bounded = fast.model_copy(update={"max_call_duration": 300.0})
    async with (
        running_worker(ghost_app(), bounded, store) as worker,
        RecordingClient(fast.amqp_url, queue_prefix=fast.queue_prefix) as client,
    ):
        task_id = await client.submit("boss", {"timeouts": [20]})
        [request] = await take(ghost, 1)
        subtask = f"{task_id}:1:0"
        [call] = await paused_calls(store, task_id)

        async def extensions(count: int) -> None:
            async def seen() -> bool:
                return (await stream_types(store, task_id)).count("DeadlineExtended") >= count

            await eventually(seen, 30, f"{count} DeadlineExtended")

        sent = time.time()
        await progress(amqp_channel, request, 60, 1)
        await extensions(1)
        moved = (await store.pending_call_deadlines(task_id))[subtask]
        assert sent + 60 <= moved + 1e-3 and moved <= time.time() + 60
        # the same report again (a redelivery, a peer retrying): recorded once. A moment later,
        # so that deciding it again would give another deadline
        await asyncio.sleep(0.05)
        await progress(amqp_channel, request, 60, 1)
        await eventually(
            lambda: counter(worker, "progress_ignored") == 1, 30, "the repeated report to be acked"
        )
        assert (await stream_types(store, task_id)).count("DeadlineExtended") == 1

        # far beyond the maximum: held at dispatch + max_call_duration
        await progress(amqp_channel, request, 3600, 2)
        await extensions(2)
        bound = call["dispatched_at"] + bounded.max_call_duration
        assert (await store.pending_call_deadlines(task_id))[subtask] == pytest.approx(
            bound, abs=1e-3
        )
        # a report that would bring it forward changes nothing
        await progress(amqp_channel, request, 1, 3)
        await eventually(
            lambda: counter(worker, "progress_ignored") == 2, 30, "the useless report to be acked"
        )
        assert counter(worker, "deadlines_extended") == 2
        await publish_reply(amqp_channel, request, {"status": "ok", "result": 7}, message_id="r")
        result = await client.result(task_id, timeout=60)
        # progress for a call already answered: acked, ignored
        await progress(amqp_channel, request, 10, 4)
        await eventually(
            lambda: counter(worker, "progress_ignored") == 3, 30, "the report after the reply"
        )
    assert result.result == [["ok", 7, None]]
    events = await store.read_stream(task_id)
    extended = [e.data for e in events if e.event_type == "DeadlineExtended"]
    assert [e["deadline_at"] for e in extended] == [pytest.approx(moved, abs=1e-3), bound]
    assert [e["subtask_id"] for e in extended] == [subtask, subtask]
    assert "ResultRecorded" in [e.event_type for e in events]
    assert [e.data["outcome"] for e in events if e.event_type == "ResultRecorded"] == ["ok"]


@pytest.mark.timeout(120)
async def test_a_peer_reporting_progress_outlives_its_deadline_but_not_the_maximum(
    fast: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    """Two calls of 3 s whose peer reports progress every half second (4 s more each time, so a
    report processed late still lands well before the deadline it moves): one is answered after
    6 s (two original deadlines later) and succeeds; the other is never answered and times out
    at the maximum (9 s from dispatch), however often its peer reports."""
    bounded = fast.model_copy(update={"max_call_duration": 9.0})
    async with (
        running_worker(ghost_app(), bounded, store) as worker,
        RecordingClient(fast.amqp_url, queue_prefix=fast.queue_prefix) as client,
    ):
        task_id = await client.submit("boss", {"timeouts": [3, 3]})
        requests = {m.correlation_id: m for m in await take(ghost, 2)}
        answered, endless = requests[f"{task_id}:1:0"], requests[f"{task_id}:1:1"]
        calls = await paused_calls(store, task_id)
        dispatched = calls[0]["dispatched_at"]

        async def keep_reporting() -> None:
            replied = False
            for n in range(1, 1000):
                if not replied and time.time() < dispatched + 6:
                    await progress(amqp_channel, answered, 4, n)
                elif not replied:
                    await publish_reply(
                        amqp_channel, answered, {"status": "ok", "result": "done"}, message_id="a"
                    )
                    replied = True
                await progress(amqp_channel, endless, 4, n)
                await asyncio.sleep(0.5)

        reporter = asyncio.create_task(keep_reporting())
        try:
            result = await client.result(task_id, timeout=60)
            received = time.time()
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
    assert result.result == [["ok", "done", None], ["timeout", None, TIMEOUT_ERROR]]
    bound = dispatched + 9
    assert bound <= received, received - bound  # not before the maximum; no upper bound here
    events = await store.read_stream(task_id)
    [timed_out] = [e for e in events if e.data.get("outcome") == "timeout"]
    assert timed_out.metadata["occurred_at"] >= bound
    extended = [e.data for e in events if e.event_type == "DeadlineExtended"]
    assert {e["subtask_id"] for e in extended} == {answered.correlation_id, endless.correlation_id}
    assert max(e["deadline_at"] for e in extended) == pytest.approx(bound)
    assert counter(worker, "timeouts") == 1


async def test_every_call_has_a_deadline_its_own_else_its_agents_else_the_global_default(
    fast: Settings,
    store: PostgresEventStore,
    ghost: AbstractQueue,
) -> None:
    defaults = fast.model_copy(update={"default_call_timeout": 11.0})
    async with (
        running_worker(ghost_app(default_timeout=7.0), defaults, store),
        RecordingClient(fast.amqp_url, queue_prefix=fast.queue_prefix) as client,
    ):
        boss = await client.submit("boss", {"timeouts": [3, None]})
        plain = await client.submit("plain", {})
        await take(ghost, 3)
        boss_calls = await paused_calls(store, boss)
        [plain_call] = await paused_calls(store, plain)
        assert [c["deadline_at"] - c["dispatched_at"] for c in boss_calls] == [
            pytest.approx(3.0),
            pytest.approx(7.0),
        ]
        assert plain_call["deadline_at"] - plain_call["dispatched_at"] == pytest.approx(11.0)
        pending = {
            **await store.pending_call_deadlines(boss),
            **await store.pending_call_deadlines(plain),
        }
        assert pending == {
            c["subtask_id"]: pytest.approx(c["deadline_at"], abs=1e-3)
            for c in [*boss_calls, plain_call]
        }
        # done with them: cancelled, so no later test's sweeper finds them
        for agent, task_id in (("boss", boss), ("plain", plain)):
            assert await client.cancel(agent, task_id, timeout=10) == "cancelled"
    assert await store.pending_call_deadlines(boss) == {}
    assert await store.pending_call_deadlines(plain) == {}


async def test_a_call_no_queue_can_take_fails_at_once_not_at_its_deadline(
    fast: Settings, store: PostgresEventStore, extra_agents: list[str]
) -> None:
    extra_agents.append("lonely")
    app = App()

    @app.agent("lonely")
    async def lonely(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("nobody-serves-this", {"x": 1}, timeout=3000)])
        return Complete([[r.outcome, r.error] for r in task.results])

    async with (
        running_worker(app, fast, store),
        RecordingClient(fast.amqp_url, queue_prefix=fast.queue_prefix) as client,
    ):
        # the call's deadline is an hour away: an answer within the minute is not the timeout
        result = await client.call("lonely", {}, timeout=60)
    [[outcome, error]] = result.result
    assert outcome == "error" and error["type"] == "unroutable", error
    assert await store.pending_call_deadlines(result.task_id) == {}
