"""The chaos run's setup and cleanup: :class:`Chaos`, what the run holds.

A RabbitMQ vhost of the run's own (the delivery-limit policy applied as in production) and a
scratch PostgreSQL cluster of its own (``pg_createcluster`` on a free port), so that closing every
connection and restarting PostgreSQL hit nothing else on this machine; RabbitMQ's
``max_message_size`` set for the run. In them: the worker processes of the chaos app, each slot
refilled when its worker dies, and one ``waystation projections run``. Whatever happens (Ctrl-C
included) the processes are stopped, the broker's ``max_message_size`` set back, the vhost
deleted and the cluster dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from scripts.lab.harness.broker import (
    apply_queue_policy,
    broker_size_limit,
    deployment_names,
    run_rabbitmqctl,
    temporary_vhost,
)
from scripts.lab.harness.database import PostgresCluster, paused_now
from scripts.lab.harness.processes import WorkerProcess, run_environment, stop_all
from waystation import migrations
from waystation.projections.postgres import projection_status
from waystation.settings import Settings

from . import HEALTHY_WITHIN, HOSTILE_ANSWERS, NEVER_DRAINED, PREFIX
from .collector import ChaosCollector, Health, probe_health
from .hostile import HostileSent

if TYPE_CHECKING:
    from .drive import FullQueue

DATABASE = "waystation_chaos"
APP = "tests.apps.chaos:app"


class Chaos:
    """What a chaos run holds: its options, services, processes and logs, and what its phases
    record (submissions, full queues, hostile messages, samples, faults, failures, figures)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.started_at = datetime.now(UTC)
        self.logs = Path(tempfile.mkdtemp(prefix="waystation-chaos-"))
        self.stack = contextlib.AsyncExitStack()
        self.victims = random.Random(args.seed + 1)
        self.names = deployment_names(PREFIX)
        self.amqp_url = ""
        self.vhost = ""
        self.database_url = ""
        self.cluster: PostgresCluster | None = None
        self.engine: AsyncEngine | None = None
        self.http: aiohttp.ClientSession | None = None
        self.collector: ChaosCollector | None = None
        self.slots: list[WorkerProcess] = []
        """The worker process of each slot now; a killed one is replaced in its slot."""
        self.generation: list[int] = []
        self.ports: dict[str, int] = {}
        self.retired: list[WorkerProcess] = []
        self.runner: WorkerProcess | None = None
        self.kinds: dict[str, str] = {}
        """Each task's kind (``_chaos.plan.TASK_KINDS``)."""
        self.windowed = 0
        """Tasks kept in the window of ``--in-flight`` (those answered through a full queue
        are not: a full queue holds their results back on purpose)."""
        self.submitted = 0
        self.window_submitted = 0
        self.submitting = True
        self.submit_retries: list[str] = []
        self.full_queues: list[FullQueue] = []
        self.drainers: set[asyncio.Task[None]] = set()
        self.hostile: list[HostileSent] = []
        self.outbox_oldest_max = 0.0
        self.outbox_oldest_last: float | None = None
        self.outbox_oldest_window_end: float | None = None
        """When the last result of the window came (only rows still refused, or stragglers)."""
        self.outbox_oldest_end: float | None = None
        """Once settled (none: 0)."""
        self.left: dict[str, int] = {}
        """What was still waiting (outbox rows, messages per queue) when settling ended."""
        self.counters: dict[str, dict[str, dict[str, float]]] = {}
        """Per process, its counters as last read from its /metrics (by counter, by label)."""
        self.broker_limit_seen: set[int] = set()
        self.settled = False
        self.faults: list[dict[str, Any]] = []
        self.faults_done = asyncio.Event()
        self.failures: list[str] = []
        self.figures: dict[str, Any] = {}
        self.cleanup_errors: list[str] = []

    def say(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {message}", flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def fail(self, message: str) -> None:
        self.failures.append(message)
        self.say(f"FAIL {message}")

    # ---- processes -------------------------------------------------------------------------

    def _environment(self, name: str) -> dict[str, str]:
        return run_environment(
            name,
            self.ports,
            database_url=self.database_url,
            amqp_url=self.amqp_url,
            queue_prefix=PREFIX,
            # the harness applied the policy once (apply_queue_policy), as an operator would
            WAYSTATION_BROKER_POLICY="none",
            WAYSTATION_DELIVERY_LIMIT=str(self.args.delivery_limit),
            WAYSTATION_MAX_MESSAGE_BYTES=str(self.args.max_message_bytes),
            WAYSTATION_REFUSED_RETRY_SECONDS=str(self.args.refused_retry),
            WAYSTATION_WORKER_ID=f"chaos-{name}",
            WAYSTATION_STATS_FILE=str(self.logs / f"{name}.stats.json"),
        )

    def start_worker(self, slot: int) -> WorkerProcess:
        if slot == len(self.generation):
            self.generation.append(0)
        self.generation[slot] += 1
        name = f"w{slot + 1}.{self.generation[slot]}"
        worker = WorkerProcess(self._environment(name), self.logs / f"{name}.log", app=APP).start()
        if slot == len(self.slots):
            self.slots.append(worker)
        else:
            self.slots[slot] = worker
        return worker

    def processes(self) -> list[WorkerProcess]:
        return [*self.slots, *([self.runner] if self.runner else [])]

    def interrupt(self) -> None:
        for process in self.processes():
            process.terminate()

    async def health(self, worker: WorkerProcess) -> Health:
        assert self.http is not None
        return await probe_health(self.http, self.ports[worker.name])

    async def wait_healthy(self, within: float = HEALTHY_WITHIN) -> list[str]:
        """Until every worker answers /healthz with 200; the ones that did not, if any."""
        deadline = time.monotonic() + within
        while True:
            unhealthy = [
                w.name for w in self.slots if not w.alive() or not (await self.health(w)).healthy
            ]
            if not unhealthy or time.monotonic() > deadline:
                return unhealthy
            await asyncio.sleep(0.2)

    def replace_crashed(self) -> None:
        """A worker that exited without being killed is a finding; replace it so the run goes on."""
        for slot, worker in enumerate(self.slots):
            if not worker.alive():
                code = worker.wait(1)
                self.fail(f"worker {worker.name} exited by itself with code {code}")
                self.retired.append(worker)
                self.say(f"started {self.start_worker(slot).name} in its place")
        if self.runner is not None and not self.runner.alive():
            self.fail(f"the projection runner exited by itself with code {self.runner.wait(1)}")
            self.runner = None

    # ---- the run's setup -------------------------------------------------------------------

    async def prepare(self) -> None:
        """The vhost, the scratch cluster, the database, the queue policy and the broker's
        message size limit."""
        base = Settings()
        self.vhost, self.amqp_url = await self.stack.enter_async_context(
            temporary_vhost(base.amqp_url)
        )
        home = PostgresCluster.find(base.database_url)
        version = home.version if isinstance(home, PostgresCluster) else _newest_postgresql()
        self.cluster = await self.stack.enter_async_context(PostgresCluster.scratch(version))
        self.database_url = self.cluster.url(DATABASE)
        await migrations.upgrade(self.database_url)
        self.engine = create_async_engine(self.database_url, poolclass=NullPool)
        self.stack.push_async_callback(self.engine.dispose)
        await apply_queue_policy(self.vhost, self.names, self.args.delivery_limit)
        self.say(
            f"vhost {self.vhost} (policy: delivery limit {self.args.delivery_limit}, dead letters "
            f"to {self.names.dead_letter_exchange}); PostgreSQL {version} scratch cluster "
            f"{self.cluster.name} on port {self.cluster.port}, database {DATABASE}"
        )
        limit = self.args.broker_max_message_size
        if limit:
            # RabbitMQ reads it as a channel opens: set before any connection of the run
            before = await broker_max_message_size()
            await self.stack.enter_async_context(broker_size_limit(limit))
            self.say(f"RabbitMQ's max_message_size {before} -> {limit} for the run")

    async def start(self) -> None:
        """The workers and the projection runner, started and healthy."""
        args = self.args
        self.http = await self.stack.enter_async_context(aiohttp.ClientSession())
        for slot in range(args.workers):
            self.start_worker(slot)
        environment = self._environment("projections")
        environment["WAYSTATION_PROJECTION_POLL_INTERVAL"] = "0.25"
        self.runner = WorkerProcess(
            environment, self.logs / "projections.log", command=["projections", "run"]
        ).start()
        unhealthy = await self.wait_healthy()
        if unhealthy:
            raise RuntimeError(f"workers not healthy after starting: {unhealthy}")
        await self.wait_for_projection_runner()
        self.say(f"{args.workers} workers healthy, the projection runner active; submitting")

    async def start_collector(self, mix: Counter[str]) -> None:
        """The collector of the results, of the hostile messages' answers and of the queue
        never drained (when a task is answered through it)."""
        args = self.args
        self.collector = ChaosCollector(self.amqp_url, queue_prefix=PREFIX)
        await self.collector.connect()
        # the vhost's deletion takes the queues with it; close only the connection
        self.stack.push_async_callback(self.collector.close, delete_queue=False)
        self.collector.uncounted = {t for t, kind in self.kinds.items() if kind.startswith("full-")}
        await self.collector.keep_answers(HOSTILE_ANSWERS)
        if mix["full-never"]:
            await self.collector.full_queue(NEVER_DRAINED, args.full_length)

    async def wait_for_projection_runner(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(Exception):
                if all(s.active for s in await projection_status(self.engine_())):
                    return
            if self.runner is None or not self.runner.alive():
                raise RuntimeError("the projection runner exited while starting (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError("the projection runner did not become active")
            await asyncio.sleep(0.2)

    # ---- what the phases share -----------------------------------------------------------

    def results_in(self) -> int:
        """Tasks of the window with their result."""
        assert self.collector is not None
        return self.collector.answered()

    def collector_(self) -> ChaosCollector:
        assert self.collector is not None
        return self.collector

    async def retrying(self, what: str, act: Callable[[], Awaitable[None]]) -> None:
        """``act()``, again while it fails (the collector's connection is coming back from a
        fault), for up to two minutes."""
        deadline = time.monotonic() + 120
        while True:
            try:
                await asyncio.wait_for(act(), 30)
                return
            except Exception as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: {type(error).__name__}: {error}") from error
                await asyncio.sleep(0.5)

    async def paused_now(self) -> int | None:
        return await paused_now(self.engine_())

    def engine_(self) -> AsyncEngine:
        assert self.engine is not None
        return self.engine

    # ---- the cleanup -----------------------------------------------------------------------

    async def cleanup(self) -> None:
        leftover = [p for p in [*self.processes(), *self.retired] if p.alive()]
        if leftover:
            stop_all(leftover, timeout=15)
        try:
            await self.stack.aclose()
        except Exception as problem:
            self.cleanup_errors.append(f"{type(problem).__name__}: {problem}")


async def broker_max_message_size() -> int:
    found = await run_rabbitmqctl("eval", "application:get_env(rabbit, max_message_size).")
    digits = "".join(ch for ch in found if ch.isdigit())
    return int(digits) if digits else 134_217_728


def _newest_postgresql() -> str:
    versions = sorted(
        (p.name for p in Path("/usr/lib/postgresql").iterdir() if p.name.isdigit()), key=int
    )
    if not versions:
        raise RuntimeError("no PostgreSQL server installed under /usr/lib/postgresql")
    return versions[-1]
