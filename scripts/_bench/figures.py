"""What the figures of ``scripts/bench`` are: the keys of the JSON that are always there
(:data:`REQUIRED_KEYS`), the table's sections and rows (:data:`FIGURES`: which phase's measure
each row is the median of, its unit and target) and the notes the JSON carries (:data:`NOTES`);
and :func:`memory_parents` and :func:`fmt`, which the options and the report share.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

REQUIRED_KEYS = (
    "parents_per_s",
    "celery_parents_per_s",
    "ratio_vs_celery",
    "single_p50_ms",
    "single_p99_ms",
    "checkpoint_p50_ms",
    "checkpoint_p99_ms",
    "append_events_per_s",
    "rebuild_events_per_s",
    "messages_per_parent",
    "db_transactions_per_parent",
    "worker_cpu_ms_per_parent",
    "rss_start_mb",
    "rss_end_mb",
)
"""Top-level keys of the JSON that are always there (a number, or null when not measured)."""


def memory_parents(args: argparse.Namespace) -> int:
    """Parents of the memory mode: ``--memory-tasks`` / (1 + K), the parent and its K calls."""
    return int(args.memory_tasks) // (1 + int(args.k))


def fmt(value: float | None, pattern: str) -> str:
    """``value`` formatted with ``pattern``; ``-`` for None."""
    return "-" if value is None else pattern.format(value)


@dataclass(frozen=True)
class Figure:
    """One row of the table: the median of ``phase``'s ``inner`` over the runs, as ``key``."""

    key: str
    label: str
    unit: str
    phase: str
    inner: str
    fmt: str = "{:.1f}"
    target: str = ""


THROUGHPUT = "throughput: {parents} parents, {in_flight} in flight, {workers} worker processes"
SINGLE = "one parent at a time ({single} parents)"
COST = "cost per parent (throughput session)"
LOG = "event log"
MEMORY = (
    "memory: {memory_tasks} tasks = {memory_parents} parents of 1+K tasks, {in_flight} in flight"
)

