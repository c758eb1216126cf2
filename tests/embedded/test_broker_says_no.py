"""When the broker says no, or a publisher sends what it should not (issue 28): each refusal and
each hostile message costs that message alone. The in-memory broker refuses as RabbitMQ does
(``waystation.brokers.memory``); ``tests/integration/test_broker_says_no.py`` runs the same cases
that need the real broker's own refusals."""

from __future__ import annotations

import asyncio
import struct
from collections import Counter

import pytest

from waystation.agent import App, TaskContext
from waystation.brokers.memory import InMemoryBroker
from waystation.brokers.metadata import HEADER_RAW
from waystation.events import Call, Complete, OutboxMessage, Outcome, Pause
from waystation.events.codec import dumps
from waystation.events.memory import InMemoryEventStore
from waystation.events.task import MAX_IGNORED_REPLIES
from waystation.observability.observer import Observer
from waystation.protocol.wire import Names
from waystation.runtime.outbox import OutboxPublisher

from .harness import RESULTS, World, eventually, settings, world

pytestmark = pytest.mark.timeout(60)

FULL = "mem.full-replies"


def app_of(runs: Counter[str]) -> App:
    app = App()

    @app.agent("boss")
    async def boss(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("quick", {"n": n}) for n in range(task.input.get("calls", 1))])
        return Complete({"answers": [r.value for r in task.results]})

    @app.agent("quick")
    async def quick(task: TaskContext) -> Outcome:
        runs[task.task_id] += 1
        return Complete({"n": task.input.get("n", 0)})

    @app.agent("flaky")
    async def flaky(task: TaskContext) -> Outcome:
        runs[task.task_id] += 1
        if runs[task.task_id] == 1:
            raise RuntimeError("once")
        return Complete("second time")

    @app.agent("hesitant")
    async def hesitant(task: TaskContext) -> Outcome:
        if task.resumed:
            return Complete("done")
        runs[task.task_id] += 1
        if runs[task.task_id] == 1:
            raise RuntimeError("once")
        return Pause([Call("quick", {})])

    @app.agent("big")
    async def big(task: TaskContext) -> Outcome:
        runs[task.task_id] += 1
        return Complete({"blob": "x" * task.input["bytes"]})

    @app.agent("deep")
    async def deep(task: TaskContext) -> Outcome:
        if task.resumed:
            return Complete({"depth": task.input["depth"], "below": task.results[0].outcome})
        return Pause([Call("deep", {"depth": task.input["depth"] + 1})])

    return app


def full_queue(w: World) -> None:
    """A publisher's reply queue that rejects publishes, full already (one message)."""
    w.broker.declare_queue(FULL, max_length=1)
    w.broker.enqueue([FULL], OutboxMessage("blocker", FULL, b"{}"))


def drain(w: World) -> None:
    w.broker.queues[FULL].ready.clear()


def answers_in(w: World, queue: str) -> list[bytes]:
    return [m.body for m in w.broker.messages(queue)]


async def test_a_refused_result_is_retried_with_backoff_while_everything_else_goes_on() -> None:
    """A refused row used to stop its worker's relay for good. The refused result is now
    tried again with backoff, other tasks complete meanwhile, and it arrives once there is
    room."""
    runs: Counter[str] = Counter()
    async with world(app_of(runs), settings(reply_shards=0)) as w:
        full_queue(w)
        await w.start_worker()
        refused = await w.publish("boss", {"calls": 2}, reply_to=FULL)
        others = [await w.publish("boss", {"calls": 2}) for _ in range(5)]
        for task_id in others:  # their requests, resumes and results are not held up
            assert (await w.answer(task_id))["status"] == "ok"
        await eventually(
            lambda: w.workers[0].stats.counters.get("publish_refusals", 0) >= 2, "refusals"
        )
        assert answers_in(w, FULL) == [b"{}"]
        drain(w)
        await eventually(lambda: len(answers_in(w, FULL)) == 1, "the refused result")
        assert (
            b'"status":"ok"' in answers_in(w, FULL)[0]
            and refused.encode() in answers_in(w, FULL)[0]
        )
        await eventually(lambda: not w.store._outbox, "the outbox to empty")


