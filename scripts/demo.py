"""The demo: 3 workers, 500 fan-out tasks, one worker SIGKILLed mid-run, everything checked.

It makes its own database (``waystation_demo``, dropped first if a previous demo left it) and its
own queues (prefix ``demo.``), starts three worker processes of the example app and one
projection runner (``waystation projections run``), submits 500 ``orchestrator`` tasks (each
fans out to 3 ``researcher`` peers that work 30 ms), kills one worker with SIGKILL in the middle
of a burst of submissions and starts a replacement, and shows live progress: completed, paused
(waiting for peer replies, from the ``paused_tasks`` projection) and in flight. Then it checks:

* every result is correct and there is exactly one per task (none lost, none duplicated);
* the event log: per task exactly one TaskResumed, one TaskCompleted and 3 SubtaskClaimed, every
  stream's hash chain verifies, one stream per task and no other but those of researchers'
  tasks run again after the kill (just started and completed);
* ``waystation verify`` (the real command) finds no problem;
* the ``paused_tasks`` projection caught up, shows no task still paused, and
  ``waystation projections rebuild paused_tasks --check`` finds it identical to a rebuild;
* every process still running exits 0 on SIGTERM.

Each worker gets its own metrics port (``WAYSTATION_METRICS_PORT``); no check depends on it. On a
terminal the progress is a live bar; otherwise (CI, a pipe) a plain line about once a second.
Whatever happens (Ctrl-C included) it stops its processes, deletes its queues and drops its
database; it exits 0 only if everything held. ``--keep-logs`` keeps the process logs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from scripts.lab.harness.broker import (
    broker_counters,
    delete_topology,
    deployment_names,
    topology_queues,
    wait_for_consumers,
)
from scripts.lab.harness.checks import unplanned_streams
from scripts.lab.harness.database import paused_now, with_database
from scripts.lab.harness.guarded import run_guarded
from scripts.lab.harness.processes import (
    WorkerProcess,
    free_port,
    log_problems,
    metrics_env,
    stop_all,
    waystation_cli,
)
from waystation import migrations
from waystation.brokers.amqp import topology
from waystation.client import Client
from waystation.events import GENESIS_HASH, chain_hash
from waystation.events.postgres import PostgresEventStore
from waystation.example import app as example_app
from waystation.example import expected_total
from waystation.projections.postgres import projection_status
from waystation.settings import Settings

TASKS = 500
K = 3
WORK_MS = 30
WORKERS = 3
SUBMIT_PER_S = 80.0
"""Submission pace, so the run lasts a few seconds and the kill lands in the middle of it."""
KILL_AFTER = TASKS // 2
BURST = 60
"""The tasks before the kill are submitted at once, so the killed worker surely has work."""
KILL_DELAY = 0.05
RESULT_TIMEOUT = 60.0
"""How long the results may take after the last submission."""
CATCH_UP_TIMEOUT = 20.0
"""How long the projection runner may take to apply the whole log once the results are in."""
CLI_TIMEOUT = 60.0
DATABASE = "waystation_demo"
PREFIX = "demo."
AGENTS = tuple(example_app.agents)
PROJECTION = "paused_tasks"


@dataclass
class Line:
    """One row of the final summary."""

    what: str
    value: str
    ok: bool | None = None
    """None: information, not a check."""


class Demo:
    def __init__(self) -> None:
        base = Settings()
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
        self.console = Console(highlight=False, soft_wrap=True)
        self.live = self.console.is_terminal
        """A live progress bar on a terminal; plain lines elsewhere (CI, a pipe)."""
        if not self.live and "COLUMNS" not in os.environ:
            self.console.width = 100  # not 80: the summary table stays one line a row
        policy = os.environ.get("WAYSTATION_BROKER_POLICY", "auto")
        self.policy = (
            policy
            if policy != "auto"
            else ("rabbitmqctl" if shutil.which("rabbitmqctl") else "none")
        )

    def say(self, message: str) -> None:
        """A line with the time since the start (above the progress bar while it is shown)."""
        self.console.print(f"[{time.monotonic() - self.started:5.1f}s] {message}", markup=False)

    # ---- processes -------------------------------------------------------------------------------

    def _environment(self, name: str) -> dict[str, str]:
        port = free_port(exclude=self.ports.values())
        self.ports[name] = port
        return {
            "WAYSTATION_DATABASE_URL": self.database_url,
            "WAYSTATION_AMQP_URL": self.amqp_url,
            "WAYSTATION_QUEUE_PREFIX": PREFIX,
            "WAYSTATION_BROKER_POLICY": self.policy,
            "WAYSTATION_WORKER_ID": f"demo-{name}",
            **metrics_env(port),
            "WAYSTATION_LOG_FORMAT": "text",  # readable when the logs are kept
        }

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

    # ---- the run ---------------------------------------------------------------------------------

    async def run(self) -> list[str]:
        """Everything; the list of failed checks (empty when all held)."""
        self.console.print(
            f"Waystation demo: {WORKERS} workers, {TASKS} orchestrator tasks fanning out to {K} "
            f"researchers ({WORK_MS} ms of work each), one worker SIGKILLed mid-run.",
            markup=False,
        )
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

        failures: list[str] = []
        broker_before = broker_counters()
        async with Client(self.amqp_url, queue_prefix=PREFIX) as client:
            task_ids: dict[str, int] = {}
            submitter = asyncio.create_task(self.submit_all(client, task_ids))
            try:
                done = await self.follow(client, task_ids, submitter, failures)
            finally:
                if not submitter.done():
                    submitter.cancel()
                    with contextlib.suppress(BaseException):
                        await submitter
            await asyncio.sleep(0.5)  # a duplicate result, if any, has time to arrive
            results = {t: client.results[t] for t in task_ids if t in client.results}
            duplicate_messages = client.duplicates
        broker_after = broker_counters()

        # ---- checks ----
        self.say(
            ("all results in" if done == TASKS else f"{done} results in")
            + "; checking them, the event log and the projection"
        )
        wrong = [
            (task_ids[t], r)
            for t, r in results.items()
            if not r.ok or r.result != {"n": task_ids[t], "total": expected_total(task_ids[t], K)}
        ]
        check(
            self.console,
            failures,
            not wrong,
            f"all {len(results)} results correct (total = expected_total(n, {K}))",
            f"{len(wrong)} wrong results, e.g. {wrong[:3]}",
        )
        lost = len(task_ids) - len(results)
        check(
            self.console,
            failures,
            len(results) == len(task_ids) == TASKS,
            f"{len(results)} distinct results for {len(task_ids)} submitted tasks "
            f"({duplicate_messages} duplicate result messages ignored by the client)",
            f"{len(results)} distinct results for {len(task_ids)} submitted tasks",
        )
        duplicated, taken_over = await self.check_log(list(task_ids), failures)
        verified = await self.check_verify(failures)
        projection = await self.check_projection(failures)

        stopping = [p for p in self.processes() if p.alive()]
        codes = stop_all(stopping, timeout=30)
        self.say(
            "stopped with SIGTERM: "
            + ", ".join(f"{name} exit {code}" for name, code in codes.items())
        )
        stopped_ok = all(code == 0 for code in codes.values()) and len(codes) == WORKERS + 1
        check(
            self.console,
            failures,
            stopped_ok,
            f"every surviving worker and the projection runner exited 0 ({len(codes)} processes)",
            f"exit codes on SIGTERM {codes}",
        )
        recovery = _recovery_lines(sorted(self.logs.glob("worker*.log")))
        if broker_before and broker_after:
            recovery["messages RabbitMQ redelivered (broker-wide counter)"] = (
                broker_after["redelivered"] - broker_before["redelivered"]
            )
        self.note(
            "recovery seen in the worker logs: "
            + (", ".join(f"{what}: {n}" for what, n in recovery.items()) or "none")
        )
        problems, first = log_problems(sorted(self.logs.glob("*.log")))
        self.note(f"process logs: {problems} warning/error lines" + (":" if first else ""))
        for line in first:
            self.note(f"  {line}")

        replacement = self.workers[-1]
        moved_by = f"{self.killed.name} -> {replacement.name}" if self.killed else "none"
        self.summary = [
            Line("tasks submitted", str(len(task_ids)), len(task_ids) == TASKS),
            Line(
                "completed correctly",
                str(len(results) - len(wrong)),
                not wrong and len(results) == TASKS,
            ),
            Line("lost", str(lost), lost == 0),
            Line("duplicated", str(duplicated), duplicated == 0),
            Line("waystation verify", verified[1], verified[0]),
            Line(PROJECTION, projection[1], projection[0]),
            Line(
                "killed -> replaced",
                f"{moved_by}, {taken_over} of its paused tasks moved",
                self.killed is not None,
            ),
            Line(
                "exit 0 on SIGTERM",
                f"{sum(c == 0 for c in codes.values())} of {len(codes)} processes",
                stopped_ok,
            ),
        ]
        return failures

    async def submit_all(self, client: Client, task_ids: dict[str, int]) -> None:
        for n in range(TASKS):
            task_ids[await client.submit("orchestrator", {"n": n, "k": K, "work_ms": WORK_MS})] = n
            if n + 1 == KILL_AFTER:
                # the burst just before is in the works: kill a worker in the middle of it
                await asyncio.sleep(KILL_DELAY)
                self.killed = self.workers[1]
                self.killed.kill()
                self.say(
                    f"submitted {n + 1}/{TASKS} (the last {BURST} at once): "
                    f"SIGKILL {self.killed.name} (pid {self.killed.pid}) mid-run"
                )
                self.start_worker()
            if not KILL_AFTER - BURST <= n + 1 < KILL_AFTER:
                await asyncio.sleep(1 / SUBMIT_PER_S)

    async def follow(
        self,
        client: Client,
        task_ids: dict[str, int],
        submitter: asyncio.Task[None],
        failures: list[str],
    ) -> int:
        """Show the progress until every result is in (or the time is up); the results in."""
        deadline = time.monotonic() + TASKS / SUBMIT_PER_S + RESULT_TIMEOUT
        with self.progress() as show:
            while True:
                await asyncio.sleep(0.2)
                done = sum(1 for t in task_ids if t in client.results)
                show(done, len(task_ids), await self.paused_now(), len(self.alive()))
                if submitter.done():
                    submitter.result()  # raise its error, if any
                    if done == TASKS:
                        return done
                if time.monotonic() > deadline:
                    failures.append(
                        f"only {done} of {TASKS} results within {RESULT_TIMEOUT:.0f}s "
                        f"after the last submission"
                    )
                    return done

    @contextlib.contextmanager
    def progress(self) -> Iterator[Callable[[int, int, int | None, int], None]]:
        """A function to call with (completed, submitted, paused, workers alive): a live bar on a
        terminal, else a plain line about once a second (and the last one at the end)."""
        if not self.live:
            plain = _PlainProgress(self.say)
            try:
                yield plain.update
            finally:
                plain.flush()
            return
        bar = _LiveProgress(
            TextColumn("[bold]tasks"),
            BarColumn(bar_width=40),
            MofNCompleteColumn(),
            TextColumn("completed"),
            TimeElapsedColumn(),
            console=self.console,
            refresh_per_second=10,
        )
        task = bar.add_task("tasks", total=TASKS, counts=_counts(0, 0, 0, len(self.alive())))

        def live(done: int, submitted: int, paused: int | None, alive: int) -> None:
            bar.update(task, completed=done, counts=_counts(done, submitted, paused, alive))

        with bar:
            yield live

    def note(self, message: str) -> None:
        self.console.print(f"       {message}", markup=False)

    async def check_log(self, task_ids: list[str], failures: list[str]) -> tuple[int, int]:
        """The event log's checks; (tasks with a step recorded more than once, tasks the killed
        worker paused that another worker completed)."""
        store = PostgresEventStore.from_url(self.database_url, pool_size=4)
        killed_id = f"demo-{self.killed.name}" if self.killed else None
        try:
            counts: collections.Counter[str] = collections.Counter()
            bad_counts: list[str] = []
            broken_chains: list[str] = []
            moved = taken_over = duplicated = 0
            writers: collections.Counter[str] = collections.Counter()
            for task_id in task_ids:
                events = await store.read_stream(task_id)
                types = collections.Counter(e.event_type for e in events)
                counts.update(types)
                duplicated += (
                    types["TaskCompleted"] > 1
                    or types["TaskResumed"] > 1
                    or types["SubtaskClaimed"] > K
                )
                if (types["TaskCompleted"], types["TaskResumed"], types["SubtaskClaimed"]) != (
                    1,
                    1,
                    K,
                ):
                    bad_counts.append(f"{task_id}: {dict(types)}")
                previous = GENESIS_HASH
                for event in events:
                    if (
                        event.prev_hash != previous
                        or chain_hash(previous, event.hash_body()) != event.hash
                    ):
                        broken_chains.append(f"{task_id} v{event.stream_version}")
                        break
                    previous = event.hash
                by_type = {e.event_type: e.metadata.get("worker_id") for e in events}
                writers.update(str(e.metadata.get("worker_id")) for e in events)
                if by_type.get("TaskPaused") != by_type.get("TaskCompleted"):
                    moved += 1
                    taken_over += by_type.get("TaskPaused") == killed_id
            others = await _other_streams(store, task_ids)
        finally:
            await store.close()
        check(
            self.console,
            failures,
            not bad_counts,
            f"every task's stream has exactly 1 TaskCompleted, 1 TaskResumed "
            f"and {K} SubtaskClaimed",
            f"{len(bad_counts)} streams with other counts, e.g. {bad_counts[:3]}",
        )
        check(
            self.console,
            failures,
            not broken_chains,
            f"hash chains of all {len(task_ids)} streams verify",
            f"{len(broken_chains)} broken hash chains, e.g. {broken_chains[:3]}",
        )
        unplanned = unplanned_streams(task_ids, others, K, rounds=1)
        check(
            self.console,
            failures,
            not unplanned,
            f"the log holds {len(task_ids) + len(others)} streams: one per task, and "
            f"{len(others)} of researchers' tasks run again after the kill (each started and "
            "completed once; a first run records nothing)",
            f"{len(unplanned)} streams of no task and of no researcher's task run again, "
            f"e.g. {unplanned[:3]}",
        )
        self.note(f"events: {dict(sorted(counts.items()))}")
        self.note(f"events written per worker: {dict(sorted(writers.items()))}")
        self.note(
            f"tasks paused on one worker and completed on another: {moved} "
            f"({taken_over} paused by the killed worker)"
        )
        return duplicated, taken_over

    async def check_verify(self, failures: list[str]) -> tuple[bool, str]:
        """``waystation verify`` of the whole log: (it exited 0, its summary line)."""
        code, output = await self.cli("verify")
        summary = output.strip().splitlines()[-1] if output.strip() else "(no output)"
        check(
            self.console,
            failures,
            code == 0,
            f"waystation verify: {summary}",
            f"waystation verify exited {code}: {output.strip()[-2000:]}",
        )
        return code == 0, summary if code == 0 else f"exit {code}: {summary}"

    async def check_projection(self, failures: list[str]) -> tuple[bool, str]:
        """The runner applied the whole log, no task is still paused, and the live table equals
        a rebuild from position zero; (all that held, what to show)."""
        deadline = time.monotonic() + CATCH_UP_TIMEOUT
        while True:
            statuses = await projection_status(self._engine())
            behind = next(s.behind for s in statuses if s.name == PROJECTION)
            paused = await self.paused_now()
            if (behind == 0 and paused == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        caught_up = behind == 0 and paused == 0
        check(
            self.console,
            failures,
            caught_up,
            f"the {PROJECTION} projection applied the whole log: no task still paused",
            f"the {PROJECTION} projection after {CATCH_UP_TIMEOUT:.0f}s: {behind} events behind, "
            f"{paused} tasks still paused",
        )
        code, output = await self.cli("projections", "rebuild", PROJECTION, "--check")
        lines = output.strip().splitlines()
        check(
            self.console,
            failures,
            code == 0,
            f"waystation projections rebuild {PROJECTION} --check: "
            + (lines[-1].strip() if lines else "(no output)"),
            f"waystation projections rebuild {PROJECTION} --check exited {code}: "
            f"{output.strip()[-2000:]}",
        )
        ok = caught_up and code == 0
        return ok, (
            f"{paused} paused, {behind} behind, rebuild --check "
            + ("identical" if code == 0 else f"exit {code}")
        )

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


async def _other_streams(store: PostgresEventStore, task_ids: list[str]) -> dict[str, list[str]]:
    """The event types of every stream but the tasks', by stream id."""
    async with store.engine.connect() as connection:
        rows = await connection.execute(
            text(
                "SELECT stream_id, event_type FROM events "
                "WHERE NOT (stream_id = ANY(CAST(:ids AS text[]))) "
                "ORDER BY stream_id, stream_version"
            ),
            {"ids": task_ids},
        )
        streams: dict[str, list[str]] = {}
        for stream_id, event_type in rows:
            streams.setdefault(stream_id, []).append(event_type)
        return streams


