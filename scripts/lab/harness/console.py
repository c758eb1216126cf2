"""The console's scene: real workers, the projections and a console over the real services,
with the tasks a person finds there; and Debian's Chromium to look at it.

Shared by the browser tests (``tests/browser``) and ``scripts/console-screenshots``, so the
screenshots in the docs show what the tests check. The scene's agents:

* ``orchestrator`` calls ``researcher`` once per topic and, when its input says ``review``, a
  ``reviewer`` too; it completes with what they answered. One with a review stays paused on
  that peer call until someone approves it.
* ``reviewer`` waits for a typed ``approval`` signal (the console's signal form shows its
  schema) and completes with it and who sent it.
* ``quote`` takes a typed input: an invalid one is dead-lettered before the handler runs,
  which is how the scene gets a dead letter.

Chromium runs headless from Debian's package (``apt-get install chromium``), never a browser
Playwright downloads; its background connections are turned off, since nothing here may leave
127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from waystation import App, Call, Complete, Outcome, Pause, Signal, TaskContext
from waystation.client import Client
from waystation.events import fold
from waystation.events.postgres import PostgresEventStore
from waystation.settings import Settings

from .broker import delete_topology, fresh_prefix

__all__ = [
    "AGENTS",
    "CHROMIUM",
    "CHROMIUM_ARGS",
    "Approval",
    "Scene",
    "chromium_missing",
    "running_scene",
    "scene_app",
    "scene_settings",
    "wait_for",
]

CHROMIUM = Path("/usr/bin/chromium")
"""Debian's Chromium (``apt-get install chromium``)."""

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
"""Headless, and none of Chromium's own connections (updates, sync, safe browsing): a closed
network refuses them, and a test of a console that works offline must not need them."""

AGENTS = ("orchestrator", "researcher", "reviewer", "quote")
"""The scene's agents, whose queues are deleted afterwards."""


def chromium_missing() -> str | None:
    """Why the browser cannot run here, or None."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    try:
        import playwright.async_api  # noqa: F401
    except ImportError as error:
        return f"Playwright for Python is missing ({error}): scripts/bootstrap test installs it"
    return None


class Approval(BaseModel):
    approved: bool
    note: str = ""


class QuoteRequest(BaseModel):
    item: str
    quantity: int


def scene_app() -> App:
    """A new app of the scene's agents (a test may add its own to it before it runs)."""
    app = App(version="console-scene")

    @app.agent("orchestrator")
    async def orchestrator(task: TaskContext) -> Outcome:
        topics = task.input.get("topics", [])
        if not task.resumed:
            calls = [Call("researcher", {"topic": topic}) for topic in topics]
            if task.input.get("review"):
                # as long as the reviewer waits for its approval
                calls.append(Call("reviewer", {"topics": topics}, timeout=3600))
            return Pause(calls, update={"asked": len(calls)})
        return Complete(
            {"topics": topics, "answers": [r.value if r.ok else r.outcome for r in task.results]}
        )

    @app.agent("researcher")
    async def researcher(task: TaskContext) -> Outcome:
        return Complete({"finding": f"notes on {task.input['topic']}"})

    @app.agent("reviewer", signals={"approval": Approval})
    async def reviewer(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Signal("approval", timeout=3600)])
        answer = task.results[0]
        return Complete({"approval": answer.value, "by": answer.sender})

    @app.agent("quote", input=QuoteRequest)
    async def quote(task: TaskContext) -> Outcome:
        return Complete({"price": 12 * task.input.quantity})

    return app


def scene_settings(database_url: str, amqp_url: str) -> Settings:
    """Settings of a scene on these services, under a queue prefix of its own: a short outbox
    delay, and no broker policy (nothing a scene leaves behind)."""
    return Settings(
        database_url=database_url,
        amqp_url=amqp_url,
        queue_prefix=fresh_prefix(),
        broker_policy="none",
        outbox_delay=0.5,
        outbox_poll_interval=0.2,
        concurrency=16,
        shutdown_grace=5.0,
    )