async def test_a_result_refused_for_too_long_is_dead_lettered_as_refused() -> None:
    runs: Counter[str] = Counter()
    async with world(app_of(runs), settings(refused_retry_seconds=2.0)) as w:
        full_queue(w)
        await w.start_worker()
        task_id = await w.publish("boss", {"calls": 1}, reply_to=FULL)
        await eventually(
            lambda: bool(w.broker.messages(w.names.dead_letter_queue)), "a dead letter"
        )
        (letter,) = w.broker.messages(w.names.dead_letter_queue)
        assert letter.headers["x-waystation-reason"] == "refused"
        assert letter.headers["x-waystation-queue"] == FULL
        assert letter.properties["correlation_id"] == task_id
        await eventually(lambda: not w.store._outbox, "the outbox to empty")
        types = [e.event_type for e in await w.store.read_stream(task_id)]
        assert types[-1] == "TaskCompleted"


async def test_a_task_without_peers_whose_answer_is_refused_runs_once_and_is_recorded() -> None:
    """The direct path: a refused answer used to requeue the task, and its handler ran again.
    Now the completion is recorded (G10 gives way), and its result goes through the outbox."""
    runs: Counter[str] = Counter()
    async with world(app_of(runs)) as w:
        full_queue(w)
        await w.start_worker()
        task_id = await w.publish("quick", {"n": 7}, reply_to=FULL)
        await eventually(lambda: bool(w.store._streams.get(task_id)), "the completion recorded")
        assert [e.event_type for e in await w.store.read_stream(task_id)] == [
            "TaskStarted",
            "TaskCompleted",
        ]
        await eventually(lambda: w.broker.unsettled() == 0, "the task to be settled")
        drain(w)
        await eventually(lambda: len(answers_in(w, FULL)) == 1, "the result")
        assert runs[task_id] == 1


async def test_a_relay_never_stalls_on_a_row_the_broker_refuses() -> None:
    """The relay alone, which used to retry a refused row and nothing else: rows claimed after
    a refused one (here: appended while it waits) are published, and the refused one is tried
    again with backoff, its refusals counted, until it is undeliverable."""
    broker = InMemoryBroker()
    names = Names("relay.")
    connection = broker.connection("relay")
    await connection.connect()
    await connection.declare(names, ["a"])
    broker.declare_queue(FULL, max_length=0)
    store = InMemoryEventStore()
    undeliverable: list[tuple[str, str]] = []

    async def give_up(message: OutboxMessage, error: Exception) -> None:
        undeliverable.append((message.message_id, type(error).__name__))

    outbox = OutboxPublisher(
        connection, store, Observer(), poll_interval=0.05, on_undeliverable=give_up, refused_for=1.5
    )

    async def append(message_id: str, queue: str) -> None:
        import uuid

        from waystation.events import GENESIS_HASH, NewEvent

        await store.append(
            message_id,
            0,
            [NewEvent(uuid.uuid4(), "Probe", {}, {})],
            prev_hash=GENESIS_HASH,
            outbox=[OutboxMessage(message_id, queue, b"{}")],
            outbox_delay=0,
        )

    await append("refused", FULL)
    relay = asyncio.create_task(outbox.relay())
    forget = asyncio.create_task(outbox.forget_published())
    try:
        for n in range(3):
            await append(f"ok-{n}", names.tasks("a"))
            await eventually(
                lambda n=n: any(
                    m.properties["message_id"] == f"ok-{n}"
                    for m in broker.messages(names.tasks("a"))
                ),
                f"ok-{n} published",
            )
        await eventually(lambda: undeliverable == [("refused", "PublishRefused")], "giving up")
        await eventually(lambda: not store._outbox, "every row forgotten")
        assert broker.refused >= 2  # tried again, with backoff, before giving up
        assert [m.properties["message_id"] for m in broker.messages(names.tasks("a"))] == [
            "ok-0",
            "ok-1",
            "ok-2",
        ]
    finally:
        relay.cancel()
        forget.cancel()


async def test_a_message_that_cannot_be_encoded_never_holds_up_its_batch() -> None:
    """One unencodable message used to make the batch's publish raise after the rest had gone
    out; every lease then published the rest again. Now each message's outcome is its own."""
    broker = InMemoryBroker(keep_ledger=True)
    names = Names("batch.")
    connection = broker.connection("batch")
    await connection.connect()
    await connection.declare(names, ["a"])
    good = [OutboxMessage(f"m-{n}", names.tasks("a"), b"{}") for n in range(3)]
    bad = OutboxMessage("x" * 300, names.tasks("a"), b"{}")
    errors = await connection.publish_all([good[0], bad, *good[1:]])
    assert [type(e).__name__ if e else None for e in errors] == [
        None,
        "Unsendable",
        None,
        None,
    ]
    assert len(broker.ledger) == 3


