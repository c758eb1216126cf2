"""The console overview's reads against real PostgreSQL: the ``agent_minutes`` projection
(exact, windowed, a day kept, rebuilt to the same rows, created and dropped by revision 0010),
``agent_activity``, ``calls_outstanding`` and ``slots_in_use``.

The log is written by :func:`waystation.events.simulation.simulate` through the event store,
the way workers append; the slots by :class:`PostgresSlotLeases`, the way workers take them.
The expected figures are computed here from the streams themselves. The store stamps every
event with the database's ``now()``, so the tests that need events of another time copy
streams the store wrote with their ``recorded_at`` moved back, in plain SQL.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import defaultdict
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from alembic import command as alembic_command
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from scripts.lab.harness.database import fresh_database_url
from waystation import migrations
from waystation.events import RecordedEvent, fold, parse
from waystation.events.postgres import PostgresEventStore
from waystation.events.simulation import simulate
from waystation.events.store import Position
from waystation.projections.activity import KEEP, LATENCY_BOUNDS
from waystation.projections.model import UNKNOWN_AGENT
from waystation.projections.postgres import (
    PROJECTIONS,
    SlotUse,
    agent_activity,
    calls_outstanding,
    catch_up,
    create_engine,
    rebuild,
    slots_in_use,
)
from waystation.slots import Limit
from waystation.slots.postgres import PostgresSlotLeases

from ..support import Services, eventually

pytestmark = pytest.mark.integration

MINUTES = PROJECTIONS["agent_minutes"]
_COUNTED = {
    "TaskStarted": "started",
    "TaskCompleted": "completed",
    "TaskFailed": "failed",
    "TaskCancelled": "cancelled",
}


async def _streams(
    store: PostgresEventStore, task_ids: list[str]
) -> dict[str, list[RecordedEvent]]:
    return {t: await store.read_stream(t) for t in task_ids}


def _agent_of(events: list[RecordedEvent]) -> tuple[str, RecordedEvent | None]:
    """The stream's agent and its ``TaskStarted`` (the first event, when there is one)."""
    first = events[0]
    if first.event_type != "TaskStarted":
        return UNKNOWN_AGENT, None
    return parse(first).agent, first  # type: ignore[attr-defined]


def _latencies(streams: dict[str, list[RecordedEvent]]) -> dict[str, list[float]]:
    """Per agent, the seconds from each task's start to its completion or failure, for the tasks
    whose start and finish the log recorded in different transactions."""
    found: dict[str, list[float]] = defaultdict(list)
    for events in streams.values():
        agent, start = _agent_of(events)
        for event in events:
            if event.event_type in ("TaskCompleted", "TaskFailed") and start is not None:
                if start.tx_id != event.tx_id:
                    assert event.recorded_at and start.recorded_at
                    found[agent].append((event.recorded_at - start.recorded_at).total_seconds())
    return dict(found)


def expected_minutes(
    streams: dict[str, list[RecordedEvent]],
) -> dict[tuple[str, datetime], dict[str, Any]]:
    """The ``agent_minutes`` rows the streams imply when nothing is a day older than the rest:
    counts, and latencies by a plain count of the bounds below them."""
    rows: dict[tuple[str, datetime], dict[str, Any]] = {}
    for events in streams.values():
        agent, start = _agent_of(events)
        for event in events:
            column = _COUNTED.get(event.event_type)
            if column is None:
                continue
            assert event.recorded_at is not None
            minute = event.recorded_at.replace(second=0, microsecond=0)
            row = rows.setdefault(
                (agent, minute),
                {
                    "started": 0,
                    "completed": 0,
                    "failed": 0,
                    "cancelled": 0,
                    "latency": [0] * (len(LATENCY_BOUNDS) + 1),
                },
            )
            row[column] += 1
            if column in ("completed", "failed") and start and start.tx_id != event.tx_id:
                assert start.recorded_at is not None
                took = (event.recorded_at - start.recorded_at) // timedelta(microseconds=1)
                row["latency"][sum(1 for bound in LATENCY_BOUNDS if bound <= took)] += 1
    return rows