FIGURES: dict[str, list[Figure]] = {
    THROUGHPUT: [
        Figure("parents_per_s", "Waystation", "parents/s", "throughput", "parents_per_s",
               target="≥1.5× Celery"),
        Figure("celery_parents_per_s", "Celery", "parents/s", "celery_throughput",
               "parents_per_s"),
        Figure("ratio_vs_celery", "Waystation / Celery", "×", "ratio", "ratio", "{:.2f}",
               target="≥1.5"),
        Figure("throughput_p50_ms", "latency p50, Waystation", "ms", "throughput",
               "latency_p50_ms"),
        Figure("throughput_p99_ms", "latency p99, Waystation", "ms", "throughput",
               "latency_p99_ms"),
        Figure("celery_throughput_p50_ms", "latency p50, Celery", "ms", "celery_throughput",
               "latency_p50_ms"),
        Figure("celery_throughput_p99_ms", "latency p99, Celery", "ms", "celery_throughput",
               "latency_p99_ms"),
    ],
    SINGLE: [
        Figure("single_p50_ms", "latency p50, Waystation", "ms", "single", "latency_p50_ms",
               target="<10"),
        Figure("single_p99_ms", "latency p99, Waystation", "ms", "single", "latency_p99_ms",
               target="<25"),
        Figure("celery_single_p50_ms", "latency p50, Celery", "ms", "celery_single",
               "latency_p50_ms"),
        Figure("celery_single_p99_ms", "latency p99, Celery", "ms", "celery_single",
               "latency_p99_ms"),
        Figure("checkpoint_p50_ms", "checkpoint p50, one at a time", "ms", "single",
               "checkpoint_p50_ms", "{:.2f}", target="<2"),
        Figure("checkpoint_p99_ms", "checkpoint p99, one at a time", "ms", "single",
               "checkpoint_p99_ms", "{:.2f}", target="<10"),
        Figure("checkpoint_under_load_p50_ms", "checkpoint p50, under load ({in_flight} in flight)",
               "ms", "throughput", "checkpoint_p50_ms", "{:.2f}"),
        Figure("checkpoint_under_load_p99_ms", "checkpoint p99, under load ({in_flight} in flight)",
               "ms", "throughput", "checkpoint_p99_ms", "{:.2f}"),
        Figure("single_worker_cpu_ms_per_parent", "worker CPU / parent, one at a time", "ms",
               "single", "worker_cpu_ms_per_parent", "{:.2f}"),
        Figure("single_db_transactions_per_parent", "db transactions / parent, one at a time",
               "xacts", "single", "db_transactions_per_parent", "{:.2f}"),
    ],
    COST: [
        Figure("messages_per_parent", "broker messages, Waystation", "msgs", "throughput",
               "messages_per_parent", "{:.2f}"),
        Figure("celery_messages_per_parent", "broker messages, Celery (received by workers)",
               "msgs", "celery_throughput", "messages_per_parent", "{:.2f}"),
        Figure("celery_redis_commands_per_parent", "Redis commands, Celery", "cmds",
               "celery_throughput", "redis_commands_per_parent", "{:.1f}"),
        Figure("db_transactions_per_parent", "db transactions, Waystation", "xacts", "throughput",
               "db_transactions_per_parent", "{:.2f}"),
        Figure("version_conflicts_per_parent", "version conflicts, Waystation", "", "throughput",
               "version_conflicts_per_parent", "{:.3f}"),
        Figure("db_connections_opened", "db connections opened (whole session)", "",
               "throughput", "db_sessions_opened", "{:.0f}"),
        Figure("worker_cpu_ms_per_parent", "worker CPU (all workers), Waystation", "ms",
               "throughput", "worker_cpu_ms_per_parent", "{:.2f}"),
        Figure("celery_worker_cpu_ms_per_parent", "worker CPU (all workers), Celery", "ms",
               "celery_throughput", "worker_cpu_ms_per_parent", "{:.2f}"),
        Figure("broker_cpu_ms_per_parent", "RabbitMQ CPU, Waystation", "ms", "throughput",
               "broker_cpu_ms_per_parent", "{:.2f}"),
        Figure("celery_broker_cpu_ms_per_parent", "RabbitMQ CPU, Celery", "ms",
               "celery_throughput", "broker_cpu_ms_per_parent", "{:.2f}"),
        Figure("celery_redis_cpu_ms_per_parent", "Redis CPU, Celery", "ms", "celery_throughput",
               "redis_cpu_ms_per_parent", "{:.2f}"),
        Figure("bench_client_cpu_ms_per_parent", "client CPU (bench process), Waystation", "ms",
               "throughput", "bench_client_cpu_ms_per_parent", "{:.2f}"),
        Figure("celery_client_cpu_ms_per_parent", "client CPU (bench process), Celery", "ms",
               "celery_throughput", "bench_client_cpu_ms_per_parent", "{:.2f}"),
        Figure("machine_cpu_ms_per_parent", "machine CPU (all processes), Waystation", "ms",
               "throughput", "machine_cpu_ms_per_parent", "{:.2f}"),
        Figure("celery_machine_cpu_ms_per_parent", "machine CPU (all processes), Celery", "ms",
               "celery_throughput", "machine_cpu_ms_per_parent", "{:.2f}"),
        Figure("worker_cpu_ratio_vs_celery", "worker CPU, Waystation / Celery (per run)", "×",
               "ratio", "worker_cpu_ratio", "{:.2f}", target="≤0.56"),
        Figure("machine_cpu_ratio_vs_celery", "machine CPU, Waystation / Celery (per run)", "×",
               "ratio", "machine_cpu_ratio", "{:.2f}"),
    ],
    LOG: [
        Figure("append_events_per_s", "appends, {append_batch} events each, {append_writers} "
               "writers", "events/s", "append", "events_per_s", "{:,.0f}", target="≥30,000"),
        Figure("append_batch_p50_ms", "one append of {append_batch} events, p50", "ms", "append",
               "append_p50_ms", "{:.1f}"),
        Figure("append_unbatched_events_per_s", "appends, 1 event each, {append_writers} writers",
               "events/s", "append", "unbatched_events_per_s", "{:,.0f}"),
        Figure("statestore_events_per_s", "PenguiFlow save_event, {statestore_callers} callers, "
               "{statestore_traces} traces", "events/s", "statestore", "events_per_s", "{:,.0f}"),
        Figure("statestore_save_p50_ms", "one save_event, p50", "ms", "statestore",
               "save_p50_ms", "{:.1f}"),
        Figure("statestore_half_repeated_calls_per_s", "save_event, half of the calls repeats",
               "calls/s", "statestore", "half_repeated_calls_per_s", "{:,.0f}"),
        Figure("rebuild_events_per_s", "projection rebuild, slowest projection", "events/s",
               "rebuild", "slowest_events_per_s", "{:,.0f}", target="≥50,000"),
    ],
    MEMORY: [
        Figure("rss_start_mb", "worker RSS after the warm-up (largest worker)", "MiB", "memory",
               "rss_start_mb", target="flat"),
        Figure("rss_mid_mb", "worker RSS half-way (largest worker)", "MiB", "memory",
               "rss_mid_mb"),
        Figure("rss_end_mb", "worker RSS at the end (largest worker)", "MiB", "memory",
               "rss_end_mb", target="flat"),
        Figure("rss_growth_mb", "RSS growth, start to end (largest of the workers)", "MiB",
               "memory", "rss_growth_mb"),
        Figure("rss_second_half_growth_mb", "RSS growth, half-way to end (largest)", "MiB",
               "memory", "rss_second_half_growth_mb", target="~0"),
        Figure("memory_parents_per_s", "throughput sustained over the run", "parents/s",
               "memory", "parents_per_s"),
    ],
}  # fmt: skip


