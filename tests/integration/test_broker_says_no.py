"""When the broker says no, on the real RabbitMQ (issue 28): a full queue that rejects publishes,
a message over ``max_message_size``, properties and headers a client library should never have
written, and the AMQP user of a message that was retried. Each costs that message alone: the
worker stays connected, settles everything, and every task gets its answer.

Each case failed before its fix (they are named in the issue: a, b, c, d, f, i):
the refused row stalled the relay and the direct answer re-ran its handler (a), a 250-byte task
id never answered (b), a non-UTF-8 header left its delivery unsettled (c), a non-UTF-8
``message_id`` or a header nested 3,000 deep dropped the worker's connection at each redelivery
(d), a result over the broker's limit re-ran its handler (f), the copies dropped ``user_id`` (i).
"""

from __future__ import annotations

import struct
import uuid
from collections import Counter
from collections.abc import AsyncIterator

import aio_pika
import pytest
import pytest_asyncio
from aio_pika.abc import AbstractChannel, AbstractQueue

from scripts.lab.harness.broker import (
    broker_size_limit,
    connection_pids,
    publish_raw_properties,
    run_rabbitmqctl,
)
from waystation.events.codec import dumps, loads
from waystation.events.postgres import PostgresEventStore
from waystation.settings import Settings

from ..embedded.test_broker_says_no import app_of
from ..support import (
    Services,
    dead_letters,
    eventually,
    require,
    running_worker,
    take,
)

pytestmark = pytest.mark.integration

AGENTS = ["boss", "quick", "flaky", "big", "deep", "hesitant"]


@pytest_asyncio.fixture
async def replies(amqp_channel: AbstractChannel, queue_prefix: str) -> AsyncIterator[AbstractQueue]:
    queue = await amqp_channel.declare_queue(f"{queue_prefix}test-replies", auto_delete=True)
    yield queue


@pytest_asyncio.fixture
async def full_replies(
    amqp_channel: AbstractChannel, queue_prefix: str
) -> AsyncIterator[AbstractQueue]:
    """A publisher's reply queue that rejects publishes when it holds one message: full."""
    queue = await amqp_channel.declare_queue(
        f"{queue_prefix}full-replies",
        auto_delete=True,
        arguments={"x-max-length": 1, "x-overflow": "reject-publish"},
    )
    await amqp_channel.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=queue.name)
    yield queue


@pytest.fixture
def agents(extra_agents: list[str]) -> list[str]:
    extra_agents.extend(AGENTS)
    return extra_agents


async def submit(
    channel: AbstractChannel,
    settings: Settings,
    agent: str,
    body: object,
    reply_to: str,
    **extra: object,
) -> str:
    task_id = str(extra.pop("message_id", None) or uuid.uuid4())
    await channel.default_exchange.publish(
        aio_pika.Message(dumps(body), message_id=task_id, reply_to=reply_to, **extra),  # type: ignore[arg-type]
        routing_key=f"{settings.queue_prefix}{agent}",
        mandatory=True,
    )
    return task_id


async def answers(queue: AbstractQueue, count: int) -> dict[str, dict[str, object]]:
    return {m.correlation_id or "": loads(m.body) for m in await take(queue, count, 60)}


async def test_a_full_reply_queue_holds_up_only_its_own_result(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    replies: AbstractQueue,
    full_replies: AbstractQueue,
    agents: list[str],
) -> None:
    runs: Counter[str] = Counter()
    async with running_worker(app_of(runs), settings, store):
        refused = await submit(amqp_channel, settings, "boss", {"calls": 2}, full_replies.name)
        direct = await submit(amqp_channel, settings, "quick", {"n": 3}, full_replies.name)
        others = [
            await submit(amqp_channel, settings, "boss", {"calls": 2}, replies.name)
            for _ in range(10)
        ]
        found = await answers(replies, len(others))
        assert all(found[t]["status"] == "ok" for t in others)
        await eventually(lambda: store_has(store, direct), 60, "the refused answer recorded")
        first = await full_replies.get(fail=True, timeout=10)  # room again
        await first.ack()
        got = await answers(full_replies, 2)
        assert got[refused]["status"] == "ok" and got[direct]["result"] == {"n": 3}
        assert runs[direct] == 1


async def store_has(store: PostgresEventStore, task_id: str) -> bool:
    return bool(await store.read_stream(task_id))


async def test_results_over_the_brokers_size_limit_and_ids_too_long_answer_with_errors(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    replies: AbstractQueue,
    agents: list[str],
) -> None:
    runs: Counter[str] = Counter()
    async with broker_size_limit(48 * 1024):  # (read when a channel opens)
        async with running_worker(app_of(runs), settings, store):
            big = await submit(amqp_channel, settings, "big", {"bytes": 64 * 1024}, replies.name)
            long = await submit(
                amqp_channel, settings, "quick", {}, replies.name, message_id="t" * 250
            )
            deep = await submit(amqp_channel, settings, "deep", {"depth": 0}, replies.name)
            found = await answers(replies, 3)
    assert found[big]["status"] == "error"
    assert found[big]["error"]["type"] == "undeliverable-result"  # type: ignore[index]
    assert runs[big] == 1
    assert found[long]["error"]["type"] == "id-too-long"  # type: ignore[index]
    assert found[deep]["status"] == "ok"
    # (a dead letter published as the big answer closed the channel is sent again: maybe twice)
    assert await letter_reasons(amqp_channel, settings) >= {"too-large", "id-too-long"}