async def minute_rows(engine: AsyncEngine) -> dict[tuple[str, datetime], dict[str, Any]]:
    async with engine.connect() as connection:
        result = await connection.execute(
            text(
                "SELECT agent, minute, started, completed, failed, cancelled, latency "
                "FROM agent_minutes"
            )
        )
        return {
            (row.agent, row.minute): {
                "started": row.started,
                "completed": row.completed,
                "failed": row.failed,
                "cancelled": row.cancelled,
                "latency": list(row.latency),
            }
            for row in result
        }


async def _copy_back(
    connection: AsyncConnection,
    streams: dict[str, list[RecordedEvent]],
    ago: timedelta,
    prefix: str,
) -> dict[str, list[RecordedEvent]]:
    """Copies of ``streams`` appended to the log in the caller's transaction as if recorded
    ``ago`` earlier, under the task ids ``prefix`` + the original's; the copies as recorded."""
    result = await connection.execute(
        text(
            """
            INSERT INTO events (stream_id, stream_version, event_id, event_type,
                                schema_version, data, metadata, recorded_at, prev_hash, hash)
            SELECT :prefix || stream_id, stream_version, gen_random_uuid(), event_type,
                   schema_version, data, metadata, recorded_at - CAST(:ago AS interval),
                   prev_hash, hash
            FROM events WHERE stream_id = ANY(CAST(:streams AS text[]))
            ORDER BY global_position
            RETURNING stream_id, stream_version, global_position, tx_id::text, recorded_at
            """
        ),
        {"prefix": prefix, "ago": ago, "streams": list(streams)},
    )
    moved = {(r.stream_id, r.stream_version): r for r in result}
    copies: dict[str, list[RecordedEvent]] = {}
    for task_id, events in streams.items():
        copies[prefix + task_id] = []
        for event in events:
            row = moved[prefix + task_id, event.stream_version]
            copies[prefix + task_id].append(
                replace(
                    event,
                    stream_id=prefix + task_id,
                    global_position=row.global_position,
                    tx_id=int(row.tx_id),
                    recorded_at=row.recorded_at,
                )
            )
    return copies


async def _copied_back(
    engine: AsyncEngine, streams: dict[str, list[RecordedEvent]], ago: timedelta, prefix: str
) -> dict[str, list[RecordedEvent]]:
    """:func:`_copy_back` in a transaction of its own."""
    async with engine.begin() as connection:
        return await _copy_back(connection, streams, ago, prefix)


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(q * len(ordered)) - 1]


def _close_to(shown: float | None, true: float) -> bool:
    """A percentile as the histogram gives it: within about 9% of the true one from 1 ms up, and
    "at most 1 ms" below."""
    assert shown is not None
    if true < 0.001:
        return shown == 0.001
    return 1 / 1.091 <= shown / true <= 1.091