NOTES = {
    "latency": "submit (before the publish) to the result received by the client",
    "checkpoint": "from the handler returning a pause to the ack of its message, from the workers' "
    "stats files; the warm-up's checkpoints are dropped per worker in proportion. "
    "checkpoint_p50_ms/checkpoint_p99_ms: one parent at a time (the checkpoint's own cost); "
    "checkpoint_under_load_*: the throughput phase",
    "messages_per_parent": "(deliveries settled by the workers + results received by the client) / "
    "parents, over the session, warm-up included; the structural minimum is 2K+2",
    "db_transactions_per_parent": "pg_stat_database.xact_commit delta of the bench database "
    "over the session (worker start-up, warm-up and background polling included) / parents",
    "cpu": "utime+stime deltas over the measured phase only "
    "(/proc/<pid>/stat; machine: /proc/stat; bench: the bench process, i.e. the client)",
    "ratio_vs_celery": "parents_per_s / celery_parents_per_s (medians); null without --compare",
    "curve": "per point: fresh workers, a continuous stream with the given parents in flight; "
    "after max(in flight, 50) completions a window opens; parents/s = completions in the window / "
    "its length; latency of the parents submitted in it",
    "memory": "rss_start_mb/rss_end_mb: VmRSS of the largest worker after the warm-up and after "
    "the last result; rss_mid_mb half-way (by parents), rss_second_half_growth_mb from there to "
    "the end (a cache that fills early and stays shows growth, but none in the second half; a "
    "leak shows both); per worker and periodic samples under memory; memory_tasks counts a "
    "parent as 1+K tasks, warm-up included; samples count parents after the warm-up",
    "append": "events appended / wall time, batched by concurrent writers to streams of their own "
    "(see scripts/_bench/append.py)",
    "rebuild_events_per_s": "the slowest projection's median rate (every projection rebuilds at "
    "least that fast); per projection under projection_rebuild",
}