_RECOVERY = {
    "outbox messages republished by the relay": re.compile(rb"outbox relay published (\d+)"),
    "redeliveries recognised": re.compile(
        rb"redelivered after its checkpoint|already recorded by another"
    ),
    "resumes already done": re.compile(rb"resume of .* already done"),
    "replies not applied (duplicate or late)": re.compile(rb"not applied: "),
}


def _recovery_lines(paths: list[Path]) -> dict[str, int]:
    """What the workers logged about redeliveries and the outbox relay (INFO lines)."""
    found: collections.Counter[str] = collections.Counter()
    for path in paths:
        with contextlib.suppress(OSError), open(path, "rb") as log:
            for line in log:
                for what, pattern in _RECOVERY.items():
                    match = pattern.search(line)
                    if match:
                        found[what] += int(match.group(1)) if match.groups() else 1
    return dict(found)


def _counts(done: int, submitted: int, paused: int | None, alive: int) -> dict[str, str]:
    """What the progress shows besides the bar; in flight = submitted - completed - paused (in
    the queues or in a handler). The projection can lag a moment behind the results: never
    show more paused than not completed, nor fewer than 0 in flight."""
    if paused is None:  # the projection could not be read this time
        shown, in_flight = "?", "?"
    else:
        paused = min(paused, submitted - done)
        shown, in_flight = str(paused), str(submitted - done - paused)
    return {
        "paused": shown,
        "in_flight": in_flight,
        "submitted": str(submitted),
        "alive": str(alive),
    }


