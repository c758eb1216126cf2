"""Bad input never crashes a worker and never loses a message (G9).

Each unusable message is published with a plain aio-pika channel, exactly as a broken or foreign
publisher would send it. The test then takes it from ``<prefix>dead-letter`` and checks its reason
header, that it kept its body and properties, that the worker counted it under its reason, that a
publisher who set ``reply_to`` on a task got an error result naming the reason, and that the worker
still serves a normal orchestrator task afterwards, recording it exactly once.

Replies that are valid but useless (duplicates, late replies, replies for calls never made) are
not dead letters: they are acked and audited as ``ReplyIgnored``; that has its own test below.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from aio_pika.abc import AbstractChannel

from scripts.lab.harness.broker import declare_quorum_queue
from scripts.lab.harness.checks import chain_problems
from scripts.lab.harness.clients import RecordingClient
from waystation.agent import App, TaskContext
from waystation.events import Call, Complete, Outcome, Pause
from waystation.events.codec import dumps, loads
from waystation.events.postgres import PostgresEventStore
from waystation.example import app as example_app
from waystation.example import expected_total
from waystation.protocol.wire import Names
from waystation.runtime.worker import Worker
from waystation.settings import Settings

from ..support import (
    counter,
    dead_letters,
    eventually,
    publish_raw,
    publish_reply,
    publish_with_pika,
    running_worker,
    stream_types,
    take,
)

pytestmark = pytest.mark.integration

MAX_BODY = 4096
MAX_HEADERS = 1024


@pytest.fixture
def strict(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"max_message_bytes": MAX_BODY, "max_header_bytes": MAX_HEADERS}
    )


@dataclass(frozen=True)
class Bad:
    """One unusable message: where it goes, what it is, and the reason it must be given."""

    queue: str
    """``tasks`` or ``replies`` (of the orchestrator)."""
    reason: str
    body: bytes
    properties: dict[str, Any] = field(default_factory=dict)
    answered: bool = False
    """Sent with ``reply_to``: its publisher must get an error result naming the reason."""


def _task_props(**extra: Any) -> dict[str, Any]:
    return {"message_id": f"bad-{uuid.uuid4()}", "correlation_id": f"c-{uuid.uuid4()}", **extra}


BAD: dict[str, Bad] = {
    "task: invalid JSON": Bad("tasks", "invalid-json", b'{"n": 1,', _task_props(), True),
    "task: not UTF-8": Bad("tasks", "invalid-utf8", b'{"n": "\xff\xfe"}', _task_props(), True),
    "task: over the size limit": Bad(
        "tasks", "too-large", dumps({"n": 1, "pad": "x" * (2 * MAX_BODY)}), _task_props(), True
    ),
    "task: huge headers": Bad(
        "tasks",
        "headers-too-large",
        dumps({"n": 1}),
        _task_props(headers={"x-junk": "y" * (4 * MAX_HEADERS)}),
        True,
    ),
    "task: no message_id": Bad(
        "tasks", "missing-property", dumps({"n": 1}), {"correlation_id": "no-id"}, True
    ),
    "tasks queue: unknown type": Bad(
        "tasks", "unknown-message-type", dumps({"n": 1}), _task_props(type="frobnicate"), True
    ),
    "cancel without task_id": Bad(
        "tasks", "wrong-shape", dumps({"reason": "x"}), _task_props(type="cancel"), True
    ),
    "resume of the wrong shape": Bad(
        "tasks", "wrong-shape", dumps({"task_id": "t"}), _task_props(type="resume")
    ),
    "reply without status": Bad(
        "replies", "wrong-shape", dumps({"result": 1}), {"correlation_id": "t:1:0"}
    ),
    "reply: invalid JSON": Bad("replies", "invalid-json", b"{]", {"correlation_id": "t:1:0"}),
    "reply: not UTF-8": Bad("replies", "invalid-utf8", b'"\xc3\x28"', {"correlation_id": "t:1:0"}),
    "reply without correlation_id": Bad(
        "replies", "missing-property", dumps({"status": "ok", "result": 1}), {"message_id": "r"}
    ),
    "reply: malformed correlation id": Bad(
        "replies",
        "malformed-correlation-id",
        dumps({"status": "ok", "result": 1}),
        {"correlation_id": "not a sub-task id"},
    ),
    "reply: unknown task": Bad(
        "replies",
        "unknown-task",
        dumps({"status": "ok", "result": 1}),
        {"correlation_id": f"nobody-{uuid.uuid4()}:1:0"},
    ),
    "replies queue: unknown type": Bad(
        "replies",
        "unknown-message-type",
        dumps({"status": "ok"}),
        {"correlation_id": "t:1:0", "type": "chatter"},
    ),
    "progress without extend_by": Bad(
        "replies",
        "wrong-shape",
        dumps({"extend": 5}),
        {"correlation_id": "t:1:0", "type": "progress"},
    ),
    "progress: negative extension": Bad(
        "replies",
        "wrong-shape",
        dumps({"extend_by": -5}),
        {"correlation_id": "t:1:0", "type": "progress"},
    ),
    "progress without correlation_id": Bad(
        "replies", "missing-property", dumps({"extend_by": 5}), {"type": "progress"}
    ),
    "progress: unknown task": Bad(
        "replies",
        "unknown-task",
        dumps({"extend_by": 5}),
        {"correlation_id": f"nobody-{uuid.uuid4()}:1:0", "type": "progress"},
    ),
    # JSON that parses but that the log cannot store used to loop to the delivery limit, with
    # no reason given and no answer to its publisher
    "task: NUL in the body": Bad(
        "tasks", "unstorable", b'{"n": 1, "note": "a\\u0000b"}', _task_props(), True
    ),
    "task: nested 300 deep": Bad(
        "tasks", "unstorable", b"[" * 300 + b"]" * 300, _task_props(), True
    ),
    "task: nested 1,000 deep": Bad(
        "tasks", "unstorable", b"[" * 1000 + b"]" * 1000, _task_props(), True
    ),
    "task: NUL in the message_id": Bad(
        "tasks",
        "invalid-property",
        dumps({"n": 1}),
        {"message_id": "bad\x00id", "correlation_id": "c"},
        True,
    ),
    "task: NUL in the correlation_id": Bad(
        "tasks",
        "invalid-property",
        dumps({"n": 1}),
        _task_props(correlation_id="c\x00"),
        True,
    ),
    "task: NUL in the trace header": Bad(
        "tasks",
        "invalid-property",
        dumps({"n": 1}),
        _task_props(headers={"x-waystation-trace-id": "trace\x00"}),
        True,
    ),
    "cancel: a task id no index can hold": Bad(
        "tasks",
        "wrong-shape",
        dumps({"task_id": "t" * 3000}),
        _task_props(type="cancel"),
        True,
    ),
    "reply: NUL in the correlation_id": Bad(
        "replies", "invalid-property", dumps({"status": "ok"}), {"correlation_id": "t:1:0\x00"}
    ),
}


async def send(
    settings: Settings,
    channel: AbstractChannel,
    queue: str,
    body: bytes,
    properties: dict[str, Any],
) -> None:
    if properties.get("message_id"):
        await publish_raw(channel, queue, body, **properties)
    else:  # aio-pika would make one up
        await publish_with_pika(settings.amqp_url, queue, body, **properties)


async def serves_normally(
    client: RecordingClient, store: PostgresEventStore, worker: Worker, n: int = 2
) -> None:
    """A normal orchestrator task completes, recorded exactly once, with the right result."""
    result = await client.call("orchestrator", {"n": n, "k": 3}, timeout=20)
    assert result.ok and result.result == {"n": n, "total": expected_total(n, 3)}, result
    events = await store.read_stream(result.task_id)
    types = [e.event_type for e in events]
    claims = Counter(e.data["subtask_id"] for e in events if e.event_type == "SubtaskClaimed")
    assert claims == Counter(f"{result.task_id}:1:{i}" for i in range(3)), types
    assert types.count("TaskResumed") == 1 and types.count("TaskCompleted") == 1, types
    assert chain_problems(events) == []
    assert len(client.distinct_results(result.task_id)) == 1


@pytest.mark.parametrize("case", list(BAD))
async def test_an_unusable_message_is_dead_lettered_with_its_reason_and_the_worker_goes_on(
    case: str, strict: Settings, store: PostgresEventStore, amqp_channel: AbstractChannel
) -> None:
    bad = BAD[case]
    names = Names(strict.queue_prefix)
    queue = names.tasks("orchestrator") if bad.queue == "tasks" else names.replies("orchestrator")
    answers = await amqp_channel.declare_queue(exclusive=True, auto_delete=True)
    properties = dict(bad.properties)
    if bad.answered:
        properties["reply_to"] = answers.name
    async with (
        running_worker(example_app, strict, store) as worker,
        RecordingClient(strict.amqp_url, queue_prefix=strict.queue_prefix) as client,
    ):
        await send(strict, amqp_channel, queue, bad.body, properties)
        [dead] = await dead_letters(amqp_channel, names, 1)
        headers = dead.headers or {}
        assert headers.get("x-waystation-reason") == bad.reason, headers.get("x-waystation-detail")
        assert headers.get("x-waystation-queue") == queue
        assert headers.get("x-waystation-detail")
        # the letter is the message: same bytes, same properties
        assert dead.body == bad.body
        for name in ("correlation_id", "type", "reply_to"):
            assert getattr(dead, name) == properties.get(name), name
        if properties.get("message_id"):
            # (a letter of a message without one gets a random one from aio-pika's publish)
            assert dead.message_id == properties["message_id"]
        assert counter(worker, f"dead_letter.{bad.reason}") == 1, worker.stats.counters
        # (the letter is published before the message is acked: wait for the ack)
        await eventually(
            lambda: counter(worker, "settled_dead-letter") == 1, 10, "the message to be settled"
        )
        assert counter(worker, "processing_errors") == 0

        if bad.answered:
            [answer] = await take(answers, 1, within=10)
            assert answer.correlation_id == properties["correlation_id"]
            body = loads(answer.body)
            assert body["status"] == "error" and body["error"]["type"] == bad.reason, body
        await serves_normally(client, store, worker)
        assert await answers.get(fail=False) is None, "more than one answer to the bad message"
        # nothing else went to the dead-letter queue
        assert counter(worker, "settled_dead-letter") == 1


async def test_a_burst_of_bad_messages_between_good_ones_loses_nothing(
    strict: Settings, store: PostgresEventStore, amqp_channel: AbstractChannel
) -> None:
    """Every bad message of the table at once, interleaved with valid tasks: each bad one is
    dead-lettered once with its reason, each valid task completes once."""
    names = Names(strict.queue_prefix)
    async with (
        running_worker(example_app, strict, store) as worker,
        RecordingClient(strict.amqp_url, queue_prefix=strict.queue_prefix) as client,
    ):
        good: list[str] = []
        for number, bad in enumerate(BAD.values()):
            queue = (
                names.tasks("orchestrator")
                if bad.queue == "tasks"
                else names.replies("orchestrator")
            )
            await send(strict, amqp_channel, queue, bad.body, bad.properties)
            good.append(await client.submit("orchestrator", {"n": number, "k": 2}))
        dead = await dead_letters(amqp_channel, names, len(BAD), within=30)
        results = {t: await client.result(t, timeout=30) for t in good}
        assert Counter((d.headers or {}).get("x-waystation-reason") for d in dead) == Counter(
            bad.reason for bad in BAD.values()
        )
        for number, task_id in enumerate(good):
            assert results[task_id].result == {"n": number, "total": expected_total(number, 2)}
            types = await stream_types(store, task_id)
            assert types.count("SubtaskClaimed") == 2 and types.count("TaskCompleted") == 1
        for reason, count in Counter(bad.reason for bad in BAD.values()).items():
            assert counter(worker, f"dead_letter.{reason}") == count, reason
        assert counter(worker, "processing_errors") == 0


# ---- valid but useless replies: acked and audited, never dead letters ---------------------------


def peer_app() -> App:
    """``boss`` calls ``ghost`` ``k`` times (the test plays ghost) and completes with the values."""
    app = App()

    @app.agent("boss")
    async def boss(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("ghost", {"i": i}) for i in range(int(task.input["k"]))])
        return Complete([[r.outcome, r.value] for r in task.results])

    return app


async def test_useless_replies_are_acked_and_audited_never_applied_or_dead_lettered(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    extra_agents: list[str],
) -> None:
    extra_agents.extend(["boss", "ghost"])
    names = Names(settings.queue_prefix)
    ghost = await declare_quorum_queue(amqp_channel, names.tasks("ghost"))
    async with (
        running_worker(peer_app(), settings, store) as worker,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        done_id = await client.submit("boss", {"k": 2})
        cancelled_id = await client.submit("boss", {"k": 1})
        requests = {m.correlation_id: m for m in await take(ghost, 3)}
        first, second = requests[f"{done_id}:1:0"], requests[f"{done_id}:1:1"]

        async def reply(request: Any, value: Any, message_id: str, to: str | None = None) -> None:
            if to is None:
                await publish_reply(
                    amqp_channel, request, {"status": "ok", "result": value}, message_id=message_id
                )
            else:
                await publish_raw(
                    amqp_channel,
                    names.replies("boss"),
                    dumps({"status": "ok", "result": value}),
                    correlation_id=to,
                    message_id=message_id,
                )

        async def ignored(task_id: str, count: int) -> None:
            async def seen() -> bool:
                return (await stream_types(store, task_id)).count("ReplyIgnored") >= count

            await eventually(seen, 10, f"{count} ReplyIgnored in {task_id}")

        await reply(first, "real", "m-0")
        await eventually(
            lambda: _has(store, done_id, "SubtaskClaimed"), 10, "the first reply's claim"
        )
        await reply(first, "dup", "m-0-dup")  # a duplicate: another message for a claimed call
        await ignored(done_id, 1)
        await reply(first, "real", "m-0")  # the claiming message again: recognised, nothing new
        await reply(None, "never", "m-unknown", to=f"{done_id}:1:5")  # a call never made
        await ignored(done_id, 2)
        await reply(second, "second", "m-1")
        result = await client.result(done_id, timeout=20)
        assert result.ok and result.result == [["ok", "real"], ["ok", "second"]]

        # after the task finished: a reply for a call it never made is late
        await reply(None, "after", "m-late", to=f"{done_id}:1:7")
        await ignored(done_id, 3)

        # a cancelled task: its outstanding call's reply is late
        assert await client.cancel("boss", cancelled_id, timeout=10) == "cancelled"
        [cancel_message] = await take(ghost, 1)
        assert cancel_message.type == "cancel"
        assert loads(cancel_message.body)["task_id"] == f"{cancelled_id}:1:0"
        await reply(requests[f"{cancelled_id}:1:0"], "too late", "m-c")
        await ignored(cancelled_id, 1)
        # the same ignored replies again (a peer retrying, or a redelivery): acked, no new event
        before = counter(worker, "settled_ack")
        await reply(requests[f"{cancelled_id}:1:0"], "too late", "m-c")
        await reply(first, "dup", "m-0-dup")
        await eventually(
            lambda: counter(worker, "settled_ack") >= before + 2, 10, "the repeats to be acked"
        )
        await serves_normally_boss(client, ghost, amqp_channel)

        dead = await amqp_channel.declare_queue(names.dead_letter_queue, passive=True)
        assert await dead.get(fail=False) is None, "a valid reply was dead-lettered"
        assert counter(worker, "processing_errors") == 0, worker.stats.counters

    done = [e for e in await store.read_stream(done_id) if e.event_type == "ReplyIgnored"]
    assert [(e.data["subtask_id"], e.data["reason"], e.data["message_id"]) for e in done] == [
        (f"{done_id}:1:0", "duplicate", "m-0-dup"),
        (f"{done_id}:1:5", "unknown-call", "m-unknown"),
        (f"{done_id}:1:7", "late", "m-late"),
    ]
    types = await stream_types(store, done_id)
    assert types.count("SubtaskClaimed") == 2 and types.count("TaskCompleted") == 1
    cancelled = await store.read_stream(cancelled_id)
    assert [e.event_type for e in cancelled][-2:] == ["TaskCancelled", "ReplyIgnored"]
    assert cancelled[-1].data["reason"] == "late"
    assert len(client.distinct_results(done_id)) == 1
    assert len(client.distinct_results(cancelled_id)) == 1


async def serves_normally_boss(
    client: RecordingClient, ghost: Any, channel: AbstractChannel
) -> None:
    task_id = await client.submit("boss", {"k": 1})
    [request] = await take(ghost, 1)
    await publish_reply(channel, request, {"status": "ok", "result": 42}, message_id="fine")
    result = await client.result(task_id, timeout=20)
    assert result.ok and result.result == [["ok", 42]]


async def _has(store: PostgresEventStore, task_id: str, event_type: str) -> bool:
    return event_type in await stream_types(store, task_id)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b'{"status": "ok", "result": "a\\u0000b"}', "NUL character"),
        (b'{"status": "ok", "result": ' + b"[" * 400 + b"]" * 400 + b"}", "nests deeper"),
    ],
    ids=["NUL", "too deep"],
)
async def test_a_reply_the_log_cannot_store_fails_its_call_at_once_and_is_dead_lettered(
    body: bytes,
    problem: str,
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    extra_agents: list[str],
) -> None:
    """Such a reply used to loop to the delivery limit, with no reason anywhere, and
    its call then waited for its deadline to be recorded as a timeout. Now the call records an
    ``unstorable-reply`` error at once (the task goes on) and the reply is a dead letter."""
    extra_agents.extend(["boss", "ghost"])
    names = Names(settings.queue_prefix)
    ghost = await declare_quorum_queue(amqp_channel, names.tasks("ghost"))
    async with (
        running_worker(peer_app(), settings, store) as worker,
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        task_id = await client.submit("boss", {"k": 1})
        [request] = await take(ghost, 1)
        assert request.reply_to
        await publish_raw(
            amqp_channel,
            request.reply_to,
            body,
            correlation_id=request.correlation_id,
            message_id="unstorable",
        )
        result = await client.result(task_id, timeout=20)
        [dead] = await dead_letters(amqp_channel, names, 1)
        assert counter(worker, "processing_errors") == 0, worker.stats.counters
    assert result.ok, result
    [[outcome, value]] = result.result
    assert (outcome, value) == ("error", None)
    headers = dead.headers or {}
    assert headers["x-waystation-reason"] == "unstorable"
    assert problem in headers["x-waystation-detail"]
    assert dead.body == body
    events = await store.read_stream(task_id)
    [recorded] = [e for e in events if e.event_type == "ResultRecorded"]
    assert recorded.data["outcome"] == "error"
    assert recorded.data["error"]["type"] == "unstorable-reply"
    assert problem in recorded.data["error"]["message"]
    assert chain_problems(events) == []
