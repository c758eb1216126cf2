"""The bench's worker modes, each on fresh databases and workers: ``throughput`` and ``single``
(one run of each, with Celery's right after), ``curve`` (a point per parents in flight, and its
chart) and ``memory`` (a long session with the workers' RSS sampled)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from scripts.lab.harness.processes import ROOT

from .drive import Progress
from .figures import fmt, memory_parents
from .memory import RssSampler, rss_summary
from .session import Session, measure_session
from .setup import Bench, shown

SINGLE_WARMUP = 20


async def run(bench: Bench, index: int) -> dict[str, Any]:
    """One run of the throughput and single modes (and Celery's, with --compare)."""
    a = bench.args
    database_url, prefix, other_load = await bench.fresh(f"run {index}")
    result: dict[str, Any] = {
        "database": database_url.rsplit("/", 1)[1],
        "prefix": prefix,
        "other_load_cores": other_load,
        "throughput": None,
        "single": None,
    }
    if "throughput" in a.only:
        throughput = result["throughput"] = await measure_session(
            bench,
            f"run{index}-throughput",
            database_url,
            prefix,
            warmup=a.warmup,
            measured=a.parents,
            in_flight=a.in_flight,
        )
        _said(f"run {index}: throughput", throughput)
    if "single" in a.only and a.single:
        single = result["single"] = await measure_session(
            bench,
            f"run{index}-single",
            database_url,
            prefix,
            warmup=min(SINGLE_WARMUP, a.warmup),
            measured=a.single,
            in_flight=1,
        )
        _said(f"run {index}: single parent", single)
    await bench.cleanup_run(database_url, prefix)
    if bench.celery is not None:
        if "throughput" in a.only:
            celery = result["celery_throughput"] = await bench.celery.session(
                f"run{index}-celery-throughput",
                warmup=a.warmup,
                measured=a.parents,
                in_flight=a.in_flight,
            )
            _said(f"run {index}: celery throughput", celery)
        if "single" in a.only and a.single:
            celery = result["celery_single"] = await bench.celery.session(
                f"run{index}-celery-single",
                warmup=min(SINGLE_WARMUP, a.warmup),
                measured=a.single,
                in_flight=1,
            )
            _said(f"run {index}: celery single parent", celery)
    return result


async def curve(bench: Bench) -> dict[str, Any]:
    """Each point: fresh workers (and database), a continuous stream, a measuring window."""
    a = bench.args
    points: dict[str, list[dict[str, Any]]] = {"waystation": []}
    if bench.celery is not None:
        points["celery"] = []
    loads = []
    for in_flight in a.curve_points:
        warmup = max(in_flight, 50)
        database_url, prefix, other_load = await bench.fresh(f"curve {in_flight} in flight")
        loads.append(other_load)
        measured = await measure_session(
            bench,
            f"curve{in_flight}",
            database_url,
            prefix,
            warmup=warmup,
            seconds=a.curve_seconds,
            in_flight=in_flight,
        )
        await bench.cleanup_run(database_url, prefix)
        points["waystation"].append(_curve_point(in_flight, measured))
        _said(f"curve {in_flight} in flight", measured)
        if bench.celery is not None:
            measured = await bench.celery.session(
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


def chart(bench: Bench, curve: dict[str, Any]) -> str | None:
    try:
        from .chart import plot_curve
    except ImportError:
        return None
    path = Path(bench.args.chart)
    path = path if path.is_absolute() else ROOT / path
    try:
        plot_curve(
            {s: curve[s] for s in ("waystation", "celery") if curve.get(s)},
            path,
            title=f"fan-out/fan-in, K={bench.args.k}, {bench.args.workers} worker processes, "
            f"{os.cpu_count()} CPUs; {bench.args.curve_seconds:g}s window per point "
            f"({time.strftime('%Y-%m-%d')})",
        )
    except ImportError:
        print("bench: no chart: matplotlib is missing (scripts/bench installs it)", flush=True)
        return None
    return str(shown(path))


async def memory(bench: Bench) -> dict[str, Any]:
    """``--memory-tasks`` tasks through one session of the workers; their RSS over time."""
    a = bench.args
    parents = memory_parents(a)
    database_url, prefix, other_load = await bench.fresh("memory")
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

    measured = await measure_session(
        bench,
        "memory",
        database_url,
        prefix,
        warmup=a.memory_warmup,
        measured=parents - a.memory_warmup,
        in_flight=a.in_flight,
        observe=observe,
    )
    await bench.cleanup_run(database_url, prefix)
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
