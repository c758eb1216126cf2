"""The chaos run: real worker processes on the real services under mixed faults, every task
checked.

A RabbitMQ vhost of the run's own (the delivery-limit policy applied as in production) and a
scratch PostgreSQL cluster of its own (``pg_createcluster`` on a free port), so that closing every
connection and restarting PostgreSQL hit nothing else on this machine. In them: ``--workers``
worker processes of the chaos app (``tests.apps.chaos``: the example app's agents) and one
``waystation projections run``. ``--tasks`` orchestrator tasks, each 2 rounds of 3 researcher
calls (``work_ms`` of simulated work per call), are kept ``--in-flight`` at a time; their results
come back through a durable reply queue (:class:`_chaos.collector.ChaosCollector`), which outlives a
closed connection.

Meanwhile the faults land, spread over the run by results (:func:`_chaos.plan.plan_faults`):
``--kills`` SIGKILLs of a random worker (a replacement starts at once), ``--connection-closes``
``rabbitmqctl close_all_connections`` in the vhost (every worker and the collector cut off) and
``--pg-restarts`` fast stops of the cluster, down ``--pg-down`` seconds, started again. Each
waits until every worker answers ``/healthz`` (so that it hits a worker with work, not one still
starting) and is logged with the results in, the tasks in flight and the victim's messages in
its handlers. The last ``--in-flight`` tasks are submitted only once every fault has landed, so
no fault can find the run over.

And the broker says no (:func:`_chaos.plan.plan_tasks`, docs/failures.md): a share of the
tasks (``--full-queue-share``) is submitted with a ``reply_to`` queue of ``x-max-length``
``--full-length`` that rejects publishes, kept full: each such queue takes the tasks of
``--full-hold`` seconds and is then drained (a consumer started late), so their results are
refused, retried with backoff by the outbox relay and arrive; ``--never-drained`` of them go to
a queue drained only once the run is over, so their results are dead-lettered (``refused``)
after the workers' ``WAYSTATION_REFUSED_RETRY_SECONDS`` (``--refused-retry``), which is their
answer. A share (``--oversized-share``) has a result larger than the workers'
``WAYSTATION_MAX_MESSAGE_BYTES`` (``--max-message-bytes``: the task fails at once,
``MessageTooLarge``) or, half of them, than RabbitMQ's ``max_message_size``
(``--broker-max-message-size``, set for the run and set back after: dead-lettered as
``too-large``, an ``undeliverable-result`` error to the publisher). A hostile publisher sends
``--hostile-rate`` messages a second to the agents' queues while tasks are submitted, with
content headers no client library writes (:data:`_chaos.hostile.HOSTILE_KINDS`), each body
tagged: each must be dead-lettered with its reason, or refused by RabbitMQ itself.

Then, once nothing is left in any queue or in the outbox, the figures: tasks missing, wrong
(another answer than their kind's, or two different ones) and duplicated; per task in the log,
one terminal event, each pause recorded and resumed once, each sub-task claimed once;
``waystation verify`` and ``waystation projections rebuild paused_tasks|agent_stats --check`` as
subprocesses; dead letters and their reasons, each explained; the hostile messages' fates; the
publishes refused, the outbox's oldest row; the faults with their times; the wall time. Printed,
and written as JSON (``--json``). Exit 0 only if nothing was lost, stuck, unsettled or wrong; 1
otherwise (each failure named); 2 when this machine cannot run it (no rabbitmqctl or PostgreSQL
cluster tools). Whatever happens (Ctrl-C included) the processes are stopped, the broker's
``max_message_size`` set back, the vhost deleted and the cluster dropped; the process logs are
kept when the run failed (or with ``--keep-logs``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
import aiormq.exceptions
from _chaos.answers import AnswerFigures, answer_figures
from _chaos.collector import ChaosCollector, Health, counter_values, probe_health
from _chaos.hostile import (
    HostileFigures,
    HostileSent,
    hostile_figures,
    hostile_message,
    hostile_plan,
    hostile_tag,
)
from _chaos.plan import (
    OVER_BROKER_ROOM,
    OVERSIZED_KINDS,
    PlannedFault,
    expected_answer,
    fault_span,
    padding,
    plan_faults,
    plan_tasks,
    task_mix,
)
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from scripts.lab.harness.broker import (
    apply_queue_policy,
    broker_connections,
    broker_size_limit,
    busy_queues,
    close_all_broker_connections,
    deployment_names,
    publish_raw_properties,
    run_rabbitmqctl,
    temporary_vhost,
)
from scripts.lab.harness.checks import LogFigures, log_figures
from scripts.lab.harness.database import PG_TOOLS, PostgresCluster, paused_now
from scripts.lab.harness.guarded import run_guarded
from scripts.lab.harness.processes import (
    ROOT,
    WorkerProcess,
    free_port,
    log_problems,
    metrics_env,
    stats_counters,
    stop_all,
    waystation_cli,
)
from waystation import migrations
from waystation.brokers.amqp.deadletters import DeadLetter, browse
from waystation.events.codec import loads
from waystation.example import expected_total
from waystation.projections.postgres import projection_status
from waystation.settings import Settings

K = 3
ROUNDS = 2
PREFIX = "chaos."
DATABASE = "waystation_chaos"
APP = "tests.apps.chaos:app"
PROJECTIONS = ("paused_tasks", "agent_stats")
HEALTHY_WITHIN = 90.0
"""How long the workers may take to be healthy again before a fault (a restart, a reconnect)."""
STALL_LIMIT = 180.0
"""Once every task is submitted: how long without a new result before the rest count as lost."""
SETTLE_WITHIN = 120.0
"""How long the run may take to settle once every result is in, beyond what the rows refused
for ``--refused-retry`` seconds need (their last wait is up to a minute)."""
CLI_TIMEOUT = 300.0
SAMPLE_EVERY = 2.0
"""Seconds between two samples of the outbox's oldest row and of the workers' counters."""
BROKER_CHECK_EVERY = 60.0
"""Seconds between two looks at the broker's max_message_size (rabbitmqctl is not cheap)."""
HOSTILE_TRIES = 10
DEAD_LETTERS_READ = 100_000
FULL_QUEUES = f"{PREFIX}full-"
NEVER_DRAINED = f"{PREFIX}full-never"
HOSTILE_ANSWERS = f"{PREFIX}hostile-answers"
QUICK = {
    "tasks": 50,
    "kills": 2,
    "connection_closes": 1,
    "pg_restarts": 1,
    "in_flight": 10,
    "work_ms": (1000.0, 1800.0),
    "pg_down": 1.0,
    "full_queue_share": 0.12,
    "full_hold": 5.0,
    "refused_retry": 14.0,
    "oversized_share": 0.08,
    "hostile_rate": 2.0,
    "progress_every": 2.0,
}


