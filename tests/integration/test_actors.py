"""Who acted, in the log, on RabbitMQ and PostgreSQL (issue 32): the actor a cancel or a signal
names (``x-waystation-actor``: through ``Client(...).cancel/signal(actor=...)``, or as a plain AMQP
header from any language, cleaned by the worker) is on the events it causes, in ``history`` and in
``export``; ``waystation dead-letters replay`` records a ``DeadLettersReplayed`` with its
``--actor`` in the operations stream, which ``verify``, ``history``, ``export`` and the
projections read without a false alarm, and says so loudly, exiting non-zero, when the log cannot
record a replay that happened. The same on the test kit: tests/embedded/test_actors.py.
"""

from __future__ import annotations

import asyncio
import getpass
import uuid

import orjson
import pytest
from aio_pika.abc import AbstractChannel

from scripts.lab.harness.database import fresh_database_url
from tests.apps import signals as signal_app
from waystation.client import Client
from waystation.events import OPERATIONS_STREAM, fold
from waystation.events.codec import dumps
from waystation.events.model import RecordedEvent
from waystation.events.postgres import PostgresEventStore
from waystation.projections.postgres import (
    PROJECTIONS,
    agent_stats,
    catch_up,
    create_engine,
    rebuild,
)
from waystation.protocol.actors import MAX_ACTOR
from waystation.protocol.wire import HEADER_ACTOR, HEADER_REASON, Names
from waystation.settings import Settings

from ..support import Services, dead_letters, eventually, publish_raw, running_worker
from .test_cli import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

HOSTILE = "console:\x1b[2Jmal\u202elory\u200b\r\n<img src=x onerror=alert(1)>\x00" + "y" * 300
CLEANED = ("console:[2Jmallory <img src=x onerror=alert(1)>" + "y" * 300)[:MAX_ACTOR]


@pytest.fixture(autouse=True)
def signal_agents(extra_agents: list[str]) -> None:
    """The queues of the app's agents are deleted after each test."""
    extra_agents.extend(signal_app.AGENTS)


async def until(store: PostgresEventStore, task_id: str, status: str) -> list[RecordedEvent]:
    """The task's stream once the log shows it ``status``."""
    events: list[RecordedEvent] = []

    async def reached() -> bool:
        events[:] = await store.read_stream(task_id)
        return fold(task_id, events).status == status

    await eventually(reached, 30, f"task {task_id} to be {status}")
    return events


async def paused_task(client: Client, store: PostgresEventStore) -> str:
    task_id = await client.submit("approver", {})
    await until(store, task_id, "paused")
    return task_id


async def cli(settings: Settings, *args: str) -> tuple[int, str, str]:
    done = await asyncio.to_thread(run_cli, settings, *args)
    return done.returncode, done.stdout, done.stderr


def of_type(events: list[RecordedEvent], event_type: str) -> RecordedEvent:
    [event] = [e for e in events if e.event_type == event_type]
    return event


