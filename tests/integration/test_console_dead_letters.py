"""The console's dead-letters page over real RabbitMQ: letters made as bad input and failing
handlers make them (a malformed task, a handler that fails for good), listed with their reason,
agent, age, task and a redacted, escaped body; filtered; replayed, one or all of a reason, only
after a confirmation; and a letter whose queue is gone stays a dead letter."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aio_pika
import aiohttp
import markupsafe
import orjson
import pytest
import pytest_asyncio
from aio_pika.abc import AbstractChannel

from scripts.lab.harness.clients import RecordingClient
from waystation.agent import App, TaskContext
from waystation.brokers.amqp.deadletters import browse, replay
from waystation.brokers.amqp.topology import declare
from waystation.events import OPERATIONS_STREAM, Outcome
from waystation.events.postgres import PostgresEventStore
from waystation.policies import Permanent
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import eventually, publish_raw, running_worker, take
from .console_support import browser, console, sign_in
from .test_cli import run_cli

pytestmark = pytest.mark.integration

AGENT = "stubborn"
HOSTILE = '"><img src=x onerror=alert(1)>'
SCRIPT = "<script>alert('dead')</script>"
SECRET = "hunter2-do-not-show"


def stubborn_app() -> App:
    """An agent whose handler fails for good, saying what its input asked (hostile text)."""
    app = App()

    @app.agent(AGENT)
    async def stubborn(task: TaskContext) -> Outcome:
        raise Permanent(f"will not: {task.input.get('note')}")

    return app


@dataclass(frozen=True)
class Letters:
    """The dead letters a test starts with."""

    failed_task: str
    """The task whose handler failed for good (``handler-failed``), its input holding a
    ``security_context`` and hostile text."""
    malformed: str
    """The message id of a task message that is not JSON (``invalid-json``), a script."""


async def _letters_in(settings: Settings) -> list[str]:
    return [
        letter.message_id or ""
        for letter in await browse(settings.amqp_url, Names(settings.queue_prefix), 100)
    ]


@pytest_asyncio.fixture
async def letters(
    settings: Settings,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
    extra_agents: list[str],
) -> AsyncIterator[Letters]:
    extra_agents.append(AGENT)
    names = Names(settings.queue_prefix)
    malformed = f"malformed-{uuid.uuid4()}"
    async with (
        running_worker(stubborn_app(), settings, store),
        RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        task_id = await client.submit(
            AGENT,
            {
                "note": HOSTILE,
                "security_context": {"password": SECRET},
                "nested": [{"security_context": SECRET}],
            },
        )
        result = await client.result(task_id, timeout=30)
        assert result.status == "error", result
        await publish_raw(
            amqp_channel,
            names.tasks(AGENT),
            f'{SCRIPT} {{"n": '.encode(),
            message_id=malformed,
            correlation_id=malformed,
        )

        async def both_dead() -> bool:
            return {task_id, malformed} <= set(await _letters_in(settings))

        await eventually(both_dead, 30, "both letters in the dead-letter queue")
    yield Letters(failed_task=task_id, malformed=malformed)


async def _get(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as response:
        page = await response.text()
        assert response.status == 200, page
        return page


def _rows(page: str) -> list[str]:
    """The message ids of the letters a page lists, in order."""
    return re.findall(r'<tr class="dead-letter" data-message-id="([^"]*)"', page)


async def test_the_page_lists_each_letter_with_reason_agent_age_task_and_a_redacted_escaped_body(
    settings: Settings, letters: Letters
) -> None:
    names = Names(settings.queue_prefix)
    async with console(settings) as base, browser() as session:
        page = await _get(session, f"{base}/dead-letters")
    assert sorted(_rows(page)) == sorted([letters.failed_task, letters.malformed])
    assert "2 dead letters wait." in page
    # counts on top, by reason and by agent
    for reason in ("handler-failed", "invalid-json"):
        count = rf'data-reason="{reason}">\s*<td><a href="[^"]*">{reason}</a></td><td class="n">1<'
        assert re.search(count, page), reason
    assert re.search(rf">{AGENT}</a></td><td class=\"n\">2</td>", page)
    failed = _row_of(page, letters.failed_task)
    assert ">handler-failed</a>" in failed
    assert f'{AGENT}<div class="queue">{names.tasks(AGENT)}</div>' in failed
    assert re.search(r"<span title=\"[0-9-]+ [0-9:]+ UTC\">[0-9.]+[smh] ago</span>", failed)
    assert f'href="/tasks/{letters.failed_task}"' in failed
    # the body: JSON, redacted as an export redacts (security_context, wherever it is)
    assert SECRET not in page
    assert failed.count("&#34;redacted&#34;: &#34;sha256:") == 2, failed
    # hostile text, in the body and in the detail (the handler's error quotes it), is escaped
    assert HOSTILE not in page and "<img" not in page
    assert _escaped(HOSTILE) in failed.split('class="body"')[1]
    assert f"will not: {_escaped(HOSTILE)}" in failed
    malformed = _row_of(page, letters.malformed)
    assert ">invalid-json</a>" in malformed and "text, " in malformed
    assert SCRIPT not in page and _escaped(SCRIPT) in malformed
    assert f'href="/tasks/{letters.malformed}"' in malformed
    # signed out: no action form, a way to sign in
    assert 'action="/dead-letters/replay"' not in page
    assert "/sign-in?next=/dead-letters" in page


def _escaped(text: str) -> str:
    return str(markupsafe.escape(text))


def _row_of(page: str, message_id: str) -> str:
    found = re.search(
        rf'<tr class="dead-letter" data-message-id="{re.escape(message_id)}">(.*?)</tr>', page, re.S
    )
    assert found is not None, f"{message_id} is not listed"
    return found.group(1)


async def test_filters_by_reason_agent_and_task(settings: Settings, letters: Letters) -> None:
    async with console(settings) as base, browser() as session:
        by_reason = await _get(session, f"{base}/dead-letters?reason=invalid-json")
        by_task = await _get(session, f"{base}/dead-letters?task={letters.failed_task}")
        by_agent = await _get(session, f"{base}/dead-letters?agent={AGENT}")
        nobody = await _get(session, f"{base}/dead-letters?agent=nobody")
    assert _rows(by_reason) == [letters.malformed]
    assert _rows(by_task) == [letters.failed_task]
    assert sorted(_rows(by_agent)) == sorted([letters.failed_task, letters.malformed])
    assert _rows(nobody) == [] and "No dead letters match." in nobody
    # the counts on top stay those of every letter
    assert 'data-reason="handler-failed"' in by_reason


async def test_a_replay_needs_its_confirmation_then_sends_the_letter_back_to_its_queue(
    settings: Settings, letters: Letters, amqp_channel: AbstractChannel
) -> None:
    names = Names(settings.queue_prefix)
    async with console(settings) as base, browser() as session:
        csrf = await sign_in(session, base, "ops")
        page = await _get(session, f"{base}/dead-letters")
        assert f'name="message_id" value="{letters.failed_task}"' in page
        asked = {"csrf": csrf, "message_id": letters.failed_task}
        async with session.post(
            f"{base}/dead-letters/replay", data=asked, allow_redirects=False
        ) as response:
            assert response.status == 303
            confirm = response.headers["Location"]
        assert confirm == f"/dead-letters/confirm?message_id={letters.failed_task}"
        # nothing was replayed by asking
        assert sorted(await _letters_in(settings)) == sorted(
            [letters.failed_task, letters.malformed]
        )
        page = await _get(session, base + confirm)
        assert _rows(page) == [letters.failed_task]
        assert 'name="confirmed" value="yes"' in page and "Replay 1 letter</button>" in page
        # a confirmation without the session's CSRF token is refused
        forged = {**asked, "confirmed": "yes", "csrf": "forged"}
        async with session.post(f"{base}/dead-letters/replay", data=forged) as response:
            assert response.status == 403
        assert len(await _letters_in(settings)) == 2
        async with session.post(
            f"{base}/dead-letters/replay", data={**asked, "confirmed": "yes"}
        ) as response:
            assert response.status == 200 and str(response.url.path) == "/dead-letters"
            page = await response.text()
        assert "Replayed 1 dead letter." in page and "not replayed" not in page
        assert _rows(page) == [letters.malformed]
    # back in its queue, as it was (no worker runs to take it)
    queue = await amqp_channel.declare_queue(names.tasks(AGENT), passive=True)
    [back] = await take(queue, 1)
    assert back.message_id == letters.failed_task
    assert orjson.loads(back.body)["security_context"] == {"password": SECRET}
    assert not any(key.startswith("x-waystation-") for key in back.headers or {})
    assert await _letters_in(settings) == [letters.malformed]


async def test_replaying_a_reason_sends_its_letters_to_the_worker_which_dead_letters_them_again(
    settings: Settings, store: PostgresEventStore, letters: Letters
) -> None:
    async with console(settings) as base, browser() as session:
        csrf = await sign_in(session, base, "ops")
        page = await _get(session, f"{base}/dead-letters/confirm?reason=invalid-json")
        assert _rows(page) == [letters.malformed]
        [before] = [
            letter
            for letter in await browse(settings.amqp_url, Names(settings.queue_prefix), 10)
            if letter.message_id == letters.malformed
        ]
        async with running_worker(stubborn_app(), settings, store) as worker:
            form = {"csrf": csrf, "reason": "invalid-json", "confirmed": "yes"}
            async with session.post(f"{base}/dead-letters/replay", data=form) as response:
                page = await response.text()
            assert "Replayed 1 dead letter." in page
            # (the last of the test run's replays: other tests replay in the same log)
            recorded = (await store.read_stream(OPERATIONS_STREAM))[-1]
            assert recorded.event_type == "DeadLettersReplayed"
            assert recorded.data["actor"] == "console:ops", "who replayed, in the log"
            assert recorded.data["message_ids"] == [letters.malformed]
            await eventually(
                lambda: worker.stats.counters.get("dead_letter.invalid-json") == 1,
                30,
                "the replayed letter to be dead-lettered again",
            )
        page = await _get(session, f"{base}/dead-letters?reason=invalid-json")
    assert _rows(page) == [letters.malformed]
    again = [
        letter
        for letter in await browse(settings.amqp_url, Names(settings.queue_prefix), 10)
        if letter.message_id == letters.malformed
    ]
    assert len(again) == 1 and again[0].dead_lettered_at is not None
    assert before.dead_lettered_at is not None
    assert again[0].dead_lettered_at > before.dead_lettered_at
    assert letters.failed_task in await _letters_in(settings)


async def test_a_letter_whose_queue_is_gone_stays_a_dead_letter(
    settings: Settings, amqp_channel: AbstractChannel
) -> None:
    names = Names(settings.queue_prefix)
    await declare(amqp_channel, names, [])
    dlx = await amqp_channel.get_exchange(names.dead_letter_exchange)
    for message_id, queue in (("orphan", "no-such-agent"), ("kept", "still-here")):
        await dlx.publish(
            aio_pika.Message(
                b'{"task_id": "t"}',
                message_id=message_id,
                headers={
                    "x-waystation-reason": "handler-failed",
                    "x-waystation-queue": settings.queue_prefix + queue,
                },
            ),
            routing_key="",
        )
    still_here = await amqp_channel.declare_queue(
        settings.queue_prefix + "still-here", exclusive=True
    )
    replayed = await replay(settings.amqp_url, names, reason="handler-failed")
    assert [letter.message_id for letter in replayed] == ["kept"]
    assert await _letters_in(settings) == ["orphan"]
    [back] = await take(still_here, 1)
    assert back.message_id == "kept"

    async with console(settings) as base, browser() as session:
        csrf = await sign_in(session, base, "ops")
        form = {"csrf": csrf, "message_id": "orphan", "confirmed": "yes"}
        async with session.post(f"{base}/dead-letters/replay", data=form) as response:
            page = await response.text()
    assert "Replayed 0 dead letters." in page
    assert "1 letter was not replayed" in page
    assert _rows(page) == ["orphan"]
    assert await _letters_in(settings) == ["orphan"]


async def test_a_replay_takes_only_the_letters_there_when_it_starts(
    settings: Settings, amqp_channel: AbstractChannel
) -> None:
    """A replayed letter that is dead-lettered again at once (here by the broker: its queue
    lets nothing live) is not replayed again, and again, in the same round."""
    names = Names(settings.queue_prefix)
    await declare(amqp_channel, names, [])
    boomerang = await amqp_channel.declare_queue(
        settings.queue_prefix + "boomerang",
        exclusive=True,
        arguments={"x-message-ttl": 0, "x-dead-letter-exchange": names.dead_letter_exchange},
    )
    await publish_raw(amqp_channel, boomerang.name, b"{}", message_id="boomerang")

    async def dead_again() -> bool:
        return await _letters_in(settings) == ["boomerang"]

    await eventually(dead_again, 10, "the broker to dead-letter it")
    replayed = await replay(settings.amqp_url, names, limit=20)
    assert [letter.message_id for letter in replayed] == ["boomerang"]
    await eventually(dead_again, 10, "the broker to dead-letter it again")


async def test_the_cli_replays_one_letter_by_its_message_id(
    settings: Settings, amqp_channel: AbstractChannel, extra_agents: list[str]
) -> None:
    names = Names(settings.queue_prefix)
    extra_agents.append("cli-agent")
    await declare(amqp_channel, names, ["cli-agent"])
    dlx = await amqp_channel.get_exchange(names.dead_letter_exchange)
    for message_id in ("first", "second"):
        await dlx.publish(
            aio_pika.Message(
                b"{}",
                message_id=message_id,
                headers={
                    "x-waystation-reason": "invalid-input",
                    "x-waystation-queue": names.tasks("cli-agent"),
                },
            ),
            routing_key="",
        )
    done = await asyncio.to_thread(
        run_cli, settings, "dead-letters", "replay", "--message-id", "second", "--json"
    )
    assert done.returncode == 0, done.stderr
    assert [letter["message_id"] for letter in orjson.loads(done.stdout)] == ["second"]
    assert await _letters_in(settings) == ["first"]


async def test_hostile_metadata_is_escaped_and_links_stay_in_the_console(
    settings: Settings, amqp_channel: AbstractChannel
) -> None:
    names = Names(settings.queue_prefix)
    await declare(amqp_channel, names, [])
    dlx = await amqp_channel.get_exchange(names.dead_letter_exchange)
    await dlx.publish(
        aio_pika.Message(
            SCRIPT.encode(),
            message_id=HOSTILE,
            correlation_id="javascript:alert(1)",
            headers={
                "x-waystation-reason": SCRIPT,
                "x-waystation-detail": HOSTILE,
                "x-waystation-queue": settings.queue_prefix + HOSTILE,
                "x-waystation-dead-lettered-at": HOSTILE,
            },
        ),
        routing_key="",
    )
    async with console(settings) as base, browser() as session:
        csrf = await sign_in(session, base, "ops")
        page = await _get(session, f"{base}/dead-letters")
        confirm = await _get(session, f"{base}/dead-letters/confirm?reason={SCRIPT}")
        async with session.post(
            f"{base}/dead-letters/replay",
            data={"csrf": csrf, "reason": SCRIPT},
            allow_redirects=False,
        ) as response:
            assert response.status == 303
            assert response.headers["Location"].startswith("/dead-letters/confirm?reason=%3C")
    for shown in (page, confirm):
        assert "<img" not in shown and "<script>alert" not in shown
        assert "javascript:" not in shown.replace(">javascript:alert(1)<", "")
        assert 'href="/tasks/javascript%3Aalert%281%29"' in shown
    assert _rows(page) == [_escaped(HOSTILE)]
    assert f'name="reason" value="{_escaped(SCRIPT)}"' in page
    assert "Replay 1 letter</button>" in confirm
