"""Cancellation (G7): durable, cascading to pending peers (recursively through Waystation agents),
settled by the log when it races the last reply. Workers run in this process; the test plays the
peer ``ghost`` (and ``leaf``) with a plain aio-pika channel, and runs ``waystation cancel`` as a
user does, as a subprocess."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aio_pika.abc import AbstractChannel, AbstractQueue

from scripts.lab.harness.broker import declare_quorum_queue
from scripts.lab.harness.checks import chain_problems
from scripts.lab.harness.clients import RecordingClient
from waystation.agent import App, TaskContext
from waystation.events import Call, Complete, Outcome, Pause
from waystation.events.codec import loads
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import (
    counter,
    eventually,
    publish_reply,
    published_everything,
    running_worker,
    stream_types,
    take,
)
from .test_cli import run_cli

pytestmark = pytest.mark.integration

TERMINAL = {"TaskCompleted", "TaskFailed", "TaskCancelled"}


@dataclass
class Gate:
    """Holds the ``slow`` agent's first run until the test lets it go."""

    entered: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    runs: int = 0


def cancel_app(gate: Gate | None = None) -> App:
    app = App()

    @app.agent("boss")
    async def boss(task: TaskContext) -> Outcome:
        """Calls ``ghost`` ``k`` times (the test plays ghost); completes with the values."""
        if not task.resumed:
            return Pause([Call("ghost", {"i": i}) for i in range(int(task.input["k"]))])
        return Complete([r.value for r in task.results])

    @app.agent("root")
    async def root(task: TaskContext) -> Outcome:
        """Calls ``middle``, a Waystation agent of this app."""
        if not task.resumed:
            return Pause([Call("middle", {"from": task.task_id})])
        return Complete([r.outcome for r in task.results])

    @app.agent("middle")
    async def middle(task: TaskContext) -> Outcome:
        """Calls ``leaf`` (the test plays leaf)."""
        if not task.resumed:
            return Pause([Call("leaf", {"from": task.task_id})])
        return Complete("middle done")

    @app.agent("slow")
    async def slow(task: TaskContext) -> Outcome:
        """Decides to call ``ghost`` once the test opens the gate."""
        assert gate is not None, "the slow agent needs a gate"
        if not task.resumed:
            gate.runs += 1
            gate.entered.set()
            await gate.release.wait()
            return Pause([Call("ghost", {"slow": True})])
        return Complete("slow done")

    return app


@pytest.fixture
async def ghost(
    amqp_channel: AbstractChannel, settings: Settings, extra_agents: list[str]
) -> AbstractQueue:
    extra_agents.extend(["boss", "ghost", "root", "middle", "leaf", "slow"])
    return await declare_quorum_queue(amqp_channel, Names(settings.queue_prefix).tasks("ghost"))


def decisive(types: list[str]) -> list[str]:
    return [t for t in types if t != "ReplyIgnored"]


async def every_stream_has(store: PostgresEventStore, task_ids: list[str], event_type: str) -> bool:
    for task_id in task_ids:
        if event_type not in await stream_types(store, task_id):
            return False
    return True


