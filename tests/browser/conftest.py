"""Fixtures of the browser tests: Debian's Chromium driven by Playwright, and one scene for the
whole module (real workers, the projections' runner and a console on 127.0.0.1; see
``scripts.lab.harness.console``).

Chromium missing skips these tests locally, saying what to install, and fails them under CI
(``tests.support.require``): CI must run them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pytest
import pytest_asyncio

from scripts.lab.harness.console import (
    AGENTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    Approval,
    Scene,
    chromium_missing,
    running_scene,
    scene_app,
    scene_settings,
)
from scripts.lab.harness.database import fresh_database_url
from waystation import Complete, Outcome, Pause, Signal, TaskContext, migrations

from ..support import Capability, Services, require

HOSTILE_AGENT = "javascript:window.__pwned+1#@,"
"""An agent name that a link would run if a page made it the link's target. ``App.agent`` takes
any name without whitespace, but the AMQP client (pamqp) refuses a queue name outside
``[a-zA-Z0-9-_.:@#,/+ ]``, so a worker cannot serve an agent whose name holds markup (``<``,
``>``, quotes, ``=``): this is the most hostile agent name a log can hold."""


@pytest.fixture(scope="session", autouse=True)
def needs_chromium() -> None:
    """Before anything starts: no browser, no browser test (a skip naming what to install; a
    failure under CI)."""
    require(
        Capability("Debian's Chromium and Playwright", chromium_missing()),
        "the console's browser tests",
    )


@pytest_asyncio.fixture(scope="session")
async def browser() -> AsyncIterator[Any]:
    """Headless Chromium, one for the session (Playwright's own browsers are never used)."""
    from playwright.async_api import async_playwright, expect

    expect.set_options(timeout=20_000)  # a busy machine: wait for conditions, generously
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        yield chromium
        await chromium.close()


def browser_app() -> Any:
    """The scene's agents and one with a hostile name, which waits for an approval too."""
    app = scene_app()

    @app.agent(HOSTILE_AGENT, signals={"approval": Approval})
    async def hostile(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Signal("approval", timeout=3600)])
        return Complete({"approval": task.results[0].value, "input": task.input})

    return app


@pytest_asyncio.fixture(scope="module")
async def scene(services: Services) -> AsyncIterator[Scene]:
    """One pool of real workers, the projections and a console for the module, with the
    scene's tasks in it (a completed task, calls paused, an approval waiting, a dead letter).

    On a database of its own: the projections' runner then applies only the scene's events,
    not those of every test before it in the run's database."""
    database_url = fresh_database_url(services.admin_database_url)
    await migrations.upgrade(database_url)
    try:
        settings = scene_settings(database_url, services.amqp_url)
        async with running_scene(
            settings, app=browser_app(), agents=[*AGENTS, HOSTILE_AGENT], token="browser-token"
        ) as running:
            await running.populate()
            yield running
    finally:
        await migrations.drop_database(database_url)


@dataclass
class Watched:
    """A page whose problems are collected as they happen: console errors, uncaught errors,
    failed requests and error responses, requests to anywhere but the console, dialogs."""

    page: Any
    base_url: str
    errors: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    async def pwned(self) -> Any:
        """What a hostile payload would have set (``window.__pwned``), or None."""
        return await self.page.evaluate("window.__pwned === undefined ? null : window.__pwned")


async def watched_page(context: Any, base_url: str) -> Watched:
    """A new page of ``context`` with every problem recorded; requests to any host but
    127.0.0.1 are aborted (and recorded), so the console must work offline, without a CDN."""
    page = await context.new_page()
    watched = Watched(page, base_url)
    errors = watched.errors

    async def route(route: Any) -> None:
        url = route.request.url
        if urlsplit(url).hostname != "127.0.0.1":
            watched.outside.append(url)
            await route.abort()
        else:
            await route.continue_()

    async def dialog(dialog: Any) -> None:
        watched.dialogs.append(f"{dialog.type}: {dialog.message}")
        await dialog.dismiss()

    await page.route("**/*", route)
    page.on("dialog", dialog)
    page.on(
        "console",
        lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
    )
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on(
        "requestfailed",
        # a request the page's own navigation abandoned (the overview's refresh) is no failure
        lambda r: (
            errors.append(f"request failed: {r.url} ({r.failure})")
            if r.url.startswith(base_url) and r.failure != "net::ERR_ABORTED"
            else None
        ),
    )
    page.on(
        "response",
        lambda r: errors.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None,
    )
    return watched


@pytest_asyncio.fixture
async def context(browser: Any) -> AsyncIterator[Any]:
    """A fresh browser context (its own cookies), closed after the test."""
    made = await browser.new_context(viewport={"width": 1280, "height": 900})
    made.set_default_timeout(20_000)
    yield made
    await made.close()


async def sign_in(watched: Watched, token: str, name: str, next_path: str = "/") -> None:
    """Sign in through the console's own form, as a person does."""
    page = watched.page
    await page.goto(f"{watched.base_url}/sign-in?next={next_path}")
    await page.get_by_label("Your name").fill(name)
    await page.get_by_label("Token").fill(token)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(f"{watched.base_url}{next_path}*")
