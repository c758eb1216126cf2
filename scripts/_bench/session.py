"""One worker session of the bench: fresh worker processes, a warm-up, the measured phase (a
number of parents, or a window of seconds), SIGTERM, and what the workers and the bench measured:
throughput, latency, the checkpoint's own cost, CPU, database transactions and messages per
parent, what the workers' logs and the broker's queues were left with."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.lab.harness.broker import (
    broker_counters,
    deployment_names,
    queue_depths,
    topology_queues,
    wait_for_consumers,
)
from scripts.lab.harness.processes import WorkerProcess, log_problems, stop_all
from waystation.client import Client
from waystation.example import expected_total

from . import (
    cpu_per_parent_ms,
    cpu_snapshot,
    database_counters,
    percentile,
    rabbitmq_pid,
    wait_for_backends_gone,
)
from .drive import BenchFailure, One, Progress, measure
from .setup import AGENTS, Bench


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


def start_workers(bench: Bench, session: Session, database_url: str, prefix: str) -> None:
    for index in range(bench.args.workers):
        stats = bench.scratch / f"{session.label}-worker{index}.json"
        stats.unlink(missing_ok=True)
        env = {
            "WAYSTATION_DATABASE_URL": database_url,
            "WAYSTATION_AMQP_URL": bench.amqp_url,
            "WAYSTATION_QUEUE_PREFIX": prefix,
            "WAYSTATION_BROKER_POLICY": "none",
            "WAYSTATION_STATS_FILE": str(stats),
            "WAYSTATION_WORKER_ID": f"bench-{session.label}-{index}",
            # several workers on one host: no metrics endpoint (its port would clash)
            "WAYSTATION_METRICS_PORT": "0",
        }
        if bench.args.concurrency:
            env["WAYSTATION_CONCURRENCY"] = str(bench.args.concurrency)
        worker = WorkerProcess(env, bench.logs / f"{session.label}-worker{index}.log").start()
        session.workers.append(worker)
        session.stats_files.append(stats)
        bench.all_workers.append(worker)


def one_parent(bench: Bench, client: Client) -> One:
    """One parent: submit an orchestrator task, wait for its result, check it."""
    k = bench.args.k

    async def one() -> None:
        n = bench.next_n
        bench.next_n += 1
        task_id = await client.submit(
            "orchestrator", {"n": n, "k": k, "work_ms": bench.args.work_ms}
        )
        try:
            result = await client.result(task_id, bench.args.timeout)
        except TimeoutError:
            raise BenchFailure(
                f"no result for parent n={n} within {bench.args.timeout}s (see {bench.logs})"
            ) from None
        if not result.ok or result.result != {"n": n, "total": expected_total(n, k)}:
            raise BenchFailure(f"wrong result for parent n={n}: {result}")

    return one


async def measure_session(
    bench: Bench,
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
    db_before = await database_counters(bench.admin_url, database)
    start_workers(bench, session, database_url, prefix)
    progress = Progress()
    try:
        await wait_for_consumers(
            bench.amqp_url,
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

        async with Client(bench.amqp_url, queue_prefix=prefix) as client:
            result = await measure(
                one_parent(bench, client),
                in_flight,
                warmup=warmup,
                measured=measured,
                seconds=seconds,
                snapshot=snapshot,
                stopping=lambda: bench.stopping,
                progress=progress,
                observe=observe(session, progress) if observe else None,
            )
            session.parents = result.total
            results_received = client.results_received + client.duplicates
            result_duplicates = client.duplicates
        dead = [w.name for w in session.workers if not w.alive()]
        if dead:
            raise BenchFailure(
                f"worker(s) {', '.join(dead)} died during the session (see {bench.logs})"
            )
    finally:
        exits = stop_all(session.workers)
    await wait_for_backends_gone(bench.admin_url, database)
    db_after = await database_counters(bench.admin_url, database)
    broker_after = broker_counters()
    leftover = {
        q: n
        for q, n in (await queue_depths(bench.amqp_url, topology_queues(names, AGENTS))).items()
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
