"""The PenguiFlow StateStore benchmark: how fast ``save_event`` records a flow's events in the log.

A fresh database (``waystation_bench_statestore_<random>``, migrated, dropped at the end) and
the real adapter, ``waystation.contrib.penguiflow.WaystationStateStore`` on
:class:`waystation.events.postgres.PostgresEventStore` (a pool of 8 connections), as one process of
a PenguiFlow deployment would hold it. ``concurrency`` callers save ``events`` distinct events
(``node_start``/``node_success`` of a flow, with the runtime's payload fields) spread over
``traces`` traces, each caller awaiting one save at a time, as PenguiFlow's runtime does per
message. Events/s = distinct events / wall time. A second phase saves the same number of calls
of which half repeat an event already saved (PenguiFlow's retries), to show what recognising a
duplicate costs. Then ``load_history`` of one trace, timed.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from typing import Any

from scripts.lab.harness.database import with_database
from waystation import migrations
from waystation.events.postgres import PostgresEventStore

from . import percentile

__all__ = ["statestore_benchmark"]

POOL = 8


def flow_events(trace: str, count: int) -> list[Any]:
    """``count`` events of the kind PenguiFlow's runtime saves for a trace."""
    from penguiflow.state import StoredEvent

    events = []
    for index in range(count):
        kind = "node_start" if index % 2 == 0 else "node_success"
        node = f"node_{index // 2}"
        events.append(
            StoredEvent(
                trace_id=trace,
                ts=1_800_000_000.0 + index / 1000,
                kind=kind,
                node_name=node,
                node_id=f"{node}_{uuid.uuid4().hex[:8]}",
                payload={
                    "event": kind,
                    "node_name": node,
                    "trace_id": trace,
                    "latency_ms": 12.5 if kind == "node_success" else None,
                    "q_depth_in": 0,
                    "q_depth_out": 1,
                    "outgoing": 1,
                    "attempt": 1,
                    "trace_inflight": 2,
                    "trace_cancelled": False,
                },
            )
        )
    return events


async def _save_all(adapter: Any, calls: list[Any], concurrency: int) -> tuple[float, list[float]]:
    queue = list(reversed(calls))
    seconds: list[float] = []

    async def caller() -> None:
        while queue:
            event = queue.pop()
            started = time.perf_counter()
            await adapter.save_event(event)
            seconds.append(time.perf_counter() - started)

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(caller())
    return time.perf_counter() - started, seconds


async def statestore_benchmark(
    admin_url: str, *, events: int, traces: int, concurrency: int, runs: int
) -> dict[str, Any]:
    """``runs`` runs of the distinct and the half-repeated phase; every run and the medians."""
    from waystation.contrib.penguiflow import WaystationStateStore

    url = with_database(admin_url, f"waystation_bench_statestore_{uuid.uuid4().hex[:8]}")
    await migrations.upgrade(url)
    store = PostgresEventStore.from_url(url, pool_size=POOL)
    results: list[dict[str, Any]] = []
    rng = random.Random(7)
    try:
        for run in range(runs):
            adapter = WaystationStateStore(store, timeout=300)
            per_trace = max(1, events // traces)
            names = [f"bench-{run}-{uuid.uuid4().hex[:8]}" for _ in range(traces)]
            distinct = [e for name in names for e in flow_events(name, per_trace)]
            rng.shuffle(distinct)
            wall, seconds = await _save_all(adapter, distinct, concurrency)
            # the same number of calls again, half of them repeats of events already saved
            fresh = [
                e
                for name in (f"bench-{run}-r-{uuid.uuid4().hex[:8]}" for _ in range(traces))
                for e in flow_events(name, per_trace // 2)
            ]
            repeats = rng.sample(distinct, len(fresh))
            mixed = fresh + repeats
            rng.shuffle(mixed)
            mixed_wall, _ = await _save_all(adapter, mixed, concurrency)
            started = time.perf_counter()
            history = await adapter.load_history(names[0])
            load_ms = 1000 * (time.perf_counter() - started)
            if adapter.errors or len(history) != per_trace:
                raise RuntimeError(f"statestore run {run + 1} failed: {dict(adapter.errors)}")
            measured = {
                "events": len(distinct),
                "events_per_s": len(distinct) / wall,
                "save_p50_ms": 1000 * (percentile(seconds, 50) or 0),
                "save_p99_ms": 1000 * (percentile(seconds, 99) or 0),
                "half_repeated_calls_per_s": len(mixed) / mixed_wall,
                "load_history_ms": load_ms,
                "load_history_events": len(history),
                "conflicts": adapter._log.conflicts,
            }
            print(
                f"statestore run {run + 1}: {len(distinct):,} save_event calls by {concurrency} "
                f"callers over {traces} traces: {measured['events_per_s']:,.0f} events/s "
                f"(save p50 {measured['save_p50_ms']:.1f} ms, p99 {measured['save_p99_ms']:.1f}"
                f" ms); half repeats: {measured['half_repeated_calls_per_s']:,.0f} calls/s; "
                f"load_history of {len(history)} events {load_ms:.1f} ms",
                flush=True,
            )
            results.append(measured)
    finally:
        await store.close()
        await migrations.drop_database(url)
    return {
        "events": events,
        "traces": traces,
        "concurrency": concurrency,
        "pool": POOL,
        "events_per_s": statistics.median(r["events_per_s"] for r in results),
        "save_p50_ms": statistics.median(r["save_p50_ms"] for r in results),
        "save_p99_ms": statistics.median(r["save_p99_ms"] for r in results),
        "half_repeated_calls_per_s": statistics.median(
            r["half_repeated_calls_per_s"] for r in results
        ),
        "load_history_ms": statistics.median(r["load_history_ms"] for r in results),
        "runs": results,
    }