class _LiveProgress(Progress):
    """The bar, and under it the counts: paused, in flight, submitted, workers alive."""

    def get_renderables(self) -> Iterator[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            counts = task.fields["counts"]
            yield Text.from_markup(
                f"      [yellow]{counts['paused']:>3}[/] paused on peers   "
                f"[cyan]{counts['in_flight']:>3}[/] in flight   "
                f"{counts['submitted']:>3} submitted   {counts['alive']} workers alive"
            )


class _PlainProgress:
    """Progress for a pipe or a log: a line about once a second, no escape codes."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.pending: str | None = None
        self.printed = 0.0

    def update(self, done: int, submitted: int, paused: int | None, alive: int) -> None:
        counts = _counts(done, submitted, paused, alive)
        self.pending = (
            f"completed {done:3d}/{TASKS}, paused {counts['paused']:>3}, in flight "
            f"{counts['in_flight']:>3}, submitted {submitted:3d}, workers alive {alive}"
        )
        if time.monotonic() - self.printed >= 1.0:
            self.flush()

    def flush(self) -> None:
        if self.pending is not None:
            self.printed = time.monotonic()
            self.say(self.pending)
            self.pending = None


def check(console: Console, failures: list[str], ok: bool, good: str, bad: str) -> None:
    console.print(f"  {'ok  ' if ok else 'FAIL'} {good if ok else bad}", markup=False)
    if not ok:
        failures.append(bad)


def summary_table(lines: list[Line], elapsed: float, passed: bool) -> Table:
    table = Table(title="Waystation demo: summary", title_justify="left", show_header=False)
    table.add_column("check")
    table.add_column("what")
    table.add_column("value")
    for line in [*lines, Line("elapsed", f"{elapsed:.1f}s")]:
        mark = "" if line.ok is None else ("[green]ok[/]" if line.ok else "[bold red]FAIL[/]")
        table.add_row(mark, line.what, escape(line.value))
    table.add_row("", "[bold]result", "[bold green]PASSED" if passed else "[bold red]FAILED")
    return table


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    demo = Demo()
    failures, error, interrupted = run_guarded(demo.run, demo.cleanup, demo.interrupt, name="demo")
    elapsed = time.monotonic() - demo.started
    console = demo.console
    if interrupted:
        shutil.rmtree(demo.logs, ignore_errors=True)
        print(
            "demo: interrupted; processes stopped, queues deleted, database "
            + (f"{DATABASE} dropped" if not demo.cleanup_errors else "cleanup incomplete"),
            file=sys.stderr,
        )
        return 130
    failures = list(failures or []) + [f"cleanup: {e}" for e in demo.cleanup_errors]
    passed = error is None and not failures
    if demo.summary:
        console.print()
        console.print(summary_table(demo.summary, elapsed, passed))
    if error is not None:
        print(
            f"\ndemo: FAILED after {elapsed:.1f}s: {type(error).__name__}: {error}", file=sys.stderr
        )
        if not isinstance(error, (TimeoutError, RuntimeError)):
            traceback.print_exception(error)
        print(f"  process logs kept in {demo.logs}", file=sys.stderr)
        return 1
    if failures:
        print(f"\ndemo: FAILED after {elapsed:.1f}s:", file=sys.stderr)
        for failure in failures:
            print(f"  - {failure}", file=sys.stderr)
        print(f"  process logs kept in {demo.logs}", file=sys.stderr)
        return 1
    if "--keep-logs" in sys.argv[1:]:
        console.print(f"process logs kept in {demo.logs}", markup=False)
    else:
        shutil.rmtree(demo.logs, ignore_errors=True)
    console.print(
        f"\ndemo: everything held ({elapsed:.1f}s); processes stopped, queues deleted, "
        f"database {DATABASE} dropped.",
        markup=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