async def test_cancel_during_a_pause_cancels_every_pending_call_and_answers_once(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    async with (
        running_worker(cancel_app(), settings, store) as worker,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        task_id = await client.submit("boss", {"k": 3})
        requests = {m.correlation_id: m for m in await take(ghost, 3)}
        subtasks = [f"{task_id}:1:{i}" for i in range(3)]
        assert sorted(requests) == subtasks

        assert await client.cancel("boss", task_id, reason="user asked", timeout=60) == "cancelled"
        cancels = await take(ghost, 3)
        assert sorted(
            (m.type, m.message_id, loads(m.body)["task_id"], loads(m.body)["reason"])
            for m in cancels
        ) == [("cancel", f"{sub}:cancel", sub, "user asked") for sub in subtasks]
        result = await client.result(task_id, timeout=60)
        assert result.status == "cancelled"
        assert result.error == {"type": "cancelled", "message": "user asked"}

        # a reply that comes anyway: acked and audited as late, never applied
        await publish_reply(
            amqp_channel, requests[subtasks[1]], {"status": "ok", "result": 1}, message_id="late"
        )

        async def audited() -> bool:
            return "ReplyIgnored" in await stream_types(store, task_id)

        await eventually(audited, 30, "the late reply's audit")
        # a second cancel changes nothing and sends nothing
        assert await client.cancel("boss", task_id, reason="again", timeout=60) == "cancelled"
        assert counter(worker, "cancels_applied") == 1
        assert counter(worker, "cancels_ignored") == 1
        await published_everything(store, [task_id])
        assert await ghost.get(fail=False) is None, "something more went to the peer"
    events = await store.read_stream(task_id)
    assert [e.event_type for e in events] == [
        "TaskStarted",
        "TaskPaused",
        "TaskCancelled",
        "ReplyIgnored",
    ]
    assert events[2].data == {
        "reason": "user asked",
        "pending": [{"subtask_id": sub, "agent": "ghost"} for sub in subtasks],
    }
    assert (events[3].data["reason"], events[3].data["subtask_id"]) == ("late", subtasks[1])
    assert chain_problems(events) == []
    assert await store.pending_call_deadlines(task_id) == {}
    # one result, whatever the relay may have published twice
    assert [loads(b) for b in set(client.bodies(task_id))] == [
        {
            "status": "cancelled",
            "error": {"type": "cancelled", "message": "user asked"},
            "task_id": task_id,
        }
    ]


async def test_waystation_cancel_cancels_a_paused_task_and_refuses_a_finished_one(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    async with (
        running_worker(cancel_app(), settings, store),
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        paused_id = await client.submit("boss", {"k": 1})
        done_id = await client.submit("boss", {"k": 1})
        requests = {m.correlation_id: m for m in await take(ghost, 2)}
        await publish_reply(
            amqp_channel, requests[f"{done_id}:1:0"], {"status": "ok", "result": 5}, message_id="d"
        )
        assert (await client.result(done_id, timeout=60)).result == [5]

        cancelled = await asyncio.to_thread(run_cli, settings, "cancel", paused_id)
        assert cancelled.returncode == 0, cancelled.stderr
        assert orjson.loads(cancelled.stdout) == {"task_id": paused_id, "status": "cancelled"}
        assert (await client.result(paused_id, timeout=60)).status == "cancelled"
        [cancel] = await take(ghost, 1)
        assert loads(cancel.body)["task_id"] == f"{paused_id}:1:0"

        finished = await asyncio.to_thread(run_cli, settings, "cancel", done_id)
        assert finished.returncode == 1, finished.stderr
        assert orjson.loads(finished.stdout) == {"task_id": done_id, "status": "completed"}

        unknown = await asyncio.to_thread(run_cli, settings, "cancel", "no-such-task")
        assert unknown.returncode == 2
        assert "not in the event log" in unknown.stderr
    assert decisive(await stream_types(store, paused_id))[-1] == "TaskCancelled"
    done_types = await stream_types(store, done_id)
    assert done_types[-1] == "TaskCompleted" and "TaskCancelled" not in done_types


async def test_cancel_cascades_through_a_waystation_agent_to_its_own_peer(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    names = Names(settings.queue_prefix)
    leaf = await declare_quorum_queue(amqp_channel, names.tasks("leaf"))
    async with (
        running_worker(cancel_app(), settings, store),
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        root_id = await client.submit("root", {})
        middle_id = f"{root_id}:1:0"
        leaf_call = f"{middle_id}:1:0"
        [request] = await take(leaf, 1)
        assert request.correlation_id == leaf_call

        assert await client.cancel("root", root_id, reason="stop it all", timeout=60) == "cancelled"
        [cancel] = await take(leaf, 1)
        assert cancel.type == "cancel"
        assert loads(cancel.body) == {"task_id": leaf_call, "reason": "stop it all"}
        assert (await client.result(root_id, timeout=60)).status == "cancelled"

        async def middle_told_root() -> bool:
            # the middle agent's own "cancelled" answer reaches the root, already cancelled
            return "ReplyIgnored" in await stream_types(store, root_id)

        await eventually(middle_told_root, 30, "the middle agent's answer to reach the root")

    middle = await store.read_stream(middle_id)
    assert [e.event_type for e in middle] == ["TaskStarted", "TaskPaused", "TaskCancelled"]
    assert middle[-1].data == {
        "reason": "stop it all",
        "pending": [{"subtask_id": leaf_call, "agent": "leaf"}],
    }
    # every event of the tree names its root
    assert {e.metadata["correlation_id"] for e in middle} == {root_id}
    root = await store.read_stream(root_id)
    assert [e.event_type for e in root] == [
        "TaskStarted",
        "TaskPaused",
        "TaskCancelled",
        "ReplyIgnored",
    ]
    assert root[2].data["pending"] == [{"subtask_id": middle_id, "agent": "middle"}]
    assert (root[3].data["subtask_id"], root[3].data["reason"]) == (middle_id, "late")
    assert await store.pending_call_deadlines(middle_id) == {}
    assert chain_problems(middle) == [] and chain_problems(root) == []


async def test_a_cancel_before_the_first_run_is_recorded_wins_over_its_pause(
    settings: Settings,
    store: PostgresEventStore,
    ghost: AbstractQueue,
) -> None:
    gate = Gate()
    async with (
        running_worker(cancel_app(gate), settings, store) as worker,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        task_id = await client.submit("slow", {})
        await asyncio.wait_for(gate.entered.wait(), 30)  # the handler is deciding
        assert await client.cancel("slow", task_id, reason="too slow", timeout=60) == "cancelled"
        assert await stream_types(store, task_id) == ["TaskCancelled"]
        gate.release.set()  # it decides to pause, and finds its stream taken by the cancel
        result = await client.result(task_id, timeout=60)
        assert result.status == "cancelled"
        await eventually(
            lambda: counter(worker, "duplicate_tasks") == 1, 30, "the run to find its stream taken"
        )
        await published_everything(store, [task_id])
        assert await ghost.get(fail=False) is None, "the cancelled task's call was sent"
    assert gate.runs == 1
    assert await stream_types(store, task_id) == ["TaskCancelled"]
    assert len(client.distinct_results(task_id)) == 1


RACES = 30
ROUNDS = 4
"""Rounds of RACES races at most: a round is run again until both sides have won at least once
(each does about half the time here), so the test shows the log settling the race either way."""


@pytest.mark.timeout(ROUNDS * 150 + 30)
async def test_a_cancel_racing_the_last_reply_ends_each_task_exactly_once_whichever_wins(
    settings: Settings,
    database_url: str,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
) -> None:
    stores = [PostgresEventStore.from_url(database_url, pool_size=8) for _ in range(2)]
    app = cancel_app()
    outcomes: Counter[str] = Counter()
    rounds = 0
    try:
        async with (
            running_worker(
                app, settings.model_copy(update={"worker_id": "race-a"}), stores[0]
            ) as a,
            running_worker(
                app, settings.model_copy(update={"worker_id": "race-b"}), stores[1]
            ) as b,
            RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
        ):
            while rounds < ROUNDS and not (outcomes["completed"] and _cancel_wins(outcomes)):
                rounds += 1
                relayed = sum(counter(w, "outbox_relayed") for w in (a, b))
                duplicates = await _race_round(stores[0], amqp_channel, ghost, client, outcomes)
                # a cancel goes twice to the peer (same message id) only through the relay
                relayed = sum(counter(w, "outbox_relayed") for w in (a, b)) - relayed
                assert duplicates <= relayed, f"{duplicates} cancels sent twice, {relayed} relayed"
        print(f"cancel racing the last reply, {rounds} round(s) of {RACES}: {dict(outcomes)}")
        assert outcomes["completed"] and _cancel_wins(outcomes), (
            f"in {rounds} rounds of {RACES} races one side always won ({dict(outcomes)}): "
            "the race was never settled the other way"
        )
    finally:
        for store in stores:
            await store.close()


def _cancel_wins(outcomes: Counter[str]) -> int:
    return outcomes["cancelled while paused"] + outcomes["cancelled while resumed"]


async def _race_round(
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    ghost: AbstractQueue,
    client: RecordingClient,
    outcomes: Counter[str],
) -> int:
    """RACES tasks of two calls: the first answered, then the last reply and a cancel of each
    task sent at the same moment. Each task must end once, as the winner says; how each ended
    is counted in ``outcomes``. Returns how many cancels the peer got twice."""
    task_ids = [await client.submit("boss", {"k": 2}) for _ in range(RACES)]
    requests = {m.correlation_id: m for m in await take(ghost, 2 * RACES, within=30)}
    # the first reply of each task, settled before the race
    await asyncio.gather(
        *(
            publish_reply(
                amqp_channel,
                requests[f"{t}:1:0"],
                {"status": "ok", "result": "first"},
                message_id=f"{t}-first",
            )
            for t in task_ids
        )
    )

    await eventually(
        lambda: every_stream_has(store, task_ids, "SubtaskClaimed"),
        30,
        "every first reply to be claimed",
    )

    # then the last reply and a cancel of each task, at the same moment
    async def race(task_id: str) -> str:
        _, status = await asyncio.gather(
            publish_reply(
                amqp_channel,
                requests[f"{task_id}:1:1"],
                {"status": "ok", "result": "last"},
                message_id=f"{task_id}-last",
            ),
            client.cancel("boss", task_id, reason="race", timeout=30),
        )
        return str(status)

    statuses = dict(zip(task_ids, await asyncio.gather(*(race(t) for t in task_ids)), strict=True))
    answers = await asyncio.gather(*(client.result(t, timeout=30) for t in task_ids))
    results = dict(zip(task_ids, answers, strict=True))
    # a last reply that lost to the cancel is audited as late once it is handled
    cancelled_first = [
        t
        for t in task_ids
        if statuses[t] == "cancelled" and "TaskResumed" not in await stream_types(store, t)
    ]

    await eventually(
        lambda: every_stream_has(store, cancelled_first, "ReplyIgnored"),
        30,
        "every losing last reply to be audited",
    )
    await published_everything(store, task_ids)
    sent = await _drain(ghost)  # every cancel published is in the queue by now

    cancels_expected: Counter[str] = Counter()
    for task_id in task_ids:
        events = await store.read_stream(task_id)
        types = [e.event_type for e in events]
        ends = [t for t in types if t in TERMINAL]
        assert len(ends) == 1, types
        assert decisive(types)[-1] == ends[0], f"an event after the end: {types}"
        assert chain_problems(events) == []
        assert len(client.distinct_results(task_id)) == 1, client.bodies(task_id)
        result = results[task_id]
        if ends[0] == "TaskCompleted":
            assert result.status == "ok" and result.result == ["first", "last"], result
            assert statuses[task_id] == "completed"
            outcomes["completed"] += 1
        else:
            assert ends[0] == "TaskCancelled"
            assert result.status == "cancelled", result
            assert statuses[task_id] == "cancelled"
            cancelled = next(e for e in events if e.event_type == "TaskCancelled")
            pending = [p["subtask_id"] for p in cancelled.data["pending"]]
            if pending:
                # cancelled before the last reply's claim: that reply came late
                assert pending == [f"{task_id}:1:1"]
                ignored = [e.data for e in events if e.event_type == "ReplyIgnored"]
                assert [(i["subtask_id"], i["reason"]) for i in ignored] == [
                    (f"{task_id}:1:1", "late")
                ]
                cancels_expected[f"{task_id}:1:1"] += 1
                outcomes["cancelled while paused"] += 1
            else:
                # after the resume, before the resumed run completed
                assert "TaskResumed" in types
                outcomes["cancelled while resumed"] += 1
    distinct = {m.message_id: loads(m.body)["task_id"] for m in sent}
    assert Counter(distinct.values()) == cancels_expected
    assert all(message_id == f"{t}:cancel" for message_id, t in distinct.items()), distinct
    return len(sent) - len(distinct)


async def _drain(queue: AbstractQueue) -> list[Any]:
    taken = []
    while (message := await queue.get(fail=False)) is not None:
        await message.ack()
        taken.append(message)
    return taken
