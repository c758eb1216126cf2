"""The console's page of a task (issue 32, page 3) on real workers, PostgreSQL and RabbitMQ: its
timeline and state after each event, its call tree linked both ways, its result, its hash chain
verified (and marked broken once tampered with), its export (the CLI's lines), cancel from the
page, and hostile task ids, agent names, inputs, results and signal payloads shown escaped.

The console is served in this process (``console_support``) and requested as a browser would.
"""

from __future__ import annotations

import re
import time
from html.parser import HTMLParser
from typing import Any
from urllib.parse import quote

import pytest
from markupsafe import escape
from yarl import URL

from tests.apps import signals as signal_app
from waystation.agent import App, TaskContext
from waystation.client import Client
from waystation.events import (
    Call,
    Complete,
    EventMetadata,
    NewEvent,
    Outcome,
    Pause,
    TaskStarted,
    decide_outcome,
    decide_reply,
    event_id,
    fold,
)
from waystation.events.chain import recorded_events
from waystation.events.codec import GENESIS_HASH
from waystation.events.postgres import PostgresEventStore
from waystation.settings import Settings

from ..support import eventually, running_worker, stream_types
from .console_support import browser, console, sign_in
from .test_audit_cli import cli, run_tasks, tamper

pytestmark = pytest.mark.integration

HOSTILE = '"><img src=x onerror=alert(1)><script>alert("in")</script> javascript:alert(1)'
HOSTILE_ID = "<script>alert('id')</script>\"/javascript:alert(1)"
HOSTILE_AGENT = "mid<script>alert('agent')</script>\"javascript:"
"""A task id, an agent name and a value no page may let run. No queue can have such an agent's
name (AMQP allows letters, digits and ``-_.:``), but the log is read as it is."""
TREE_AGENTS = ("ct-boss", "ct-middle", "ct-leaf")


def tree_app() -> App:
    """``ct-boss`` calls ``ct-middle``, which calls ``ct-leaf``: a call tree of three, the
    leaf never logged (it completes without pausing)."""
    app = App()

    @app.agent("ct-boss")
    async def boss(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("ct-middle", {"note": task.input["note"]})], update={"asked": 1})
        return Complete({"echo": task.input["note"], "middle": task.results[0].value})

    @app.agent("ct-middle")
    async def middle(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Call("ct-leaf", {"note": task.input["note"]})])
        return Complete({"leaf": task.results[0].value})

    @app.agent("ct-leaf")
    async def leaf(task: TaskContext) -> Outcome:
        return Complete({"answer": 42, "note": task.input["note"]})

    return app


class _Markup(HTMLParser):
    """What a page's markup carries where a browser would run or follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.handlers: list[str] = []
        self.scripts: list[dict[str, str | None]] = []
        self.events: list[str | None] = []
        self.classes: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        self.urls += [v or "" for k, v in attrs if k in ("href", "src", "action", "formaction")]
        self.handlers += [k for k, _ in attrs if k.startswith("on")]
        if tag in ("script", "img", "iframe", "object", "embed"):
            self.scripts.append(attributes)
        if tag == "tr" and "data-event" in attributes:
            self.events.append(attributes["data-event"])
        self.classes += (attributes.get("class") or "").split()


def markup(page: str) -> _Markup:
    parsed = _Markup()
    parsed.feed(page)
    return parsed


def assert_inert(page: str) -> None:
    """Nothing hostile runs: no raw markup of it, no handler attribute, no script but the
    console's own, every link and form to this console."""
    for raw in ("<script>alert", "<img"):
        assert raw not in page, f"{raw!r} unescaped in the page"
    assert page.count("<script") == 1, "the console's own script only"
    parsed = markup(page)
    assert parsed.handlers == []
    assert parsed.scripts == [{"src": "/static/console.js", "defer": None}]
    for url in parsed.urls:
        assert url.startswith(("/", "?")) and not url.startswith("//"), url


def url_of(task_id: str) -> str:
    return "/tasks/" + quote(task_id, safe="")


def same_url(location: str, expected: str) -> bool:
    """Whether a redirect's ``Location`` is ``expected`` (aiohttp writes it requoted: a ``(``
    stays as it is in a path, where ``quote`` escapes it)."""
    return URL(location) == URL(expected)


async def get(session: Any, url: str) -> tuple[int, str]:
    async with session.get(url, allow_redirects=False) as response:
        return response.status, await response.text()


