"""The worker's flows against the real services, with workers running in this process.

Where a test needs to control exactly what a peer answers and when, the test itself plays the
peer: its app calls an agent (``ghost``) that no worker serves, and the test takes the requests
from ``<prefix>ghost`` and answers them with a plain aio-pika channel, using nothing but the
wire format of ``workers/protocol/wire.py``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from scripts.lab.harness.broker import declare_quorum_queue
from scripts.lab.harness.checks import (
    chain_problems,
    record_outbox_claims,
    result_messages,
    unexplained_repeats,
)
from scripts.lab.harness.clients import RecordingClient
from waystation.agent import App, TaskContext
from waystation.events import Call, Complete, Outcome, Pause, apply_delta, canonical, parse
from waystation.events.codec import dumps, loads
from waystation.events.postgres import PostgresEventStore
from waystation.example import app as example_app
from waystation.example import expected_total
from waystation.protocol.wire import HEADER_ROOT, Names
from waystation.settings import Settings

from ..support import (
    count_rows,
    eventually,
    publish_reply,
    published_everything,
    running_worker,
    stream_types,
    take,
)

pytestmark = pytest.mark.integration

CLAIM_AND_RESULT = ["SubtaskClaimed", "ResultRecorded"]


def boss_app(invocations: list[tuple[str, int]] | None = None) -> App:
    """``boss`` calls ``k`` ghosts (served by no worker) and completes with what they answered."""
    app = App()

    @app.agent("boss")
    async def boss(task: TaskContext) -> Outcome:
        if invocations is not None:
            invocations.append((task.task_id, task.pause))
        if not task.resumed:
            k = int(task.input["k"])
            return Pause([Call("ghost", {"i": i, "of": task.task_id}) for i in range(k)])
        return Complete([[r.outcome, r.value, r.error] for r in task.results])

    return app


async def ghost_queue(channel: AbstractChannel, settings: Settings) -> AbstractQueue:
    return await declare_quorum_queue(channel, Names(settings.queue_prefix).tasks("ghost"))


# ---- G10 -----------------------------------------------------------------------------------------


async def test_g10_a_task_without_peer_calls_writes_nothing(
    settings: Settings, store: PostgresEventStore
) -> None:
    before = (await count_rows(store, "events"), await count_rows(store, "outbox"))
    async with (
        running_worker(example_app, settings, store),
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        result = await client.call("researcher", {"x": 7}, timeout=20)
        assert result.ok and result.result == {"answer": 49}
    after = (await count_rows(store, "events"), await count_rows(store, "outbox"))
    assert after == before, f"(events, outbox) rows before {before}, after {after}"
    assert await stream_types(store, result.task_id) == []


async def test_g10_auditing_all_tasks_records_them(
    settings: Settings, store: PostgresEventStore
) -> None:
    audited = settings.model_copy(update={"audit_all_tasks": True})
    async with (
        running_worker(example_app, audited, store),
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        result = await client.call("researcher", {"x": 3}, timeout=20)
    assert result.ok and result.result == {"answer": 9}
    events = await store.read_stream(result.task_id)
    assert [e.event_type for e in events] == ["TaskStarted", "TaskCompleted"]
    assert events[-1].data["result"] == {"answer": 9}
    assert chain_problems(events) == []


# ---- state and results across several pauses ----------------------------------------------------

ROUND_UPDATES: list[dict[str, Any]] = [
    {
        "text": 'naïve café — 日本語 🚀 \u2028 "quoted" \\ back',
        "floats": [0.1, 1e-7, 3.141592653589793, -2.5, 1.25e-5, 6.02214076e23, 1e300, -0.0],
        "big": 7.405149907093126e17,
        "nested": {"a": {"b": [1, 2.5, {"c": "é", "d": None, "e": [True, False]}]}, "z": {}},
        "count": 0,
    },
    {"count": 1, "text": None, "nested": {"a": {"b": []}, "new": 0.5}, "added": "ü" * 3},
    {"count": 2, "floats": None, "zero": -0.0, "unicode key ✓": {"ключ": "значение"}},
]


async def test_state_round_trips_byte_identically_and_results_keep_call_order(
    settings: Settings, store: PostgresEventStore, extra_agents: list[str]
) -> None:
    extra_agents.extend(["planner", "helper"])
    k, rounds = 4, 3
    seen: dict[int, bytes] = {}
    seen_results: dict[int, list[Any]] = {}
    app = App()

    @app.agent("planner")
    async def planner(task: TaskContext) -> Outcome:
        if task.resumed:
            seen[task.pause] = canonical(dict(task.state))
            seen_results[task.pause] = [(r.subtask_id, r.outcome, r.value) for r in task.results]
        if task.pause < rounds:
            calls = [Call("helper", {"index": i, "k": k, "round": task.pause}) for i in range(k)]
            return Pause(calls, update=ROUND_UPDATES[task.pause])
        return Complete({"rounds": task.pause})

    @app.agent("helper")
    async def helper(task: TaskContext) -> Outcome:
        index, of = int(task.input["index"]), int(task.input["k"])
        # the last call answers first: each helper waits until the next call's reply is
        # claimed, so replies arrive in the reverse of call order, however slow the machine
        if index < of - 1:
            planner_id, pause, _ = task.task_id.rsplit(":", 2)
            after = f"{planner_id}:{pause}:{index + 1}"

            async def answered_after() -> bool:
                events = await store.read_stream(planner_id)
                return any(
                    e.event_type == "SubtaskClaimed" and e.data["subtask_id"] == after
                    for e in events
                )

            await eventually(answered_after, 30, f"the claim of {after}")
        return Complete({"index": index, "round": task.input["round"]})

    async with (
        running_worker(app, settings, store),
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        result = await client.call("planner", {"go": True}, timeout=90)
    assert result.ok and result.result == {"rounds": rounds}

    expected: dict[str, Any] = {}
    for pause in range(1, rounds + 1):
        expected = apply_delta(expected, ROUND_UPDATES[pause - 1])
        assert seen[pause] == canonical(expected), f"state seen on resume from pause {pause}"
        assert seen_results[pause] == [
            (f"{result.task_id}:{pause}:{i}", "ok", {"index": i, "round": pause - 1})
            for i in range(k)
        ], f"results of pause {pause} in call order"

    events = await store.read_stream(result.task_id)
    assert chain_problems(events) == []
    # the replies arrived in the reverse of call order: the log records them as they came
    for pause in range(1, rounds + 1):
        arrival = [
            int(e.data["subtask_id"].rsplit(":", 1)[1])
            for e in events
            if e.event_type == "SubtaskClaimed" and e.data["pause"] == pause
        ]
        assert arrival == list(reversed(range(k))), (pause, arrival)
    # and each pause stored a minimal delta that folds back to the same state
    folded: dict[str, Any] = {}
    for event in events:
        if event.event_type == "TaskPaused":
            folded = apply_delta(folded, parse(event).state_delta)  # type: ignore[attr-defined]
    assert canonical(folded) == canonical(expected)


# ---- duplicates, a foreign peer, racing workers -------------------------------------------------


async def test_a_duplicate_reply_is_recorded_for_audit_and_never_applied(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    extra_agents: list[str],
) -> None:
    extra_agents.extend(["boss", "ghost"])
    ghost = await ghost_queue(amqp_channel, settings)
    async with (
        running_worker(boss_app(), settings, store) as worker,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        task_id = await client.submit("boss", {"k": 2})
        requests = sorted(await take(ghost, 2), key=lambda m: m.correlation_id or "")
        first, second = requests
        assert [m.correlation_id for m in requests] == [f"{task_id}:1:0", f"{task_id}:1:1"]

        await publish_reply(
            amqp_channel, first, {"status": "ok", "result": "real"}, message_id="r-0"
        )

        async def claimed() -> bool:
            return "SubtaskClaimed" in await stream_types(store, task_id)

        await eventually(claimed, 10, "the first reply's claim")
        # another reply for the same call, another message: audited, not applied
        await publish_reply(
            amqp_channel, first, {"status": "ok", "result": "dup"}, message_id="r-0-dup"
        )

        async def ignored() -> bool:
            return "ReplyIgnored" in await stream_types(store, task_id)

        await eventually(ignored, 10, "the duplicate's ReplyIgnored")
        # the very same message again (a redelivery): recognised, no event at all
        recognised = worker.stats.counters.get("redelivered_recognised", 0)
        await publish_reply(
            amqp_channel, first, {"status": "ok", "result": "real"}, message_id="r-0"
        )
        await eventually(
            lambda: worker.stats.counters.get("redelivered_recognised", 0) > recognised,
            10,
            "the redelivered reply to be recognised",
        )
        await publish_reply(
            amqp_channel, second, {"status": "ok", "result": "second"}, message_id="r-1"
        )
        result = await client.result(task_id, timeout=20)
    assert result.ok and result.result == [["ok", "real", None], ["ok", "second", None]]

    events = await store.read_stream(task_id)
    types = [e.event_type for e in events]
    claims = [e.data["subtask_id"] for e in events if e.event_type == "SubtaskClaimed"]
    assert claims == [f"{task_id}:1:0", f"{task_id}:1:1"], types
    ignored_events = [e.data for e in events if e.event_type == "ReplyIgnored"]
    assert [(i["subtask_id"], i["reason"], i["message_id"]) for i in ignored_events] == [
        (f"{task_id}:1:0", "duplicate", "r-0-dup")
    ], types
    assert types.count("TaskResumed") == 1 and types.count("TaskCompleted") == 1, types
    assert chain_problems(events) == []


async def test_a_foreign_peer_and_a_plain_publisher_speak_the_wire_format(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    extra_agents: list[str],
) -> None:
    """Neither side uses Waystation code: a plain aio-pika peer serves ``ghost`` (answering
    errors for odd inputs, without message ids), and a plain aio-pika publisher submits."""
    extra_agents.extend(["boss", "ghost"])
    names = Names(settings.queue_prefix)
    ghost = await ghost_queue(amqp_channel, settings)
    seen_requests: list[AbstractIncomingMessage] = []

    async def serve(request: AbstractIncomingMessage) -> None:
        async with request.process():
            seen_requests.append(request)
            i = loads(request.body)["i"]
            body = (
                {"status": "ok", "result": {"square": i * i}}
                if i % 2 == 0
                else {"status": "error", "error": {"type": "Odd", "message": f"{i} is odd"}}
            )
            await amqp_channel.default_exchange.publish(
                aio_pika.Message(
                    dumps(body),
                    correlation_id=request.correlation_id,
                    content_type="application/json",
                ),
                routing_key=request.reply_to or "",
            )

    peer_tag = await ghost.consume(serve)
    results = await amqp_channel.declare_queue(exclusive=True, auto_delete=True)
    try:
        async with running_worker(boss_app(), settings, store):
            submitted = {}
            for n in range(5):
                task_id, correlation = f"plain-{uuid.uuid4()}", f"corr-{n}"
                submitted[correlation] = (task_id, n + 1)
                await amqp_channel.default_exchange.publish(
                    aio_pika.Message(
                        dumps({"k": n + 1}),
                        message_id=task_id,
                        correlation_id=correlation,
                        reply_to=results.name,
                        content_type="application/json",
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    ),
                    routing_key=names.tasks("boss"),
                    mandatory=True,
                )
            answers = await take(results, len(submitted), within=30)
    finally:
        await ghost.cancel(peer_tag)

    for answer in answers:
        task_id, k = submitted[answer.correlation_id or ""]
        assert answer.type == "result" and answer.content_type == "application/json"
        expected = [
            ["ok", {"square": i * i}, None]
            if i % 2 == 0
            else ["error", None, {"type": "Odd", "message": f"{i} is odd"}]
            for i in range(k)
        ]
        assert loads(answer.body) == {"status": "ok", "result": expected, "task_id": task_id}
        assert [e.event_type for e in await store.read_stream(task_id)].count("SubtaskClaimed") == k
    assert sorted(a.correlation_id or "" for a in answers) == sorted(submitted)
    # what a peer gets: a persistent JSON task whose message and correlation ids name the sub-task
    for request in seen_requests:
        task_id, pause, index = (request.correlation_id or "").rsplit(":", 2)
        assert request.message_id == request.correlation_id and pause == "1"
        assert request.type == "task" and request.content_type == "application/json"
        assert request.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        # the reply shard of the worker that paused the task (waystation.runtime.routing)
        assert (
            request.reply_to in Names(names.prefix, settings.reply_shards).reply_queues("boss")[1:]
        )
        assert (request.headers or {}).get(HEADER_ROOT) == task_id
        assert loads(request.body) == {"i": int(index), "of": task_id}
    assert len(seen_requests) == sum(k for _, k in submitted.values())


@pytest.mark.timeout(240)
async def test_two_workers_racing_on_one_tasks_replies_claim_each_call_once(
    settings: Settings,
    database_url: str,
    amqp_channel: AbstractChannel,
    extra_agents: list[str],
) -> None:
    extra_agents.extend(["boss", "ghost"])
    k, tasks = 5, 20
    # without reply routing, so that both workers take replies of the same tasks (with it, a
    # race is rare, not impossible: a full prefetch, a worker that died, more workers than shards)
    settings = settings.model_copy(update={"reply_shards": 0})
    ghost = await ghost_queue(amqp_channel, settings)
    store_a = PostgresEventStore.from_url(database_url, pool_size=5)
    store_b = PostgresEventStore.from_url(database_url, pool_size=5)
    await record_outbox_claims(store_a)
    try:
        async with (
            running_worker(
                boss_app(), settings.model_copy(update={"worker_id": "racer-a"}), store_a
            ) as a,
            running_worker(
                boss_app(), settings.model_copy(update={"worker_id": "racer-b"}), store_b
            ) as b,
            RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
        ):
            task_ids = [await client.submit("boss", {"k": k}) for _ in range(tasks)]
            requests = await take(ghost, k * tasks, within=30)
            # every reply right followed by a duplicate of it (another message id), all at once
            await asyncio.gather(
                *(
                    publish_reply(
                        amqp_channel,
                        request,
                        {
                            "status": "ok",
                            "result": int((request.correlation_id or "").rsplit(":", 1)[1]),
                        },
                        message_id=f"{request.correlation_id}/{copy}",
                    )
                    for request in requests
                    for copy in ("first", "again")
                )
            )
            answers = await asyncio.gather(*(client.result(t, timeout=60) for t in task_ids))
            results = dict(zip(task_ids, answers, strict=True))

            def acked(counter: str) -> int:
                return sum(w.stats.counters.get(counter, 0) for w in (a, b))

            # a resume runs in place with the last reply, or else travels as its own message
            await eventually(
                lambda: (
                    acked("settled_ack") >= tasks * (1 + 2 * k) + tasks - acked("resumed_in_place")
                ),
                60,
                "every task, reply and resume message to be acked",
            )
            stats = {w.settings.worker_id: dict(w.stats.counters) for w in (a, b)}
            # decisions started from a worker's own last write, some of them stale (then the
            # version check sent them back to read): the results above are right either way
            assert acked("stream_cache_hits") > 0, stats
        read = PostgresEventStore.from_url(database_url, pool_size=2)
        try:
            for task_id in task_ids:
                assert results[task_id].ok
                assert results[task_id].result == [["ok", i, None] for i in range(k)]
                assert client.distinct_results(task_id) == {
                    canonical(
                        {"status": "ok", "result": results[task_id].result, "task_id": task_id}
                    )
                }
                events = await read.read_stream(task_id)
                types = [e.event_type for e in events]
                claims = Counter(
                    e.data["subtask_id"] for e in events if e.event_type == "SubtaskClaimed"
                )
                assert claims == Counter(f"{task_id}:1:{i}" for i in range(k)), (types, stats)
                c = Counter(types)
                assert (c["ResultRecorded"], c["TaskResumed"], c["TaskCompleted"]) == (k, 1, 1), (
                    types
                )
                assert c["ReplyIgnored"] == k, (types, stats)
                assert types[-1] in ("TaskCompleted", "ReplyIgnored"), types
                assert chain_problems(events) == []
            assert not await unexplained_repeats(read, client, task_ids), result_messages(client)
        finally:
            await read.close()
        # both workers really took part
        for worker_id, counters in stats.items():
            assert counters.get("settled_ack", 0) > 0, (worker_id, stats)
        print(f"racing workers: {stats}")
    finally:
        await store_a.close()
        await store_b.close()


async def test_a_parents_replies_come_back_to_the_worker_that_paused_it(
    settings: Settings,
    database_url: str,
    amqp_channel: AbstractChannel,
    extra_agents: list[str],
) -> None:
    """Reply routing (waystation.runtime.routing) on the real broker and slot table: the two workers
    claim different home shards, and each task's replies are recorded where it paused."""
    extra_agents.extend(["boss", "ghost"])
    k = 3
    ghost = await ghost_queue(amqp_channel, settings)
    stores = [PostgresEventStore.from_url(database_url, pool_size=5) for _ in range(2)]
    try:
        async with (
            running_worker(
                boss_app(), settings.model_copy(update={"worker_id": "home-a"}), stores[0]
            ) as a,
            running_worker(
                boss_app(), settings.model_copy(update={"worker_id": "home-b"}), stores[1]
            ) as b,
            RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
        ):
            homes = {w.settings.worker_id: w.routes.homes["boss"] for w in (a, b)}
            assert len(set(homes.values())) == 2, homes
            names = Names(settings.queue_prefix, settings.reply_shards)
            for _ in range(6):
                task_id = await client.submit("boss", {"k": k})
                requests = await take(ghost, k, within=30)
                for request in requests:
                    index = int((request.correlation_id or "").rsplit(":", 1)[1])
                    await publish_reply(amqp_channel, request, {"status": "ok", "result": index})
                assert (await client.result(task_id, timeout=60)).result == [
                    ["ok", i, None] for i in range(k)
                ]
                events = await stores[0].read_stream(task_id)
                (paused,) = [e for e in events if e.event_type == "TaskPaused"]
                pauser = paused.metadata["worker_id"]
                assert {r.reply_to for r in requests} == {names.reply_shard("boss", homes[pauser])}
                recorders = {
                    e.metadata["worker_id"] for e in events if e.event_type == "ResultRecorded"
                }
                assert recorders == {pauser}, (task_id, pauser, recorders)
            conflicts = sum(w.stats.counters.get("version_conflicts", 0) for w in (a, b))
            assert conflicts == 0
    finally:
        for store in stores:
            await store.close()


