"""The console's approvals and its signal form (issue 32) on RabbitMQ and PostgreSQL: a task of
``tests.apps.approvals`` pauses for a typed ``decision``; /approvals lists it with its input
(from the paused-tasks projection, kept by a runner as ``waystation projections run`` keeps it);
a signed-in person's form resumes it once, typed as the agent's model reads it; a value that is
not one, or one the worker refuses, is shown again with the problem and applies nothing; a form
sent twice is one signal; no form is taken without a session and its CSRF token.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import markupsafe
import pytest

from tests.apps import approvals as approval_app
from waystation.client import Client
from waystation.console.forms import signal_id_of
from waystation.console.pages import approvals as approvals_page
from waystation.events import fold
from waystation.events.codec import dumps
from waystation.events.model import RecordedEvent
from waystation.events.postgres import PostgresEventStore
from waystation.projections.postgres import PROJECTIONS, ProjectionRunner, create_engine
from waystation.settings import Settings

from ..support import eventually, running_worker
from .console_support import browser, console, sign_in

pytestmark = pytest.mark.integration

HOSTILE = '"><script>alert("x")</script><img src=x onerror=alert(1)>'


@pytest.fixture(autouse=True)
def approval_agents(extra_agents: list[str]) -> None:
    """The queues of the app's agents are deleted after each test."""
    extra_agents.extend(approval_app.AGENTS)


@contextlib.asynccontextmanager
async def pool(settings: Settings, store: PostgresEventStore) -> AsyncIterator[Client]:
    """A worker of ``tests.apps.approvals``, the paused-tasks projection kept up to date beside
    it, and a publisher's client."""
    engine = create_engine(settings.database_url)
    runner = ProjectionRunner(engine, [PROJECTIONS["paused_tasks"]], poll_interval=0.2)
    stop = asyncio.Event()
    keeping = asyncio.create_task(runner.run(stop))
    try:
        async with (
            running_worker(approval_app.app, settings, store),
            Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
        ):
            yield client
    finally:
        stop.set()
        await keeping
        await engine.dispose()


async def waiting_claim(
    client: Client, store: PostgresEventStore, claim: Any, agent: str = "expenses"
) -> str:
    """A new task of ``agent`` (``expenses``) for ``claim``, once the log shows it waiting."""
    task_id = await client.submit(agent, claim)

    async def has_paused() -> bool:
        return fold(task_id, await store.read_stream(task_id)).status == "paused"

    await eventually(has_paused, 30, f"task {task_id} to pause")
    return task_id