async def test_a_task_id_too_long_for_what_is_derived_from_it_is_refused_at_intake() -> None:
    runs: Counter[str] = Counter()
    async with world(app_of(runs)) as w:
        await w.start_worker()
        task_id = await w.publish("quick", {}, message_id="t" * 250)
        answer = await w.answer(task_id)
        assert answer["status"] == "error" and answer["error"]["type"] == "id-too-long"
        (letter,) = w.broker.messages(w.names.dead_letter_queue)
        assert letter.headers["x-waystation-reason"] == "id-too-long"
        assert runs[task_id] == 0


async def test_a_call_tree_too_deep_for_its_ids_fails_its_deepest_pause_and_answers() -> None:
    """Deep call trees used to hit the short-string wall (the 255 bytes of an AMQP property)
    at about depth 53, and stalled."""
    async with world(app_of(Counter()), settings(reply_shards=0)) as w:
        await w.start_worker()
        task_id = await w.publish("deep", {"depth": 0})
        answer = await w.answer(task_id)
        assert answer["status"] == "ok", answer
        await eventually(lambda: w.broker.unsettled() == 0 and not w.store._outbox, "quiet")
        failed = [
            e
            for e in w.store._all
            if e.event_type == "TaskFailed"
            and "call tree is too deep" in e.data["error"]["message"]
        ]
        assert len(failed) == 1 and len(failed[0].stream_id.encode()) <= 200


async def test_a_result_too_large_to_send_fails_its_task_at_once() -> None:
    """A result over the broker's limit used to re-run its handler until the consumer
    timeout."""
    runs: Counter[str] = Counter()
    async with world(app_of(runs), settings(max_message_bytes=64 * 1024)) as w:
        await w.start_worker()
        task_id = await w.publish("big", {"bytes": 100 * 1024})
        answer = await w.answer(task_id)
        assert answer["status"] == "error"
        assert answer["error"]["type"] == "MessageTooLarge"
        assert runs[task_id] == 1


async def test_a_result_larger_than_the_broker_takes_is_kept_and_its_publisher_told() -> None:
    """The broker's own limit below the workers' setting: the result is unsendable; it is
    dead-lettered without its body, and its publisher gets an error instead, once."""
    runs: Counter[str] = Counter()
    async with world(app_of(runs)) as w:
        w.broker.max_message_bytes = 16 * 1024
        await w.start_worker()
        task_id = await w.publish("big", {"bytes": 32 * 1024})
        answer = await w.answer(task_id)
        assert answer["status"] == "error", answer
        assert answer["error"]["type"] == "undeliverable-result"
        (letter,) = w.broker.messages(w.names.dead_letter_queue)
        assert letter.headers["x-waystation-reason"] == "too-large"
        assert letter.headers["x-waystation-body-omitted"]
        assert runs[task_id] == 1