# ---- bad replies, redeliveries ------------------------------------------------------------------


async def test_a_reply_for_an_unknown_task_is_dead_lettered_with_its_reason(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
) -> None:
    names = Names(settings.queue_prefix)
    async with (
        running_worker(example_app, settings, store) as worker,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        bad = {
            "no-such-task:1:0": ({"status": "ok", "result": 1}, "unknown-task"),
            "not a sub-task id": ({"status": "ok", "result": 2}, "malformed-correlation-id"),
        }
        for correlation_id, (body, _) in bad.items():
            await amqp_channel.default_exchange.publish(
                aio_pika.Message(
                    dumps(body), correlation_id=correlation_id, message_id=correlation_id
                ),
                routing_key=names.replies("orchestrator"),
                mandatory=True,
            )
        dead_queue = await amqp_channel.declare_queue(names.dead_letter_queue, passive=True)
        dead = await take(dead_queue, len(bad), within=20)
        assert sorted(m.correlation_id or "" for m in dead) == sorted(bad)
        for message in dead:
            headers = message.headers or {}
            body, reason = bad[message.correlation_id or ""]
            assert headers.get("x-waystation-reason") == reason, headers
            assert headers.get("x-waystation-queue") == names.replies("orchestrator"), headers
            assert loads(message.body) == body
        assert worker.stats.counters.get("settled_dead-letter") == len(bad), worker.stats.counters
        # and it keeps serving
        result = await client.call("orchestrator", {"n": 2, "k": 3}, timeout=20)
        assert result.ok and result.result == {"n": 2, "total": expected_total(2, 3)}


async def test_a_resubmitted_task_after_its_pause_committed_records_and_answers_once(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    extra_agents: list[str],
) -> None:
    """The same task message again (same message id), while paused and after completion: it
    is recognised from the log before its handler runs. While paused it publishes nothing and
    acks; after completion it is answered from the log with the recorded result (its publisher
    asked again), and nothing is recorded twice."""
    extra_agents.extend(["boss", "ghost"])
    ghost = await ghost_queue(amqp_channel, settings)
    invocations: list[tuple[str, int]] = []
    await record_outbox_claims(store)
    async with (
        running_worker(boss_app(invocations), settings, store) as worker,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        task_id = await client.submit("boss", {"k": 2})
        requests = sorted(await take(ghost, 2), key=lambda m: m.correlation_id or "")
        await published_everything(store, [task_id])

        await client.submit("boss", {"k": 2}, task_id=task_id)
        await eventually(
            lambda: worker.stats.counters.get("duplicate_tasks", 0) == 1,
            10,
            "the resubmission to find its pause recorded",
        )
        assert await ghost.get(fail=False) is None, "the peer requests were published again"
        for request in requests:
            index = int((request.correlation_id or "").rsplit(":", 1)[1])
            await publish_reply(
                amqp_channel,
                request,
                {"status": "ok", "result": index},
                message_id=f"reply-{index}",
            )
        result = await client.result(task_id, timeout=20)
        assert result.ok and result.result == [["ok", 0, None], ["ok", 1, None]]

        # once more after completion: still nothing new
        await client.submit("boss", {"k": 2}, task_id=task_id)
        await eventually(
            lambda: worker.stats.counters.get("duplicate_tasks", 0) == 2,
            10,
            "the second resubmission to find its events recorded",
        )
        await eventually(lambda: len(client.bodies(task_id)) == 2, 10, "the answer from the log")
        assert worker.stats.counters.get("results_answered_from_log") == 1
        await published_everything(store, [task_id])
        assert await ghost.get(fail=False) is None
    assert invocations.count((task_id, 0)) == 1 and invocations.count((task_id, 1)) == 1, (
        invocations
    )
    types = await stream_types(store, task_id)
    assert types == [
        "TaskStarted",
        "TaskPaused",
        *CLAIM_AND_RESULT * 2,
        "TaskResumed",
        "TaskCompleted",
    ]
    assert len(client.distinct_results(task_id)) == 1, client.bodies(task_id)
    # answered once by the log's outbox (a repeat only where a relay claimed its row again),
    # and once more from the log, to the resubmission after completion
    last = max(i for i, (t, _) in enumerate(client.received) if t == task_id)
    del client.received[last], client._redelivered_flags[last]
    assert not await unexplained_repeats(store, client, [task_id]), result_messages(client)


async def test_a_redelivered_task_message_after_its_pause_is_acked_without_running_the_handler(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    extra_agents: list[str],
) -> None:
    extra_agents.extend(["boss", "ghost"])
    names = Names(settings.queue_prefix)
    ghost = await ghost_queue(amqp_channel, settings)
    invocations: list[tuple[str, int]] = []
    app = boss_app(invocations)
    async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        async with running_worker(app, settings, store):
            task_id = await client.submit("boss", {"k": 1})
            [request] = await take(ghost, 1)
        # no worker now: the same task message comes back with the redelivered flag set
        await client.submit("boss", {"k": 1}, task_id=task_id)
        boss_queue = await amqp_channel.declare_queue(names.tasks("boss"), passive=True)
        for _ in range(200):
            delivery = await boss_queue.get(fail=False)
            if delivery is not None:
                break
            await asyncio.sleep(0.02)
        assert delivery is not None and not delivery.redelivered
        await delivery.nack(requeue=True)

        async with running_worker(app, settings, store) as worker:
            await eventually(
                lambda: worker.stats.counters.get("redelivered_recognised", 0) == 1,
                10,
                "the redelivered task to be recognised",
            )
            assert invocations == [(task_id, 0)], "the handler ran again for a recorded pause"
            await publish_reply(
                amqp_channel, request, {"status": "ok", "result": "x"}, message_id="r"
            )
            result = await client.result(task_id, timeout=20)
    assert result.ok and result.result == [["ok", "x", None]]
    assert invocations == [(task_id, 0), (task_id, 1)]
    types = await stream_types(store, task_id)
    assert types == ["TaskStarted", "TaskPaused", *CLAIM_AND_RESULT, "TaskResumed", "TaskCompleted"]
    assert len(client.distinct_results(task_id)) == 1, client.bodies(task_id)
