"""Alembic environment: runs the migrations on an async engine, one migrator at a time.

The database URL comes from ``config.attributes["database_url"]`` (set by ``migrations.upgrade``),
else from ``WAYSTATION_DATABASE_URL`` (``alembic upgrade head`` from the project root). Several
workers starting at once all try to upgrade; a transaction-level advisory lock lets one migrate
while the others wait and then find nothing to do.
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

MIGRATION_LOCK = 7_467_730_001  # an arbitrary, fixed advisory lock key

config = context.config


def _url() -> str:
    # no sqlalchemy.url: the CLI's config is [tool.alembic] in pyproject.toml, which has no .ini
    url = config.attributes.get("database_url") or os.environ.get("WAYSTATION_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: set WAYSTATION_DATABASE_URL")
    return str(url)


def _migrate(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=None, transaction_per_migration=False)
    with context.begin_transaction():
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        context.run_migrations()


async def _run() -> None:
    engine = create_async_engine(_url())
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_migrate)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run())