def _header_table(entries: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(bytes((len(key),)) + key + value for key, value in entries)
    return struct.pack(">I", len(body)) + body


def _properties(message_id: bytes, headers: bytes) -> bytes:
    flags = 0x2000 | 0x0080 | 0x0200  # headers, reply_to, message_id (in pamqp's order)
    reply_to = RESULTS.encode()
    return (
        struct.pack(">H", flags)
        + headers
        + bytes((len(reply_to),))
        + reply_to
        + bytes((len(message_id),))
        + message_id
    )


async def test_a_header_that_is_not_utf8_is_kept_in_its_copies() -> None:
    """The retry and dead-letter copies used to re-publish a header pamqp cannot encode (a
    long string that is not UTF-8, decoded as bytes): settling raised, and the delivery was
    never settled. Now the copies carry it as a byte array."""
    runs: Counter[str] = Counter()
    async with world(app_of(runs)) as w:
        await w.start_worker()
        raw = _header_table([(b"x-odd", b"S" + struct.pack(">I", 2) + b"\xff\xfe")])
        w.broker.enqueue_raw(w.names.tasks("flaky"), dumps({}), _properties(b"t-retried", raw))
        w.broker.enqueue_raw(w.names.tasks("flaky"), b"{not json", _properties(b"t-dead", raw))
        assert (await w.answer("t-retried"))["result"] == "second time"
        assert runs["t-retried"] == 2
        await eventually(lambda: bool(w.broker.messages(w.names.dead_letter_queue)), "the letter")
        (letter,) = w.broker.messages(w.names.dead_letter_queue)
        assert letter.headers["x-waystation-reason"] == "invalid-json"
        assert letter.headers["x-odd"] == bytearray(b"\xff\xfe")
        await eventually(lambda: w.broker.unsettled() == 0, "both settled")


async def test_metadata_that_cannot_be_decoded_is_dead_lettered_and_the_worker_goes_on() -> None:
    """A message_id that is not UTF-8 costs that message alone (the in-memory half; the AMQP
    one is in tests/integration)."""
    runs: Counter[str] = Counter()
    async with world(app_of(runs)) as w:
        await w.start_worker()
        properties = _properties(b"\xff\xfe", _header_table([]))
        w.broker.enqueue_raw(w.names.tasks("quick"), dumps({}), properties)
        await eventually(lambda: bool(w.broker.messages(w.names.dead_letter_queue)), "the letter")
        (letter,) = w.broker.messages(w.names.dead_letter_queue)
        assert letter.headers["x-waystation-reason"] == "undecodable-metadata"
        assert "message_id" in letter.headers["x-waystation-detail"]
        assert bytes(letter.headers[HEADER_RAW]) == properties
        task_id = await w.publish("quick", {})
        assert (await w.answer(task_id))["status"] == "ok"


async def test_events_after_a_retry_or_a_wait_keep_their_publishers_user() -> None:
    """The copies used to drop ``user_id``, so what was recorded after a retry lost its
    actor. (A copy names it in a header, believed only on a message the workers published.)"""
    app = App()
    tries: Counter[str] = Counter()

    @app.agent("boss")
    async def boss(task: TaskContext) -> Outcome:
        tries[task.task_id] += 1
        if tries[task.task_id] == 1:
            raise RuntimeError("once")
        if not task.resumed:
            return Pause([Call("quick", {})])
        return Complete("done")

    @app.agent("quick")
    async def quick(task: TaskContext) -> Outcome:
        return Complete(1)

    async with world(app) as w:
        await w.start_worker()
        task_id = "by-alice"
        await w.publisher.publish(
            OutboxMessage(
                task_id,
                w.names.tasks("boss"),
                dumps({}),
                {"type": "task", "reply_to": RESULTS, "user_id": "alice"},
            )
        )
        assert (await w.answer(task_id))["status"] == "ok"
        started = (await w.store.read_stream(task_id))[0]
        assert started.event_type == "TaskStarted"
        assert started.metadata["amqp_user"] == "alice"
        # a publisher cannot claim to be someone else with the header alone
        await w.publisher.publish(
            OutboxMessage(
                "by-mallory",
                w.names.tasks("boss"),
                dumps({}),
                {
                    "type": "task",
                    "reply_to": RESULTS,
                    "user_id": "mallory",
                    "headers": {"x-waystation-user": "alice", "x-waystation-attempts": 1},
                },
            )
        )
        assert (await w.answer("by-mallory"))["status"] == "ok"
        started = (await w.store.read_stream("by-mallory"))[0]
        assert started.metadata["amqp_user"] == "mallory"
        # nor does a retry make the workers' own user the actor of a task that named none
        anonymous = await w.publish("boss", {})
        assert (await w.answer(anonymous))["status"] == "ok"
        started = (await w.store.read_stream(anonymous))[0]
        assert "amqp_user" not in started.metadata


async def test_a_stream_records_a_bounded_number_of_ignored_replies() -> None:
    """Anyone who may publish to a reply queue used to be able to append ``ReplyIgnored`` to any
    task without end (and streams are read and folded whole). Past the bound, such replies are
    dead-lettered instead."""
    async with world(app_of(Counter()), settings(reply_shards=0)) as w:
        await w.start_worker()
        task_id = await w.publish("boss", {"calls": 1})
        assert (await w.answer(task_id))["status"] == "ok"
        for n in range(MAX_IGNORED_REPLIES + 5):
            await w.publisher.publish(
                OutboxMessage(
                    f"late-{n}",
                    w.names.replies("boss"),
                    dumps({"status": "ok", "result": n}),
                    {"type": "result", "correlation_id": f"{task_id}:1:0"},
                )
            )
        await eventually(
            lambda: len(w.broker.messages(w.names.dead_letter_queue)) == 5, "five dead letters"
        )
        types = Counter(e.event_type for e in await w.store.read_stream(task_id))
        assert types["ReplyIgnored"] == MAX_IGNORED_REPLIES
        reasons = {
            m.headers["x-waystation-reason"] for m in w.broker.messages(w.names.dead_letter_queue)
        }
        assert reasons == {"ignored-replies-limit"}
