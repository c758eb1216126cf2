"""The console in integration tests: served on a free port over the test's real PostgreSQL and
RabbitMQ (``settings``), requested with aiohttp's client as a browser would, and signed in."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from waystation.console import make_app
from waystation.settings import Settings

__all__ = ["browser", "console", "sign_in"]

TOKEN = "t"


@contextlib.asynccontextmanager
async def console(settings: Settings, *, token: str | None = TOKEN) -> AsyncIterator[str]:
    """The console of ``settings`` (read-only when ``token`` is None), serving until the block
    ends; its base URL."""
    runner = web.AppRunner(make_app(settings, token=token))
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def browser() -> aiohttp.ClientSession:
    """A client that keeps cookies as a browser does, for an address like 127.0.0.1 too (the
    default jar ignores cookies of IP addresses)."""
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


async def sign_in(
    session: aiohttp.ClientSession, base_url: str, name: str, token: str = TOKEN
) -> str:
    """Sign ``session`` in as ``name``; the CSRF token its forms carry."""
    form = {"token": token, "name": name, "next": "/paused"}
    async with session.post(f"{base_url}/sign-in", data=form) as response:
        page = await response.text()
        assert response.status == 200, page
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None, f"no CSRF token on the page after signing in:\n{page}"
    return found.group(1)