async def test_agent_activity_counts_the_window_and_its_percentiles_are_within_the_buckets(
    log_db: tuple[PostgresEventStore, AsyncEngine],
) -> None:
    store, engine = log_db
    seed = random.randrange(2**32)
    tasks = await simulate(store, tasks=150, writers=4, seed=seed, leave_paused=0.2, waits=True)
    streams = await _streams(store, [t.task_id for t in tasks])
    # the same tasks again, half an hour earlier: outside a 15-minute window, inside an hour
    await _copied_back(engine, streams, timedelta(minutes=30), "earlier-")
    async with engine.connect() as connection:
        await catch_up(connection, MINUTES, batch_size=97)

    expected = expected_minutes(streams)
    latencies = _latencies(streams)
    activity = await agent_activity(engine, minutes=15)
    assert set(activity) == {agent for agent, _ in expected}, f"seed {seed}"
    async with engine.connect() as connection:
        current = await connection.scalar(text("SELECT date_trunc('minute', now())"))
    for agent, shown in activity.items():
        own = [row for (a, _), row in expected.items() if a == agent]
        counts = {c: sum(row[c] for row in own) for c in _COUNTED.values()}
        assert (shown.started, shown.completed, shown.failed, shown.cancelled) == (
            counts["started"],
            counts["completed"],
            counts["failed"],
            counts["cancelled"],
        ), f"seed {seed}: {agent}"
        assert 15 <= shown.window_minutes <= 16
        assert shown.completed_per_minute == pytest.approx(counts["completed"] / 15, rel=0.07)
        assert len(shown.series) == 16 and shown.series[-1][0] == current
        finished = {
            minute: (row["completed"], row["failed"])
            for (a, minute), row in expected.items()
            if a == agent and row["completed"] + row["failed"]
        }
        assert {m: (c, f) for m, c, f in shown.series if c + f} == finished
        samples = latencies.get(agent, [])
        assert shown.latency_samples == len(samples)
        if samples:
            assert _close_to(shown.p50_seconds, _nearest_rank(samples, 0.5)), f"seed {seed}"
            assert _close_to(shown.p99_seconds, _nearest_rank(samples, 0.99)), f"seed {seed}"
        else:
            assert shown.p50_seconds is shown.p99_seconds is None
        assert shown.to_json()["series"][-1]["minute"] == current.isoformat()
    assert sum(s.latency_samples for s in activity.values()) > 20, "too few latencies to test"

    hour = await agent_activity(engine, minutes=60)
    for agent, shown in activity.items():
        assert hour[agent].completed == 2 * shown.completed, "the copies half an hour back"
    with pytest.raises(ValueError):
        await agent_activity(engine, minutes=0)


async def test_rows_a_day_older_than_the_newest_go_and_a_rebuild_keeps_the_same(
    log_db: tuple[PostgresEventStore, AsyncEngine],
) -> None:
    """Copies three days old that come first in the log (their transaction took its id before
    the live streams were written, and committed after) are counted, then deleted once the
    newest minute passes them by a day; copies as old after the live streams are skipped;
    copies 23 hours old stay. The rows equal the streams' own (the kept ones), and a rebuild
    from zero gives the same."""
    store, engine = log_db
    async with engine.connect() as early:
        await early.execute(text("SELECT pg_current_xact_id()"))  # its events sort first
        tasks = await simulate(store, tasks=40, writers=2, seed=17, leave_paused=0.2, waits=True)
        streams = await _streams(store, [t.task_id for t in tasks])
        first = await _copy_back(early, streams, timedelta(days=3), "before-")
        await early.commit()
    await _copied_back(engine, streams, timedelta(days=3), "after-")
    # (a copy's events are of one transaction: they add no latency)
    yesterday = await _copied_back(engine, streams, timedelta(hours=23), "yesterday-")
    last = max((e for events in first.values() for e in events), key=lambda e: e.global_position)

    async with engine.connect() as connection:
        await catch_up(
            connection, MINUTES, batch_size=50, upto=Position(last.tx_id, last.global_position)
        )
    assert await minute_rows(engine) == expected_minutes(first), "the old copies, all counted"

    async with engine.connect() as connection:
        await catch_up(connection, MINUTES, batch_size=50)
    rows = await minute_rows(engine)
    live, kept = expected_minutes(streams), expected_minutes(yesterday)
    assert not set(live) & set(kept)
    assert rows == live | kept
    assert min(minute for _, minute in rows) >= max(minute for _, minute in rows) - KEEP
    report = await rebuild(engine, MINUTES, check_only=True)
    assert report.identical, report.to_json()


