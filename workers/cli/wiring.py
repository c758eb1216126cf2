"""What every command builds the same way: settings, the event loop, the PostgreSQL backends.

The libraries are imported when a command runs, not when the CLI loads, so ``--help`` and
usage errors answer at once.
"""

from __future__ import annotations

import asyncio
import getpass
import importlib
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import click

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from waystation.events.postgres import PostgresEventStore
    from waystation.settings import Settings

__all__ = [
    "actor_option",
    "cli_actor",
    "load_app",
    "load_settings",
    "open_store",
    "projection_engine",
    "run",
    "until_started",
    "with_projection_engine",
]

T = TypeVar("T")
P = ParamSpec("P")

log = logging.getLogger("waystation")

_loaded: list[Settings] = []
"""The settings this command loaded: a failure names their URLs (redacted)."""


def load_settings(**overrides: Any) -> Settings:
    """Settings from WAYSTATION_* variables; an option given on the command line wins.

    A variable that is no setting (a misspelling) or a value a setting cannot take ends the
    command with one line per variable, naming it (or its option), and ``EXIT_CONFIG``."""
    from pydantic import ValidationError

    from waystation.cli.exits import EXIT_CONFIG, Failure
    from waystation.settings import Settings, unknown_variables, variable_of

    given = {k: v for k, v in overrides.items() if v is not None}
    problems = [
        f"{name} is not a setting"
        + (f"; did you mean {close}?" if close else "")
        + " (docs/configuration.md lists them)"
        for name, close in unknown_variables(os.environ, _command_line_variables())
    ]
    try:
        settings = Settings(**given)
    except ValidationError as error:
        for each in error.errors():
            field = str(each["loc"][0]) if each["loc"] else "?"
            name = f"--{field.replace('_', '-')}" if field in given else variable_of(field)
            value = given.get(field, os.environ.get(name))
            if value is not None and "url" not in field:  # (a URL may hold a password)
                name = f"{name}={value}"
            message = str(each["msg"])
            if message.startswith("Value error, "):
                problems.append(f"{name} {message.removeprefix('Value error, ')}")
            else:
                problems.append(f"{name}: {message[:1].lower()}{message[1:]}")
    if problems:
        raise Failure("\nwaystation: ".join(problems), EXIT_CONFIG)
    _loaded.append(settings)
    return settings


def _command_line_variables() -> set[str]:
    """Every variable an option of the running ``waystation`` command reads (``WAYSTATION_APP``,
    ``WAYSTATION_LOG_LEVEL``, ...), from the commands themselves."""
    import click

    context = click.get_current_context(silent=True)
    found: set[str] = set()
    commands = [context.find_root().command] if context else []
    while commands:
        command = commands.pop()
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            found.update([envvar] if isinstance(envvar, str) else envvar or ())
        commands.extend(getattr(command, "commands", {}).values())
    return found


NO_APP = (
    "name the app: --app module:attribute, or WAYSTATION_APP (the example app that comes with "
    "Waystation: --app waystation.example:app)"
)


def load_app(path: str | None) -> Any:
    """The app ``module:attribute`` names (``module`` alone means its ``app``), importing from
    the current directory first, as ``python -m`` would: an installed ``waystation`` script has
    its own directory on ``sys.path``, not the one it is run from. None (neither ``--app`` nor
    ``WAYSTATION_APP`` given) is a usage error: no app is served that was not named."""
    import click

    from waystation.policies import PolicyError

    if not path:
        raise click.UsageError(NO_APP)

    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    module_name, _, attribute = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute or "app")
    except (ImportError, AttributeError, PolicyError) as error:  # a policy that cannot work
        raise click.BadParameter(
            f"cannot load app {path!r}: {error}", param_hint="--app"
        ) from error


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine to completion, on uvloop where it is installed. A failure a
    user can cause (a broker or database that cannot be used, an agent no queue takes:
    ``waystation.cli.exits``) ends the command in one line naming the setting to check, with
    its exit code; its traceback is logged at debug level. Anything else keeps its traceback."""
    from waystation.cli.exits import explain

    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(coroutine)
        return uvloop.run(coroutine)
    except Exception as error:
        failure = explain(error, _loaded[-1] if _loaded else None)
        if failure is None:
            raise
        log.debug("%s", failure.message, exc_info=error)
        raise failure from None


async def until_started(
    stop: asyncio.Event, start: Callable[[], Awaitable[None]], *, longest: float = 5.0
) -> bool:
    """Run ``start`` until it succeeds (True), or until ``stop`` is set (False: a signal
    stops a service in every phase, its start included).

    A failure that may pass by itself (the broker or the database not reachable yet: compose
    may start a worker before them) is logged in one line and tried again, after waits that
    double up to ``longest`` seconds; any other (a wrong password, a missing virtual host)
    is raised, to end the process with its line and code (:func:`run`)."""
    from waystation.cli.exits import explain

    delay = 0.5
    while not stop.is_set():
        attempt = asyncio.ensure_future(start())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({attempt, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not attempt.done():
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
            break
        error = attempt.exception()
        if error is None:
            return True
        failure = explain(error, _loaded[-1] if _loaded else None)
        if failure is None or not failure.transient:
            raise error
        log.warning("%s; trying again in %.1fs", failure.message, delay)
        log.debug("the failure", exc_info=error)
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            delay = min(delay * 2, longest)
    log.info("stopped while starting")
    return False


def open_store(settings: Settings) -> PostgresEventStore:
    """The event log for a one-shot command: one connection is enough."""
    from waystation.events.postgres import PostgresEventStore

    return PostgresEventStore.from_url(settings.database_url, pool_size=1)


async def agent_in_log(settings: Settings, task_id: str) -> str | None:
    """The agent of ``task_id`` as its stream records it; None when the log has no stream."""
    from waystation.events import fold

    store = open_store(settings)
    try:
        return fold(task_id, await store.read_stream(task_id)).agent
    finally:
        await store.close()


def projection_engine(settings: Settings) -> AsyncEngine:
    from waystation.projections.postgres import create_engine

    return create_engine(settings.database_url, pool_size=2)


async def with_projection_engine(
    settings: Settings,
    function: Callable[Concatenate[AsyncEngine, P], Awaitable[T]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """``function(engine, ...)`` on an engine of its own, disposed of afterwards."""
    engine = projection_engine(settings)
    try:
        return await function(engine, *args, **kwargs)
    finally:
        await engine.dispose()


def cli_actor() -> str:
    """Who acts from this shell by default: ``cli:`` and the OS user's name (``cli:root``)."""
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # no name for this uid (a container's): still a command line
        return "cli"


def actor_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``--actor`` option of a command that acts (``what``: "cancels"), recorded in the log
    as the ``actor`` of the events it causes; by default :func:`cli_actor`."""
    return click.option(
        "--actor",
        default=cli_actor,
        show_default="cli: and your OS user name",
        help=f"Who {what}, as the event log records it (e.g. console:alice).",
    )
