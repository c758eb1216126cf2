"""The benchmark: the fan-out/fan-in job of docs/performance.md on real worker processes, and the
figures around it (event appends, projection rebuilds, a worker's memory over a long run, a
concurrency curve), optionally side by side with the same job in Celery.

Modes (``--only``, comma-separated, or ``all``; by default ``throughput,single`` with Celery
beside them, three to four minutes, so that it can be run before and after every change):

* ``throughput``: per run, a warm-up, then ``--parents`` orchestrator tasks (K researchers each,
  work_ms 0) kept ``--in-flight`` at a time; parents/s and submit-to-result latency;
* ``single``: per run, a short warm-up, then ``--single`` parents one at a time; latency, and the
  checkpoint's own cost without queueing (``checkpoint_p50_ms``);
* ``curve``: throughput and latency at each of ``--curve-points`` parents in flight, each point a
  window of ``--curve-seconds`` in a continuous stream (after a warm-up of max(in flight, 50)
  completions); a PNG chart (``--chart``);
* ``memory``: ``--memory-tasks`` tasks (a parent is 1+K tasks) through the workers; each
  worker's VmRSS after the warm-up, periodically, and at the end;
* ``append``: event appends to the PostgreSQL log, batched, by concurrent writers
  (:mod:`_bench.append`);
* ``rebuild``: projection rebuilds from position zero (:mod:`_bench.rebuild`);
* ``statestore``: PenguiFlow's ``save_event`` through ``waystation.contrib.penguiflow`` on the log,
by
  concurrent callers (:mod:`_bench.statestore`; needs ``waystation[penguiflow]``).

Each run of the worker modes gets a fresh database (``waystation_bench_<random>``, migrated,
dropped at the end) and a fresh queue prefix (queues deleted at the end), and each session fresh
``python -m waystation.cli worker`` subprocesses of the example app. The workers are stopped with
SIGTERM after each session and write their stats file (``WAYSTATION_STATS_FILE``): checkpoint
latencies (handler returned a pause until its ack) and counters. Per parent, over the whole
session (warm-up included, so that database statistics are flushed by the exiting backends and
nothing is cut in half): database transactions (the database's ``pg_stat_database.xact_commit``),
messages (each delivery a worker settled, plus the result the client received; cross-checked
with RabbitMQ's global counters when rabbitmqctl works). Per parent over the measured phase
only: CPU of the workers (/proc/<pid>/stat), of RabbitMQ, of the bench process (the client) and
of the whole machine. Figures are the median across ``--runs``; the JSON has every run.

``--compare celery`` (the default; ``--compare none`` skips it) runs the same job in Celery
(:mod:`_bench.celery_job`) in the same runs, right after the Waystation sessions, with the same
parents and parents in flight, and at every curve point; ``ratio_vs_celery`` is the ratio of the
median throughputs. ``worker_cpu_ratio_vs_celery`` and ``machine_cpu_ratio_vs_celery`` are the
medians of each run's own ratio of CPU per parent (both systems on the same machine within a
run, whose speed moves from hour to hour): the steadiest figure to compare code by. Its target,
0.56, is issue 13's: 55% of the 1.02 it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench import (
    cpu_per_parent_ms,
    cpu_snapshot,
    database_counters,
    percentile,
    rabbitmq_pid,
    server_versions,
    system_busy_seconds,
    wait_for_backends_gone,
)
from _bench.append import append_benchmark
from _bench.drive import BenchFailure, One, Progress, measure
from _bench.memory import RssSampler, rss_summary
from _bench.rebuild import rebuild_benchmark
from _bench.report import fmt, memory_parents, print_report, summarise

from scripts.lab.harness.broker import (
    broker_counters,
    delete_topology,
    deployment_names,
    queue_depths,
    topology_queues,
    wait_for_consumers,
)
from scripts.lab.harness.database import with_database
from scripts.lab.harness.guarded import run_guarded
from scripts.lab.harness.processes import ROOT, WorkerProcess, log_problems, stop_all
from waystation import migrations
from waystation.client import Client
from waystation.example import app as example_app
from waystation.example import expected_total
from waystation.settings import Settings

AGENTS = tuple(example_app.agents)
SINGLE_WARMUP = 20
MODES = ("throughput", "single", "curve", "memory", "append", "rebuild", "statestore")
DEFAULT_MODES = ("throughput", "single")
"""What plain ``scripts/bench`` runs (three to four minutes with Celery); the rest on request."""
CELERY_POOLS = ("solo", "prefork", "threads")  # as _bench.celery_job.POOLS (needs no celery here)


def _modes(value: str) -> list[str]:
    modes = [m.strip() for m in value.split(",") if m.strip()]
    if modes == ["all"]:
        return list(MODES)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(MODES)}"
        )
    return [m for m in MODES if m in modes]


def _points(value: str) -> list[int]:
    try:
        points = sorted({int(p) for p in value.split(",") if p.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {value!r}") from None
    if not points or points[0] < 1:
        raise argparse.ArgumentTypeError("points must be integers of at least 1")
    return points


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/bench",
        description="Fan-out/fan-in benchmark of Waystation on real worker processes, with event "
        "appends, projection rebuilds, memory over a long run and a concurrency curve; "
        "optionally side by side with the same job in Celery.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--only",
        type=_modes,
        default=list(DEFAULT_MODES),
        metavar="MODES",
        help=f"comma-separated modes to run, of: {', '.join(MODES)}; or all",
    )
    parser.add_argument(
        "--compare",
        choices=["celery", "none"],
        default="celery",
        help="run the same job in Celery (RabbitMQ broker, Redis results, acks_late) side by side "
        "in the throughput, single and curve modes; none: Waystation alone",
    )
    job = parser.add_argument_group("the job (both systems)")
    job.add_argument("--parents", type=int, default=2000, help="parents in the throughput phase")
    job.add_argument("--in-flight", type=int, default=100, help="parents in flight at once")
    job.add_argument("--k", type=int, default=3, help="researchers per parent")
    job.add_argument(
        "--single",
        type=int,
        default=200,
        help="parents submitted one at a time (single-parent latency); 0 skips",
    )
    job.add_argument("--runs", type=int, default=3, help="runs; medians are reported")
    job.add_argument("--warmup", type=int, default=100, help="unmeasured parents first")
    job.add_argument("--workers", type=int, default=2, help="worker processes")
    job.add_argument("--work-ms", type=float, default=0.0, help="simulated work per researcher")
    job.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="WAYSTATION_CONCURRENCY of the workers (default: the worker's own)",
    )
    job.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds to wait for any one result before giving up",
    )
    curve = parser.add_argument_group("curve mode")
    curve.add_argument(
        "--curve-points",
        type=_points,
        default=[1, 10, 100, 500],
        metavar="N,N,...",
        help="parents in flight at each point of the concurrency curve",
    )
    curve.add_argument(
        "--curve-seconds",
        type=float,
        default=10.0,
        help="measuring window of each curve point (after its warm-up)",
    )
    curve.add_argument(
        "--chart", default="bench-results/concurrency.png", help="where to draw the curve (PNG)"
    )
    memory = parser.add_argument_group("memory mode")
    memory.add_argument(
        "--memory-tasks",
        type=int,
        default=100_000,
        help="tasks through the workers, warm-up included (a parent is 1+K tasks)",
    )
    memory.add_argument(
        "--memory-warmup", type=int, default=1000, help="parents before the start sample"
    )
    memory.add_argument(
        "--memory-sample-every", type=float, default=5.0, help="seconds between RSS samples"
    )
    append = parser.add_argument_group("append mode")
    append.add_argument(
        "--append-events", type=int, default=200_000, help="events appended per run (batched)"
    )
    append.add_argument("--append-batch", type=int, default=100, help="events per append")
    append.add_argument("--append-writers", type=int, default=8, help="concurrent writers")
    statestore = parser.add_argument_group("statestore mode")
    statestore.add_argument(
        "--statestore-events", type=int, default=20_000, help="distinct events saved per run"
    )
    statestore.add_argument(
        "--statestore-traces", type=int, default=200, help="traces the events are spread over"
    )
    statestore.add_argument(
        "--statestore-callers", type=int, default=64, help="concurrent save_event callers"
    )
    rebuild = parser.add_argument_group("rebuild mode")
    rebuild.add_argument(
        "--rebuild-events",
        type=int,
        default=200_000,
        help="events in the log of the projection-rebuild benchmark; 0 skips it",
    )
    rebuild.add_argument(
        "--rebuild-only",
        action="store_true",
        help="only the projection-rebuild benchmark (the same as --only rebuild)",
    )
    celery = parser.add_argument_group("--compare celery")
    celery.add_argument(
        "--celery-pool",
        choices=CELERY_POOLS,
        default="solo",
        help="solo: --workers `celery worker --pool solo` processes; prefork: one worker with "
        "--concurrency=--workers; threads: --workers processes of --celery-threads threads",
    )
    celery.add_argument(
        "--celery-threads", type=int, default=4, help="threads per process of --celery-pool threads"
    )
    celery.add_argument(
        "--celery-prefetch",
        type=int,
        default=64,
        help="worker_prefetch_multiplier of the Celery workers (Celery's default is 4; measured "
        "here: 2 solo workers did ~92 parents/s at 4, ~138 at 16, ~140 at 64)",
    )
    celery.add_argument(
        "--celery-queue-type",
        choices=["classic", "quorum"],
        default="classic",
        help="type of the Celery task queue (Celery's default is classic; Waystation's queues "
        "are quorum queues)",
    )
    parser.add_argument(
        "--json", default="bench-results/latest.json", help="where to write results"
    )
    args = parser.parse_args(argv)
    if args.compare == "none":
        args.compare = None
    if args.rebuild_only:
        args.only = ["rebuild"]
    for name in (
        "parents",
        "in_flight",
        "k",
        "runs",
        "workers",
        "append_batch",
        "append_writers",
        "statestore_events",
        "statestore_traces",
        "statestore_callers",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.single < 0 or args.warmup < 0 or args.memory_warmup < 0 or args.rebuild_events < 0:
        parser.error("--single, --warmup, --memory-warmup, --rebuild-events: not negative")
    if args.curve_seconds <= 0 or args.memory_sample_every <= 0:
        parser.error("--curve-seconds and --memory-sample-every must be positive")
    if memory_parents(args) <= args.memory_warmup:
        parser.error("--memory-tasks must make more parents than --memory-warmup")
    return args


# ---- one worker session ------------------------------------------------------------------------


@dataclass
class Session:
    """Fresh workers for one phase, and what was measured while they ran."""

    label: str
    workers: list[WorkerProcess] = field(default_factory=list)
    stats_files: list[Path] = field(default_factory=list)
    parents: int = 0
    """Every parent the workers saw (warm-up included)."""


Observer = Callable[[Session, Progress], contextlib.AbstractAsyncContextManager[Any]]
"""Entered just before a session's measured phase and left right after it (the memory sampler)."""


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        base = Settings()
        self.amqp_url = base.amqp_url
        self.admin_url = base.database_url
        self.logs = ROOT / Path(args.json).parent / "logs"
        self.scratch = Path(tempfile.mkdtemp(prefix="waystation-bench-"))
        self.next_n = 0
        self.all_workers: list[WorkerProcess] = []
        self.cleanups: list[tuple[str, str]] = []
        """(database URL, queue prefix) of each run, for the cleanup."""
        self.stopping = False
        self.celery: Any = None
        """The :class:`_bench.celery_job.CelerySide` with ``--compare celery``."""

    def interrupt(self) -> None:
        """On SIGINT/SIGTERM: submit nothing more, and SIGTERM the workers now."""
        self.stopping = True
        for worker in self.all_workers:
            worker.terminate()
        if self.celery is not None:
            self.celery.interrupt()

    # -- the parts of a session --

    def _start_workers(self, session: Session, database_url: str, prefix: str) -> None:
        for index in range(self.args.workers):
            stats = self.scratch / f"{session.label}-worker{index}.json"
            stats.unlink(missing_ok=True)
            env = {
                "WAYSTATION_DATABASE_URL": database_url,
                "WAYSTATION_AMQP_URL": self.amqp_url,
                "WAYSTATION_QUEUE_PREFIX": prefix,
                "WAYSTATION_BROKER_POLICY": "none",
                "WAYSTATION_STATS_FILE": str(stats),
                "WAYSTATION_WORKER_ID": f"bench-{session.label}-{index}",
                # several workers on one host: no metrics endpoint (its port would clash)
                "WAYSTATION_METRICS_PORT": "0",
            }
            if self.args.concurrency:
                env["WAYSTATION_CONCURRENCY"] = str(self.args.concurrency)
            worker = WorkerProcess(env, self.logs / f"{session.label}-worker{index}.log").start()
            session.workers.append(worker)
            session.stats_files.append(stats)
            self.all_workers.append(worker)

    def _one(self, client: Client) -> One:
        """One parent: submit an orchestrator task, wait for its result, check it."""
        k = self.args.k

        async def one() -> None:
            n = self.next_n
            self.next_n += 1
            task_id = await client.submit(
                "orchestrator", {"n": n, "k": k, "work_ms": self.args.work_ms}
            )
            try:
                result = await client.result(task_id, self.args.timeout)
            except TimeoutError:
                raise BenchFailure(
                    f"no result for parent n={n} within {self.args.timeout}s (see {self.logs})"
                ) from None
            if not result.ok or result.result != {"n": n, "total": expected_total(n, k)}:
                raise BenchFailure(f"wrong result for parent n={n}: {result}")

        return one

    async def session(
        self,
        label: str,
        database_url: str,
        prefix: str,
        *,
        warmup: int,
        in_flight: int,
        measured: int | None = None,
        seconds: float | None = None,
        observe: Observer | None = None,
    ) -> dict[str, Any]:
        """Fresh workers; warm-up; the measured phase; SIGTERM; what they and we measured.

        The measured phase is ``measured`` parents after ``warmup`` ones; or, when ``measured``
        is None, a window of ``seconds`` in a continuous stream after ``warmup`` completions.
        """
        session = Session(label)
        database = database_url.rsplit("/", 1)[1]
        names = deployment_names(prefix)
        broker_before = broker_counters()
        db_before = await database_counters(self.admin_url, database)
        self._start_workers(session, database_url, prefix)
        progress = Progress()
        try:
            await wait_for_consumers(
                self.amqp_url,
                topology_queues(names, AGENTS)[:-1],
                len(session.workers),
                alive=lambda: all(w.alive() for w in session.workers),
            )
            broker_pid = rabbitmq_pid()

            def snapshot() -> dict[str, float | None]:
                return cpu_snapshot(
                    {
                        "workers": [w.pid for w in session.workers],
                        "broker": [broker_pid] if broker_pid else None,
                    }
                )

            async with Client(self.amqp_url, queue_prefix=prefix) as client:
                result = await measure(
                    self._one(client),
                    in_flight,
                    warmup=warmup,
                    measured=measured,
                    seconds=seconds,
                    snapshot=snapshot,
                    stopping=lambda: self.stopping,
                    progress=progress,
                    observe=observe(session, progress) if observe else None,
                )
                session.parents = result.total
                results_received = client.results_received + client.duplicates
                result_duplicates = client.duplicates
            dead = [w.name for w in session.workers if not w.alive()]
            if dead:
                raise BenchFailure(
                    f"worker(s) {', '.join(dead)} died during the session (see {self.logs})"
                )
        finally:
            exits = stop_all(session.workers)
        await wait_for_backends_gone(self.admin_url, database)
        db_after = await database_counters(self.admin_url, database)
        broker_after = broker_counters()
        leftover = {
            q: n
            for q, n in (await queue_depths(self.amqp_url, topology_queues(names, AGENTS))).items()
            if n
        }

        # what the workers wrote on SIGTERM
        counters: dict[str, int] = {}
        per_worker: list[list[float]] = []
        for path in session.stats_files:
            if not path.exists():
                raise BenchFailure(f"a worker wrote no stats file ({path.name}); exits: {exits}")
            stats = json.loads(path.read_bytes())
            for name, value in stats["counters"].items():
                counters[name] = counters.get(name, 0) + int(value)
            per_worker.append([float(s) for s in stats["checkpoint_seconds"]])
        checkpoints = _drop_warmup(per_worker, result.warmup)

        parents = session.parents
        settled = sum(v for k, v in counters.items() if k.startswith("settled_"))
        cpu_ms = cpu_per_parent_ms(result.before, result.after, result.measured)
        broker_delta = (
            {k: broker_after[k] - broker_before[k] for k in broker_before}
            if broker_before and broker_after
            else None
        )
        problems, first_problems = log_problems(w.log_path for w in session.workers)
        return {
            **result.figures(),
            "in_flight": in_flight,
            "checkpoints_counted": len(checkpoints),
            "checkpoint_p50_ms": _ms(percentile(checkpoints, 50)),
            "checkpoint_p99_ms": _ms(percentile(checkpoints, 99)),
            "worker_cpu_ms_per_parent": cpu_ms["workers"],
            "broker_cpu_ms_per_parent": cpu_ms["broker"],
            "bench_client_cpu_ms_per_parent": cpu_ms["bench"],
            "machine_cpu_ms_per_parent": cpu_ms["machine"],
            "db_transactions_per_parent": (db_after["xact_commit"] - db_before["xact_commit"])
            / parents,
            "db_rollbacks": db_after["xact_rollback"] - db_before["xact_rollback"],
            "db_sessions_opened": db_after["sessions"] - db_before["sessions"],
            "messages_per_parent": (settled + results_received) / parents,
            "broker_messages_per_parent": (
                {
                    "routed": broker_delta["routed"] / parents,
                    "delivered": broker_delta["delivered"] / parents,
                    "redelivered": broker_delta["redelivered"] / parents,
                }
                if broker_delta
                else None
            ),
            "version_conflicts_per_parent": counters.get("version_conflicts", 0) / parents,
            "result_duplicates": result_duplicates,
            "worker_counters": counters,
            "worker_exit_codes": exits,
            "worker_log_problems": problems,
            "worker_log_first_problems": first_problems,
            "leftover_messages": leftover,
        }

    # -- fresh databases and prefixes --

    async def fresh(self, what: str) -> tuple[str, str, float]:
        """A migrated database and a queue prefix of their own (removed by :meth:`_cleanup_run`),
        and how busy the machine was with other work before starting."""
        tag = uuid.uuid4().hex[:10]
        database_url = with_database(self.admin_url, f"waystation_bench_{tag}")
        prefix = f"bench-{tag}."
        self.cleanups.append((database_url, prefix))
        await migrations.upgrade(database_url)
        other_load = await _busy_cores(1.0)
        print(
            f"{what}: database waystation_bench_{tag}, prefix {prefix}; machine busy with "
            f"other work: {other_load:.2f} cores",
            flush=True,
        )
        if other_load > 0.25:
            print(
                f"{what}: WARNING: other processes use {other_load:.2f} of "
                f"{os.cpu_count()} cores; these figures are not comparable",
                flush=True,
            )
        return database_url, prefix, other_load

    # -- the modes --

    async def run(self, index: int) -> dict[str, Any]:
        """One run of the throughput and single modes (and Celery's, with --compare)."""
        a = self.args
        database_url, prefix, other_load = await self.fresh(f"run {index}")
        result: dict[str, Any] = {
            "database": database_url.rsplit("/", 1)[1],
            "prefix": prefix,
            "other_load_cores": other_load,
            "throughput": None,
            "single": None,
        }
        if "throughput" in a.only:
            throughput = result["throughput"] = await self.session(
                f"run{index}-throughput",
                database_url,
                prefix,
                warmup=a.warmup,
                measured=a.parents,
                in_flight=a.in_flight,
            )
            _said(f"run {index}: throughput", throughput)
        if "single" in a.only and a.single:
            single = result["single"] = await self.session(
                f"run{index}-single",
                database_url,
                prefix,
                warmup=min(SINGLE_WARMUP, a.warmup),
                measured=a.single,
                in_flight=1,
            )
            _said(f"run {index}: single parent", single)
        await self._cleanup_run(database_url, prefix)
        if self.celery is not None:
            if "throughput" in a.only:
                celery = result["celery_throughput"] = await self.celery.session(
                    f"run{index}-celery-throughput",
                    warmup=a.warmup,
                    measured=a.parents,
                    in_flight=a.in_flight,
                )
                _said(f"run {index}: celery throughput", celery)
            if "single" in a.only and a.single:
                celery = result["celery_single"] = await self.celery.session(
                    f"run{index}-celery-single",
                    warmup=min(SINGLE_WARMUP, a.warmup),
                    measured=a.single,
                    in_flight=1,
                )
                _said(f"run {index}: celery single parent", celery)
        return result

    async def curve(self) -> dict[str, Any]:
        """Each point: fresh workers (and database), a continuous stream, a measuring window."""
        a = self.args
        points: dict[str, list[dict[str, Any]]] = {"waystation": []}
        if self.celery is not None:
            points["celery"] = []
        loads = []
        for in_flight in a.curve_points:
            warmup = max(in_flight, 50)
            database_url, prefix, other_load = await self.fresh(f"curve {in_flight} in flight")
            loads.append(other_load)
            measured = await self.session(
                f"curve{in_flight}",
                database_url,
                prefix,
                warmup=warmup,
                seconds=a.curve_seconds,
                in_flight=in_flight,
            )
            await self._cleanup_run(database_url, prefix)
            points["waystation"].append(_curve_point(in_flight, measured))
            _said(f"curve {in_flight} in flight", measured)
            if self.celery is not None:
                measured = await self.celery.session(
                    f"curve{in_flight}-celery",
                    warmup=warmup,
                    seconds=a.curve_seconds,
                    in_flight=in_flight,
                )
                points["celery"].append(_curve_point(in_flight, measured))
                _said(f"curve {in_flight} in flight: celery", measured)
        return {
            "in_flight": a.curve_points,
            "window_s": a.curve_seconds,
            "warmup": "max(in flight, 50) completions before the window",
            "other_load_cores": loads,
            **points,
        }

    async def memory(self) -> dict[str, Any]:
        """``--memory-tasks`` tasks through one session of the workers; their RSS over time."""
        a = self.args
        parents = memory_parents(a)
        database_url, prefix, other_load = await self.fresh("memory")
        print(
            f"memory: {parents * (1 + a.k):,} tasks = {parents:,} parents of 1+K tasks, "
            f"{a.in_flight} in flight; RSS sampled after {a.memory_warmup} parents, every "
            f"{a.memory_sample_every:g}s and at the end",
            flush=True,
        )
        samplers: list[RssSampler] = []

        @contextlib.asynccontextmanager
        async def observe(session: Session, progress: Progress) -> AsyncIterator[None]:
            sampler = RssSampler(
                {w.name: w.pid for w in session.workers}, progress, a.memory_sample_every
            )
            samplers.append(sampler)
            async with sampler.running():
                yield

        measured = await self.session(
            "memory",
            database_url,
            prefix,
            warmup=a.memory_warmup,
            measured=parents - a.memory_warmup,
            in_flight=a.in_flight,
            observe=observe,
        )
        await self._cleanup_run(database_url, prefix)
        rss = rss_summary(samplers[0].samples)
        print(
            f"memory: RSS of the largest worker {rss['rss_start_mb']:.1f} MiB after the warm-up, "
            f"{rss['rss_end_mb']:.1f} MiB at the end; {measured['parents_per_s']:.1f} parents/s "
            "sustained",
            flush=True,
        )
        return {
            "tasks": parents * (1 + a.k),
            "parents": parents,
            "warmup_parents": a.memory_warmup,
            "in_flight": a.in_flight,
            "other_load_cores": other_load,
            **rss,
            "parents_per_s": measured["parents_per_s"],
            "session": measured,
            "samples": samplers[0].samples,
        }

    async def _cleanup_run(self, database_url: str, prefix: str) -> None:
        errors = []
        try:
            await delete_topology(self.amqp_url, prefix, AGENTS)
        except Exception as error:
            errors.append(f"deleting queues of {prefix}: {error}")
        try:
            await migrations.drop_database(database_url)
        except Exception as error:
            errors.append(f"dropping {database_url.rsplit('/', 1)[1]}: {error}")
        with contextlib.suppress(ValueError):
            self.cleanups.remove((database_url, prefix))
        if errors:
            raise RuntimeError("; ".join(errors))

    async def cleanup(self) -> None:
        """Whatever is left after an error or Ctrl-C: workers, queues, databases, Celery's
        workers, Redis and vhost."""
        leftover = [w for w in self.all_workers if w.alive()]
        if leftover:
            stop_all(leftover, timeout=15)
        if self.celery is not None:
            try:
                await self.celery.cleanup()
            except Exception as error:
                print(f"cleanup: celery: {error}", file=sys.stderr)
        for database_url, prefix in list(self.cleanups):
            try:
                await self._cleanup_run(database_url, prefix)
            except Exception as error:
                print(f"cleanup: {error}", file=sys.stderr)
        with contextlib.suppress(OSError):
            for path in self.scratch.iterdir():
                path.unlink()
            self.scratch.rmdir()

    async def main(self) -> dict[str, Any]:
        started = time.monotonic()
        a = self.args
        self.logs.mkdir(parents=True, exist_ok=True)
        for old in self.logs.glob("*.log"):
            old.unlink()
        versions = await server_versions(self.admin_url, self.amqp_url)
        machine: dict[str, Any] = {
            "nproc": os.cpu_count(),
            "cpu": _cpu_model(),
            "python": platform.python_version(),
            "uvloop": _has_uvloop(),
            "postgresql": versions["postgresql"],
            "rabbitmq": versions["rabbitmq"],
            "loadavg_at_start": list(os.getloadavg()),
        }
        print(
            f"Waystation bench: {', '.join(a.only)}"
            f"{' (and Celery side by side)' if a.compare else ''}; {a.workers} workers, K={a.k}, "
            f"work_ms={a.work_ms:g}; {a.runs} run(s) of {a.warmup} warm-up + {a.parents} parents "
            f"({a.in_flight} in flight) + {a.single} single; machine {machine['nproc']} CPUs, "
            f"load {machine['loadavg_at_start'][0]:.2f}",
            flush=True,
        )
        results: dict[str, Any] = {"machine": machine}
        worker_modes = {"throughput", "single", "curve"} & set(a.only)
        if a.compare == "celery" and worker_modes:
            try:
                from _bench.celery_job import CelerySide
            except ImportError as error:
                raise BenchFailure(
                    f"--compare celery needs the bench extra ({error}); scripts/bench installs it"
                ) from None
            self.celery = CelerySide(
                amqp_url=self.amqp_url,
                k=a.k,
                work_ms=a.work_ms,
                workers=a.workers,
                pool=a.celery_pool,
                threads=a.celery_threads,
                prefetch=a.celery_prefetch,
                queue_type=a.celery_queue_type,
                timeout=a.timeout,
                logs=self.logs,
                stopping=lambda: self.stopping,
            )
            results["celery"] = await self.celery.start()
            print(f"celery: {results['celery']}", flush=True)
        if {"throughput", "single"} & set(a.only):
            results["runs"] = [await self.run(index + 1) for index in range(a.runs)]
        if "curve" in a.only:
            results["curve"] = await self.curve()
            results["curve"]["chart"] = self._chart(results["curve"])
        if "memory" in a.only:
            results["memory"] = await self.memory()
        if "append" in a.only:
            results["append"] = await append_benchmark(
                self.admin_url,
                events=a.append_events,
                batch=a.append_batch,
                writers=a.append_writers,
                runs=a.runs,
            )
        if "statestore" in a.only:
            from _bench.statestore import statestore_benchmark

            results["statestore"] = await statestore_benchmark(
                self.admin_url,
                events=a.statestore_events,
                traces=a.statestore_traces,
                concurrency=a.statestore_callers,
                runs=a.runs,
            )
        if "rebuild" in a.only and a.rebuild_events:
            results["projection_rebuild"] = await rebuild_benchmark(
                self.admin_url, a.rebuild_events, a.runs
            )
        results["duration_s"] = time.monotonic() - started
        summary = summarise(a, results)
        print_report(summary)
        return summary

    def _chart(self, curve: dict[str, Any]) -> str | None:
        try:
            from _bench.chart import plot_curve
        except ImportError:
            return None
        path = Path(self.args.chart)
        path = path if path.is_absolute() else ROOT / path
        try:
            plot_curve(
                {s: curve[s] for s in ("waystation", "celery") if curve.get(s)},
                path,
                title=f"fan-out/fan-in, K={self.args.k}, {self.args.workers} worker processes, "
                f"{os.cpu_count()} CPUs; {self.args.curve_seconds:g}s window per point "
                f"({time.strftime('%Y-%m-%d')})",
            )
        except ImportError:
            print("bench: no chart: matplotlib is missing (scripts/bench installs it)", flush=True)
            return None
        return str(_shown(path))


