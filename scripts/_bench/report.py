"""The figures of ``scripts/bench``: the JSON summary and the printed table.

:func:`summarise` takes what the modes measured (``results``: the runs of the throughput and
single modes with their Celery counterparts, the curve, memory, append and rebuild results) and
gives the JSON: the median of every figure at top level (the keys of :data:`REQUIRED_KEYS` always,
null when not measured), the table as printed, every run, notes and warnings.
:func:`print_report` prints it. No services, no measuring: pure functions of the results.
What the table shows, row by row, and the notes of the JSON: :mod:`_bench.figures`.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from typing import Any

from .figures import FIGURES, LOG, NOTES, REQUIRED_KEYS, Figure, fmt, memory_parents

__all__ = ["FIGURES", "REQUIRED_KEYS", "fmt", "memory_parents", "print_report", "summarise"]

PHASES = ("throughput", "single", "celery_throughput", "celery_single")


def _phases(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each phase's measurements, one per run (one in all for memory)."""
    runs = results.get("runs") or []
    phases: dict[str, list[dict[str, Any]]] = {
        phase: [run[phase] for run in runs if run.get(phase)] for phase in PHASES
    }
    phases["ratio"] = [
        {
            "ratio": run["throughput"]["parents_per_s"] / run["celery_throughput"]["parents_per_s"],
            # the machine's speed moves by a fifth from hour to hour here; within one run both
            # systems see the same machine, so their ratio is the steadier figure
            **{
                f"{cost}_ratio": _ratio(
                    run["throughput"].get(key), run["celery_throughput"].get(key)
                )
                for cost, key in (
                    ("worker_cpu", "worker_cpu_ms_per_parent"),
                    ("machine_cpu", "machine_cpu_ms_per_parent"),
                )
            },
        }
        for run in runs
        if run.get("throughput") and run.get("celery_throughput")
    ]
    phases["append"] = (results.get("append") or {}).get("runs", [])
    phases["statestore"] = (results.get("statestore") or {}).get("runs", [])
    rebuild = (results.get("projection_rebuild") or {}).get("runs", [])
    phases["rebuild"] = [
        {"slowest_events_per_s": r["slowest_events_per_s"], **r["events_per_s"]} for r in rebuild
    ]
    phases["memory"] = [results["memory"]] if results.get("memory") else []
    return phases


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def summarise(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    """The JSON: every figure's median at top level (``REQUIRED_KEYS`` always, null when not
    measured), the table as printed, what every run measured, notes and warnings."""
    phases = _phases(results)
    memory = results.get("memory") or {}
    words = {
        **vars(args),
        "memory_tasks": f"{memory.get('tasks', memory_parents(args) * (1 + args.k)):,}",
        "memory_parents": f"{memory.get('parents', memory_parents(args)):,}",
    }
    figures = {section: list(rows) for section, rows in FIGURES.items()}
    for name in (results.get("projection_rebuild") or {}).get("events_per_second", {}):
        figures[LOG].append(
            Figure(f"rebuild_{name}_events_per_s", f"projection rebuild, {name}", "events/s",
                   "rebuild", name, "{:,.0f}")
        )  # fmt: skip
    summary: dict[str, Any] = dict.fromkeys(REQUIRED_KEYS)
    table: list[dict[str, Any]] = []
    for section, rows in figures.items():
        for figure in rows:
            values = [
                entry[figure.inner]
                for entry in phases[figure.phase]
                if entry.get(figure.inner) is not None
            ]
            median = statistics.median(values) if values else None
            summary[figure.key] = median
            if median is None:
                continue
            table.append(
                {
                    "section": section.format(**words),
                    "key": figure.key,
                    "label": figure.label.format(**words),
                    "median": median,
                    "unit": figure.unit,
                    "target": figure.target,
                    "median_text": figure.fmt.format(median),
                    "per_run_text": ", ".join(figure.fmt.format(v) for v in values),
                }
            )
    if summary["parents_per_s"] and summary["celery_parents_per_s"]:
        # the ratio of the medians (the table's per-run column shows each run's own ratio)
        summary["ratio_vs_celery"] = summary["parents_per_s"] / summary["celery_parents_per_s"]
        for row in table:
            if row["key"] == "ratio_vs_celery":
                row["median"] = summary["ratio_vs_celery"]
                row["median_text"] = f"{summary['ratio_vs_celery']:.2f}"
    summary["memory_tasks"] = memory.get("tasks")
    summary["memory_parents"] = memory.get("parents")
    summary["messages_per_parent_minimum"] = 2 * args.k + 2
    runs = results.get("runs") or []
    broker = [run["throughput"]["broker_messages_per_parent"] for run in runs if run["throughput"]]
    summary["broker_counted_messages_per_parent"] = (
        {k: statistics.median(b[k] for b in broker) for k in broker[0]}
        if broker and all(broker)
        else None
    )
    summary["table"] = table
    summary["warnings"] = _warnings(results)
    summary["curve"] = results.get("curve")
    summary["memory"] = results.get("memory")
    summary["append"] = results.get("append")
    summary["projection_rebuild"] = results.get("projection_rebuild")
    summary["console"] = results.get("console")
    summary["celery"] = results.get("celery")
    summary["runs"] = runs
    summary["machine"] = results.get("machine")
    summary["duration_s"] = results.get("duration_s")
    summary["command"] = (
        "scripts/bench " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "scripts/bench"
    )
    summary["options"] = {k: v for k, v in vars(args).items() if k != "json"}
    summary["notes"] = NOTES
    summary["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return summary


def _sessions(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every worker session that ran: (name, what it measured) (curve points only in brief)."""
    sessions = [
        (f"run {index + 1} {phase}", run[phase])
        for index, run in enumerate(results.get("runs") or [])
        for phase in PHASES
        if run.get(phase)
    ]
    if results.get("memory"):
        sessions.append(("memory", results["memory"]["session"]))
    return sessions


def _warnings(results: dict[str, Any]) -> list[str]:
    warnings = []
    loads = [run["other_load_cores"] for run in results.get("runs") or []]
    loads += (results.get("curve") or {}).get("other_load_cores", [])
    if results.get("memory"):
        loads.append(results["memory"]["other_load_cores"])
    loaded = [load for load in loads if load > 0.25]
    if loaded:
        warnings.append(
            f"{len(loaded)} of {len(loads)} runs started with other processes busy "
            f"({', '.join(f'{c:.2f}' for c in loaded)} cores): those figures are not comparable"
        )
    sessions = _sessions(results)
    curve = results.get("curve") or {}
    curve_problems = sum(
        point.get("worker_log_problems") or 0
        for system in ("waystation", "celery")
        for point in curve.get(system) or []
    )
    problems = sum(s["worker_log_problems"] for _, s in sessions) + curve_problems
    duplicates = sum(s.get("result_duplicates", 0) for _, s in sessions)
    leftovers = {name: s["leftover_messages"] for name, s in sessions if s["leftover_messages"]}
    if problems or duplicates or leftovers:
        warnings.append(
            f"worker log warnings/errors: {problems}; duplicate results: {duplicates}; "
            f"messages left in queues after a session: {leftovers or 'none'}"
        )
        for name, session in sessions:
            warnings += [f"  {name}: {line}" for line in session["worker_log_first_problems"]]
    return warnings


def print_report(summary: dict[str, Any]) -> None:
    """The table, the curve, what the figures count, and the warnings."""
    table = summary["table"]
    options = summary["options"]
    print()
    if table:
        width = max(len(row["label"]) for row in table)
        section = None
        for row in table:
            if row["section"] != section:
                section = row["section"]
                print(f"\n{section}")
                print(f"  {'figure':<{width}}  {'median':>9}  {'unit':<9} {'target':<12} per run")
                print(f"  {'-' * width}  {'-' * 9}  {'-' * 9} {'-' * 12} {'-' * 24}")
            print(
                f"  {row['label']:<{width}}  {row['median_text']:>9}  {row['unit']:<9} "
                f"{row['target']:<12} {row['per_run_text']}"
            )
    curve = summary.get("curve")
    if curve:
        celery = curve.get("celery")
        print(
            f"\nconcurrency curve ({curve['window_s']:g}s window per point after "
            f"{curve['warmup']}; fresh workers per point; chart: {curve.get('chart') or 'none'})"
        )
        header = f"  {'in flight':>9}  {'parents/s':>9} {'p50 ms':>9} {'p99 ms':>9}"
        if celery:
            header += f"  | celery {'parents/s':>9} {'p50 ms':>9} {'p99 ms':>9}"
        print(header)
        for index, point in enumerate(curve["waystation"]):
            line = (
                f"  {point['in_flight']:>9}  {point['parents_per_s']:>9.1f} "
                f"{fmt(point['latency_p50_ms'], '{:.1f}'):>9} "
                f"{fmt(point['latency_p99_ms'], '{:.1f}'):>9}"
            )
            if celery:
                other = celery[index]
                line += (
                    f"  |        {other['parents_per_s']:>9.1f} "
                    f"{fmt(other['latency_p50_ms'], '{:.1f}'):>9} "
                    f"{fmt(other['latency_p99_ms'], '{:.1f}'):>9}"
                )
            print(line)
    print()
    if summary.get("messages_per_parent") is not None:
        print(
            "messages / parent: deliveries settled by the workers + results received by the "
            "client, per parent (warm-up included), as measured; the structural minimum is "
            f"2K+2 = {summary['messages_per_parent_minimum']} (task, K requests, K replies, "
            "result)."
        )
    counted = summary.get("broker_counted_messages_per_parent")
    if counted:
        print(
            f"RabbitMQ's global counters (whole broker, so other traffic counts too): "
            f"{counted['routed']:.2f} routed, {counted['delivered']:.2f} delivered, "
            f"{counted['redelivered']:.3f} redelivered per parent."
        )
    if summary.get("db_transactions_per_parent") is not None:
        print(
            "db transactions / parent: pg_stat_database.xact_commit of the bench database over "
            "the whole session (worker start-up, warm-up, outbox polling included) / parents."
        )
    if summary.get("checkpoint_p50_ms") is not None:
        print(
            "checkpoint: from the handler returning a pause to the ack of its message; "
            "checkpoint_p50/p99_ms are one parent at a time (the checkpoint's own cost), "
            "checkpoint_under_load_* with the throughput phase's parents in flight (queueing)."
        )
    if summary.get("celery"):
        c = summary["celery"]
        print(
            f"celery {c['celery']}: {c['worker_processes']} worker process(es), pool {c['pool']} "
            f"x {c['concurrency_per_process']}, prefetch multiplier {c['prefetch_multiplier']}, "
            f"{c['queue_type']} queue, acks_late, persistent "
            f"messages, Redis {c['redis_server']} results. Celery's messages: task messages its "
            "workers received from RabbitMQ (parent, K children, callback); its results and "
            "chord counter go through Redis (the Redis commands row)."
        )
    if summary.get("memory"):
        m = summary["memory"]
        print(f"memory: the largest worker's RSS by parents completed: {_trend(m['samples'])}")
        print(
            f"memory: VmRSS of each worker after {m['warmup_parents']:,} warm-up parents (start), "
            f"every {options['memory_sample_every']:g}s, and after the last result (end); "
            "rss_start_mb/rss_end_mb are the largest worker's; per worker: "
            + ", ".join(
                f"{name} {fmt(w['start_mb'], '{:.1f}')} -> {fmt(w['end_mb'], '{:.1f}')} MiB"
                for name, w in m["per_worker"].items()
            )
        )
    for line in summary["warnings"]:
        print(f"WARNING: {line}" if not line.startswith("  ") else line)
    if summary.get("duration_s") is not None:
        print(f"bench took {summary['duration_s']:.0f}s")


def _trend(samples: list[dict[str, Any]], points: int = 8) -> str:
    """About ``points`` samples, evenly spread, start and end included: ``parents: MiB``."""
    step = max(1, (len(samples) - 1) // (points - 1))
    chosen = samples[::step]
    if chosen[-1] is not samples[-1]:
        chosen.append(samples[-1])
    shown = []
    for sample in chosen:
        values = [v for v in sample["rss_mb"].values() if v is not None]
        shown.append(
            f"{sample['parents_completed']:,}: {fmt(max(values) if values else None, '{:.1f}')}"
        )
    return ", ".join(shown)
