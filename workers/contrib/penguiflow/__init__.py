"""PenguiFlow's StateStore on Waystation's event log (``pip install waystation[penguiflow]``).

PenguiFlow's admin CLI loads it by its factory::

    penguiflow-admin history --state-store waystation.contrib.penguiflow:create_store TRACE_ID

:func:`create_store` reads the worker's ``WAYSTATION_*`` settings (the database URL, the queue
prefix as the records' deployment); :func:`create_memory_store` needs no services (tests, a
laptop). Nothing in the worker imports this package: PenguiFlow is never a dependency of it.
"""

from __future__ import annotations

from typing import Any

from waystation import migrations
from waystation.contrib.penguiflow.artifacts import (
    MemoryBlobs,
    PostgresBlobs,
    WaystationArtifactStore,
)
from waystation.contrib.penguiflow.store import GLOBAL_TRACE, WaystationStateStore
from waystation.events import EventStore
from waystation.events.memory import InMemoryEventStore
from waystation.settings import Settings

__all__ = [
    "GLOBAL_TRACE",
    "WaystationArtifactStore",
    "WaystationStateStore",
    "create_memory_store",
    "create_store",
]

POOL_SIZE = 4


async def create_store(**overrides: Any) -> WaystationStateStore:
    """The adapter on the PostgreSQL log the worker's settings name (``WAYSTATION_DATABASE_URL``),
    migrated to the current schema first; ``overrides`` are settings by name."""
    from waystation.events.postgres import PostgresEventStore

    settings = Settings(**overrides)
    await migrations.upgrade(settings.database_url)
    store = PostgresEventStore.from_url(settings.database_url, pool_size=POOL_SIZE)
    return WaystationStateStore(
        store,
        artifact_store=_artifacts(store),
        deployment=settings.queue_prefix,
        owns_store=True,
    )


def create_memory_store(store: EventStore | None = None, **options: Any) -> WaystationStateStore:
    """The adapter on an in-memory log (``waystation.events.memory.InMemoryEventStore``): nothing
    durable."""
    log = store if store is not None else InMemoryEventStore()
    options.setdefault("artifact_store", _artifacts(log))
    return WaystationStateStore(log, **options)


def _artifacts(store: EventStore) -> WaystationArtifactStore:
    """The artifact store beside ``store``: the table ``penguiflow_artifacts`` of the same
    database for PostgreSQL, memory otherwise (``workers/contrib/penguiflow/artifacts/``)."""
    from waystation.events.postgres import PostgresEventStore

    if isinstance(store, PostgresEventStore):
        return WaystationArtifactStore(PostgresBlobs(store.engine))
    return WaystationArtifactStore(MemoryBlobs())
