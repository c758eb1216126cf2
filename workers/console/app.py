"""The console's aiohttp application: its sources, templates, security and routes.

Every page is rendered on the server from Jinja2 templates with autoescaping on, so every value
a page shows (task inputs, results, agent names, signal payloads: all hostile input) is escaped
where it is rendered; nothing is marked safe but the console's own markup. Pages send a strict
Content-Security-Policy (scripts, styles and images from the console itself only, no inline
script, forms posting only to it, no framing), so an escaping mistake would still run nothing.

Actions are POSTs, checked here before any page sees them (:func:`_guard`): the console must
have a token, the request a signed-in session and the form its CSRF token. A page's handler
that acts then records the person as the actor of what it causes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.resources import files
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode, urlsplit

import jinja2
from aiohttp import web

from waystation.console import forms
from waystation.console.security import COOKIE, Session, Signer

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from waystation.client import Client
    from waystation.events.postgres import PostgresEventStore
    from waystation.protocol.wire import Names
    from waystation.settings import Settings

__all__ = [
    "Sources",
    "actor_of",
    "make_app",
    "pretty",
    "render",
    "session_of",
    "sources_of",
    "task_url",
]

log = logging.getLogger("waystation.console")

SOURCES = web.AppKey("sources", "Sources")
SIGNER = web.AppKey("signer", object)
TEMPLATES = web.AppKey("templates", jinja2.Environment)

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


@dataclass
class Sources:
    """What the pages read and act through: the log, its projections, the broker."""

    settings: Settings
    engine: AsyncEngine
    store: PostgresEventStore
    names: Names
    _client: Client | None = None
    _client_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def open(cls, settings: Settings) -> Sources:
        from waystation.events.postgres import PostgresEventStore
        from waystation.projections.postgres import create_engine
        from waystation.protocol.wire import Names

        return cls(
            settings=settings,
            engine=create_engine(settings.database_url, pool_size=4),
            store=PostgresEventStore.from_url(settings.database_url, pool_size=4),
            names=Names(settings.queue_prefix),
        )

    async def client(self) -> Client:
        """The broker client actions publish with, connected on first use."""
        from waystation.client import Client

        async with self._client_lock:
            if self._client is None:
                client = Client(self.settings.amqp_url, queue_prefix=self.settings.queue_prefix)
                await client.connect()
                self._client = client
            return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
        await self.store.close()
        await self.engine.dispose()


def sources_of(request: web.Request) -> Sources:
    return request.app[SOURCES]


def session_of(request: web.Request) -> Session | None:
    """The signed-in person, or None (signed out, or a console without a token)."""
    signer: Signer | None = request.app[SIGNER]  # type: ignore[assignment]
    if signer is None:
        return None
    return signer.session(request.cookies.get(COOKIE))


def actor_of(request: web.Request) -> str:
    """The actor the log records for an action of this request's person (``console:<name>``);
    only a signed-in person's POST reaches an action (:func:`_guard`)."""
    session = session_of(request)
    if session is None:  # pragma: no cover - the guard lets no action through without one
        raise web.HTTPForbidden(text="sign in to act")
    return session.actor


def render(
    request: web.Request, template: str, *, status: int = 200, **context: Any
) -> web.Response:
    """``template`` rendered with ``context`` and what every page shows (who is signed in,
    whether actions are possible, the CSRF token for its forms)."""
    signer: Signer | None = request.app[SIGNER]  # type: ignore[assignment]
    session = session_of(request)
    page = request.app[TEMPLATES].get_template(template)
    html = page.render(
        request_path=request.path,
        query=request.query,
        session=session,
        can_act=session is not None,
        read_only=signer is None,
        csrf=signer.csrf(session) if signer is not None and session is not None else "",
        **context,
    )
    return web.Response(text=html, status=status, content_type="text/html", charset="utf-8")


# ---- templates ------------------------------------------------------------------------------


