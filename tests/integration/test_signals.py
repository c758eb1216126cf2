"""Signals on RabbitMQ and PostgreSQL (issue 31, item 1): a paused task waits for a named message
from outside, which the first open wait on its name takes, once, and any worker of the agent
may take it (the wait is an event in the log, not a process).

Worker processes of ``tests.apps.signals`` show a signal resuming a task whose worker was
SIGKILLed; workers in this process serve the rest: ``waystation signal`` as a user runs it, a
signal kept for a later wait, a cancel racing a signal, and the plain AMQP message another
language sends (docs/wire-format.md#signals). The same flows on the test kit:
tests/embedded/test_signals.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aio_pika.abc import AbstractChannel

from scripts.lab.harness.checks import chain_problems
from scripts.lab.harness.clients import RecordingClient
from scripts.lab.harness.processes import app_workers, worker_logs
from tests.apps import signals as signal_app
from waystation.client import Client, SignalNotApplied
from waystation.events import fold
from waystation.events.codec import dumps, loads
from waystation.events.model import RecordedEvent
from waystation.events.postgres import PostgresEventStore
from waystation.events.task import MAX_IGNORED_REPLIES
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..documents import DOCS, code_blocks
from ..support import (
    count_rows,
    dead_letters,
    eventually,
    publish_raw,
    publish_with_pika,
    published_everything,
    running_worker,
    start_workers,
    take,
)
from .test_cli import run_cli

pytestmark = pytest.mark.integration

APP = "tests.apps.signals:app"
SENDER = "guest"
"""The AMQP user of the test broker's URL: the sender RabbitMQ vouches for."""


@pytest.fixture(autouse=True)
def signal_agents(extra_agents: list[str]) -> None:
    """The queues of the app's agents are deleted after each test."""
    extra_agents.extend(signal_app.AGENTS)


