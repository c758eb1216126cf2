"""The event-append benchmark: how many events per second the PostgreSQL log takes.

A fresh database (``waystation_bench_append_<random>``, migrated, dropped at the end) and the
real :class:`waystation.events.postgres.PostgresEventStore` with a pool of one connection per
writer. ``writers`` concurrent writers each append batches of ``batch`` events to a stream of their
own (``per_stream`` appends to a stream, then a new stream), at the version they wrote last and
chained to the hash they got back, as a worker does. The events are what a worker records for
replies (``SubtaskClaimed`` + ``ResultRecorded`` pairs with a researcher's answer and a worker's
metadata), built before the clock starts: the figure is the log's (hashing, encoding, the
statement, the commit), not pydantic's. Events/s = events appended / wall time of the whole
phase. Each run appends ``events`` events batched, then ``events // 20`` events one per append
(the unbatched figure, for comparison).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
import uuid
from typing import Any

from scripts.lab.harness.database import with_database
from waystation import migrations
from waystation.events.codec import GENESIS_HASH
from waystation.events.model import EventMetadata, NewEvent, ResultRecorded, SubtaskClaimed
from waystation.events.postgres import PostgresEventStore

from . import percentile

__all__ = ["append_benchmark", "reply_events"]

UNBATCHED_SHARE = 20
"""The unbatched phase appends ``events // UNBATCHED_SHARE`` events."""


def reply_events(stream: str, count: int, *, worker: str = "bench-append") -> list[NewEvent]:
    """``count`` events of the kind a worker appends for replies: claimed, then recorded."""
    new: list[NewEvent] = []
    for index in range(count):
        subtask = f"{stream}.1.{index // 2}"
        metadata = EventMetadata(
            worker_id=worker,
            amqp_user="guest",
            causation_id=uuid.uuid4().hex,
            correlation_id=stream,
            trace_id=uuid.uuid4().hex,
            occurred_at=time.time(),
            deployment="bench-append.",
        )
        event = (
            SubtaskClaimed(subtask_id=subtask, pause=1, message_id=uuid.uuid4().hex)
            if index % 2 == 0
            else ResultRecorded(
                subtask_id=subtask, pause=1, outcome="ok", value={"answer": (index + 7) ** 2}
            )
        )
        new.append(NewEvent.of(uuid.uuid4(), event, metadata))
    return new


async def _phase(
    store: PostgresEventStore,
    label: str,
    *,
    events: int,
    batch: int,
    writers: int,
    per_stream: int,
) -> dict[str, Any]:
    """Every writer appends its share of ``events`` in batches of ``batch``."""
    appends = max(1, events // batch)
    shares = [appends // writers + (1 if w < appends % writers else 0) for w in range(writers)]
    # built up front, (stream, batch) per append of each writer: copies of one batch with
    # event ids of their own (the same payloads, as encoding cost goes)
    template = reply_events(f"bench-append-{label}", batch)
    plans: list[list[tuple[str, list[NewEvent]]]] = [
        [
            (
                f"bench-append-{label}-{writer}-{index // per_stream}",
                [dataclasses.replace(e, event_id=uuid.uuid4()) for e in template],
            )
            for index in range(share)
        ]
        for writer, share in enumerate(shares)
    ]
    seconds: list[float] = []

    async def write(plan: list[tuple[str, list[NewEvent]]]) -> None:
        stream, version, last_hash = "", 0, GENESIS_HASH
        for stream_id, batch_events in plan:
            if stream_id != stream:
                stream, version, last_hash = stream_id, 0, GENESIS_HASH
            started = time.perf_counter()
            result = await store.append(stream, version, batch_events, prev_hash=last_hash)
            seconds.append(time.perf_counter() - started)
            version, last_hash = result.version, result.last_hash

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for plan in plans:
            group.create_task(write(plan))
    elapsed = time.perf_counter() - started
    appended = sum(shares) * batch
    return {
        "events": appended,
        "appends": sum(shares),
        "batch": batch,
        "writers": writers,
        "seconds": elapsed,
        "events_per_s": appended / elapsed,
        "appends_per_s": sum(shares) / elapsed,
        "append_p50_ms": 1000 * (percentile(seconds, 50) or 0),
        "append_p99_ms": 1000 * (percentile(seconds, 99) or 0),
    }


async def append_benchmark(
    admin_url: str,
    *,
    events: int,
    batch: int,
    writers: int,
    runs: int,
    per_stream: int = 10,
) -> dict[str, Any]:
    """``runs`` runs of a batched and an unbatched phase; every run and the medians."""
    url = with_database(admin_url, f"waystation_bench_append_{uuid.uuid4().hex[:8]}")
    await migrations.upgrade(url)
    store = PostgresEventStore.from_url(url, pool_size=writers)
    results: list[dict[str, Any]] = []
    try:
        for run in range(runs):
            batched = await _phase(
                store,
                f"r{run}b",
                events=events,
                batch=batch,
                writers=writers,
                per_stream=per_stream,
            )
            unbatched = await _phase(
                store,
                f"r{run}u",
                events=max(writers, events // UNBATCHED_SHARE),
                batch=1,
                writers=writers,
                per_stream=per_stream * batch,
            )
            print(
                f"append run {run + 1}: {batched['events']:,} events in batches of {batch} by "
                f"{writers} writers: {batched['events_per_s']:,.0f} events/s "
                f"(append p50 {batched['append_p50_ms']:.1f} ms); one event per append: "
                f"{unbatched['events_per_s']:,.0f} events/s",
                flush=True,
            )
            results.append(
                {
                    "events_per_s": batched["events_per_s"],
                    "unbatched_events_per_s": unbatched["events_per_s"],
                    "append_p50_ms": batched["append_p50_ms"],
                    "append_p99_ms": batched["append_p99_ms"],
                    "batched": batched,
                    "unbatched": unbatched,
                }
            )
    finally:
        await store.close()
        await migrations.drop_database(url)
    return {
        "batch": batch,
        "writers": writers,
        "events": events,
        "events_per_s": statistics.median(r["events_per_s"] for r in results),
        "unbatched_events_per_s": statistics.median(r["unbatched_events_per_s"] for r in results),
        "runs": results,
    }
