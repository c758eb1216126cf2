"""The projection-rebuild benchmark: how fast a projection is rebuilt from position zero.

A fresh database (``waystation_bench_rebuild_<random>``, dropped at the end) is filled with at
least ``events`` events by :func:`waystation.events.simulation.simulate` (8 concurrent writers
driving tasks through random lifecycles with the task's own decide functions, as workers append
them). The live projections are brought up to date first, then each run rebuilds every projection
with ``rebuild(check_only=True)``: replay from zero into a shadow table, compare with the live one,
drop the shadow. Events per second = events replayed / the whole rebuild's wall time (shadow
creation and the comparison included). Each run's entry also has the slowest projection's rate
(the bench's ``rebuild_events_per_s``: every projection rebuilds at least that fast).
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

from sqlalchemy import text

from scripts.lab.harness.database import with_database
from waystation import migrations
from waystation.events.postgres import PostgresEventStore
from waystation.events.simulation import simulate
from waystation.projections.postgres import PROJECTIONS, catch_up, create_engine, rebuild

EVENTS_PER_TASK = 8.5  # about what simulate() writes per task; only sizes the first round


async def rebuild_benchmark(admin_url: str, events: int, runs: int) -> dict[str, Any]:
    url = with_database(admin_url, f"waystation_bench_rebuild_{uuid.uuid4().hex[:8]}")
    await migrations.upgrade(url)
    store = PostgresEventStore.from_url(url, pool_size=10)
    engine = create_engine(url)
    try:
        started = time.perf_counter()
        total = 0
        round_ = 0
        while total < events:
            missing = events - total
            await simulate(
                store,
                tasks=max(1, int(missing / EVENTS_PER_TASK) + 1),
                writers=8,
                seed=round_,
                prefix=f"bench{round_}",
            )
            round_ += 1
            async with engine.connect() as connection:
                total = int(await connection.scalar(text("SELECT count(*) FROM events")) or 0)
        generated = time.perf_counter() - started
        print(f"rebuild: the log holds {total} events ({generated:.0f}s to write them)")
        async with engine.connect() as connection:
            for projection in PROJECTIONS.values():
                await catch_up(connection, projection, batch_size=10_000)
        per_projection: dict[str, list[float]] = {name: [] for name in PROJECTIONS}
        per_run: list[dict[str, Any]] = []
        for run in range(runs):
            for name, projection in PROJECTIONS.items():
                report = await rebuild(engine, projection, check_only=True)
                if not report.identical or report.events != total:
                    raise RuntimeError(f"rebuild of {name} disagrees: {report.to_json()}")
                rate = report.events / report.seconds
                per_projection[name].append(rate)
                print(
                    f"rebuild run {run + 1}: {name} {report.events} events in "
                    f"{report.seconds:.2f}s = {rate:,.0f} events/s",
                    flush=True,
                )
            rates = {name: per_projection[name][-1] for name in PROJECTIONS}
            per_run.append({"events_per_s": rates, "slowest_events_per_s": min(rates.values())})
        return {
            "events": total,
            "write_seconds": generated,
            "events_per_second": {
                name: {"median": statistics.median(rates), "runs": rates}
                for name, rates in per_projection.items()
            },
            "runs": per_run,
        }
    finally:
        await engine.dispose()
        await store.close()
        await migrations.drop_database(url)
