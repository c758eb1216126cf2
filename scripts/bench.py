"""The benchmark: the fan-out/fan-in job of DESIGN.md section 8 on real worker processes.

Each run gets a fresh database (``waystation_bench_<random>``, migrated, dropped at the end) and
a fresh queue prefix (queues deleted at the end), and two worker sessions of fresh
``python -m workers.cli worker`` subprocesses of the example app:

* throughput session: a warm-up, then ``--parents`` orchestrator tasks (K researchers each,
  work_ms 0) kept ``--in-flight`` at a time; parents/s and submit-to-result latency;
* single session: a short warm-up, then ``--single`` parents one at a time; latency.

The workers are stopped with SIGTERM after each session and write their stats file
(``WAYSTATION_STATS_FILE``): checkpoint latencies (handler returned a pause until its ack) and
counters. Per parent, over the whole session (warm-up included, so that database statistics are
flushed by the exiting backends and nothing is cut in half): database transactions (the
database's ``pg_stat_database.xact_commit``), messages (each delivery a worker settled, plus the
result the client received; cross-checked with RabbitMQ's global counters when rabbitmqctl works).
Per parent over the measured phase only: CPU of the workers (/proc/<pid>/stat), of RabbitMQ, and
of the whole machine. Figures are the median across ``--runs``; the JSON has every run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench import (
    ROOT,
    WorkerProcess,
    broker_counters,
    database_counters,
    delete_topology,
    log_problems,
    percentile,
    process_cpu_seconds,
    queue_depths,
    rabbitmq_pid,
    run_guarded,
    server_versions,
    stop_all,
    system_busy_seconds,
    topology_queues,
    wait_for_backends_gone,
    wait_for_consumers,
    with_database,
)
from _bench.rebuild import rebuild_benchmark

import migrations
from workers.client import Client
from workers.example import app as example_app
from workers.example import expected_total
from workers.settings import Settings
from workers.wire import Names

AGENTS = tuple(example_app.agents)
SINGLE_WARMUP = 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/bench",
        description="Fan-out/fan-in benchmark of Waystation on real worker processes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--parents", type=int, default=2000, help="parents in the throughput phase")
    parser.add_argument("--in-flight", type=int, default=100, help="parents in flight at once")
    parser.add_argument("--k", type=int, default=3, help="researchers per parent")
    parser.add_argument(
        "--single",
        type=int,
        default=200,
        help="parents submitted one at a time (single-parent latency); 0 skips",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs; medians are reported")
    parser.add_argument("--warmup", type=int, default=100, help="unmeasured parents first")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--work-ms", type=float, default=0.0, help="simulated work per researcher")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="WAYSTATION_CONCURRENCY of the workers (default: the worker's own)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds to wait for any one result before giving up",
    )
    parser.add_argument(
        "--rebuild-events",
        type=int,
        default=200_000,
        help="events in the log of the projection-rebuild benchmark; 0 skips it",
    )
    parser.add_argument(
        "--rebuild-only",
        action="store_true",
        help="only the projection-rebuild benchmark, not the worker sessions",
    )
    parser.add_argument(
        "--json", default="bench-results/latest.json", help="where to write results"
    )
    args = parser.parse_args(argv)
    for name in ("parents", "in_flight", "k", "runs", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.single < 0 or args.warmup < 0:
        parser.error("--single and --warmup must not be negative")
    return args


# ---- one worker session ------------------------------------------------------------------------


class BenchFailure(Exception):
    """The job itself went wrong (a wrong or missing result, a worker that died)."""


@dataclass
class Session:
    """Fresh workers for one phase, and what was measured while they ran."""

    label: str
    workers: list[WorkerProcess] = field(default_factory=list)
    stats_files: list[Path] = field(default_factory=list)
    parents: int = 0
    """Every parent the workers saw (warm-up included)."""


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

    def interrupt(self) -> None:
        """On SIGINT/SIGTERM: submit nothing more, and SIGTERM the workers now."""
        self.stopping = True
        for worker in self.all_workers:
            worker.terminate()

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
            worker = WorkerProcess(
                f"{session.label}-worker{index}",
                env,
                self.logs / f"{session.label}-worker{index}.log",
            ).start()
            session.workers.append(worker)
            session.stats_files.append(stats)
            self.all_workers.append(worker)

    async def _drive(self, client: Client, count: int, in_flight: int) -> tuple[float, list[float]]:
        """Run ``count`` parents, ``in_flight`` at a time; (elapsed seconds, latencies)."""
        latencies: list[float] = []
        remaining = count
        k = self.args.k

        async def one_at_a_time() -> None:
            nonlocal remaining
            while remaining > 0 and not self.stopping:
                remaining -= 1
                n = self.next_n
                self.next_n += 1
                started = time.perf_counter()
                task_id = await client.submit(
                    "orchestrator", {"n": n, "k": k, "work_ms": self.args.work_ms}
                )
                try:
                    result = await client.result(task_id, self.args.timeout)
                except TimeoutError:
                    raise BenchFailure(
                        f"no result for parent n={n} within {self.args.timeout}s (see {self.logs})"
                    ) from None
                latencies.append(time.perf_counter() - started)
                if not result.ok or result.result != {"n": n, "total": expected_total(n, k)}:
                    raise BenchFailure(f"wrong result for parent n={n}: {result}")

        started = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels the others
                for _ in range(min(in_flight, count)):
                    group.create_task(one_at_a_time())
        except* BenchFailure as failures:
            raise failures.exceptions[0] from None
        return time.perf_counter() - started, latencies

    def _cpu_snapshot(self, session: Session, broker: int | None) -> dict[str, float | None]:
        workers = [process_cpu_seconds(w.pid) for w in session.workers]
        own = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "workers": None if None in workers else sum(w for w in workers if w is not None),
            "broker": process_cpu_seconds(broker) if broker else None,
            "bench": own.ru_utime + own.ru_stime,
            "machine": system_busy_seconds(),
        }

    async def session(
        self,
        label: str,
        database_url: str,
        prefix: str,
        *,
        warmup: int,
        measured: int,
        in_flight: int,
    ) -> dict[str, Any]:
        """Fresh workers; warm-up; the measured phase; SIGTERM; what they and we measured."""
        session = Session(label)
        database = database_url.rsplit("/", 1)[1]
        names = Names(prefix)
        broker_before = broker_counters()
        db_before = await database_counters(self.admin_url, database)
        self._start_workers(session, database_url, prefix)
        try:
            await wait_for_consumers(
                self.amqp_url,
                topology_queues(names, AGENTS)[:-1],
                len(session.workers),
                alive=lambda: all(w.alive() for w in session.workers),
            )
            broker_pid = rabbitmq_pid()
            async with Client(self.amqp_url, queue_prefix=prefix) as client:
                if warmup:
                    await self._drive(client, warmup, in_flight)
                cpu_before = self._cpu_snapshot(session, broker_pid)
                elapsed, latencies = await self._drive(client, measured, in_flight)
                cpu_after = self._cpu_snapshot(session, broker_pid)
                session.parents = warmup + measured
                results_received = len(client.results) + client.duplicates
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
        checkpoints = _drop_warmup(per_worker, warmup)

        parents = session.parents
        settled = sum(v for k, v in counters.items() if k.startswith("settled_"))
        cpu: dict[str, float | None] = {}
        for name, before in cpu_before.items():
            after = cpu_after[name]
            cpu[name] = (
                None if before is None or after is None else (after - before) * 1000 / measured
            )
        broker_delta = (
            {k: broker_after[k] - broker_before[k] for k in broker_before}
            if broker_before and broker_after
            else None
        )
        problems, first_problems = log_problems(w.log_path for w in session.workers)
        return {
            "parents_measured": measured,
            "parents_total": parents,
            "elapsed_s": elapsed,
            "parents_per_s": measured / elapsed,
            "latency_p50_ms": _ms(percentile(latencies, 50)),
            "latency_p99_ms": _ms(percentile(latencies, 99)),
            "latency_max_ms": _ms(max(latencies)),
            "checkpoints_counted": len(checkpoints),
            "checkpoint_p50_ms": _ms(percentile(checkpoints, 50)),
            "checkpoint_p99_ms": _ms(percentile(checkpoints, 99)),
            "worker_cpu_ms_per_parent": cpu["workers"],
            "broker_cpu_ms_per_parent": cpu["broker"],
            "bench_client_cpu_ms_per_parent": cpu["bench"],
            "machine_cpu_ms_per_parent": cpu["machine"],
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

    # -- a run and the whole bench --

    async def run(self, index: int) -> dict[str, Any]:
        tag = uuid.uuid4().hex[:10]
        database_url = with_database(self.admin_url, f"waystation_bench_{tag}")
        prefix = f"bench-{tag}."
        self.cleanups.append((database_url, prefix))
        await migrations.upgrade(database_url)
        other_load = await _busy_cores(1.0)
        print(
            f"run {index}: database waystation_bench_{tag}, prefix {prefix}; machine busy with "
            f"other work: {other_load:.2f} cores",
            flush=True,
        )
        if other_load > 0.25:
            print(
                f"run {index}: WARNING: other processes use {other_load:.2f} of "
                f"{os.cpu_count()} cores; this run's figures are not comparable",
                flush=True,
            )
        throughput = await self.session(
            f"run{index}-throughput",
            database_url,
            prefix,
            warmup=self.args.warmup,
            measured=self.args.parents,
            in_flight=self.args.in_flight,
        )
        print(
            f"run {index}: throughput {throughput['parents_per_s']:.1f} parents/s, "
            f"p50 {throughput['latency_p50_ms']:.1f} ms, p99 {throughput['latency_p99_ms']:.1f} ms",
            flush=True,
        )
        single = None
        if self.args.single:
            single = await self.session(
                f"run{index}-single",
                database_url,
                prefix,
                warmup=min(SINGLE_WARMUP, self.args.warmup),
                measured=self.args.single,
                in_flight=1,
            )
            print(
                f"run {index}: single parent p50 {single['latency_p50_ms']:.1f} ms, "
                f"p99 {single['latency_p99_ms']:.1f} ms",
                flush=True,
            )
        await self._cleanup_run(database_url, prefix)
        return {
            "database": f"waystation_bench_{tag}",
            "prefix": prefix,
            "other_load_cores": other_load,
            "throughput": throughput,
            "single": single,
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
        """Whatever is left after an error or Ctrl-C: workers, queues, databases."""
        leftover = [w for w in self.all_workers if w.alive()]
        if leftover:
            stop_all(leftover, timeout=15)
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
        a = self.args
        print(
            f"Waystation bench: {a.workers} workers, K={a.k}, work_ms={a.work_ms:g}; "
            f"{a.runs} run(s) of {a.warmup} warm-up + {a.parents} parents ({a.in_flight} in flight)"
            f" + {a.single} single; machine {machine['nproc']} CPUs, "
            f"load {machine['loadavg_at_start'][0]:.2f}",
            flush=True,
        )
        summary: dict[str, Any] = {"machine": machine}
        if not a.rebuild_only:
            runs = [await self.run(index + 1) for index in range(a.runs)]
            summary = summarise(a, runs, machine)
        if a.rebuild_events:
            rebuilt = await rebuild_benchmark(self.admin_url, a.rebuild_events, a.runs)
            summary["projection_rebuild"] = rebuilt
            print()
            for name, rates in rebuilt["events_per_second"].items():
                print(
                    f"projection rebuild {name}: {rates['median']:,.0f} events/s median over "
                    f"{len(rates['runs'])} run(s) of {rebuilt['events']} events "
                    f"({', '.join(f'{r:,.0f}' for r in rates['runs'])})"
                )
        return summary


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


# ---- the summary -------------------------------------------------------------------------------

# (JSON key, label, unit, phase, key inside the phase, format)
FIGURES = [
    ("parents_per_s", "throughput", "parents/s", "throughput", "parents_per_s", "{:.1f}"),
    (
        "throughput_p50_ms",
        "latency p50, under load",
        "ms",
        "throughput",
        "latency_p50_ms",
        "{:.1f}",
    ),
    (
        "throughput_p99_ms",
        "latency p99, under load",
        "ms",
        "throughput",
        "latency_p99_ms",
        "{:.1f}",
    ),
    (
        "single_p50_ms",
        "latency p50, one parent at a time",
        "ms",
        "single",
        "latency_p50_ms",
        "{:.1f}",
    ),
    (
        "single_p99_ms",
        "latency p99, one parent at a time",
        "ms",
        "single",
        "latency_p99_ms",
        "{:.1f}",
    ),
    (
        "checkpoint_p50_ms",
        "checkpoint p50, under load",
        "ms",
        "throughput",
        "checkpoint_p50_ms",
        "{:.2f}",
    ),
    (
        "checkpoint_p99_ms",
        "checkpoint p99, under load",
        "ms",
        "throughput",
        "checkpoint_p99_ms",
        "{:.2f}",
    ),
    (
        "single_checkpoint_p50_ms",
        "checkpoint p50, one at a time",
        "ms",
        "single",
        "checkpoint_p50_ms",
        "{:.2f}",
    ),
    (
        "single_checkpoint_p99_ms",
        "checkpoint p99, one at a time",
        "ms",
        "single",
        "checkpoint_p99_ms",
        "{:.2f}",
    ),
    (
        "messages_per_parent",
        "broker messages / parent",
        "msgs",
        "throughput",
        "messages_per_parent",
        "{:.2f}",
    ),
    (
        "db_transactions_per_parent",
        "db transactions / parent",
        "xacts",
        "throughput",
        "db_transactions_per_parent",
        "{:.2f}",
    ),
    (
        "version_conflicts_per_parent",
        "version conflicts / parent",
        "",
        "throughput",
        "version_conflicts_per_parent",
        "{:.3f}",
    ),
    (
        "db_connections_opened",
        "db connections opened (throughput session)",
        "",
        "throughput",
        "db_sessions_opened",
        "{:.0f}",
    ),
    (
        "worker_cpu_ms_per_parent",
        "worker CPU / parent (all workers)",
        "ms",
        "throughput",
        "worker_cpu_ms_per_parent",
        "{:.2f}",
    ),
    (
        "broker_cpu_ms_per_parent",
        "RabbitMQ CPU / parent",
        "ms",
        "throughput",
        "broker_cpu_ms_per_parent",
        "{:.2f}",
    ),
    (
        "machine_cpu_ms_per_parent",
        "machine CPU / parent (all processes)",
        "ms",
        "throughput",
        "machine_cpu_ms_per_parent",
        "{:.2f}",
    ),
    (
        "single_worker_cpu_ms_per_parent",
        "worker CPU / parent, one at a time",
        "ms",
        "single",
        "worker_cpu_ms_per_parent",
        "{:.2f}",
    ),
    (
        "single_db_transactions_per_parent",
        "db transactions / parent, one at a time",
        "xacts",
        "single",
        "db_transactions_per_parent",
        "{:.2f}",
    ),
]


def summarise(
    args: argparse.Namespace, runs: list[dict[str, Any]], machine: dict[str, Any]
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    rows = []
    for key, label, unit, phase, inner, fmt in FIGURES:
        values = [
            run[phase][inner] for run in runs if run.get(phase) and run[phase][inner] is not None
        ]
        median = statistics.median(values) if values else None
        summary[key] = median
        if median is not None:
            rows.append((label, unit, fmt.format(median), ", ".join(fmt.format(v) for v in values)))
    broker = [run["throughput"]["broker_messages_per_parent"] for run in runs]
    summary["broker_counted_messages_per_parent"] = (
        {k: statistics.median(b[k] for b in broker) for k in broker[0]} if all(broker) else None
    )
    summary["messages_per_parent_design"] = 2 * args.k + 3
    summary["runs"] = runs
    summary["machine"] = machine
    summary["command"] = (
        "scripts/bench " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "scripts/bench"
    )
    summary["options"] = {k: v for k, v in vars(args).items() if k != "json"}
    summary["notes"] = NOTES
    summary["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'figure':<{width}}  {'median':>9}  {'unit':<9} per run")
    print(f"{'-' * width}  {'-' * 9}  {'-' * 9} {'-' * 24}")
    for label, unit, median, per_run in rows:
        print(f"{label:<{width}}  {median:>9}  {unit:<9} {per_run}")
    counted = summary["broker_counted_messages_per_parent"]
    print()
    print(
        f"messages / parent: deliveries settled by the workers + results received by the client, "
        f"per parent (warm-up included); the design's count is 2K+3 = {2 * args.k + 3}."
    )
    if counted:
        print(
            f"RabbitMQ's global counters (whole broker, so other traffic counts too): "
            f"{counted['routed']:.2f} routed, {counted['delivered']:.2f} delivered, "
            f"{counted['redelivered']:.3f} redelivered per parent."
        )
    print(
        "db transactions / parent: pg_stat_database.xact_commit of the bench database over the "
        "whole session (worker start-up, warm-up, outbox polling included) / parents."
    )
    loaded = [run["other_load_cores"] for run in runs if run["other_load_cores"] > 0.25]
    if loaded:
        print(
            f"WARNING: {len(loaded)} of {len(runs)} runs started with other processes busy "
            f"({', '.join(f'{c:.2f}' for c in loaded)} cores): the figures are not comparable."
        )
    problems = sum(
        run[p]["worker_log_problems"]
        for run in runs
        for p in ("throughput", "single")
        if run.get(p)
    )
    duplicates = sum(
        run[p]["result_duplicates"] for run in runs for p in ("throughput", "single") if run.get(p)
    )
    leftovers = [
        run[p]["leftover_messages"]
        for run in runs
        for p in ("throughput", "single")
        if run.get(p) and run[p]["leftover_messages"]
    ]
    print(
        f"worker log warnings/errors: {problems}; duplicate results: {duplicates}; "
        f"messages left in queues after a session: {leftovers or 'none'}"
    )
    for run in runs:
        for phase in ("throughput", "single"):
            if run.get(phase) and run[phase]["worker_log_first_problems"]:
                for line in run[phase]["worker_log_first_problems"]:
                    print(f"  {line}")
    return summary


NOTES = {
    "latency": "submit (before the publish) to the result received by the client",
    "checkpoint": "from the handler returning a pause to the ack of its message, from the workers' "
    "stats files; the warm-up's checkpoints are dropped per worker in proportion",
    "messages_per_parent": "(deliveries settled by the workers + results received by the client) / "
    "parents, over the session, warm-up included",
    "db_transactions_per_parent": "pg_stat_database.xact_commit delta of the bench database "
    "over the session (worker start-up, warm-up and background polling included) / parents",
    "cpu": "utime+stime deltas over the measured phase only "
    "(/proc/<pid>/stat; machine: /proc/stat)",
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    summary, error, interrupted = run_guarded(
        bench.main, bench.cleanup, bench.interrupt, name="bench"
    )
    if interrupted:
        print("bench: interrupted; workers stopped, queues and databases removed", file=sys.stderr)
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