def _work_ms(value: str) -> tuple[float, float]:
    try:
        low, high = (float(part) for part in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"MIN,MAX in milliseconds, not {value!r}") from None
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError("0 <= MIN <= MAX")
    return low, high


def _share(value: str) -> float:
    try:
        share = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a share from 0 to 1, not {value!r}") from None
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError("a share from 0 to 1")
    return share


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/chaos",
        description="Real worker processes on the real services under mixed faults (SIGKILLs, "
        "every broker connection closed, PostgreSQL restarted) while the broker says no (full "
        "reply queues that reject publishes, results over the size limits, hostile metadata); "
        "every task and every hostile message checked.",
    )
    parser.add_argument("--tasks", type=int, default=5000, help="orchestrator tasks")
    parser.add_argument("--workers", type=int, default=3, help="worker processes")
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs of a random worker")
    parser.add_argument(
        "--connection-closes", type=int, default=3, help="rabbitmqctl close_all_connections"
    )
    parser.add_argument("--pg-restarts", type=int, default=1, help="PostgreSQL restarts")
    parser.add_argument("--pg-down", type=float, default=3.0, help="seconds PostgreSQL stays down")
    parser.add_argument("--in-flight", type=int, default=60, help="tasks outstanding at once")
    parser.add_argument(
        "--work-ms",
        type=_work_ms,
        default=(300.0, 700.0),
        metavar="MIN,MAX",
        help="each researcher call works a random time in this range (ms)",
    )
    parser.add_argument("--delivery-limit", type=int, default=5, help="the broker policy's")
    refusals = parser.add_argument_group("when the broker says no")
    refusals.add_argument(
        "--full-queue-share",
        type=_share,
        default=0.03,
        metavar="SHARE",
        help="tasks whose reply_to is a full queue that rejects publishes (default 0.03)",
    )
    refusals.add_argument(
        "--never-drained",
        type=_share,
        default=0.34,
        metavar="SHARE",
        help="of those, the share whose queue is drained only after the run: their results "
        "end as dead letters (refused) (default 0.34)",
    )
    refusals.add_argument(
        "--full-hold",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="each drained full queue takes the tasks of this long, then its consumer starts "
        "(default 20)",
    )
    refusals.add_argument(
        "--full-length",
        type=int,
        default=2,
        metavar="N",
        help="x-max-length of a full queue, and the fillers that keep it full (default 2)",
    )
    refusals.add_argument(
        "--refused-retry",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="the workers' WAYSTATION_REFUSED_RETRY_SECONDS (default 60)",
    )
    refusals.add_argument(
        "--oversized-share",
        type=_share,
        default=0.01,
        metavar="SHARE",
        help="tasks whose result is too large: half over the workers' limit, half over the "
        "broker's (all over the workers' when the broker's is left alone) (default 0.01)",
    )
    refusals.add_argument(
        "--max-message-bytes",
        type=int,
        default=256 * 1024,
        metavar="BYTES",
        help="the workers' WAYSTATION_MAX_MESSAGE_BYTES (default 262144)",
    )
    refusals.add_argument(
        "--broker-max-message-size",
        type=int,
        default=128 * 1024,
        metavar="BYTES",
        help="RabbitMQ's max_message_size during the run (the whole broker's, set back after); "
        "0 leaves it alone (default 131072)",
    )
    refusals.add_argument(
        "--hostile-rate",
        type=float,
        default=1.0,
        metavar="PER_SECOND",
        help="hostile messages a second to the agents' queues while tasks are submitted; 0: "
        "none (default 1)",
    )
    parser.add_argument("--seed", type=int, default=None, help="the plan's (random)")
    parser.add_argument(
        "--json", default="chaos-results/latest.json", help="where to write the figures"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()),
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the process logs")
    args = parser.parse_args(argv)
    args.progress_every = 10.0
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.seed is None:
        args.seed = random.randrange(2**31)
    if args.tasks < 1 or args.workers < 1 or args.in_flight < 1:
        parser.error("--tasks, --workers and --in-flight must be at least 1")
    if min(args.kills, args.connection_closes, args.pg_restarts) < 0:
        parser.error("fault counts cannot be negative")
    if args.tasks < 3 * args.in_flight:
        parser.error("--tasks must be at least 3 times --in-flight (see fault_span)")
    if not 0 < args.full_hold < args.refused_retry:
        parser.error(
            "--full-hold must be shorter than --refused-retry: a drained queue's results would "
            "be dead-lettered before it is drained"
        )
    if args.full_length < 1 or args.hostile_rate < 0:
        parser.error("--full-length must be at least 1, --hostile-rate not negative")
    if args.broker_max_message_size and not (
        16 * 1024 <= args.broker_max_message_size <= args.max_message_bytes - OVER_BROKER_ROOM
    ):
        parser.error(
            "--broker-max-message-size must be 0, or from 16 KiB to --max-message-bytes less "
            f"{OVER_BROKER_ROOM} (a result between the two limits must fit the workers')"
        )
    try:
        plan_tasks(args.tasks, args.in_flight, task_mix(args), args.seed)
    except ValueError as error:
        parser.error(f"too many special tasks: {error}")
    return args


@dataclass
class FullQueue:
    """A reply queue of the run that rejects publishes, kept full until drained."""

    name: str
    opened: float
    """Its first task's submission (elapsed seconds)."""
    tasks: int = 0
    drained: float | None = None
    """When its consumer started (elapsed seconds)."""