async def test_calls_outstanding_are_the_unanswered_calls_of_paused_tasks_by_agent_called(
    log_db: tuple[PostgresEventStore, AsyncEngine],
) -> None:
    store, engine = log_db
    seed = random.randrange(2**32)
    tasks = await simulate(store, tasks=120, writers=4, seed=seed, leave_paused=0.4, waits=True)
    expected: dict[str, int] = defaultdict(int)
    for events in (await _streams(store, [t.task_id for t in tasks])).values():
        state = fold(events[0].stream_id, events)
        if state.finished:
            continue
        for wait in state.outstanding:
            if wait.kind == "call":
                expected[wait.agent] += 1
    assert len(expected) > 1, f"seed {seed}: too few agents called to test"
    assert await calls_outstanding(engine) == dict(expected), f"seed {seed}"


async def test_slots_in_use_count_the_slots_held_now_against_those_the_table_has(
    log_db: tuple[PostgresEventStore, AsyncEngine],
) -> None:
    _, engine = log_db
    leases = PostgresSlotLeases(engine)

    async def take(deployment: str, agent: str, limits: list[Limit], lease: str) -> None:
        refused = await leases.take(deployment, agent, limits, lease=lease, holder="h", task_id="t")
        assert refused is None, refused

    writer = [Limit("runs", 3, 60.0), Limit("starts", 5, 60.0)]
    await leases.prepare("blue", "writer", writer)
    await take("blue", "writer", writer, "w0")
    await take("blue", "writer", writer, "w1")
    await leases.give_back(["w1"])  # frees its run's slot; a start stays counted
    # a run whose slot runs out soon, as when its worker dies without giving it back
    await take("blue", "writer", [Limit("runs", 3, 0.5), Limit("starts", 5, 60.0)], "w2")
    # a concurrency lowered from 4 to 2: the table keeps the 4 slots
    await leases.prepare("blue", "planner", [Limit("runs", 4, 60.0)])
    await leases.prepare("blue", "planner", [Limit("runs", 2, 60.0)])
    await take("blue", "planner", [Limit("runs", 2, 60.0)], "p")
    await leases.prepare("green", "planner", [Limit("runs", 2, 60.0)])

    shown = await slots_in_use(engine)
    assert shown == [
        SlotUse("blue", "planner", "runs", 1, 4),
        SlotUse("blue", "writer", "runs", 2, 3),
        SlotUse("blue", "writer", "starts", 3, 5),
        SlotUse("green", "planner", "runs", 0, 2),
    ]
    assert [(s.limit, s.to_json()["limit"]) for s in shown[1:3]] == [
        ("concurrency", "concurrency"),
        ("rate", "rate"),
    ]

    async def ran_out() -> bool:
        return SlotUse("blue", "writer", "runs", 1, 3) in await slots_in_use(engine)

    await eventually(ran_out, 10, "the brief run's slot to run out")


async def test_revision_0010_creates_the_table_a_log_already_there_fills_and_drops_it(
    services: Services,
) -> None:
    """Upgrading a database whose log predates the projection: its runner starts from position
    zero. Downgrading drops the table and its checkpoint, so that upgrading again starts over."""
    url = fresh_database_url(services.admin_database_url)
    await migrations.upgrade(url, "0009")
    store = PostgresEventStore.from_url(url, pool_size=4)
    engine = create_engine(url)
    try:
        tasks = await simulate(store, tasks=30, writers=2, seed=5, leave_paused=0.3, waits=True)
        expected = expected_minutes(await _streams(store, [t.task_id for t in tasks]))
        for _ in range(2):
            await migrations.upgrade(url)
            async with engine.connect() as connection:
                await catch_up(connection, MINUTES)
            assert await minute_rows(engine) == expected
            await asyncio.to_thread(
                alembic_command.downgrade, migrations._alembic_config(url), "0009"
            )
            async with engine.connect() as connection:
                tables = await connection.scalar(
                    text("SELECT count(*) FROM pg_tables WHERE tablename = 'agent_minutes'")
                )
                checkpoints = await connection.scalar(
                    text(
                        "SELECT count(*) FROM projection_checkpoints "
                        "WHERE name LIKE 'agent_minutes%'"
                    )
                )
            assert (tables, checkpoints) == (0, 0)
    finally:
        await engine.dispose()
        await store.close()
        await migrations.drop_database(url)
