"""The chaos run: real worker processes on the real services under mixed faults, every task
checked.

A RabbitMQ vhost of the run's own (the delivery-limit policy applied as in production) and a
scratch PostgreSQL cluster of its own (``pg_createcluster`` on a free port), so that closing every
connection and restarting PostgreSQL hit nothing else on this machine. In them: ``--workers``
worker processes of the example app and one ``waystation projections run``. ``--tasks``
orchestrator tasks, each 2 rounds of 3 researcher calls (``work_ms`` of simulated work per call),
are kept ``--in-flight`` at a time; their results come back through a durable reply queue
(:class:`_bench.chaos.ChaosCollector`), which outlives a closed connection.

Meanwhile the faults land, spread over the run by results (:func:`_bench.chaos.plan_faults`):
``--kills`` SIGKILLs of a random worker (a replacement starts at once), ``--connection-closes``
``rabbitmqctl close_all_connections`` in the vhost (every worker and the collector cut off) and
``--pg-restarts`` fast stops of the cluster, down ``--pg-down`` seconds, started again. Each
waits until every worker answers ``/healthz`` (so that it hits a worker with work, not one still
starting) and is logged with the results in, the tasks in flight and the victim's messages in
its handlers. The last ``--in-flight`` tasks are submitted only once every fault has landed, so
no fault can find the run over.

Then, once nothing is left in any queue or in the outbox, the figures: results missing, wrong
(another result, or two different ones) and duplicated; per task in the log, one TaskCompleted,
each pause recorded and resumed once, each sub-task claimed once; ``waystation verify`` and
``waystation projections rebuild paused_tasks|agent_stats --check`` as subprocesses; dead
letters and their reasons; the faults with their times; the wall time. Printed, and written as
JSON (``--json``). Exit 0 only if nothing was lost or wrong; 1 otherwise (each failure named);
2 when this machine cannot run it (no rabbitmqctl or PostgreSQL cluster tools). Whatever
happens (Ctrl-C included) the processes are stopped, the vhost deleted and the cluster dropped;
the process logs are kept when the run failed (or with ``--keep-logs``).
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
from _bench import paused_now, run_guarded
from _bench.chaos import ChaosCollector, Health, PlannedFault, plan_faults, probe_health
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

import migrations
from events.codec import loads
from projections.postgres import projection_status
from tests.harness.broker import (
    apply_queue_policy,
    broker_connections,
    busy_queues,
    close_all_broker_connections,
    deployment_names,
    temporary_vhost,
)
from tests.harness.checks import LogFigures, ResultFigures, log_figures, result_figures
from tests.harness.database import PG_TOOLS, PostgresCluster
from tests.harness.processes import (
    ROOT,
    WorkerProcess,
    free_port,
    log_problems,
    metrics_env,
    stats_counters,
    stop_all,
    waystation_cli,
)
from workers.deadletters import browse
from workers.example import expected_total
from workers.settings import Settings

K = 3
ROUNDS = 2
PREFIX = "chaos."
DATABASE = "waystation_chaos"
PROJECTIONS = ("paused_tasks", "agent_stats")
HEALTHY_WITHIN = 90.0
"""How long the workers may take to be healthy again before a fault (a restart, a reconnect)."""
STALL_LIMIT = 180.0
"""Once every task is submitted: how long without a new result before the rest count as lost."""
SETTLE_WITHIN = 120.0
CLI_TIMEOUT = 300.0
QUICK = {
    "tasks": 50,
    "kills": 2,
    "connection_closes": 1,
    "pg_restarts": 1,
    "in_flight": 10,
    "work_ms": (1000.0, 1800.0),
    "pg_down": 1.0,
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/chaos",
        description="Real worker processes on the real services under mixed faults (SIGKILLs, "
        "every broker connection closed, PostgreSQL restarted); every task checked.",
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
    parser.add_argument("--seed", type=int, default=None, help="the fault plan's (random)")
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
    return args


def fault_span(tasks: int, in_flight: int) -> int:
    """The faults land within the first this many results. The last ``in_flight`` tasks are
    held back until every fault has landed, so at most ``tasks - in_flight`` results can come
    before; ending the span a tenth of those and a full window earlier leaves the tasks still to
    submit that keep work in flight while a fault waits for the workers to be healthy."""
    return max(1, int(0.9 * (tasks - in_flight)) - in_flight)


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
        self.submitted = 0
        self.submit_retries: list[str] = []
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
        worker = WorkerProcess(self._environment(name), self.logs / f"{name}.log").start()
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
        # the vhost's deletion takes the queue with it; close only the connection
        self.stack.push_async_callback(self.collector.close, delete_queue=False)
        rng = random.Random(args.seed)
        inputs = {
            f"chaos-{args.seed}-{n}": {
                "n": n,
                "k": K,
                "rounds": ROUNDS,
                "work_ms": round(rng.uniform(*args.work_ms), 1),
            }
            for n in range(args.tasks)
        }
        plan = plan_faults(
            fault_span(args.tasks, args.in_flight),
            args.kills,
            args.connection_closes,
            args.pg_restarts,
            args.seed,
        )
        submitter = asyncio.create_task(self.submit_all(inputs))
        injector = asyncio.create_task(self.inject(plan))
        try:
            await self.follow(submitter, injector)
        finally:
            for task in (submitter, injector):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
        await self.settle()
        await self.check(inputs)

    async def prepare(self) -> None:
        """The vhost, the scratch cluster, the database and the queue policy."""
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
        assert self.collector is not None
        return self.collector.answered()

    async def submit_all(self, inputs: dict[str, dict[str, Any]]) -> None:
        """Keep ``--in-flight`` tasks outstanding; hold the tail back until every fault landed."""
        assert self.collector is not None
        hold_from = len(inputs) - self.args.in_flight
        for index, (task_id, spec) in enumerate(inputs.items()):
            if index == hold_from and not self.faults_done.is_set():
                self.say(f"{index} submitted; the last {len(inputs) - index} wait for the faults")
                await self.faults_done.wait()
            await self.collector.wait_answered(self.submitted - self.args.in_flight + 1)
            await self.submit(task_id, spec)
            self.submitted += 1

    async def submit(self, task_id: str, spec: dict[str, Any]) -> None:
        """Publish one task, again (same task id) if its confirm was lost with a connection."""
        assert self.collector is not None
        deadline = time.monotonic() + 120
        while True:
            try:
                await asyncio.wait_for(
                    self.collector.submit("orchestrator", spec, task_id=task_id), 30
                )
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                self.submit_retries.append(task_id)
                await asyncio.sleep(0.5)

    async def follow(self, submitter: asyncio.Task[None], injector: asyncio.Task[None]) -> None:
        """Progress lines until every result is in, or nothing came for STALL_LIMIT seconds."""
        last_line = last_count = 0.0
        last_change = time.monotonic()
        while True:
            await asyncio.sleep(0.25)
            for task in (submitter, injector):
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
            if done >= self.args.tasks and submitter.done():
                await self.progress_line(done)
                return
            if (
                submitter.done()
                and injector.done()
                and time.monotonic() - last_change > STALL_LIMIT
            ):
                self.fail(
                    f"no new result for {STALL_LIMIT:.0f}s with {done} of {self.args.tasks} in"
                )
                return

    async def progress_line(self, done: int) -> None:
        paused = await self.paused_now()
        alive = sum(w.alive() for w in self.slots)
        self.say(
            f"results {done:>5}/{self.args.tasks}, submitted {self.submitted:>5}, in flight "
            f"{self.submitted - done:>3}, paused {'?' if paused is None else paused:>3}, "
            f"workers alive {alive}/{len(self.slots)}, faults {len(self.faults)}"
        )

    async def paused_now(self) -> int | None:
        return await paused_now(self._engine())

    def _engine(self) -> AsyncEngine:
        assert self.engine is not None
        return self.engine

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
                    "tasks_in_flight": self.submitted - done,
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
        """Until nothing can still happen: the outbox empty and every queue (the results' too)
        empty, twice in a row."""
        deadline = time.monotonic() + SETTLE_WITHIN
        quiet = 0
        state: dict[str, int] = {}
        while quiet < 2:
            if time.monotonic() > deadline:
                self.fail(f"the run did not settle within {SETTLE_WITHIN:.0f}s: {state}")
                return
            await asyncio.sleep(0.5)
            state = await self.pending()
            quiet = quiet + 1 if not state else 0
        self.say("settled: the outbox and every queue are empty")

    async def pending(self) -> dict[str, int]:
        """What is still waiting: outbox rows, and messages (ready or unacked) per queue."""
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
            t: {"n": spec["n"], "total": expected_total(spec["n"], K, ROUNDS)}
            for t, spec in inputs.items()
        }
        results = result_figures(expected, self.collector.messages())
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
        log = log_figures(list(inputs), [(r[0], r[1], r[2], r[3], r[4]) for r in rows], K, ROUNDS)
        caught_up = await self.wait_for_projections()
        paused_left = await self.paused_now()
        cli = await self.cli_checks()
        letters = await browse(self.amqp_url, self.names, limit=10_000)
        reasons = Counter(letter.reason for letter in letters)
        codes = stop_all([p for p in self.processes() if p.alive()], timeout=30)
        problems, first_problems = log_problems(sorted(self.logs.glob("*.log")))
        counters = _stats_counters(self.logs)

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
            },
            "tasks_submitted": self.submitted,
            "submits_retried": len(self.submit_retries),
            "results": results.to_json(),
            "log": {"events_in_log": len(rows), **log.to_json()},
            "verify_exit": cli["verify"][0],
            "verify": cli["verify"][1],
            "rebuild_paused_tasks_check_exit": cli["paused_tasks"][0],
            "rebuild_agent_stats_check_exit": cli["agent_stats"][0],
            "projections_caught_up": caught_up,
            "paused_tasks_left": paused_left,
            "agent_stats_orchestrator_completed": cli["completed"],
            "dead_letters": {"count": len(letters), "reasons": dict(reasons)},
            "faults": self.faults,
            "faults_injected": dict(Counter(f["kind"] for f in self.faults)),
            "processes_started": len(self.retired) + len(self.processes()),
            "exit_codes_on_sigterm": codes,
            "log_warning_lines": problems,
            "worker_counters_of_clean_exits": counters,
        }
        self.judge(results, log, cli, caught_up, paused_left, letters, codes)
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
        results: ResultFigures,
        log: LogFigures,
        cli: dict[str, Any],
        caught_up: bool,
        paused_left: int | None,
        letters: list[Any],
        codes: dict[str, int | None],
    ) -> None:
        """Every loss or wrongness found, as a failure."""
        args = self.args
        checks = [
            (self.submitted == args.tasks, f"{self.submitted} of {args.tasks} tasks submitted"),
            (not results.missing, f"{len(results.missing)} tasks lost (no result)"),
            (not results.wrong, f"{len(results.wrong)} tasks with a wrong or second result"),
            (not results.unexpected, f"{results.unexpected} results of tasks never submitted"),
            (
                not log.not_completed_once,
                f"{len(log.not_completed_once)} tasks without exactly one completion in the log",
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
                cli["completed"] == args.tasks,
                f"agent_stats counts {cli['completed']} completed orchestrator tasks",
            ),
            (not letters, f"{len(letters)} messages dead-lettered"),
            (
                all(code == 0 for code in codes.values()),
                f"exit codes on SIGTERM: {codes}",
            ),
        ]
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


def print_figures(figures: dict[str, Any], failures: list[str], elapsed: float) -> None:
    results, log = figures["results"], figures["log"]
    dead = figures["dead_letters"]
    injected = figures["faults_injected"]
    rows = [
        (
            "tasks submitted",
            f"{figures['tasks_submitted']} ({figures['submits_retried']} "
            "publishes retried after a connection close)",
        ),
        ("results received", f"{results['answered']} tasks, {results['messages']} messages"),
        ("missing results", results["missing"]),
        ("wrong results", results["wrong"]),
        (
            "duplicate results",
            f"{results['duplicates']} ({results['duplicates_redelivered_to_collector']} "
            f"redelivered to the collector, {results['duplicates_published_again']} "
            "published again by a worker)",
        ),
        ("tasks without exactly one completion", log["tasks_not_completed_once"]),
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
        ("dead letters", f"{dead['count']} {dead['reasons'] or ''}".strip()),
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
    # the collector's connection is closed on purpose; aio-pika logs each time as an error
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
            "chaos: interrupted; processes stopped, vhost deleted, cluster dropped", file=sys.stderr
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
        f"chaos: nothing lost, nothing wrong ({elapsed:.1f}s); processes stopped, vhost "
        "deleted, cluster dropped"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
