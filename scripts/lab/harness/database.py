"""The database side of a run: database URLs, and PostgreSQL clusters of a run's own.

:func:`with_database` and :func:`fresh_database_url` name a database on a server (a run
creates it with ``migrations.upgrade`` and drops it after). :class:`PostgresCluster` is a local
cluster managed with Debian's postgresql-common tools (:data:`PG_TOOLS`): the one serving a URL
(:meth:`PostgresCluster.find`), or a scratch one on a free port (:meth:`PostgresCluster.scratch`)
that a run may stop and start without anyone else on this machine noticing.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from .processes import free_port, run_tool

PG_TOOLS = ("pg_lsclusters", "pg_ctlcluster", "pg_createcluster", "pg_dropcluster")


async def columns_migrated_and_declared(
    engine: AsyncEngine, table: sa.Table
) -> tuple[list[tuple[str, str, bool]], list[tuple[str, str, bool]]]:
    """(name, type, nullable) of each column of ``table`` as the migrations made it in the
    database, and as its ``sqlalchemy.Table`` declares it: a backend and its migration in step
    give two equal lists."""
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]

    def reflected(connection: Any) -> list[tuple[str, str, bool]]:
        columns = sa.inspect(connection).get_columns(table.name)
        return [(c["name"], str(c["type"].compile(dialect)), c["nullable"]) for c in columns]

    async with engine.connect() as connection:
        migrated = await connection.run_sync(reflected)
    declared = [(c.name, str(c.type.compile(dialect)), bool(c.nullable)) for c in table.c]
    return migrated, declared


def with_database(url: str, name: str) -> str:
    """``url`` naming database ``name`` instead (password kept)."""
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def fresh_database_url(admin_url: str, prefix: str = "ws_test_") -> str:
    """A database of its own, named ``prefix`` and a random part, on the server of ``admin_url``."""
    return with_database(admin_url, f"{prefix}{uuid.uuid4().hex[:10]}")


@dataclass(frozen=True)
class PostgresCluster:
    """A local PostgreSQL cluster managed with Debian's postgresql-common tools."""

    version: str
    name: str
    port: int

    @classmethod
    def find(cls, database_url: str) -> PostgresCluster | str:
        """The cluster serving ``database_url``, or exactly what is missing to use one (a
        scratch cluster of the same version is made with the same tools)."""
        absent = [tool for tool in PG_TOOLS if shutil.which(tool) is None]
        if absent:
            return f"{', '.join(absent)} not on PATH (install postgresql-common here)"
        url = make_url(database_url)
        if url.host not in (None, "", "localhost", "127.0.0.1", "::1"):
            return f"the test database is on {url.host}, not on this host"
        if os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name != "postgres":
            return "pg_createcluster and pg_ctlcluster need root or the postgres user"
        port = str(url.port or 5432)
        listing = subprocess.run(
            ["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=False
        ).stdout
        for line in listing.splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[2] == port:
                return cls(fields[0], fields[1], int(fields[2]))
        return f"pg_lsclusters lists no cluster on port {port} (testcontainers, say)"

    @classmethod
    @contextlib.asynccontextmanager
    async def scratch(cls, version: str) -> AsyncIterator[PostgresCluster]:
        """A new, running cluster of ``version`` (trust auth, a free port); dropped after.

        A run that stops PostgreSQL stops this one, so nothing else using the machine's
        server (another test run, say) notices. Needs root or the postgres user.
        """
        cluster = cls(version, f"wst_{uuid.uuid4().hex[:8]}", free_port())
        try:
            await run_tool(
                "pg_createcluster",
                version,
                cluster.name,
                "--port",
                str(cluster.port),
                "--start",
                "--",
                "--auth=trust",
            )
        except BaseException:
            # failed or cancelled half-way: remove whatever it created
            with contextlib.suppress(Exception):
                await run_tool("pg_dropcluster", "--stop", version, cluster.name)
            raise
        try:
            yield cluster
        finally:
            await run_tool("pg_dropcluster", "--stop", version, cluster.name)

    def url(self, database: str) -> str:
        """An asyncpg URL of ``database`` on this cluster (user postgres)."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    async def _ctl(self, action: str, *options: str) -> None:
        await run_tool(
            "pg_ctlcluster", "--skip-systemctl-redirect", *options, self.version, self.name, action
        )

    async def online(self) -> bool:
        listing = await run_tool("pg_lsclusters", "--no-header")
        for line in listing.splitlines():
            fields = line.split()
            if fields[:2] == [self.version, self.name]:
                return len(fields) > 3 and fields[3] == "online"
        return False

    async def stop(self) -> None:
        """Fast shutdown: every session is terminated, open transactions roll back."""
        await self._ctl("stop", "--mode", "fast")

    async def start(self) -> None:
        await self._ctl("start")

    async def ensure_running(self) -> None:
        if not await self.online():
            await self.start()


# ---- what a run's database says now -----------------------------------------------------------


async def paused_now(engine: AsyncEngine) -> int | None:
    """Tasks waiting for peer replies right now, per the paused_tasks projection; None when it
    cannot be read (the database is down, say)."""
    try:
        async with engine.connect() as connection:
            found = await connection.scalar(
                sa.text("SELECT count(*) FROM paused_tasks WHERE status = 'paused'")
            )
    except Exception:
        return None
    return int(found or 0)
