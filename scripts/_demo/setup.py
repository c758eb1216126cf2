"""The demo's setup and cleanup: :class:`Demo`, what the run holds.

Its own database (``waystation_demo``, dropped first if a previous demo left it) and queues
(prefix ``demo.``), 3 worker processes of the example app and one projection runner, each with
its own metrics port; a session advisory lock so that one demo at a time runs per PostgreSQL
server; and, whatever stops the run, its processes stopped, its queues deleted and its database
dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from scripts.lab.harness.broker import (
    delete_topology,
    deployment_names,
    topology_queues,
    wait_for_consumers,
)
from scripts.lab.harness.database import paused_now, with_database
from scripts.lab.harness.processes import WorkerProcess, run_environment, stop_all, waystation_cli
from waystation import migrations
from waystation.brokers.amqp import topology
from waystation.projections.postgres import projection_status
from waystation.settings import Settings

from . import AGENTS, DATABASE, PREFIX, PROJECTION, WORKERS
from .output import Output

if TYPE_CHECKING:
    from .output import Line

CLI_TIMEOUT = 60.0


class Demo:
    """What a demo run holds: its URLs, processes, logs and output; what the phases add."""

    def __init__(self, base: Settings) -> None:
        self.amqp_url = base.amqp_url
        self.database_url = with_database(base.database_url, DATABASE)
        self.names = deployment_names(PREFIX)
        self.logs = Path(tempfile.mkdtemp(prefix="waystation-demo-"))
        self.workers: list[WorkerProcess] = []
        self.runner: WorkerProcess | None = None
        self.ports: dict[str, int] = {}
        self.killed: WorkerProcess | None = None
        self.engine: AsyncEngine | None = None
        self.guard: AsyncConnection | None = None
        """Holds the one-demo-at-a-time lock; without it, cleanup leaves shared things alone."""
        self.summary: list[Line] = []
        self.cleanup_errors: list[str] = []
        self.started = time.monotonic()
        self.out = Output(self.started)
        policy = os.environ.get("WAYSTATION_BROKER_POLICY", "auto")
        self.policy = (
            policy
            if policy != "auto"
            else ("rabbitmqctl" if shutil.which("rabbitmqctl") else "none")
        )

    def say(self, message: str) -> None:
        self.out.say(message)

    def note(self, message: str) -> None:
        self.out.note(message)

    async def prepare(self) -> None:
        """The database (dropped first if a previous demo left it), the queues of a previous demo
        cut short deleted, the workers and the projection runner started and ready."""
        await self.take_guard()
        await migrations.drop_database(self.database_url)
        with contextlib.suppress(Exception):
            await delete_topology(self.amqp_url, PREFIX, AGENTS)  # a previous demo cut short
        await migrations.upgrade(self.database_url)
        self.engine = create_async_engine(self.database_url, pool_size=2)
        self.say(f"database {DATABASE} created and migrated; queues prefixed {PREFIX!r}")
        for _ in range(WORKERS):
            self.start_worker()
        self.start_runner()
        await self.wait_ready()
        self.say(f"{WORKERS} workers consuming, the projection runner active; submitting")

    # ---- processes -------------------------------------------------------------------------------

    def _environment(self, name: str) -> dict[str, str]:
        return run_environment(
            name,
            self.ports,
            database_url=self.database_url,
            amqp_url=self.amqp_url,
            queue_prefix=PREFIX,
            WAYSTATION_BROKER_POLICY=self.policy,
            WAYSTATION_WORKER_ID=f"demo-{name}",
        )

    def start_worker(self) -> WorkerProcess:
        name = f"worker{len(self.workers) + 1}"
        worker = WorkerProcess(self._environment(name), self.logs / f"{name}.log").start()
        self.workers.append(worker)
        self.say(
            f"started {name} (pid {worker.pid}), metrics at "
            f"http://127.0.0.1:{self.ports[name]}/metrics"
        )
        return worker

    def start_runner(self) -> WorkerProcess:
        name = "projections"
        environment = self._environment(name)
        environment["WAYSTATION_PROJECTION_POLL_INTERVAL"] = "0.25"
        self.runner = WorkerProcess(
            environment, self.logs / f"{name}.log", command=["projections", "run"]
        ).start()
        self.say(
            f"started the projection runner (pid {self.runner.pid}), metrics at "
            f"http://127.0.0.1:{self.ports[name]}/metrics"
        )
        return self.runner

    def processes(self) -> list[WorkerProcess]:
        return [*self.workers, *([self.runner] if self.runner else [])]

    def interrupt(self) -> None:
        """On SIGINT/SIGTERM: SIGTERM every process now (the cleanup waits for them)."""
        for process in self.processes():
            process.terminate()

    def alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.alive()]

    async def wait_ready(self) -> None:
        """Until every worker consumes every queue and the runner holds the projection."""
        await wait_for_consumers(
            self.amqp_url,
            topology_queues(self.names, AGENTS)[:-1],
            len(self.workers),
            within=60,
            alive=lambda: all(p.alive() for p in self.processes()),
        )
        deadline = time.monotonic() + 30
        while not any(
            s.name == PROJECTION and s.active for s in await projection_status(self._engine())
        ):
            if self.runner is None or not self.runner.alive():
                raise RuntimeError("the projection runner exited while starting (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no projection runner became active for {PROJECTION}")
            await asyncio.sleep(0.1)

    async def paused_now(self) -> int | None:
        return await paused_now(self._engine())

    def _engine(self) -> AsyncEngine:
        assert self.engine is not None
        return self.engine

    async def cli(self, *arguments: str) -> tuple[int | None, str]:
        """Run the ``waystation`` command against the demo's database."""
        return await waystation_cli(
            arguments, {"WAYSTATION_DATABASE_URL": self.database_url}, CLI_TIMEOUT
        )

    async def take_guard(self) -> None:
        """One demo at a time per PostgreSQL server: two would drop each other's database and
        consume each other's queues. A session advisory lock on the server's ``postgres``
        database, held until the end (and released by the server if this process dies)."""
        admin = create_async_engine(
            make_url(self.database_url).set(database="postgres"), poolclass=NullPool
        )
        connection = await admin.connect()
        if not await connection.scalar(text("SELECT pg_try_advisory_lock(:key)"), {"key": _GUARD}):
            await connection.close()
            await admin.dispose()
            raise RuntimeError(
                f"another demo is running against this PostgreSQL (it uses the database "
                f"{DATABASE} and the queues {PREFIX}*); let it finish first"
            )
        self.guard = connection

    async def cleanup(self) -> None:
        leftover = [p for p in self.processes() if p.alive()]
        if leftover:
            stop_all(leftover, timeout=15)
        if self.engine is not None:
            with contextlib.suppress(Exception):
                await self.engine.dispose()
        if self.guard is None:
            return  # another demo's database and queues: not ours to remove
        try:
            await delete_topology(self.amqp_url, PREFIX, AGENTS)
        except Exception as problem:
            self.cleanup_errors.append(f"deleting the demo queues: {problem}")
        if self.policy == "rabbitmqctl":
            with contextlib.suppress(Exception):
                await topology.clear_policy(self.names)
        try:
            await migrations.drop_database(self.database_url)
        except Exception as problem:
            self.cleanup_errors.append(f"dropping {DATABASE}: {problem}")
        for message in self.cleanup_errors:
            print(f"cleanup: {message}", file=sys.stderr)
        with contextlib.suppress(Exception):
            await self.guard.close()
            await self.guard.engine.dispose()


_GUARD = 0x57617944  # "WayD": the demo's advisory lock key