async def wait_for(
    predicate: Callable[[], Awaitable[bool]], within: float, what: str, interval: float = 0.1
) -> None:
    """Wait until ``predicate()`` is true; raise naming ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(interval)


@dataclass
class Scene:
    """A running scene: its console's address, a client and the log."""

    base_url: str
    settings: Settings
    store: PostgresEventStore
    client: Client
    token: str
    created: dict[str, str] = field(default_factory=dict)
    """Task ids of :meth:`populate`, by role."""

    async def status(self, task_id: str) -> str:
        return fold(task_id, await self.store.read_stream(task_id)).status

    async def until_status(self, task_id: str, status: str, within: float = 30) -> None:
        async def reached() -> bool:
            return await self.status(task_id) == status

        await wait_for(reached, within, f"task {task_id} to be {status}")

    async def until_projected(self, task_ids: Sequence[str], within: float = 30) -> None:
        """Wait until the paused-tasks projection shows these (paused) tasks: what the console's
        lists of paused tasks and approvals read."""
        from waystation.projections.postgres import paused_tasks

        engine = self.store.engine

        async def shown() -> bool:
            rows = await paused_tasks(engine, limit=10_000)
            return set(task_ids) <= {row["task_id"] for row in rows}

        await wait_for(shown, within, f"the paused-tasks projection to show {list(task_ids)}")

    async def dead_letters(self) -> int:
        from waystation.brokers.amqp.deadletters import count
        from waystation.protocol.wire import Names

        return await count(self.settings.amqp_url, Names(self.settings.queue_prefix))

    async def populate(self) -> dict[str, str]:
        """What a person finds in a console: a completed task, a task paused on a peer call
        (whose peer waits for an approval), an approval waiting, and a dead letter."""
        client = self.client
        done = await client.submit("orchestrator", {"topics": ["tides", "harbours"]})
        also_done = await client.submit("orchestrator", {"topics": ["fuel"]})
        waiting = await client.submit("orchestrator", {"topics": ["cargo"], "review": True})
        approval = await client.submit("reviewer", {"release": "2.4.0"})
        dead_before = await self.dead_letters()
        await client.submit("quote", {"item": "crate", "quantity": "many"})
        for task_id in (done, also_done):
            await self.until_status(task_id, "completed")
        for task_id in (waiting, approval):
            await self.until_status(task_id, "paused")

        async def dead_lettered() -> bool:
            return await self.dead_letters() > dead_before

        await wait_for(dead_lettered, 30, "the invalid quote to be dead-lettered")
        self.created.update(completed=done, paused_on_call=waiting, approval=approval)
        await self.until_projected([waiting, approval])
        return self.created


@contextlib.asynccontextmanager
async def running_scene(
    settings: Settings,
    *,
    app: App | None = None,
    agents: Sequence[str] = AGENTS,
    token: str = "scene-token",
) -> AsyncIterator[Scene]:
    """Workers of ``app`` (the scene's by default) in this process, the projections' runner,
    and a console with ``token`` on 127.0.0.1 at a free port; the database must be migrated.
    The queues of ``agents`` are deleted at the end."""
    from aiohttp import web

    from waystation.console.app import make_app
    from waystation.projections.postgres import PROJECTIONS, ProjectionRunner, create_engine
    from waystation.runtime.compose import production_worker

    store = PostgresEventStore.from_url(settings.database_url, pool_size=5)
    engine = create_engine(settings.database_url, pool_size=len(PROJECTIONS) + 2)
    stop = asyncio.Event()
    projections = asyncio.create_task(
        ProjectionRunner(engine, poll_interval=0.2, standby_interval=0.2).run(stop)
    )
    worker = production_worker(app or scene_app(), settings, store)
    runner = web.AppRunner(make_app(settings, token=token), access_log=None)
    try:
        await worker.start()
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
            yield Scene(f"http://127.0.0.1:{port}", settings, store, client, token)
    finally:
        await runner.cleanup()
        await worker.stop()
        stop.set()
        await projections
        await engine.dispose()
        await store.close()
        await delete_topology(settings.amqp_url, settings.queue_prefix, agents)