@pytest.fixture(autouse=True)
def test_agents(extra_agents: list[str]) -> None:
    extra_agents.extend([*TREE_AGENTS, *signal_app.AGENTS])


@pytest.mark.timeout(180)
async def test_the_page_of_a_call_tree_with_a_hostile_id_input_and_result(
    settings: Settings, store: PostgresEventStore
) -> None:
    async with (
        running_worker(tree_app(), settings, store),
        Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        boss_id = await client.submit("ct-boss", {"note": HOSTILE}, task_id=HOSTILE_ID)
        result = await client.result(boss_id, timeout=60)
    assert result.ok, result
    middle_id, leaf_id = f"{boss_id}:1:0", f"{boss_id}:1:0:1:0"
    boss_events = await store.read_stream(boss_id)
    assert [e.event_type for e in boss_events][-1] == "TaskCompleted"

    async with console(settings) as base, browser() as session:
        async with session.get(
            f"{base}/tasks", params={"id": f"  {HOSTILE_ID} "}, allow_redirects=False
        ) as found:
            assert found.status == 303
            assert same_url(found.headers["Location"], url_of(HOSTILE_ID))

        status, page = await get(session, base + url_of(boss_id))
        assert status == 200, page
        assert_inert(page)
        parsed = markup(page)
        assert parsed.events == [e.event_type for e in boss_events]
        assert f"hash chain verified ({len(boss_events)} events)" in page
        assert "mark-ok" in parsed.classes and "mark-bad" not in parsed.classes
        # the result and the input, escaped
        assert "&lt;img src=x onerror=alert(1)&gt;&lt;script&gt;alert(" in page
        # who wrote each event, and how long its pause waited
        assert f"worker</span> {settings.worker_id}" in page
        assert re.search(r'<td class="n">\d+\.\d{3} s</td>', page), "the pause's wait"
        # the root links down to its child, which the log has, and says what came of it
        assert f'href="{url_of(middle_id)}"' in page
        assert "This task is the root of its call tree." in page
        children = page.split('<table class="children">')[1].split("</table>")[0]
        assert "<td>ok</td>" in children and "<td>completed</td>" in children
        # every state after each event, whole for a short stream; the last one completed
        assert page.count("<details") == len(boss_events)
        assert "&#34;status&#34;: &#34;completed&#34;" in page
        # a finished task offers nothing to do, signed in or not
        assert "nothing left to cancel" in page and "Sign in to act" not in page
        assert 'action="' not in page.split("<main>")[1]

        status, page = await get(session, base + url_of(middle_id))
        assert status == 200, page
        assert_inert(page)
        # the child links up to its parent, the root
        ancestry = page.split('<p class="ancestry">')[1].split("</p>")[0]
        assert f'href="{url_of(boss_id)}"' in ancestry and "root, parent, ct-boss" in ancestry
        children = page.split('<table class="children">')[1].split("</table>")[0]
        assert str(escape(leaf_id)) in children
        assert "no stream (never paused" in children, "the leaf completed without the log"
        assert f'href="{url_of(leaf_id)}"' not in children

        # the export: the CLI's lines, as a download named safely
        async with session.get(base + url_of(boss_id) + "/export") as response:
            assert response.status == 200
            assert response.content_type == "application/x-ndjson"
            disposition = response.headers["Content-Disposition"]
            exported = await response.read()
        assert re.fullmatch(r'attachment; filename="[A-Za-z0-9._-]+\.jsonl"', disposition)
        code, out, err = await cli(settings, "export", "--task", boss_id)
        assert code == 0, err
        assert exported == out.encode()
        assert len(exported.splitlines()) == len(boss_events)


@pytest.mark.timeout(180)
async def test_cancel_from_the_page_and_a_hostile_signal(
    settings: Settings, store: PostgresEventStore
) -> None:
    async with (
        running_worker(signal_app.app, settings, store),
        Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
        console(settings) as base,
        browser() as session,
    ):
        answered = await client.submit("approver", {})
        doomed = await client.submit("approver", {"why": HOSTILE})

        async def paused() -> bool:
            states = [fold(t, await store.read_stream(t)).status for t in (answered, doomed)]
            return states == ["paused", "paused"]

        await eventually(paused, 30, "both tasks to pause on their approval")
        status = await client.signal(
            answered, "approval", {"approved": True, "note": HOSTILE}, agent="approver"
        )
        assert status == "taken"
        assert (await client.result(answered, timeout=60)).ok

        status, page = await get(session, base + url_of(answered))
        assert status == 200, page
        assert_inert(page)
        shown = markup(page).events
        assert shown == [e.event_type for e in await store.read_stream(answered)]
        assert "SignalReceived" in shown and shown[-1] == "TaskCompleted"
        # the signal's payload in its summary and in the state after it, escaped
        assert "signal approval (" in page and "&#34;&gt;&lt;img src=x" in page
        assert "&lt;img src=x onerror=alert(1)&gt;&lt;script&gt;" in page

        # signed out: the page offers a sign-in, not the form, and a POST is refused
        status, page = await get(session, base + url_of(doomed))
        assert status == 200, page
        assert_inert(page)
        assert "Sign in to act" in page and "cancel-form" not in page
        assert "<strong>approval</strong>" in page, "the open signal wait is listed"
        async with session.post(
            base + url_of(doomed) + "/cancel", data={"reason": "no"}, allow_redirects=False
        ) as response:
            assert response.status == 403
        # signed in, but a form without its CSRF token is refused too
        csrf = await sign_in(session, base, "bob")
        async with session.post(
            base + url_of(doomed) + "/cancel", data={"reason": "no"}, allow_redirects=False
        ) as response:
            assert response.status == 403
        assert "TaskCancelled" not in await stream_types(store, doomed)

        # cancelling a finished task says so, and changes nothing
        before = await stream_types(store, answered)
        async with session.post(
            base + url_of(answered) + "/cancel",
            data={"csrf": csrf, "reason": "late"},
            allow_redirects=False,
        ) as response:
            assert response.status == 303
            assert response.headers["Location"] == url_of(answered) + "?done=already-completed"
        status, page = await get(session, base + url_of(answered) + "?done=already-completed")
        assert "Not cancelled: the task had already completed." in page
        assert "nothing left to cancel" in page
        assert await stream_types(store, answered) == before

        status, page = await get(session, base + url_of(doomed))
        assert 'class="stacked cancel-form"' in page and "Sign in to act" not in page
        async with session.post(
            base + url_of(doomed) + "/cancel",
            data={"csrf": csrf, "reason": HOSTILE},
            allow_redirects=False,
        ) as response:
            assert response.status == 303
            assert response.headers["Location"] == url_of(doomed) + "?done=cancelled"
        events = await store.read_stream(doomed)
        assert events[-1].event_type == "TaskCancelled"
        assert events[-1].data["reason"] == HOSTILE
        assert events[-1].metadata["actor"] == "console:bob", "who cancelled, in the log"
        assert (await client.result(doomed, timeout=60)).status == "cancelled"

        status, page = await get(session, base + url_of(doomed) + "?done=cancelled")
        assert status == 200, page
        assert_inert(page)
        assert "Cancelled. Every call it still waited for is cancelled too." in page
        assert "Cancelled: <q>&#34;&gt;&lt;img src=x" in page
        assert "<strong>approval</strong>" not in page, "no wait is open any more"
        assert markup(page).events[-1] == "TaskCancelled"


async def test_a_task_not_in_the_log_is_a_404(settings: Settings) -> None:
    async with console(settings) as base, browser() as session:
        for url in (url_of("no-such-task"), url_of("no-such-task") + "/export"):
            status, page = await get(session, base + url)
            assert status == 404, url
            assert "No such task" in page
        csrf = await sign_in(session, base, "carol")
        async with session.post(
            base + url_of("no-such-task") + "/cancel", data={"csrf": csrf}, allow_redirects=False
        ) as response:
            assert response.status == 404
        status, page = await get(session, f"{base}/tasks?id=")
        assert status == 400 and "Give a task id." in page


async def test_a_tampered_chain_is_marked_broken(
    own_log: tuple[Settings, PostgresEventStore],
) -> None:
    settings, store = own_log
    tampered, untouched = await run_tasks(settings, store, 3, 4)
    await tamper(store, tampered, version=6)
    async with console(settings) as base, browser() as session:
        status, page = await get(session, base + url_of(tampered))
        assert status == 200, page
        parsed = markup(page)
        assert "mark-bad" in parsed.classes and "mark-ok" not in parsed.classes
        assert "verification found 1 problem" in page
        assert "v6 hash-mismatch:" in page
        assert len(parsed.events) == 10, "the rest of the page still shows"

        status, page = await get(session, base + url_of(untouched))
        assert "hash chain verified (10 events)" in page
        assert "mark-ok" in markup(page).classes


def generated_stream(
    task_id: str,
    size: int,
    *,
    calls: int = 10,
    agent: str = "bench",
    peer: str = "peer",
    root: str | None = None,
) -> list[NewEvent]:
    """A task of ``agent`` of at least ``size`` events, decided by the task's own rules: pauses
    of ``calls`` calls to ``peer``, each answered, until it completes. ``root``: the root task
    of its call tree (itself by default)."""
    made: list[NewEvent] = []
    state = fold(task_id, [])
    now = time.time()

    def add(events: list[Any], step: str) -> None:
        nonlocal state
        metadata = EventMetadata(
            worker_id="bench-1", causation_id=step, correlation_id=root or task_id
        )
        new = [NewEvent.of(event_id(task_id, step, i), e, metadata) for i, e in enumerate(events)]
        recorded = recorded_events(task_id, state.version, new, state.last_hash)
        state = fold(task_id, recorded, start=state)
        made.extend(new)

    start = TaskStarted(agent=agent, input={"size": size})
    while len(made) < size - 1:
        pause = Pause(
            [Call(peer, {"i": i, "pause": state.pause}) for i in range(calls)],
            update={"round": state.pause + 1, f"seen-{state.pause}": list(range(20))},
        )
        outcome = decide_outcome(
            state, pause, now=now, default_timeout=300, start=start if not made else None
        )
        add(outcome, f"pause-{state.pause}")
        for call in state.calls:
            reply = decide_reply(
                state, call.subtask_id, outcome="ok", value={"answer": 1}, message_id="m"
            )
            add(reply, f"reply-{call.subtask_id}")
    add(decide_outcome(state, Complete({"done": True}), now=now, default_timeout=300), "end")
    return made


async def test_agent_names_and_ids_from_the_log_are_escaped(
    own_log: tuple[Settings, PostgresEventStore],
) -> None:
    """No queue can bear a hostile agent name, but the log holds whatever was appended: a task
    of such an agent, calling such a peer, child of a hostile root, shows it all escaped."""
    settings, store = own_log
    task_id = f"{HOSTILE_ID}:1:0"
    events = generated_stream(
        task_id, 20, calls=2, agent=HOSTILE_AGENT, peer=HOSTILE_AGENT, root=HOSTILE_ID
    )
    await store.append(task_id, 0, events, prev_hash=GENESIS_HASH)
    async with console(settings) as base, browser() as session:
        status, page = await get(session, base + url_of(task_id))
    assert status == 200, page
    assert_inert(page)
    agent = str(escape(HOSTILE_AGENT))
    assert f"agent <strong>{agent}</strong>" in page
    children = page.split('<table class="children">')[1].split("</table>")[0]
    rows = children.count("<tr>") - 1  # but the header's
    assert rows > 2 and children.count(f"<td>{agent}</td>") == rows
    ancestry = page.split('<p class="ancestry">')[1].split("</p>")[0]
    assert f"<span>{escape(HOSTILE_ID)}</span>" in ancestry and "not in the log" in ancestry
    assert f"started {agent} with input" in page


@pytest.mark.timeout(180)
async def test_a_task_of_a_thousand_events_renders_in_time(
    own_log: tuple[Settings, PostgresEventStore],
) -> None:
    """The issue's bench: a task page of 1,000 events in under 300 ms of server time. Here,
    beside other tests on a small machine, the bound is looser; a page that folded the stream
    again for every event's state would take seconds."""
    settings, store = own_log
    task_id = "bench-task"
    events = generated_stream(task_id, 1000)
    await store.append(task_id, 0, events, prev_hash=GENESIS_HASH)
    count = len(events)
    assert count >= 1000
    async with console(settings) as base, browser() as session:
        timings = []
        for _ in range(3):
            async with session.get(base + url_of(task_id)) as response:
                page = await response.text()
                assert response.status == 200, page
                timing = response.headers["Server-Timing"]
            timings.append(float(timing.removeprefix("app;dur=")))
        print(f"task page of {count} events: server time {timings} ms, {len(page)} bytes")
        assert min(timings) < 1500, timings
        parsed = markup(page)
        assert len(parsed.events) == count
        assert f"hash chain verified ({count} events)" in page
        # a long stream: a line per state, the last whole, any other on demand
        assert page.count("<details") == count
        assert page.count("<pre>") == 1
        assert page.count("?state_at=") == count - 1
        async with session.get(base + url_of(task_id), params={"state_at": "500"}) as response:
            chosen = await response.text()
        assert chosen.count("<pre>") == 2
        assert re.search(r'<tr id="v500"[^>]*>.*?<details open>', chosen, re.S)
