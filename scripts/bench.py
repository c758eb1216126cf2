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
* ``console``: the web console's pages over a log of 100,000 paused tasks, each page's server
  time (:mod:`_bench.console_pages`);
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

The phases live in ``scripts/_bench/``: the setup (:mod:`_bench.setup`: the run's state, fresh
databases and prefixes, the machine, Celery's side, the cleanup), one worker session
(:mod:`_bench.session`), the worker modes (:mod:`_bench.modes`), the other modes
(:mod:`_bench.append`, :mod:`_bench.statestore`, :mod:`_bench.rebuild`) and the report
(:mod:`_bench.report`, :mod:`_bench.figures`); this file parses the options and runs the phases
in order.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench.append import append_benchmark
from _bench.drive import BenchFailure
from _bench.figures import memory_parents
from _bench.modes import chart, curve, memory, run
from _bench.rebuild import rebuild_benchmark
from _bench.report import print_report, summarise
from _bench.setup import Bench, shown

from scripts.lab.harness.guarded import run_guarded
from scripts.lab.harness.processes import ROOT

MODES = (
    "throughput",
    "single",
    "curve",
    "memory",
    "append",
    "rebuild",
    "statestore",
    "console",
)
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
    console = parser.add_argument_group("console mode")
    console.add_argument(
        "--console-tasks", type=int, default=100_000, help="paused tasks in the console's log"
    )
    console.add_argument(
        "--console-requests", type=int, default=20, help="measured requests of each page"
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


async def run_all(bench: Bench) -> dict[str, Any]:
    """The modes asked for, in order; the summary (printed, and returned for the JSON)."""
    started = time.monotonic()
    a = bench.args
    bench.logs.mkdir(parents=True, exist_ok=True)
    for old in bench.logs.glob("*.log"):
        old.unlink()
    machine = await bench.machine()
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
        results["celery"] = await bench.start_celery()
        print(f"celery: {results['celery']}", flush=True)
    if {"throughput", "single"} & set(a.only):
        results["runs"] = [await run(bench, index + 1) for index in range(a.runs)]
    if "curve" in a.only:
        results["curve"] = await curve(bench)
        results["curve"]["chart"] = chart(bench, results["curve"])
    if "memory" in a.only:
        results["memory"] = await memory(bench)
    if "append" in a.only:
        results["append"] = await append_benchmark(
            bench.admin_url,
            events=a.append_events,
            batch=a.append_batch,
            writers=a.append_writers,
            runs=a.runs,
        )
    if "statestore" in a.only:
        from _bench.statestore import statestore_benchmark

        results["statestore"] = await statestore_benchmark(
            bench.admin_url,
            events=a.statestore_events,
            traces=a.statestore_traces,
            concurrency=a.statestore_callers,
            runs=a.runs,
        )
    if "console" in a.only:
        from _bench.console_pages import console_benchmark

        results["console"] = await console_benchmark(
            bench.admin_url,
            bench.amqp_url,
            tasks=a.console_tasks,
            requests=a.console_requests,
        )
    if "rebuild" in a.only and a.rebuild_events:
        results["projection_rebuild"] = await rebuild_benchmark(
            bench.admin_url, a.rebuild_events, a.runs
        )
    results["duration_s"] = time.monotonic() - started
    summary = summarise(a, results)
    print_report(summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    summary, error, interrupted = run_guarded(
        lambda: run_all(bench), bench.cleanup, bench.interrupt, name="bench"
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
    print(f"\nresults: {shown(out)}; worker logs: {shown(bench.logs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