class Chaos:
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
        port = free_port(exclude=self.ports.values())
        self.ports[name] = port
        return {
            "WAYSTATION_DATABASE_URL": self.database_url,
            "WAYSTATION_AMQP_URL": self.amqp_url,
            "WAYSTATION_QUEUE_PREFIX": PREFIX,
            # the harness applied the policy once (apply_queue_policy), as an operator would
            "WAYSTATION_BROKER_POLICY": "none",
            "WAYSTATION_DELIVERY_LIMIT": str(self.args.delivery_limit),
            "WAYSTATION_MAX_MESSAGE_BYTES": str(self.args.max_message_bytes),
            "WAYSTATION_REFUSED_RETRY_SECONDS": str(self.args.refused_retry),
            "WAYSTATION_WORKER_ID": f"chaos-{name}",
            **metrics_env(port),
            "WAYSTATION_LOG_FORMAT": "text",
            "WAYSTATION_STATS_FILE": str(self.logs / f"{name}.stats.json"),
        }

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

    # ---- the run ---------------------------------------------------------------------------

    async def run(self) -> None:
        args = self.args
        print(
            f"Waystation chaos: {args.tasks} orchestrator tasks of {ROUNDS} rounds of {K} calls "
            f"(work {args.work_ms[0]:.0f}-{args.work_ms[1]:.0f} ms a call, {args.in_flight} tasks "
            f"in flight), {args.workers} workers and a projection runner; {args.kills} kills, "
            f"{args.connection_closes} connection closes, {args.pg_restarts} PostgreSQL "
            f"restarts; seed {args.seed}",
            flush=True,
        )
        rng = random.Random(args.seed)
        kinds = plan_tasks(args.tasks, args.in_flight, task_mix(args), args.seed)
        inputs: dict[str, dict[str, Any]] = {}
        for n, kind in enumerate(kinds):
            task_id = f"chaos-{args.seed}-{n}"
            spec: dict[str, Any] = {
                "n": n,
                "k": K,
                "rounds": ROUNDS,
                "work_ms": round(rng.uniform(*args.work_ms), 1),
            }
            if padding(kind, args):
                spec["pad"] = padding(kind, args)
            inputs[task_id] = spec
            self.kinds[task_id] = kind
        mix = Counter(kinds)
        self.windowed = sum(not kind.startswith("full-") for kind in kinds)
        print(
            f"  and the broker says no: {mix['full-drained']} tasks answered through full "
            f"reply queues (reject-publish, length {args.full_length}) drained after "
            f"{args.full_hold:.0f}s, {mix['full-never']} through one never drained (refused "
            f"for {args.refused_retry:.0f}s, then dead letters); {mix['over-worker']} results "
            f"over the workers' {args.max_message_bytes} bytes, {mix['over-broker']} over the "
            f"broker's {args.broker_max_message_size or 'limit (left alone)'}; hostile "
            f"metadata at {args.hostile_rate:g}/s",
            flush=True,
        )
        await self.prepare()
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

        self.collector = ChaosCollector(self.amqp_url, queue_prefix=PREFIX)
        await self.collector.connect()
        # the vhost's deletion takes the queues with it; close only the connection
        self.stack.push_async_callback(self.collector.close, delete_queue=False)
        self.collector.uncounted = {t for t, kind in self.kinds.items() if kind.startswith("full-")}
        await self.collector.keep_answers(HOSTILE_ANSWERS)
        if mix["full-never"]:
            await self.collector.full_queue(NEVER_DRAINED, args.full_length)
        plan = plan_faults(
            fault_span(self.windowed, args.in_flight),
            args.kills,
            args.connection_closes,
            args.pg_restarts,
            args.seed,
        )
        submitter = asyncio.create_task(self.submit_all(inputs))
        injector = asyncio.create_task(self.inject(plan))
        background = [
            asyncio.create_task(self.publish_hostile()),
            asyncio.create_task(self.sample()),
        ]
        try:
            await self.follow(submitter, injector, background[0])
            self.outbox_oldest_window_end = await self.outbox_oldest()
            await self.settle()
            self.outbox_oldest_end = await self.outbox_oldest()
        finally:
            for task in (submitter, injector, *background, *self.drainers):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
        await self.check(inputs)

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
            before = await _broker_max_message_size()
            await self.stack.enter_async_context(broker_size_limit(limit))
            self.say(f"RabbitMQ's max_message_size {before} -> {limit} for the run")

    async def wait_for_projection_runner(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(Exception):
                if all(s.active for s in await projection_status(self._engine())):
                    return
            if self.runner is None or not self.runner.alive():
                raise RuntimeError("the projection runner exited while starting (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError("the projection runner did not become active")
            await asyncio.sleep(0.2)

    def results_in(self) -> int:
        """Tasks of the window with their result."""
        assert self.collector is not None
        return self.collector.answered()

    async def submit_all(self, inputs: dict[str, dict[str, Any]]) -> None:
        """Keep ``--in-flight`` tasks outstanding; hold the tail back until every fault landed.
        A task answered through a full queue is submitted beside the window, to its queue."""
        assert self.collector is not None
        hold_from = len(inputs) - self.args.in_flight
        try:
            for index, (task_id, spec) in enumerate(inputs.items()):
                if index == hold_from and not self.faults_done.is_set():
                    self.say(
                        f"{index} submitted; the last {len(inputs) - index} wait for the faults"
                    )
                    await self.faults_done.wait()
                kind = self.kinds[task_id]
                if kind.startswith("full-"):
                    await self.submit(task_id, spec, await self.full_queue_for(kind))
                    self.submitted += 1
                    continue
                await self.collector.wait_answered(self.window_submitted - self.args.in_flight + 1)
                await self.submit(task_id, spec)
                self.submitted += 1
                self.window_submitted += 1
        finally:
            self.submitting = False

    async def full_queue_for(self, kind: str) -> str:
        """The full queue a task of ``kind`` is answered through: the one never drained, or the
        drained one of the moment (a new one once it has taken tasks for ``--full-hold``
        seconds; each is drained that long after its first task)."""
        assert self.collector is not None
        if kind == "full-never":
            return NEVER_DRAINED
        now = self.elapsed()
        if not self.full_queues or now - self.full_queues[-1].opened >= self.args.full_hold:
            queue = FullQueue(f"{FULL_QUEUES}{len(self.full_queues) + 1}", now)
            await self.retrying(
                f"filling {queue.name}",
                lambda: self.collector_().full_queue(queue.name, self.args.full_length),
            )
            self.full_queues.append(queue)
            drainer = asyncio.create_task(self.drain_later(queue))
            self.drainers.add(drainer)
        self.full_queues[-1].tasks += 1
        return self.full_queues[-1].name

    async def drain_later(self, queue: FullQueue) -> None:
        assert self.collector is not None
        await asyncio.sleep(max(0.0, queue.opened + self.args.full_hold - self.elapsed()))
        await self.retrying(f"draining {queue.name}", lambda: self.collector_().drain(queue.name))
        queue.drained = self.elapsed()

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

    async def submit(self, task_id: str, spec: dict[str, Any], reply_to: str | None = None) -> None:
        """Publish one task, again (same task id) if its confirm was lost with a connection."""
        assert self.collector is not None
        deadline = time.monotonic() + 120
        while True:
            try:
                publish: Awaitable[Any]
                if reply_to is None:
                    publish = self.collector.submit("orchestrator", spec, task_id=task_id)
                else:
                    publish = self.collector.submit_to("orchestrator", spec, task_id, reply_to)
                await asyncio.wait_for(publish, 30)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                self.submit_retries.append(task_id)
                await asyncio.sleep(0.5)

    async def follow(
        self,
        submitter: asyncio.Task[None],
        injector: asyncio.Task[None],
        hostile: asyncio.Task[None],
    ) -> None:
        """Progress lines until every result of the window is in, or nothing came for
        STALL_LIMIT seconds."""
        last_line = last_count = 0.0
        last_change = time.monotonic()
        while True:
            await asyncio.sleep(0.25)
            for task in (submitter, injector, hostile):
                error = task.exception() if task.done() else None
                if error is not None:
                    raise error
            self.replace_crashed()
            done = self.results_in()
            if done != last_count:
                last_count, last_change = done, time.monotonic()
            if time.monotonic() - last_line >= self.args.progress_every:
                last_line = time.monotonic()
                await self.progress_line(done)
            if done >= self.windowed and submitter.done():
                await self.progress_line(done)
                return
            if (
                submitter.done()
                and injector.done()
                and time.monotonic() - last_change > STALL_LIMIT
            ):
                self.fail(f"no new result for {STALL_LIMIT:.0f}s with {done} of {self.windowed} in")
                return

    async def progress_line(self, done: int) -> None:
        assert self.collector is not None
        paused = await self.paused_now()
        alive = sum(w.alive() for w in self.slots)
        full = sum(1 for t in self.collector.through_full if t in self.kinds)
        oldest = self.outbox_oldest_last
        self.say(
            f"results {done:>5}/{self.windowed}, submitted {self.submitted:>5}, in flight "
            f"{self.window_submitted - done:>3}, paused {'?' if paused is None else paused:>3}, "
            f"workers alive {alive}/{len(self.slots)}, faults {len(self.faults)}; through full "
            f"queues {full}, hostile sent {len(self.hostile)}, outbox oldest "
            f"{'?' if oldest is None else f'{oldest:.0f}s'}"
        )

    async def paused_now(self) -> int | None:
        return await paused_now(self._engine())

    def _engine(self) -> AsyncEngine:
        assert self.engine is not None
        return self.engine

    # ---- the hostile publisher, and what is sampled ------------------------------------------

    async def publish_hostile(self) -> None:
        """``--hostile-rate`` hostile messages a second to the agents' task queues, while tasks
        are submitted (:func:`_chaos.hostile.hostile_message`); each kind in turn."""
        rate = self.args.hostile_rate
        if rate <= 0:
            return
        queues = [self.names.tasks("orchestrator"), self.names.tasks("researcher")]
        number = 0
        while self.submitting:
            kind = hostile_plan(number + 1, self.args.seed)[-1]
            sent = HostileSent(f"hostile-{self.args.seed}-{number}", kind, queues[number % 2])
            self.hostile.append(sent)
            await self.send_hostile(sent)
            number += 1
            await asyncio.sleep(1 / rate)

    async def send_hostile(self, sent: HostileSent) -> None:
        """Publish one hostile message; again (the same tag) when something other than the
        broker's refusal of it got in the way (a connection closed by a fault)."""
        properties, body = hostile_message(sent.kind, sent.tag, HOSTILE_ANSWERS)
        while sent.tries < HOSTILE_TRIES:
            sent.tries += 1
            try:
                await asyncio.wait_for(
                    publish_raw_properties(self.amqp_url, sent.queue, body, properties), 30
                )
                sent.outcome = "routed"
                return
            except aiormq.exceptions.ConnectionInternalError as refused:
                # 541: RabbitMQ could not parse the header and closed the connection
                sent.outcome = "refused"
                sent.errors.append(f"{type(refused).__name__}: {refused}")
                return
            except Exception as error:
                sent.outcome = "error"
                sent.errors.append(f"{type(error).__name__}: {error}"[:300])
                await asyncio.sleep(1.0)

    async def sample(self) -> None:
        """Every SAMPLE_EVERY seconds: the outbox's oldest row, and each worker's counters; the
        broker's max_message_size now and then (another user of the broker may change it)."""
        last_broker_check = time.monotonic()
        while True:
            await asyncio.sleep(SAMPLE_EVERY)
            oldest = await self.outbox_oldest()
            if oldest is not None:
                self.outbox_oldest_last = oldest
                self.outbox_oldest_max = max(self.outbox_oldest_max, oldest)
            for worker in list(self.slots):
                await self.read_counters(worker)
            if (
                self.args.broker_max_message_size
                and time.monotonic() - last_broker_check > BROKER_CHECK_EVERY
            ):
                last_broker_check = time.monotonic()
                await self.check_broker_limit()

    async def outbox_oldest(self) -> float | None:
        """Seconds since the oldest outbox row was written (0 when there is none); None when
        the database cannot tell."""
        try:
            async with self._engine().connect() as connection:
                found = await connection.scalar(
                    text("SELECT extract(epoch FROM now() - min(created_at))::float8 FROM outbox")
                )
        except Exception:
            return None
        return 0.0 if found is None else max(0.0, float(found))

    async def read_counters(self, worker: WorkerProcess) -> None:
        """Keep what ``worker``'s /metrics says of refused publishes and dead letters."""
        assert self.http is not None
        if not worker.alive():
            return
        try:
            async with self.http.get(
                f"http://127.0.0.1:{self.ports[worker.name]}/metrics",
                timeout=aiohttp.ClientTimeout(total=3),
            ) as response:
                exposition = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return
        self.counters[worker.name] = {
            name: counter_values(exposition, f"waystation_{name}")
            for name in ("publish_refusals", "dead_letters", "outbox_relayed")
        }

    async def check_broker_limit(self) -> None:
        with contextlib.suppress(Exception):
            self.broker_limit_seen.add(await _broker_max_message_size())

    def counter_totals(self, name: str) -> dict[str, float]:
        """A counter summed over every process, each as last read."""
        total: Counter[str] = Counter()
        for counters in self.counters.values():
            total.update(counters.get(name, {}))
        return {label: value for label, value in sorted(total.items())}

    # ---- faults ----------------------------------------------------------------------------

    async def inject(self, plan: list[PlannedFault]) -> None:
        assert self.collector is not None
        try:
            actions: dict[str, Callable[[dict[str, Any]], Awaitable[str]]] = {
                "kill": self.kill,
                "close": self.close_connections,
                "pg-restart": self.restart_postgresql,
            }
            for number, fault in enumerate(plan, 1):
                await self.collector.wait_answered(fault.after_results)
                await asyncio.sleep(fault.delay)
                unhealthy = await self.wait_healthy()
                if unhealthy:
                    self.fail(
                        f"workers {unhealthy} not healthy {HEALTHY_WITHIN:.0f}s after the last "
                        f"fault; {len(plan) - number + 1} faults not injected"
                    )
                    return
                done = self.results_in()
                record: dict[str, Any] = {
                    "kind": fault.kind,
                    "at_s": round(self.elapsed(), 2),
                    "at": datetime.now(UTC).isoformat(timespec="milliseconds"),
                    "results_in": done,
                    "submitted": self.submitted,
                    "tasks_in_flight": self.window_submitted - done,
                }
                what = await actions[fault.kind](record)
                self.faults.append(record)
                self.say(
                    f"fault {number:>2}/{len(plan)} {fault.kind}: {what}; at {done} results, "
                    f"{record['tasks_in_flight']} tasks in flight"
                )
        finally:
            self.faults_done.set()

    async def kill(self, record: dict[str, Any]) -> str:
        """SIGKILL a random worker among those with messages in their handlers right now (any
        worker when none has), and start its replacement."""
        handling = [(await self.health(w)).in_flight or 0 for w in self.slots]
        busy = [slot for slot, count in enumerate(handling) if count > 0]
        slot = self.victims.choice(busy or list(range(len(self.slots))))
        victim = self.slots[slot]
        pid = victim.pid
        await self.read_counters(victim)  # its last counters, or they die with it
        victim.kill()
        self.retired.append(victim)
        replacement = self.start_worker(slot)
        record.update(
            victim=victim.name,
            pid=pid,
            victim_messages_in_handlers=handling[slot],
            replacement=replacement.name,
        )
        return (
            f"SIGKILL {victim.name} (pid {pid}, {handling[slot]} messages in its handlers), "
            f"started {replacement.name}"
        )

    async def close_connections(self, record: dict[str, Any]) -> str:
        connections = await broker_connections(self.vhost)
        in_handlers = [(await self.health(w)).in_flight for w in self.slots]
        await close_all_broker_connections(self.vhost)
        record.update(
            connections_closed=len(connections),
            messages_in_handlers=sum(n or 0 for n in in_handlers),
        )
        return (
            f"closed all {len(connections)} connections of the vhost "
            f"({sum(n or 0 for n in in_handlers)} messages in the workers' handlers)"
        )

    async def restart_postgresql(self, record: dict[str, Any]) -> str:
        assert self.cluster is not None
        before = self.results_in()
        stopping = time.monotonic()
        try:
            await self.cluster.stop()
            stopped = time.monotonic()
            # the outage itself: PostgreSQL stays down this long, whatever the workers do
            await asyncio.sleep(self.args.pg_down)
        finally:
            await self.cluster.ensure_running()
        running = time.monotonic()
        record.update(
            stop_took_s=round(stopped - stopping, 2),
            down_s=round(running - stopped, 2),
            results_while_down=self.results_in() - before,
        )
        return (
            f"stopped the cluster at {record['at_s']:.1f}s (fast, took {stopped - stopping:.1f}s), "
            f"down {running - stopped:.1f}s, running again"
        )

    # ---- after the run ---------------------------------------------------------------------

    async def settle(self) -> None:
        """Until nothing can still happen: the outbox and every queue (the results' and the
        full ones' too) empty, twice in a row. The queue never drained is drained once the
        outbox is empty (every result refused there has become a dead letter)."""
        assert self.collector is not None
        self.say(
            f"every result of the window in; waiting for the outbox and the queues to empty "
            f"(a result refused for {self.args.refused_retry:.0f}s becomes a dead letter)"
        )
        deadline = time.monotonic() + SETTLE_WITHIN + self.args.refused_retry + 60
        quiet = 0
        never_drained = any(kind == "full-never" for kind in self.kinds.values())
        state: dict[str, int] = {}
        while quiet < 2:
            if time.monotonic() > deadline:
                self.fail(f"the run did not settle within {deadline - self.started:.0f}s: {state}")
                return
            await asyncio.sleep(0.5)
            state = await self.pending()
            self.left = state
            if never_drained and "outbox" not in state and await self.never_drained_finished():
                self.say(
                    f"the outbox is empty: draining {NEVER_DRAINED} (at "
                    f"{self.elapsed():.0f}s; its results were refused since)"
                )
                await self.retrying(
                    f"draining {NEVER_DRAINED}", lambda: self.collector_().drain(NEVER_DRAINED)
                )
                never_drained = False
                continue
            quiet = quiet + 1 if not state and not never_drained else 0
        self.settled = True
        self.say("settled: the outbox and every queue are empty, nothing unacked")

    async def never_drained_finished(self) -> bool:
        """Whether every task answered through the queue never drained has finished in the log
        (its result written to the outbox in the same transaction)."""
        ids = [t for t, kind in self.kinds.items() if kind == "full-never"]
        try:
            async with self._engine().connect() as connection:
                finished = await connection.scalar(
                    text(
                        "SELECT count(DISTINCT stream_id) FROM events WHERE stream_id = "
                        "ANY(CAST(:ids AS text[])) AND event_type IN ('TaskCompleted', "
                        "'TaskFailed', 'TaskCancelled')"
                    ),
                    {"ids": ids},
                )
        except Exception:
            return False
        return int(finished or 0) == len(ids)

    async def pending(self) -> dict[str, int]:
        """What is still waiting: outbox rows, and messages (ready or unacked) per queue (the
        queue never drained aside until it is drained)."""
        waiting: dict[str, int] = {}
        try:
            async with self._engine().connect() as connection:
                waiting["outbox"] = int(
                    await connection.scalar(text("SELECT count(*) FROM outbox")) or 0
                )
        except Exception:
            waiting["outbox"] = -1  # unreadable: not settled
        for name, (ready, unacked) in (await busy_queues(self.amqp_url, PREFIX)).items():
            waiting[name] = ready + unacked
        return {what: n for what, n in waiting.items() if n}

    async def check(self, inputs: dict[str, dict[str, Any]]) -> None:
        assert self.collector is not None
        args = self.args
        expected = {
            t: expected_answer(
                self.kinds[t], {"n": spec["n"], "total": expected_total(spec["n"], K, ROUNDS)}
            )
            for t, spec in inputs.items()
        }
        async with self._engine().connect() as connection:
            rows = (
                await connection.execute(
                    text(
                        "SELECT stream_id, event_type, data->>'subtask_id', "
                        "(data->>'pause')::int, data->>'reason' FROM events "
                        "ORDER BY stream_id, stream_version"
                    )
                )
            ).all()
        failing = [t for t, kind in self.kinds.items() if kind == "over-worker"]
        finished = {r[0] for r in rows if r[1] in ("TaskCompleted", "TaskFailed", "TaskCancelled")}
        unfinished = [t for t in inputs if t not in finished]
        log = log_figures(
            list(inputs), [(r[0], r[1], r[2], r[3], r[4]) for r in rows], K, ROUNDS, failed=failing
        )
        caught_up = await self.wait_for_projections()
        paused_left = await self.paused_now()
        cli = await self.cli_checks()
        letters = await browse(self.amqp_url, self.names, limit=DEAD_LETTERS_READ)
        hostile_letters = [letter for letter in letters if hostile_tag(letter.body)]
        task_letters = [letter for letter in letters if not hostile_tag(letter.body)]
        answers = answer_figures(expected, self.collector.messages(), task_letters)
        hostile = hostile_figures(self.hostile, hostile_letters, self.collector.answers)
        if args.broker_max_message_size:
            await self.check_broker_limit()
        for worker in self.slots:
            await self.read_counters(worker)
        codes = stop_all([p for p in self.processes() if p.alive()], timeout=30)
        problems, first_problems = log_problems(sorted(self.logs.glob("*.log")))
        counters = _stats_counters(self.logs)
        kinds = Counter(self.kinds.values())
        refusals = self.counter_totals("publish_refusals")
        by_kind = answers.by_kind
        self.figures = {
            "date": self.started_at.isoformat(timespec="seconds"),
            "commit": _commit(),
            "seed": args.seed,
            "options": {
                "tasks": args.tasks,
                "rounds": ROUNDS,
                "calls_per_round": K,
                "work_ms": list(args.work_ms),
                "in_flight": args.in_flight,
                "workers": args.workers,
                "kills": args.kills,
                "connection_closes": args.connection_closes,
                "pg_restarts": args.pg_restarts,
                "pg_down_s": args.pg_down,
                "delivery_limit": args.delivery_limit,
                "full_queue_share": args.full_queue_share,
                "never_drained": args.never_drained,
                "full_hold_s": args.full_hold,
                "full_length": args.full_length,
                "refused_retry_s": args.refused_retry,
                "oversized_share": args.oversized_share,
                "max_message_bytes": args.max_message_bytes,
                "broker_max_message_size": args.broker_max_message_size,
                "hostile_rate": args.hostile_rate,
            },
            "task_kinds": dict(sorted(kinds.items())),
            "tasks_submitted": self.submitted,
            "submits_retried": len(self.submit_retries),
            "results": answers.to_json(),
            "full_queues": {
                "drained_queues": len(self.full_queues),
                "tasks_per_drained_queue": [q.tasks for q in self.full_queues],
                "drained_after_s": [
                    None if q.drained is None else round(q.drained - q.opened, 1)
                    for q in self.full_queues
                ],
                "results_through_full_queues": sum(
                    1 for t in self.collector.through_full if t in self.kinds
                ),
                "answered_by_refused_dead_letter": by_kind.get("full-never", {}).get(
                    "by_dead_letter", 0
                ),
                "fillers_taken": self.collector.fillers_taken,
            },
            "oversized": {kind: by_kind.get(kind, {}) for kind in OVERSIZED_KINDS},
            "publish_refusals": {
                "metrics": refusals,
                "stats_of_clean_exits": counters.get("publish_refusals", 0),
            },
            "outbox_oldest_s": {
                "max_seen": round(self.outbox_oldest_max, 1),
                "when_the_window_was_answered": _rounded(self.outbox_oldest_window_end),
                "at_end": _rounded(self.outbox_oldest_end),
            },
            "hostile": hostile.to_json(),
            "log": {"events_in_log": len(rows), **log.to_json()},
            "verify_exit": cli["verify"][0],
            "verify": cli["verify"][1],
            "rebuild_paused_tasks_check_exit": cli["paused_tasks"][0],
            "rebuild_agent_stats_check_exit": cli["agent_stats"][0],
            "projections_caught_up": caught_up,
            "paused_tasks_left": paused_left,
            "agent_stats_orchestrator_completed": cli["completed"],
            "dead_letters": {
                "count": len(letters),
                "reasons": dict(Counter(letter.reason for letter in letters)),
                "of_tasks": dict(Counter(letter.reason for letter in task_letters)),
                "of_hostile_messages": dict(Counter(letter.reason for letter in hostile_letters)),
                "unexplained": len(answers.unexplained_letters),
                "counted_by_workers": self.counter_totals("dead_letters"),
            },
            "settled": self.settled,
            "left_unsettled": self.left,
            "lost": len(answers.missing) + len(hostile.missing),
            "stuck": len(unfinished) + (paused_left or 0),
            "unsettled": sum(self.left.values()) if not self.settled else 0,
            "tasks_unfinished_in_the_log": len(unfinished),
            "broker_max_message_size_seen": sorted(self.broker_limit_seen),
            "faults": self.faults,
            "faults_injected": dict(Counter(f["kind"] for f in self.faults)),
            "processes_started": len(self.retired) + len(self.processes()),
            "exit_codes_on_sigterm": codes,
            "log_warning_lines": problems,
            "worker_counters_of_clean_exits": counters,
        }
        self.judge(answers, hostile, log, cli, caught_up, paused_left, letters, codes)
        if first_problems:
            self.figures["log_warning_examples"] = first_problems

    async def wait_for_projections(self) -> bool:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                statuses = await projection_status(self._engine())
                if all(s.behind == 0 for s in statuses):
                    return True
            await asyncio.sleep(0.25)
        return False

    async def cli_checks(self) -> dict[str, Any]:
        env = {
            "WAYSTATION_DATABASE_URL": self.database_url,
            "WAYSTATION_AMQP_URL": self.amqp_url,
            "WAYSTATION_QUEUE_PREFIX": PREFIX,
        }
        commands = {
            "verify": ["verify"],
            **{name: ["projections", "rebuild", name, "--check"] for name in PROJECTIONS},
            "status": ["status", "--json"],
        }
        # read-only, so at once: on a busy machine each spends seconds starting Python
        outcomes = await asyncio.gather(
            *(waystation_cli(command, env, CLI_TIMEOUT) for command in commands.values())
        )
        found: dict[str, Any] = {
            what: (code, _last_line(output))
            for what, (code, output) in zip(commands, outcomes, strict=True)
        }
        try:
            status = loads(outcomes[-1][1])
            found["completed"] = status["agents"]["orchestrator"]["completed"]
        except Exception:
            found["completed"] = None
        return found

    def judge(
        self,
        answers: AnswerFigures,
        hostile: HostileFigures,
        log: LogFigures,
        cli: dict[str, Any],
        caught_up: bool,
        paused_left: int | None,
        letters: list[DeadLetter],
        codes: dict[str, int | None],
    ) -> None:
        """Every loss or wrongness found, as a failure."""
        args = self.args
        kinds = Counter(self.kinds.values())
        completing = args.tasks - kinds["over-worker"]
        refused = sum(self.figures["publish_refusals"]["metrics"].values()) + int(
            self.figures["publish_refusals"]["stats_of_clean_exits"]
        )
        checks = [
            (self.submitted == args.tasks, f"{self.submitted} of {args.tasks} tasks submitted"),
            (
                not answers.missing,
                f"{len(answers.missing)} tasks lost (no result, nor the dead letter that answers "
                f"a task whose queue was never drained): {answers.missing[:5]}",
            ),
            (
                not answers.wrong,
                f"{len(answers.wrong)} tasks answered wrong (another answer than their kind's, "
                f"or two different ones): {answers.wrong[:5]}",
            ),
            (not answers.unexpected, f"{answers.unexpected} results of tasks never submitted"),
            (
                not answers.unexplained_letters,
                f"{len(answers.unexplained_letters)} dead letters no kind of task explains: "
                f"{answers.unexplained_letters[:5]}",
            ),
            (
                not hostile.missing,
                f"{len(hostile.missing)} hostile messages taken by the broker and never "
                f"dead-lettered (lost or stuck): {hostile.missing[:5]}",
            ),
            (
                not hostile.wrong_reason,
                f"{len(hostile.wrong_reason)} hostile messages not dead-lettered with their "
                f"reason: {hostile.wrong_reason[:5]}",
            ),
            (
                not hostile.wrong_answers,
                f"{len(hostile.wrong_answers)} answers to hostile messages that are no error of "
                f"their reason: {hostile.wrong_answers[:5]}",
            ),
            (
                not log.not_completed_once,
                f"{len(log.not_completed_once)} tasks without exactly one completion (or, over "
                "the workers' limit, one failure) in the log",
            ),
            (
                not log.pauses_resumed_twice,
                f"{len(log.pauses_resumed_twice)} pauses resumed more than once",
            ),
            (
                not log.pauses_recorded_twice,
                f"{len(log.pauses_recorded_twice)} pauses recorded more than once",
            ),
            (
                not log.claims_not_once,
                f"{len(log.claims_not_once)} sub-tasks not claimed exactly once",
            ),
            (not log.unexpected_streams, f"{len(log.unexpected_streams)} unexpected streams"),
            (cli["verify"][0] == 0, f"waystation verify exited {cli['verify'][0]}"),
            (
                cli["paused_tasks"][0] == 0,
                f"projections rebuild paused_tasks --check exited {cli['paused_tasks'][0]}",
            ),
            (
                cli["agent_stats"][0] == 0,
                f"projections rebuild agent_stats --check exited {cli['agent_stats'][0]}",
            ),
            (caught_up, "the projections did not catch up with the log within 60s"),
            (paused_left == 0, f"{paused_left} tasks still paused in the paused_tasks projection"),
            (
                cli["completed"] == completing,
                f"agent_stats counts {cli['completed']} completed orchestrator tasks, not "
                f"{completing}",
            ),
            (
                len(letters) < DEAD_LETTERS_READ,
                f"{len(letters)} dead letters or more: not all of them were read",
            ),
            (
                refused > 0 or not (kinds["full-drained"] or kinds["full-never"]),
                "no publish was refused: the full queues refused nothing",
            ),
            (
                all(code == 0 for code in codes.values()),
                f"exit codes on SIGTERM: {codes}",
            ),
        ]
        limit = args.broker_max_message_size
        checks.append(
            (
                not limit or self.broker_limit_seen <= {limit},
                f"RabbitMQ's max_message_size was changed during the run by something else "
                f"(seen {sorted(self.broker_limit_seen)}, set {limit}): the oversized tasks' "
                "answers cannot be judged",
            )
        )
        injected = Counter(f["kind"] for f in self.faults)
        wanted = {
            "kill": args.kills,
            "close": args.connection_closes,
            "pg-restart": args.pg_restarts,
        }
        checks.append(
            (
                all(injected[kind] == count for kind, count in wanted.items()),
                f"faults injected {dict(injected)}, planned {wanted}",
            )
        )
        idle = [f for f in self.faults if f["tasks_in_flight"] <= 0]
        checks.append((not idle, f"{len(idle)} faults landed with no task in flight"))
        for ok, failure in checks:
            if not ok:
                self.failures.append(failure)

    async def cleanup(self) -> None:
        leftover = [p for p in [*self.processes(), *self.retired] if p.alive()]
        if leftover:
            stop_all(leftover, timeout=15)
        try:
            await self.stack.aclose()
        except Exception as problem:
            self.cleanup_errors.append(f"{type(problem).__name__}: {problem}")


async def _broker_max_message_size() -> int:
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


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _commit() -> str | None:
    try:
        found = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found.stdout.strip() or None


def _stats_counters(logs: Path) -> dict[str, int]:
    """The counters the workers that stopped cleanly wrote (killed ones write nothing)."""
    return dict(sorted(stats_counters(sorted(logs.glob("w*.stats.json"))).items()))


def _left(figures: dict[str, Any]) -> str:
    return f": {figures['left_unsettled']}" if figures["unsettled"] else ""


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def _seconds(age: float | None) -> str:
    return "empty" if not age else f"{age:.1f}s"


def _reasons(reasons: dict[str, Any]) -> str:
    return ", ".join(f"{reason} {count:g}" for reason, count in sorted(reasons.items())) or "none"


def print_figures(figures: dict[str, Any], failures: list[str], elapsed: float) -> None:
    results, log = figures["results"], figures["log"]
    dead = figures["dead_letters"]
    injected = figures["faults_injected"]
    kinds = figures["task_kinds"]
    by_kind = results["by_kind"]
    full = figures["full_queues"]
    hostile = figures["hostile"]
    options = figures["options"]
    refusals = figures["publish_refusals"]
    oldest = figures["outbox_oldest_s"]
    over_worker = by_kind.get("over-worker", {})
    over_broker = by_kind.get("over-broker", {})
    rows = [
        (
            "tasks submitted",
            f"{figures['tasks_submitted']} ({figures['submits_retried']} "
            "publishes retried after a connection close)",
        ),
        (
            "kinds of task",
            f"{kinds.get('normal', 0)} plain, {kinds.get('full-drained', 0)} through full "
            f"queues drained late, {kinds.get('full-never', 0)} through one never drained, "
            f"{kinds.get('over-worker', 0)} over the workers' limit, "
            f"{kinds.get('over-broker', 0)} over the broker's",
        ),
        (
            "tasks answered",
            f"{results['answered']} ({results['answered_by_result']} by a result, "
            f"{results['answered_by_dead_letter']} by their dead letter); "
            f"{results['messages']} result messages",
        ),
        (
            "lost",
            f"{figures['lost']} ({results['missing']} tasks without an answer, "
            f"{hostile['missing']} hostile messages taken and never dead-lettered)",
        ),
        (
            "stuck",
            f"{figures['stuck']} ({figures['tasks_unfinished_in_the_log']} tasks unfinished in "
            f"the log, {figures['paused_tasks_left']} left paused)",
        ),
        (
            "unsettled",
            f"{figures['unsettled']} (messages in queues, delivered and unacked, or in the "
            f"outbox at the end{_left(figures)})",
        ),
        ("wrong answers", results["wrong"]),
        (
            "duplicate results",
            f"{results['duplicates']} ({results['duplicates_redelivered_to_collector']} "
            f"redelivered to the collector, {results['duplicates_published_again']} "
            "published again by a worker)",
        ),
        (
            "answered through a full queue",
            f"{full['results_through_full_queues']} results through {full['drained_queues']} "
            f"queues drained {options['full_hold_s']:.0f}s late, "
            f"{full['answered_by_refused_dead_letter']} dead letters (refused) of the one "
            "never drained",
        ),
        (
            "publishes refused",
            f"{sum(refusals['metrics'].values()):.0f} ({_reasons(refusals['metrics'])}; "
            "waystation_publish_refusals_total of every worker)",
        ),
        (
            "outbox oldest row",
            f"{oldest['max_seen']:.1f}s at most (sampled every {SAMPLE_EVERY:.0f}s); "
            f"{_seconds(oldest['when_the_window_was_answered'])} when the window was answered, "
            f"{_seconds(oldest['at_end'])} at the end",
        ),
        (
            "oversized results",
            f"{over_worker.get('by_result', 0)} of {over_worker.get('tasks', 0)} answered "
            f"MessageTooLarge (over {options['max_message_bytes']} bytes), "
            f"{over_broker.get('by_result', 0)} of {over_broker.get('tasks', 0)} "
            f"undeliverable-result (over the broker's {options['broker_max_message_size']})",
        ),
        (
            "hostile messages",
            f"{hostile['sent']} sent: {hostile['dead_lettered']} dead-lettered "
            f"({_reasons(hostile['reasons'])}), {hostile['refused_by_rabbitmq']} refused by "
            f"RabbitMQ itself (541); {hostile['missing']} lost, {hostile['wrong_reason']} "
            "with another reason",
        ),
        (
            "hostile messages' publisher told",
            f"{sum(hostile['answered_with_error'].values())} errors "
            f"({_reasons(hostile['answered_with_error'])}); {hostile['wrong_answers']} wrong",
        ),
        ("tasks without exactly one terminal", log["tasks_not_completed_once"]),
        ("pauses resumed twice", log["pauses_resumed_twice"]),
        ("pauses recorded twice", log["pauses_recorded_twice"]),
        ("sub-tasks not claimed exactly once", log["subtasks_not_claimed_once"]),
        ("replies ignored (audit)", log["reply_ignored"] or 0),
        ("events in the log", f"{log['events_in_log']} in {log['streams']} streams"),
        ("waystation verify", f"exit {figures['verify_exit']}: {figures['verify']}"),
        ("rebuild paused_tasks --check", f"exit {figures['rebuild_paused_tasks_check_exit']}"),
        ("rebuild agent_stats --check", f"exit {figures['rebuild_agent_stats_check_exit']}"),
        (
            "projections",
            f"{figures['paused_tasks_left']} tasks left paused; agent_stats: "
            f"{figures['agent_stats_orchestrator_completed']} orchestrator tasks completed",
        ),
        (
            "dead letters",
            f"{dead['count']}: {_reasons(dead['reasons'])}; {dead['unexplained']} unexplained",
        ),
        (
            "settled",
            "yes: the outbox and every queue empty, nothing unacked"
            if figures["settled"]
            else "NO",
        ),
        (
            "faults injected",
            f"{injected.get('kill', 0)} SIGKILLs, {injected.get('close', 0)} "
            f"close_all_connections, {injected.get('pg-restart', 0)} PostgreSQL restarts",
        ),
        (
            "processes",
            f"{figures['processes_started']} started; exit codes on SIGTERM "
            f"{figures['exit_codes_on_sigterm']}",
        ),
        ("warning/error log lines", figures["log_warning_lines"]),
        ("wall time", f"{elapsed:.1f}s"),
    ]
    print("\nfigures")
    for what, value in rows:
        print(f"  {what:<38} {value}")
    print(f"\nresult: {'FAILED' if failures else 'PASSED'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    # the collector's connection is closed on purpose, and the hostile publisher's by RabbitMQ;
    # aio-pika and aiormq log each time as an error
    for noisy in ("aiormq", "aio_pika"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    args = parse_args(argv)
    missing = [tool for tool in ("rabbitmqctl", *PG_TOOLS) if shutil.which(tool) is None]
    if missing:
        print(f"chaos: needs {', '.join(missing)} on this host", file=sys.stderr)
        return 2
    chaos = Chaos(args)
    _, error, interrupted = run_guarded(
        chaos.run, chaos.cleanup, chaos.interrupt, name="chaos", uvloop=False
    )
    elapsed = chaos.elapsed()
    failures = chaos.failures + [f"cleanup: {e}" for e in chaos.cleanup_errors]
    if interrupted:
        shutil.rmtree(chaos.logs, ignore_errors=True)
        print(
            "chaos: interrupted; processes stopped, broker limit set back, vhost deleted, "
            "cluster dropped",
            file=sys.stderr,
        )
        return 130
    if error is not None:
        failures.append(f"the run stopped: {type(error).__name__}: {error}")
        if not isinstance(error, (TimeoutError, RuntimeError)):
            traceback.print_exception(error)
    if chaos.figures:
        chaos.figures.update(wall_time_s=round(elapsed, 1), failures=failures, ok=not failures)
        print_figures(chaos.figures, failures, elapsed)
        out = Path(args.json) if Path(args.json).is_absolute() else ROOT / args.json
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(chaos.figures, indent=2) + "\n")
        print(f"figures written to {out}")
    if failures:
        print(f"\nchaos: FAILED after {elapsed:.1f}s:", file=sys.stderr)
        for failure in failures:
            print(f"  - {failure}", file=sys.stderr)
        print(f"  process logs kept in {chaos.logs}", file=sys.stderr)
        return 1
    if args.keep_logs:
        print(f"process logs kept in {chaos.logs}")
    else:
        shutil.rmtree(chaos.logs, ignore_errors=True)
    print(
        f"chaos: nothing lost, stuck, unsettled or wrong ({elapsed:.1f}s); processes stopped, "
        "vhost deleted, cluster dropped"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