async def letter_reasons(channel: AbstractChannel, settings: Settings) -> set[str]:
    """The reasons of the dead letters in the deployment's queue, once two differ at least."""
    queue = await channel.declare_queue(f"{settings.queue_prefix}dead-letter", passive=True)
    seen: set[str] = set()

    async def more() -> bool:
        message = await queue.get(fail=False)
        if message is not None:
            seen.add(str((message.headers or {}).get("x-waystation-reason")))
            await message.ack()
        return len(seen) >= 2

    await eventually(more, 60, "two kinds of dead letter")
    return seen


def _names(settings: Settings) -> object:
    from waystation.protocol.wire import Names

    return Names(settings.queue_prefix)


def _short(value: bytes) -> bytes:
    return bytes((len(value),)) + value


def _table(entries: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(_short(key) + value for key, value in entries)
    return struct.pack(">I", len(body)) + body


def _nested(depth: int) -> bytes:
    table = struct.pack(">I", 0)
    for _ in range(depth):
        entry = _short(b"k") + b"F" + table
        table = struct.pack(">I", len(entry)) + entry
    return table


def _properties(message_id: bytes, reply_to: str, headers: bytes) -> bytes:
    # flags in pamqp's order: headers 0x2000, reply_to 0x0200, message_id 0x0080
    return (
        struct.pack(">H", 0x2000 | 0x0200 | 0x0080)
        + headers
        + _short(reply_to.encode())
        + _short(message_id)
    )


async def test_hostile_metadata_costs_its_message_alone_and_the_connection_stays(
    services: Services,
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    replies: AbstractQueue,
    agents: list[str],
) -> None:
    require(services.rabbitmqctl, "the connection's identity (rabbitmqctl)")
    runs: Counter[str] = Counter()
    odd = _table([(b"x-odd", b"S" + struct.pack(">I", 2) + b"\xff\xfe")])
    async with running_worker(app_of(runs), settings, store) as worker:
        before = await connection_pids(worker.broker.connection_name)  # type: ignore[attr-defined]
        quick = f"{settings.queue_prefix}quick"
        flaky = f"{settings.queue_prefix}flaky"
        for properties, body, queue in [
            (_properties(b"\xff\xfe", replies.name, _table([])), b"{}", quick),  # d
            (_properties(b"deep", replies.name, _nested(3000)), b"{}", quick),  # d
            (_properties(b"odd-dead", replies.name, odd), b"{not json", quick),  # c
            (_properties(b"odd-retried", replies.name, odd), b"{}", flaky),  # c
        ]:
            await publish_raw_properties(services.amqp_url, queue, body, properties)
        normal = await submit(amqp_channel, settings, "quick", {"n": 1}, replies.name)
        found = await answers(replies, 5)  # the retried, the normal, and three rejections
        assert found["odd-retried"]["result"] == "second time" and runs["odd-retried"] == 2
        assert found[normal]["status"] == "ok"
        rejected = Counter(
            a["error"]["type"]  # type: ignore[index]
            for a in found.values()
            if a["status"] == "error"
        )
        assert rejected == {"undecodable-metadata": 2, "invalid-json": 1}
        letters = await dead_letters(amqp_channel, _names(settings), 3)  # type: ignore[arg-type]
        reasons = Counter(m.headers["x-waystation-reason"] for m in letters)
        assert reasons == {"undecodable-metadata": 2, "invalid-json": 1}
        kept = next(m for m in letters if m.headers["x-waystation-reason"] == "invalid-json")
        assert kept.headers["x-odd"] == bytearray(b"\xff\xfe")
        assert await connection_pids(worker.broker.connection_name) == before  # type: ignore[attr-defined]
        assert worker.broker.connected


@pytest_asyncio.fixture
async def alice(services: Services) -> AsyncIterator[str]:
    """The AMQP URL of a user of the broker's own, ``alice``, who is not the workers' user."""
    require(services.rabbitmqctl, "a second broker user (rabbitmqctl)")
    user = f"alice-{uuid.uuid4().hex[:8]}"
    await run_rabbitmqctl("add_user", user, "secret")
    try:
        vhost = "/"
        await run_rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
        url = services.amqp_url.replace("guest:guest@", f"{user}:secret@")
        assert user in url, "the tests' broker URL names guest/guest"
        yield url
    finally:
        await run_rabbitmqctl("delete_user", user)


async def test_events_recorded_after_a_retry_keep_their_publishers_user(
    settings: Settings,
    store: PostgresEventStore,
    alice: str,
    replies: AbstractQueue,
    agents: list[str],
) -> None:
    """RabbitMQ checks ``user_id`` against the publishing connection's user: a copy cannot carry
    the original's. It names it in ``x-waystation-user``, and the events keep their actor."""
    user = alice.split("//", 1)[1].split(":", 1)[0]
    runs: Counter[str] = Counter()
    connection = await aio_pika.connect(alice)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        async with running_worker(app_of(runs), settings, store):
            task_id = await submit(channel, settings, "hesitant", {}, replies.name, user_id=user)
            found = await answers(replies, 1)
    finally:
        await connection.close()
    assert found[task_id]["result"] == "done" and runs[task_id] == 2
    events = await store.read_stream(task_id)
    assert [e.event_type for e in events[:2]] == ["TaskStarted", "TaskPaused"]
    assert {e.metadata.get("amqp_user") for e in events[:2]} == {user}