async def test_cancels_and_signals_record_their_actor_shown_by_history_and_export(
    own_log: tuple[Settings, PostgresEventStore], amqp_channel: AbstractChannel
) -> None:
    settings, store = own_log
    names = Names(settings.queue_prefix)
    async with (
        running_worker(signal_app.app, settings, store),
        Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        signalled = await paused_task(client, store)
        status = await client.signal(
            signalled, "approval", {"approved": True}, agent="approver", actor="console:alice"
        )
        assert status == "taken"
        assert (await client.result(signalled, timeout=30)).ok

        cancelled = await paused_task(client, store)
        assert await client.cancel("approver", cancelled, actor="console:bob") == "cancelled"

        # a publisher in another language, sending whatever it likes in the header
        raw = await paused_task(client, store)
        await publish_raw(
            amqp_channel,
            names.tasks("approver"),
            dumps({"task_id": raw, "reason": "from elsewhere"}),
            type="cancel",
            message_id=f"cancel:{uuid.uuid4()}",
            headers={HEADER_ACTOR: HOSTILE},
        )
        raw_events = await until(store, raw, "cancelled")

        # from a shell: the OS user by default, or --actor
        shell = await paused_task(client, store)
        code, out, err = await cli(settings, "cancel", shell)
        assert code == 0, out + err
        told = await paused_task(client, store)
        code, out, err = await cli(
            settings, "signal", told, "approval", '{"approved": false}', "--actor", "ops:zoe"
        )
        assert code == 0, out + err
    shell_events = await until(store, shell, "cancelled")
    assert of_type(shell_events, "TaskCancelled").metadata["actor"] == f"cli:{getpass.getuser()}"
    told_events = await until(store, told, "completed")
    assert of_type(told_events, "SignalReceived").metadata["actor"] == "ops:zoe"

    events = await until(store, signalled, "completed")
    assert of_type(events, "SignalReceived").metadata["actor"] == "console:alice"
    assert "actor" not in of_type(events, "TaskPaused").metadata
    cancel_events = await until(store, cancelled, "cancelled")
    assert of_type(cancel_events, "TaskCancelled").metadata["actor"] == "console:bob"
    assert of_type(raw_events, "TaskCancelled").metadata["actor"] == CLEANED

    code, out, err = await cli(settings, "history", signalled)
    assert code == 0, out + err
    assert "signal approval (" in out and " from guest (console:alice) " in out
    code, out, err = await cli(settings, "history", cancelled)
    assert code == 0, out + err
    assert "cancelled by console:bob" in out
    code, out, err = await cli(settings, "history", raw, "--json")
    assert code == 0, out + err
    [shown] = [e for e in orjson.loads(out)["events"] if e["event_type"] == "TaskCancelled"]
    assert shown["acted_by"] == CLEANED
    assert shown["summary"] == f"cancelled by {CLEANED}: from elsewhere"

    code, out, err = await cli(settings, "verify")
    assert code == 0, out + err
    code, out, err = await cli(settings, "export")
    assert code == 0, err
    exported = [orjson.loads(line) for line in out.splitlines()]
    actors = {
        (e["stream_id"], e["event_type"]): e["metadata"].get("actor")
        for e in exported
        if e["event_type"] in ("SignalReceived", "TaskCancelled")
    }
    assert actors == {
        (signalled, "SignalReceived"): "console:alice",
        (cancelled, "TaskCancelled"): "console:bob",
        (raw, "TaskCancelled"): CLEANED,
        (shell, "TaskCancelled"): f"cli:{getpass.getuser()}",
        (told, "SignalReceived"): "ops:zoe",
    }


async def test_a_replay_is_recorded_with_its_actor_and_the_audit_and_projections_accept_it(
    own_log: tuple[Settings, PostgresEventStore],
    amqp_channel: AbstractChannel,
    services: Services,
) -> None:
    settings, store = own_log
    names = Names(settings.queue_prefix)
    queue = names.tasks("approver")
    async with (
        running_worker(signal_app.app, settings, store) as worker,
        Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        paused = await paused_task(client, store)  # a task stream beside the operations one

        def dead(count: int) -> bool:
            return worker.stats.counters.get("dead_letter.wrong-shape") == count

        # a signal of the wrong shape is dead-lettered; it named its actor
        await publish_raw(
            amqp_channel,
            queue,
            b'{"no": "task id"}',
            type="signal",
            message_id="bad-signal",
            headers={HEADER_ACTOR: "console:dave"},
        )
        await eventually(lambda: dead(1), 20, "the bad signal to be dead-lettered")

        code, out, err = await cli(
            settings,
            "dead-letters",
            "replay",
            "--reason",
            "wrong-shape",
            "--actor",
            "console:carol",
        )
        assert code == 0, out + err
        assert "replayed 1 message(s)" in out
        # back in its queue with its own actor, and dead-lettered again
        await eventually(lambda: dead(2), 20, "the replayed signal to be dead-lettered again")
        [letter] = await dead_letters(amqp_channel, names, 1)
        assert letter.headers[HEADER_ACTOR] == "console:dave"
        assert letter.headers[HEADER_REASON] == "wrong-shape"
        # (taken to read it: put back as it was, for the next replay)
        await publish_raw(
            amqp_channel,
            names.dead_letter_queue,
            letter.body,
            type=letter.type,
            message_id=letter.message_id,
            headers=dict(letter.headers),
        )

        # the log cannot record it: the replay happened all the same, and the command says so
        broken = settings.model_copy(
            update={"database_url": fresh_database_url(services.admin_database_url)}
        )
        code, out, err = await cli(broken, "dead-letters", "replay", "--actor", "console:erin")
        assert code == 4, out + err
        assert "replayed 1 message(s), but NOT recorded in the event log" in err
        assert "bad-signal" in out
        await eventually(lambda: dead(3), 20, "the unrecorded replay's signal to come back")

    [record] = await store.read_stream(OPERATIONS_STREAM)
    assert record.event_type == "DeadLettersReplayed"
    assert record.data == {
        "actor": "console:carol",
        "reason": "wrong-shape",
        "count": 1,
        "message_ids": ["bad-signal"],
        "queues": [queue],
    }
    assert record.metadata["actor"] == "console:carol"
    assert record.metadata["amqp_user"] == "guest"
    assert record.metadata["deployment"] == settings.queue_prefix

    code, out, err = await cli(settings, "verify")
    assert code == 0, out + err
    assert out.startswith("2 streams, ")
    code, out, err = await cli(settings, "verify", OPERATIONS_STREAM)
    assert code == 0, out + err
    code, out, err = await cli(settings, "history", OPERATIONS_STREAM)
    assert code == 0, out + err
    assert f"replayed 1 dead letter(s) of reason wrong-shape to {queue} by console:carol" in out
    code, out, err = await cli(settings, "export")
    assert code == 0, err
    streams = {orjson.loads(line)["stream_id"] for line in out.splitlines()}
    assert streams == {paused, OPERATIONS_STREAM}

    engine = create_engine(settings.database_url)
    try:
        for projection in PROJECTIONS.values():
            async with engine.connect() as connection:
                await catch_up(connection, projection)
            report = await rebuild(engine, projection, check_only=True)
            assert report.identical, report.to_json()
        assert set(await agent_stats(engine)) == {"approver"}  # nothing of the operations
    finally:
        await engine.dispose()
    code, out, err = await cli(settings, "tasks", "--json")
    assert code == 0, out + err
    assert [row["task_id"] for row in orjson.loads(out)] == [paused]
