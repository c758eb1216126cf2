"""Database migrations (alembic) and the helpers that run them from code.

``upgrade(url)`` brings a database to the newest schema, creating the database itself first when
it does not exist, so the first command a user runs prepares everything. Alembic's own CLI works
too (``alembic upgrade head`` from the project root reads ``[tool.alembic]`` in pyproject.toml).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

__all__ = ["SCRIPT_LOCATION", "drop_database", "ensure_database", "upgrade"]

SCRIPT_LOCATION = str(Path(__file__).resolve().parent)


def _alembic_config(url: str):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    config.attributes["database_url"] = url
    return config


async def ensure_database(url: str) -> bool:
    """Create the database named in ``url`` if it is missing; True when it was created."""
    target = make_url(url)
    name = target.database
    if not name:
        raise ValueError(f"the database URL names no database: {target!r}")
    admin = create_async_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as connection:
            exists = await connection.scalar(
                text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
            )
            if exists:
                return False
            quoted = name.replace('"', '""')
            try:
                await connection.execute(text(f'CREATE DATABASE "{quoted}"'))
            except Exception:  # another process created it between our check and our create
                if await connection.scalar(
                    text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
                ):
                    return False
                raise
            return True
    finally:
        await admin.dispose()


async def drop_database(url: str) -> None:
    """Drop the database named in ``url`` (tests use it to clean up after themselves)."""
    target = make_url(url)
    admin = create_async_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as connection:
            quoted = (target.database or "").replace('"', '""')
            await connection.execute(text(f'DROP DATABASE IF EXISTS "{quoted}" WITH (FORCE)'))
    finally:
        await admin.dispose()


async def upgrade(url: str, revision: str = "head") -> None:
    """Create the database if needed and migrate it to ``revision``."""
    from alembic import command

    await ensure_database(url)
    # alembic's env.py runs its own event loop; keep it off ours
    await asyncio.to_thread(command.upgrade, _alembic_config(url), revision)
