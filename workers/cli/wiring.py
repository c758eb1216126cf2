"""What every command builds the same way: settings, the event loop, the PostgreSQL backends.

The libraries are imported when a command runs, not when the CLI loads, so ``--help`` and
usage errors answer at once.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from waystation.events.postgres import PostgresEventStore
    from waystation.settings import Settings

__all__ = [
    "load_app",
    "load_settings",
    "open_store",
    "projection_engine",
    "run",
    "with_projection_engine",
]

T = TypeVar("T")
P = ParamSpec("P")


def load_settings(**overrides: Any) -> Settings:
    """Settings from WAYSTATION_* variables; an option given on the command line wins."""
    from waystation.settings import Settings

    return Settings(**{k: v for k, v in overrides.items() if v is not None})


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


EXIT_STORE = 4
"""Exit code of a command that could not use the event log (its database is missing or down),
distinct from every command's own codes (a problem found, not in the log, not finished)."""


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine to completion, on uvloop where it is installed. When the event
    log cannot be used (the database does not exist, refuses us, or is down), say so in one line
    naming the setting to check, and exit ``EXIT_STORE``, rather than with a traceback."""
    from waystation.events.errors import EventStoreError

    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(coroutine)
        return uvloop.run(coroutine)
    except EventStoreError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(
            f"waystation: the event log cannot be used ({type(error).__name__}: {first}); "
            "check WAYSTATION_DATABASE_URL and that PostgreSQL is running "
            "(`waystation db upgrade` creates the database)",
            file=sys.stderr,
        )
        sys.exit(EXIT_STORE)


def open_store(settings: Settings) -> PostgresEventStore:
    """The event log for a one-shot command: one connection is enough."""
    from waystation.events.postgres import PostgresEventStore

    return PostgresEventStore.from_url(settings.database_url, pool_size=1)


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