@contextlib.asynccontextmanager
async def serving(
    settings: Settings, store: PostgresEventStore, client_class: type[Client] = Client
) -> AsyncIterator[Any]:
    """A worker of ``tests.apps.signals`` in this process, and a client (``client_class``)."""
    async with (
        running_worker(signal_app.app, settings, store),
        client_class(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        yield client


async def paused_task(client: Client, store: PostgresEventStore, agent: str = "approver") -> str:
    """A new task of ``agent``, once the log shows it paused."""
    task_id = await client.submit(agent, {})

    async def has_paused() -> bool:
        return fold(task_id, await store.read_stream(task_id)).status == "paused"

    await eventually(has_paused, 30, f"task {task_id} to pause")
    return task_id


def of_type(events: list[RecordedEvent], event_type: str) -> list[RecordedEvent]:
    return [e for e in events if e.event_type == event_type]


def claims_of(events: list[RecordedEvent], signal_id: str) -> list[RecordedEvent]:
    return [e for e in of_type(events, "SubtaskClaimed") if e.data["message_id"] == signal_id]


async def open_waits(store: PostgresEventStore, task_ids: list[str]) -> int:
    """Rows of ``pending_calls`` (waits the sweeper would time out) left for these tasks."""
    return await count_rows(
        store, "pending_calls", "task_id = ANY(CAST(:ids AS text[]))", ids=task_ids
    )


@pytest.mark.timeout(240)
async def test_a_signal_resumes_a_task_whose_worker_was_killed_on_another_worker_once(
    settings: Settings, store: PostgresEventStore, tmp_path: Path
) -> None:
    names = Names(settings.queue_prefix, settings.reply_shards)
    queues = [q for a in signal_app.AGENTS for q in (names.tasks(a), *names.reply_queues(a))]
    with app_workers(settings, APP, tmp_path, count=3) as workers:
        logs = worker_logs(workers)
        await start_workers(settings, workers, queues)
        async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
            task_id = await paused_task(client, store)
            [pause] = of_type(await store.read_stream(task_id), "TaskPaused")
            # a worker's id is <host>-<pid> (WAYSTATION_WORKER_ID's default)
            paused_by = str(pause.metadata["worker_id"])
            victim = next((w for w in workers if paused_by.endswith(f"-{w.pid}")), None)
            assert victim is not None, f"no worker process paused it: {paused_by}\n{logs()}"
            victim.kill()
            status = await client.signal(
                task_id,
                "approval",
                {"approved": True, "note": "ship it"},
                agent="approver",
                signal_id="approval-1",
                timeout=60,
            )
            assert status == "taken", logs()
            result = await client.result(task_id, timeout=60)
        assert result.ok, f"{result}\n{logs()}"
        assert result.result == {
            "approval": {"approved": True, "note": "ship it"},
            "by": SENDER,
            "outcome": "ok",
        }
        survivors = [w for w in workers if w is not victim]
        assert all(w.alive() for w in survivors), logs()
    events = await store.read_stream(task_id)
    [received] = of_type(events, "SignalReceived")
    assert (received.data["signal_id"], received.data["sender"]) == ("approval-1", SENDER)
    assert received.metadata["amqp_user"] == SENDER
    assert len(claims_of(events, "approval-1")) == 1
    [resumed] = of_type(events, "TaskResumed")
    [completed] = of_type(events, "TaskCompleted")
    for event in (received, resumed, completed):
        assert event.metadata["worker_id"] != paused_by, event
    assert chain_problems(events) == []
    assert await open_waits(store, [task_id]) == 0


async def test_waystation_signal_says_what_became_of_a_signal_with_its_exit_code(
    settings: Settings, store: PostgresEventStore
) -> None:
    async with serving(settings, store) as client:
        approved_id = await paused_task(client, store)
        waiting_id = await paused_task(client, store)

        def signal(*args: str) -> Any:
            return run_cli(settings, "signal", *args)

        taken = await asyncio.to_thread(
            signal, approved_id, "approval", '{"approved": true}', "--signal-id", "cli-1"
        )
        assert taken.returncode == 0, taken.stderr
        assert orjson.loads(taken.stdout) == {
            "task_id": approved_id,
            "signal": "approval",
            "signal_id": "cli-1",
            "status": "taken",
        }
        assert (await client.result(approved_id, timeout=60)).result["approval"] == {
            "approved": True,
            "note": "",
        }
        again = await asyncio.to_thread(
            signal, approved_id, "approval", '{"approved": false}', "--signal-id", "cli-1"
        )
        assert again.returncode == 0, again.stderr
        assert orjson.loads(again.stdout)["status"] == "duplicate"

        maybe = (waiting_id, "approval", '{"approved": "maybe"}', "--signal-id", "cli-2")
        for _ in range(2):  # sent again, not knowing whether it arrived: refused again
            invalid = await asyncio.to_thread(signal, *maybe)
            assert invalid.returncode == 1, invalid.stderr
            assert orjson.loads(invalid.stdout)["status"] == "invalid"
            assert len(invalid.stderr.strip().splitlines()) == 1, invalid.stderr
            assert "approved" in invalid.stderr and "the wait goes on" in invalid.stderr
        state = fold(waiting_id, await store.read_stream(waiting_id))
        assert state.status == "paused" and len(state.outstanding) == 1, "the wait must go on"

        unknown = await asyncio.to_thread(signal, "no-such-task", "approval", "{}")
        assert unknown.returncode == 2
        assert len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
        assert "not in the event log" in unknown.stderr

        nowhere = await asyncio.to_thread(
            signal, waiting_id, "approval", '{"approved": true}', "--agent", "nosuch"
        )
        assert nowhere.returncode == 7, nowhere.stderr
        assert len(nowhere.stderr.strip().splitlines()) == 1, nowhere.stderr
        assert "no queue" in nowhere.stderr and "'nosuch'" in nowhere.stderr

    # no worker consumes the queue now: no answer, and the id to send it again by
    unanswered = await asyncio.to_thread(
        signal, waiting_id, "approval", '{"approved": true}', "--timeout", "1"
    )
    assert unanswered.returncode == 3, unanswered.stderr
    [line] = unanswered.stderr.strip().splitlines()
    assert re.search(r"send it again with --signal-id signal:[0-9a-f-]{36} ", line), line
    approved = await store.read_stream(approved_id)
    assert len(of_type(approved, "SignalReceived")) == 1
    assert len(claims_of(approved, "cli-1")) == 1
    assert [
        e.data["reason"] for e in of_type(await store.read_stream(waiting_id), "SignalRefused")
    ] == ["invalid"]


async def test_a_signal_sent_before_its_wait_is_kept_and_taken_by_the_next_pause(
    settings: Settings, store: PostgresEventStore
) -> None:
    async with serving(settings, store) as client:
        task_id = await paused_task(client, store, "twice")
        assert await client.signal(task_id, "second", "b", agent="twice", signal_id="s-2") == (
            "kept"
        )
        assert await client.signal(task_id, "first", "a", agent="twice", signal_id="s-1") == (
            "taken"
        )
        result = await client.result(task_id, timeout=60)
        assert result.result == ["a", "b"]
    events = await store.read_stream(task_id)
    types = [e.event_type for e in events]
    second = next(
        i for i, e in enumerate(events) if e.event_type == "TaskPaused" and e.data["pause"] == 2
    )
    # the second pause took the kept signal in its own append: claimed, recorded, resumed
    assert types[second + 1 : second + 4] == ["SubtaskClaimed", "ResultRecorded", "TaskResumed"]
    assert events[second + 1].data["message_id"] == "s-2"
    assert events[second + 1].tx_id == events[second].tx_id
    assert [e.data["signal_id"] for e in of_type(events, "SignalReceived")] == ["s-2", "s-1"]
    assert types.count("TaskCompleted") == 1
    assert await open_waits(store, [task_id]) == 0


async def test_a_refusal_the_log_no_longer_records_is_answered_as_one_it_does(
    settings: Settings, store: PostgresEventStore
) -> None:
    """A stream records at most MAX_IGNORED_REPLIES refusals (and ignored replies); a sender
    refused past that is told the same as before, with a status the wire format lists."""
    async with serving(settings, store) as client:
        task_id = await paused_task(client, store)
        for n in range(MAX_IGNORED_REPLIES + 1):
            with pytest.raises(SignalNotApplied) as refused:
                await client.signal(
                    task_id, "approval", {"approved": f"maybe {n}"}, agent="approver"
                )
            assert refused.value.status == "invalid", refused.value
            assert "approved" in refused.value.message
        assert "not recorded" in refused.value.message
        assert await client.signal(task_id, "approval", {"approved": True}, agent="approver") == (
            "taken"
        )
        assert (await client.result(task_id, timeout=60)).ok
    events = await store.read_stream(task_id)
    assert len(of_type(events, "SignalRefused")) == MAX_IGNORED_REPLIES
    assert len(of_type(events, "SignalReceived")) == 1


async def test_an_id_refused_once_is_refused_again_even_with_a_corrected_payload(
    settings: Settings, store: PostgresEventStore
) -> None:
    """A decision is recorded once per signal id: a refused signal sent again is told why, as
    the first time, and a corrected payload under the same id is told to take a new one."""
    async with serving(settings, store) as client:
        task_id = await paused_task(client, store)
        wrong = {"approved": "maybe"}
        for _ in range(2):
            with pytest.raises(SignalNotApplied) as refused:
                await client.signal(task_id, "approval", wrong, agent="approver", signal_id="r")
            assert refused.value.status == "invalid", refused.value
            assert "approved" in refused.value.message
        assert "refused before" in refused.value.message
        with pytest.raises(SignalNotApplied) as reused:
            await client.signal(
                task_id, "approval", {"approved": True}, agent="approver", signal_id="r"
            )
        assert reused.value.status == "undeliverable", reused.value
        assert "new id" in reused.value.message
        right = {"approved": True}
        assert await client.signal(task_id, "approval", right, agent="approver") == "taken"
        assert (await client.result(task_id, timeout=60)).ok
    events = await store.read_stream(task_id)
    assert [e.data["signal_id"] for e in of_type(events, "SignalRefused")] == ["r"]
    assert len(of_type(events, "SignalReceived")) == 1


RACES = 20


@pytest.mark.timeout(180)
async def test_a_cancel_racing_a_signal_settles_each_task_one_way(
    settings: Settings, store: PostgresEventStore
) -> None:
    """A signal and a cancel for each of RACES paused tasks, at once (each first on every other
    task): the log settles each race, and what each sender is told agrees with it."""
    async with serving(settings, store, RecordingClient) as client:
        task_ids = [await paused_task(client, store) for _ in range(RACES)]

        async def signal(task_id: str) -> str:
            try:
                return await client.signal(
                    task_id, "approval", {"approved": True}, agent="approver", timeout=60
                )
            except SignalNotApplied as refused:
                return f"{refused.status}: {refused.message}"

        async def race(task_id: str, cancel_first: bool) -> tuple[str, str]:
            cancel = client.cancel("approver", task_id, reason="race", timeout=60)
            if cancel_first:  # (published first: the worker takes it a moment earlier)
                cancelled, signalled = await asyncio.gather(cancel, signal(task_id))
            else:
                signalled, cancelled = await asyncio.gather(signal(task_id), cancel)
            return signalled, cancelled

        answers = await asyncio.gather(*(race(t, i % 2 == 0) for i, t in enumerate(task_ids)))
        for task_id in task_ids:
            await eventually(lambda t=task_id: t in client.results, 60, f"the result of {task_id}")
        await published_everything(store, task_ids)

    outcomes: Counter[str] = Counter()
    for task_id, (signalled, cancelled) in zip(task_ids, answers, strict=True):
        events = await store.read_stream(task_id)
        types = [e.event_type for e in events]
        terminal = [t for t in types if t in ("TaskCompleted", "TaskFailed", "TaskCancelled")]
        assert len(terminal) == 1, (task_id, types)
        received = of_type(events, "SignalReceived")
        refused = of_type(events, "SignalRefused")
        if signalled == "taken":
            # the signal won: taken once, the task resumed; the cancel found it finished, or
            # cancelled the run the signal resumed before it completed
            assert len(received) == 1 and not refused, types
            assert len(claims_of(events, received[0].data["signal_id"])) == 1, types
            assert types.count("TaskResumed") == 1, types
            assert types.index("SignalReceived") < types.index(terminal[0]), types
            if terminal == ["TaskCompleted"]:
                assert cancelled == "completed", (task_id, cancelled)
                assert client.results[task_id].result["approval"] == {"approved": True, "note": ""}
                outcomes["signal won"] += 1
            else:
                assert terminal == ["TaskCancelled"] and cancelled == "cancelled", types
                outcomes["signal taken, then the resumed run cancelled"] += 1
        else:
            # the cancel won: the signal came to a finished task, refused and recorded as such
            assert terminal == ["TaskCancelled"] and cancelled == "cancelled", (types, cancelled)
            assert signalled.startswith("undeliverable:") and "cancelled" in signalled, signalled
            assert not received and [e.data["reason"] for e in refused] == ["finished"], types
            assert "TaskResumed" not in types, types
            assert client.results[task_id].status == "cancelled"
            outcomes["cancel won"] += 1
        assert len(client.distinct_results(task_id)) == 1, client.bodies(task_id)
        assert chain_problems(events) == []
    print(f"{RACES} races: {dict(outcomes)}")
    assert outcomes["cancel won"] and sum(outcomes.values()) > outcomes["cancel won"], (
        f"each side must win a race, or the races show one way alone: {dict(outcomes)}"
    )
    assert await open_waits(store, task_ids) == 0


async def test_a_plain_amqp_signal_is_taken_with_or_without_reply_to_but_never_without_an_id(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
) -> None:
    """What a publisher in another language sends: docs/wire-format.md#signals, byte for byte."""
    names = Names(settings.queue_prefix)
    queue = names.tasks("approver")
    answers = await amqp_channel.declare_queue(exclusive=True, auto_delete=True)

    def body(task_id: str) -> bytes:
        return dumps({"task_id": task_id, "name": "approval", "payload": {"approved": True}})

    async with serving(settings, store) as client:
        answered_id = await paused_task(client, store)
        silent_id = await paused_task(client, store)
        signal_properties = {
            "type": "signal",
            "user_id": SENDER,
            "content_type": "application/json",
        }

        await publish_raw(
            amqp_channel,
            queue,
            body(answered_id),
            message_id="plain-1",
            correlation_id="ask-1",
            reply_to=answers.name,
            **signal_properties,
        )
        [answer] = await take(answers, 1, within=30)
        assert answer.correlation_id == "ask-1"
        assert loads(answer.body) == {
            "status": "ok",
            "result": {"task_id": answered_id, "signal_id": "plain-1", "status": "taken"},
        }

        await publish_raw(
            amqp_channel, queue, body(silent_id), message_id="plain-2", **signal_properties
        )
        for task_id in (answered_id, silent_id):
            result = await client.result(task_id, timeout=60)
            assert result.result == {
                "approval": {"approved": True, "note": ""},
                "by": SENDER,
                "outcome": "ok",
            }

        # without a message_id (pika sends none; aio-pika would make one up)
        waiting_id = await paused_task(client, store)
        await publish_with_pika(
            settings.amqp_url,
            queue,
            body(waiting_id),
            correlation_id="ask-3",
            reply_to=answers.name,
            **signal_properties,
        )
        [dead] = await dead_letters(amqp_channel, names, 1)
        headers = dead.headers or {}
        assert headers.get("x-waystation-reason") == "missing-property"
        assert "message_id" in str(headers.get("x-waystation-detail"))
        assert dead.body == body(waiting_id)
        [told] = await take(answers, 1, within=30)
        assert told.correlation_id == "ask-3"
        told_body = loads(told.body)
        assert (told_body["status"], told_body["error"]["type"]) == ("error", "missing-property")
        state = fold(waiting_id, await store.read_stream(waiting_id))
        assert state.status == "paused" and not state.signals
    for task_id, signal_id in ((answered_id, "plain-1"), (silent_id, "plain-2")):
        events = await store.read_stream(task_id)
        [received] = of_type(events, "SignalReceived")
        assert (received.data["signal_id"], received.data["sender"]) == (signal_id, SENDER)
        assert len(claims_of(events, signal_id)) == 1


def node_with_amqplib() -> str:
    """``node``, once it can load ``amqplib``; else the test skips, saying what is missing.

    A skip, not :func:`require`'s failure under CI: ``.ci/run`` installs amqplib (into a cache
    outside the repository, given to node as ``NODE_PATH``) only when the npm registry answers,
    and an unreachable registry must not fail CI."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("the Node sender needs node on PATH")
    found = subprocess.run(
        [node, "-e", "require.resolve('amqplib')"], capture_output=True, text=True, timeout=30
    )
    if found.returncode != 0:
        pytest.skip(
            "the Node sender needs amqplib: npm install --prefix DIR amqplib, and NODE_PATH="
            "DIR/node_modules (.ci/run does it when the npm registry answers)"
        )
    return node


def run_node(node: str, script: Path, settings: Settings, *args: str) -> Any:
    environment = {
        **os.environ,
        "WAYSTATION_AMQP_URL": settings.amqp_url,
        "WAYSTATION_QUEUE_PREFIX": settings.queue_prefix,
    }
    return subprocess.run(
        [node, str(script), *args], env=environment, capture_output=True, text=True, timeout=90
    )


async def test_the_node_sender_of_the_wire_format_signals_a_paused_task(
    settings: Settings, store: PostgresEventStore, tmp_path: Path
) -> None:
    """The script of docs/wire-format.md#signals, as printed there, run by node."""
    node = node_with_amqplib()
    text = (DOCS / "wire-format.md").read_text()
    [block] = [b for b in code_blocks(text) if b.code.startswith("// signal.js")]
    script = tmp_path / "signal.js"
    script.write_text(block.code)
    async with serving(settings, store) as client:
        task_id = await paused_task(client, store)
        approve = ("approver", task_id, "approval", '{"approved": true}', "from-node")
        sent = await asyncio.to_thread(run_node, node, script, settings, *approve)
        assert sent.returncode == 0, sent.stderr
        assert orjson.loads(sent.stdout) == {
            "status": "ok",
            "result": {"task_id": task_id, "signal_id": "from-node", "status": "taken"},
        }
        result = await client.result(task_id, timeout=60)
        assert result.result == {
            "approval": {"approved": True, "note": ""},
            "by": SENDER,
            "outcome": "ok",
        }

        again = await asyncio.to_thread(run_node, node, script, settings, *approve)
        assert again.returncode == 0, again.stderr
        assert orjson.loads(again.stdout)["result"]["status"] == "duplicate"

        waiting_id = await paused_task(client, store)
        wrong = ("approver", waiting_id, "approval", '{"approved": "maybe"}')
        refused = await asyncio.to_thread(run_node, node, script, settings, *wrong)
        assert refused.returncode == 1, refused.stderr
        assert orjson.loads(refused.stdout)["error"]["type"] == "invalid"

        nowhere = await asyncio.to_thread(
            run_node, node, script, settings, "nosuch", task_id, "approval", "{}"
        )
        assert nowhere.returncode == 2, nowhere.stderr
        assert nowhere.stderr.startswith("signal.js: no queue"), nowhere.stderr
    events = await store.read_stream(task_id)
    [received] = of_type(events, "SignalReceived")
    assert (received.data["signal_id"], received.data["sender"]) == ("from-node", SENDER)