def _said(what: str, measured: dict[str, Any]) -> None:
    print(
        f"{what}: {measured['parents_per_s']:.1f} parents/s, p50 "
        f"{fmt(measured['latency_p50_ms'], '{:.1f}')} ms, p99 "
        f"{fmt(measured['latency_p99_ms'], '{:.1f}')} ms",
        flush=True,
    )


def _curve_point(in_flight: int, measured: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "parents_per_s",
        "latency_p50_ms",
        "latency_p99_ms",
        "parents_measured",
        "worker_cpu_ms_per_parent",
        "bench_client_cpu_ms_per_parent",
        "machine_cpu_ms_per_parent",
        "worker_log_problems",
    )
    return {"in_flight": in_flight, **{k: measured.get(k) for k in keys}}


async def _busy_cores(seconds: float) -> float:
    """Cores the machine kept busy over ``seconds`` while the bench itself was idle."""
    before = system_busy_seconds()
    await asyncio.sleep(seconds)
    return (system_busy_seconds() - before) / seconds


def _drop_warmup(per_worker: list[list[float]], warmup: int) -> list[float]:
    """The checkpoints of the measured phase: each worker's list is in time order and the warm-up
    made ``warmup`` of them (one pause per parent), shared among the workers in proportion to
    their totals (an estimate: the stats file has no timestamps)."""
    total = sum(len(w) for w in per_worker)
    kept: list[float] = []
    for seconds in per_worker:
        drop = round(warmup * len(seconds) / total) if total else 0
        kept += seconds[drop:]
    return kept


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    summary, error, interrupted = run_guarded(
        bench.main, bench.cleanup, bench.interrupt, name="bench"
    )
    if interrupted:
        print(
            "bench: interrupted; workers stopped, queues, databases (and Celery's vhost and "
            "Redis) removed",
            file=sys.stderr,
        )
        return 130
    if error is not None:
        if isinstance(error, BenchFailure):
            print(f"\nbench: FAILED: {error}", file=sys.stderr)
        else:
            print(f"\nbench: FAILED: {type(error).__name__}: {error}", file=sys.stderr)
            traceback.print_exception(error)
        return 1
    out = ROOT / args.json if not Path(args.json).is_absolute() else Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nresults: {_shown(out)}; worker logs: {_shown(bench.logs)}")
    return 0


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


if __name__ == "__main__":
    sys.exit(main())
