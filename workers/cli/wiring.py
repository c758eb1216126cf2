"""What every command builds the same way: settings, the event loop, the PostgreSQL backends.

The libraries are imported when a command runs, not when the CLI loads, so ``--help`` and
usage errors answer at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from events.postgres import PostgresEventStore

    from ..settings import Settings

__all__ = ["load_settings", "open_store", "projection_engine", "run", "with_projection_engine"]

T = TypeVar("T")
P = ParamSpec("P")


def load_settings(**overrides: Any) -> Settings:
    """Settings from WAYSTATION_* variables; an option given on the command line wins."""
    from ..settings import Settings

    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine to completion, on uvloop where it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def open_store(settings: Settings) -> PostgresEventStore:
    """The event log for a one-shot command: one connection is enough."""
    from events.postgres import PostgresEventStore

    return PostgresEventStore.from_url(settings.database_url, pool_size=1)


def projection_engine(settings: Settings) -> AsyncEngine:
    from projections.postgres import create_engine

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