async def page(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as response:
        text = await response.text()
        assert response.status == 200, text
        return text


def article(text: str, task_id: str) -> str:
    """The approval of ``task_id`` on a page ("" when the page has none)."""
    found = re.search(
        rf'<article class="approval" data-task-id="{re.escape(task_id)}">.*?</article>',
        text,
        re.S,
    )
    return found.group(0) if found else ""


async def listed(
    session: aiohttp.ClientSession, base_url: str, task_id: str, query: str = "?agent=expenses"
) -> str:
    """The approval of ``task_id`` once /approvals (with ``query``) lists it (the projection
    has applied its pause)."""
    shown = ""

    async def is_listed() -> bool:
        nonlocal shown
        shown = article(await page(session, f"{base_url}/approvals{query}"), task_id)
        return bool(shown)

    await eventually(is_listed, 30, f"/approvals to list {task_id}", interval=0.2)
    return shown


@dataclass
class Answering:
    """A task waiting for its decision, /approvals listing it, and a person signed in."""

    client: Client
    base_url: str
    web: aiohttp.ClientSession
    task_id: str
    csrf: str
    form: str
    """The task's approval on /approvals, with its form."""

    def answer(self, **fields: str) -> dict[str, str]:
        """The form's POST with ``fields`` (``amount="3"`` for ``field.amount``)."""
        posted = {f"field.{name}": value for name, value in fields.items()}
        return {"csrf": self.csrf, "wait": "decision", "nonce": hidden(self.form, "nonce")} | posted


@contextlib.asynccontextmanager
async def answering(
    settings: Settings, store: PostgresEventStore, claim: Any
) -> AsyncIterator[Answering]:
    async with pool(settings, store) as client, console(settings) as base_url, browser() as web:
        task_id = await waiting_claim(client, store, claim)
        csrf = await sign_in(web, base_url, "ann")
        form = await listed(web, base_url, task_id)
        yield Answering(client, base_url, web, task_id, csrf, form)


def hidden(form: str, name: str) -> str:
    found = re.search(rf'<input type="hidden" name="{name}" value="([^"]*)">', form)
    assert found is not None, f"no hidden {name} in\n{form}"
    return html.unescape(found.group(1))


async def post(
    session: aiohttp.ClientSession, base_url: str, task_id: str, form: dict[str, str]
) -> tuple[int, str, str]:
    """POST the signal form; its status, the Location it answered with, and the page."""
    async with session.post(
        f"{base_url}/tasks/{task_id}/signal", data=form, allow_redirects=False
    ) as response:
        return response.status, response.headers.get("Location", ""), await response.text()


def of_type(events: list[RecordedEvent], event_type: str) -> list[RecordedEvent]:
    return [e for e in events if e.event_type == event_type]


async def signal_events(store: PostgresEventStore, task_id: str) -> list[str]:
    return [
        e.event_type
        for e in await store.read_stream(task_id)
        if e.event_type in ("SignalReceived", "SignalRefused", "TaskResumed")
    ]


@pytest.mark.timeout(180)
async def test_an_approval_listed_with_its_input_and_answered_by_its_form_resumes_the_task_once(
    settings: Settings, store: PostgresEventStore
) -> None:
    claim = {"claimant": HOSTILE, "amount": 120}
    async with pool(settings, store) as client, console(settings) as base_url, browser() as web:
        task_id = await waiting_claim(client, store, claim)
        shown = await listed(web, base_url, task_id)
        assert "<script>" not in shown and "&lt;script&gt;" in shown, "the input, escaped"
        assert "claimant" in shown and "120" in shown
        assert "Agent <strong>expenses</strong>, paused since " in shown
        assert re.search(r"Answer by \S+ \S+ UTC\s+\(in (59|60)\.\dm\)", shown), "in an hour"
        state = re.search(r"<h3>State at its pause</h3><pre>(.*?)</pre>", shown, re.S)
        assert state is not None and "&#34;claim&#34;" in state.group(1), "the checkpoint state"
        assert "Asks for <code>decision</code>: Decision" in shown
        assert "A manager&#39;s answer to an expense claim." in shown, "the schema's description"
        assert "what to pay, in euros" in shown, "the fields' descriptions, signed out too"
        assert "Sign in to act" in shown and "<form" not in shown
        for query in ("?signal=decision", "?signal=decision&agent=expenses"):
            assert article(await page(web, f"{base_url}/approvals{query}"), task_id)
        for query in ("?signal=other", "?agent=twice"):
            assert not article(await page(web, f"{base_url}/approvals{query}"), task_id)

        csrf = await sign_in(web, base_url, "ann")
        form = await listed(web, base_url, task_id)
        assert 'class="signal-form stacked"' in form and 'data-signal="decision"' in form
        assert ">Send decision</button>" in form
        nonce = hidden(form, "nonce")
        assert hidden(form, "csrf") == csrf and hidden(form, "wait") == "decision"
        answer = {
            "csrf": csrf,
            "wait": "decision",
            "nonce": nonce,
            "field.verdict": "approve",
            "field.amount": "120",
            "field.note": HOSTILE,
            "field.tags": '["travel", "q4"]',
        }
        status, location, _ = await post(web, base_url, task_id, answer)
        assert (status, location) == (303, f"/tasks/{task_id}?done=signal-taken")

        result = await client.result(task_id, timeout=60)
        typed = {"verdict": "approve", "amount": 120, "note": HOSTILE, "tags": ["travel", "q4"]}
        assert result.ok and result.result["decision"] == typed, result
        assert result.result["claim"] == claim
        events = await store.read_stream(task_id)
        [received] = of_type(events, "SignalReceived")
        assert received.data["payload"] == typed, "typed: the amount a number, the tags a list"
        assert received.data["signal_id"] == signal_id_of(task_id, "decision", nonce)
        assert received.metadata["actor"] == "console:ann", "who answered, in the log"

        again, location, _ = await post(web, base_url, task_id, answer)  # resent: the same one
        assert (again, location) == (303, f"/tasks/{task_id}?done=signal-duplicate")
        assert await signal_events(store, task_id) == ["SignalReceived", "TaskResumed"]

        async def unlisted() -> bool:
            return not article(await page(web, f"{base_url}/approvals"), task_id)

        await eventually(unlisted, 30, f"/approvals to drop {task_id}", interval=0.2)


@pytest.mark.timeout(180)
async def test_a_form_sent_twice_at_once_is_one_signal(
    settings: Settings, store: PostgresEventStore
) -> None:
    async with answering(settings, store, {"amount": 5}) as it:
        answer = it.answer(verdict="reject", amount="0")
        sent = await asyncio.gather(*(post(it.web, it.base_url, it.task_id, answer) for _ in "12"))
        assert sorted(location.rsplit("-", 1)[-1] for _, location, _ in sent) == [
            "duplicate",
            "taken",
        ], sent
        result = await it.client.result(it.task_id, timeout=60)
        assert result.result["decision"] == {
            "verdict": "reject",
            "amount": 0,
            "note": "",
            "tags": [],
        }
        assert await signal_events(store, it.task_id) == ["SignalReceived", "TaskResumed"]


@pytest.mark.timeout(180)
async def test_a_value_that_is_not_one_or_that_the_worker_refuses_is_shown_with_the_form(
    settings: Settings, store: PostgresEventStore
) -> None:
    async with answering(settings, store, {"amount": 70}) as it:
        task_id = it.task_id
        wrong = it.answer(verdict="approve", amount="seventy", note=HOSTILE)
        status, _, shown = await post(it.web, it.base_url, task_id, wrong)
        assert status == 422, shown
        assert "Not sent: amount: &#39;seventy&#39; is not a whole number." in shown
        assert "<script>" not in shown and markupsafe.escape(HOSTILE) in shown
        again = article(shown, task_id)
        assert 'name="field.amount" value="seventy"' in again, "the values, to mend"
        assert '<option value="approve" selected>' in again
        assert await signal_events(store, task_id) == [], "nothing was sent"

        over = {**wrong, "nonce": hidden(again, "nonce"), "field.amount": "20000"}
        assert over["nonce"] != wrong["nonce"], "the form shown again is a rendering of its own"
        status, _, shown = await post(it.web, it.base_url, task_id, over)
        assert status == 422, shown
        refused = article(shown, task_id)
        assert "Refused: the payload is not a valid Decision: amount: " in refused
        assert "less than or equal to 10000; the wait goes on." in refused
        state = fold(task_id, await store.read_stream(task_id))
        assert state.status == "paused" and state.open_signal_wait("decision") is not None
        assert await signal_events(store, task_id) == ["SignalRefused"]

        mended = {**over, "nonce": hidden(refused, "nonce"), "field.amount": "70"}
        status, location, shown = await post(it.web, it.base_url, task_id, mended)
        assert (status, location) == (303, f"/tasks/{task_id}?done=signal-taken"), shown
        result = await it.client.result(task_id, timeout=60)
        assert result.result["decision"]["amount"] == 70
        assert await signal_events(store, task_id) == [
            "SignalRefused",
            "SignalReceived",
            "TaskResumed",
        ]


@pytest.mark.timeout(180)
async def test_no_form_is_taken_without_a_session_and_its_csrf_token(
    settings: Settings, store: PostgresEventStore
) -> None:
    async with pool(settings, store) as client:
        task_id = await waiting_claim(client, store, {"amount": 1})
        answer = {"wait": "decision", "nonce": "n", "field.verdict": "approve", "field.amount": "1"}
        async with console(settings, token=None) as base_url, browser() as web:
            status, _, shown = await post(web, base_url, task_id, answer)
            assert status == 403 and "read-only" in shown
        async with console(settings) as base_url, browser() as web:
            status, _, shown = await post(web, base_url, task_id, {**answer, "csrf": "forged"})
            assert status == 403 and "Sign in to act" in shown, "signed out"
            csrf = await sign_in(web, base_url, "ann")
            for form in (answer, {**answer, "csrf": "forged"}, {**answer, "csrf": csrf[:-1]}):
                status, _, shown = await post(web, base_url, task_id, form)
                assert status == 403 and "reload it" in shown
            status, location, _ = await post(web, base_url, task_id, {**answer, "csrf": csrf})
            assert location.endswith("?done=signal-taken"), "the same form, with its token"
        assert await signal_events(store, task_id) == ["SignalReceived", "TaskResumed"]


@pytest.mark.timeout(180)
async def test_an_untyped_signal_is_asked_for_as_json_and_a_wait_gone_is_said(
    settings: Settings, store: PostgresEventStore
) -> None:
    async with pool(settings, store) as client, console(settings) as base_url, browser() as web:
        task_id = await waiting_claim(client, store, None, agent="memo")
        csrf = await sign_in(web, base_url, "ann")
        form = await listed(web, base_url, task_id, "?signal=comment")
        assert '<textarea name="payload"' in form and 'name="field.' not in form
        sent = {"csrf": csrf, "wait": "comment", "nonce": hidden(form, "nonce")}
        status, _, shown = await post(web, base_url, task_id, {**sent, "payload": "{oops"})
        assert status == 422 and "Not sent: payload: not JSON" in shown, shown
        assert await signal_events(store, task_id) == []

        comment = {"text": HOSTILE, "n": [1, 2.5, None]}
        again = {**sent, "nonce": hidden(article(shown, task_id), "nonce")}
        status, location, _ = await post(
            web, base_url, task_id, {**again, "payload": dumps(comment).decode()}
        )
        assert (status, location) == (303, f"/tasks/{task_id}?done=signal-taken")
        assert (await client.result(task_id, timeout=60)).result == comment

        status, _, shown = await post(web, base_url, task_id, {**again, "nonce": "another"})
        assert status == 409 and f"Task {task_id} is completed and waits for no" in shown
        status, _, shown = await post(web, base_url, "no-such-task", again)
        assert status == 404 and "The log has no task &#39;no-such-task&#39;" in shown


@pytest.mark.timeout(180)
async def test_the_approvals_say_when_more_wait_than_they_show(
    settings: Settings, store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(approvals_page, "LIMIT", 1)
    async with pool(settings, store) as client, console(settings) as base_url, browser() as web:
        first = await waiting_claim(client, store, {"amount": 1})
        second = await waiting_claim(client, store, {"amount": 2})
        await listed(web, base_url, first)
        shown = ""

        async def says_more() -> bool:
            nonlocal shown
            shown = await page(web, f"{base_url}/approvals?agent=expenses")
            return "Only the 1 oldest are shown: more tasks wait." in shown

        await eventually(says_more, 30, "/approvals to say more wait", interval=0.2)
        assert article(shown, first) and not article(shown, second), "the oldest pause first"
        assert article(await page(web, f"{base_url}/approvals?agent=memo"), first) == ""