def _moment(value: datetime | float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int | float):
        value = datetime.fromtimestamp(value, UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _age(value: datetime | float | None) -> str:
    from waystation.cli.admin import readable_age

    if value is None:
        return "-"
    if isinstance(value, datetime):
        seconds = (datetime.now(UTC) - value).total_seconds()
    else:
        seconds = float(value)
    return readable_age(seconds) if seconds >= 0 else f"in {readable_age(-seconds)}"


def pretty(value: Any) -> str:
    """``value`` as indented JSON, redacted as ``waystation export`` redacts by default (a
    checkpoint's ``security_context`` shows as its hash): what a console shows, an export
    would too."""
    import orjson

    from waystation.events.codec import dumps
    from waystation.projections.export import DEFAULT_REDACT_KEYS, redact

    shown, _ = redact(orjson.loads(dumps(value)), DEFAULT_REDACT_KEYS, "$")
    return orjson.dumps(shown, option=orjson.OPT_INDENT_2).decode()


def task_url(task_id: str) -> str:
    """The page of a task: its id is a path segment, quoted whole, so no id can make the link
    go anywhere else (not even ``javascript:``: the link always starts with ``/tasks/``)."""
    return "/tasks/" + quote(str(task_id), safe="")


def _with_query(base: dict[str, Any], **changes: Any) -> str:
    merged = {k: v for k, v in {**base, **changes}.items() if v not in (None, "")}
    return "?" + urlencode(merged) if merged else "?"


def templates() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("waystation.console", "templates"),
        autoescape=True,  # every template, whatever its name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters.update(
        moment=_moment, age=_age, pretty=pretty, task_url=task_url, with_query=_with_query
    )
    environment.globals.update(forms.TEMPLATE_GLOBALS)  # the signal form's fields and nonce
    return environment


# ---- security -------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_POSTS = frozenset({"/sign-in"})
"""POSTs that need no session (they make one)."""


@web.middleware
async def _headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Security headers on every response, and its server time (``Server-Timing``: what the
    bench reads, and a browser's developer tools show)."""
    started = time.perf_counter()
    response = await handler(request)
    elapsed = (time.perf_counter() - started) * 1000
    response.headers.setdefault("Server-Timing", f"app;dur={elapsed:.1f}")
    response.headers.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    response.headers.setdefault("X-Frame-Options", "DENY")
    if response.content_type == "text/html":
        response.headers.setdefault("Cache-Control", "no-store")
    return response


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a POST that is not the console's own form, by a signed-in person."""
    if request.method in ("GET", "HEAD"):
        return await handler(request)
    origin = request.headers.get("Origin")
    if origin is not None and origin != "null" and urlsplit(origin).netloc != request.host:
        return _refused(request, 403, "This form was not sent from this console.")
    signer: Signer | None = request.app[SIGNER]  # type: ignore[assignment]
    if signer is None:
        return _refused(
            request,
            403,
            "This console is read-only: start it with WAYSTATION_CONSOLE_TOKEN set to act.",
        )
    if request.path in OPEN_POSTS:
        return await handler(request)
    session = session_of(request)
    if session is None:
        return _refused(request, 403, "Sign in to act: your session is missing or has expired.")
    form = await request.post()
    token = form.get("csrf")
    if not signer.csrf_ok(session, token if isinstance(token, str) else None):
        return _refused(
            request, 403, "This form is out of date or was not made by this console: reload it."
        )
    return await handler(request)


def _refused(request: web.Request, status: int, message: str) -> web.Response:
    return render(request, "message.html", status=status, title="Refused", message=message)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A page that cannot be made says why in a sentence (a database or broker that cannot be
    used names the setting to check), with its traceback in the log, never on the page."""
    from waystation.cli.exits import explain

    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as error:
        sources = request.app[SOURCES]
        failure = explain(error, sources.settings)
        log.exception("console page %s failed", request.path)
        message = failure.message if failure is not None else "An unexpected error: see the log."
        return render(
            request, "message.html", status=500, title="Cannot show this", message=message
        )


# ---- the application ------------------------------------------------------------------------


def make_app(
    settings: Settings, *, token: str | None = None, sources: Sources | None = None
) -> web.Application:
    """The console for ``settings``: read-only unless ``token`` is given."""
    from waystation.console import pages

    app = web.Application(middlewares=[_headers, _errors, _guard], client_max_size=1024**2)
    app[SOURCES] = sources if sources is not None else Sources.open(settings)
    app[SIGNER] = Signer(token) if token else None  # type: ignore[assignment]
    app[TEMPLATES] = templates()
    for module in pages.MODULES:
        app.router.add_routes(module.routes)
    app.router.add_static("/static", str(files("waystation.console") / "static"))

    async def close(app: web.Application) -> None:
        await app[SOURCES].close()

    app.on_cleanup.append(close)
    return app
