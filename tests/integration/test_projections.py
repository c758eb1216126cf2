"""The projection runner against real PostgreSQL: exact under concurrent writers, rebuildable,
woken by NOTIFY, reporting its lag (G8).

The log is written by :func:`waystation.events.simulation.simulate`: tasks driven through random
lifecycles by the task's decide functions and appended by 8 concurrent writers, the way workers
append. The expected rows are computed here from the streams themselves, independently of the
projections' code, and a rebuild from position zero must agree with the live tables.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command as alembic_command
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from scripts.lab.harness.database import PostgresCluster, fresh_database_url
from scripts.lab.harness.processes import WorkerProcess, log_lines, worker_logs
from waystation import migrations
from waystation.events import (
    PendingCall,
    RecordedEvent,
    ResultRecorded,
    TaskCancelled,
    TaskCompleted,
    TaskFailed,
    TaskPaused,
    TaskResumed,
    TaskStarted,
    fold,
    parse,
)
from waystation.events.codec import dumps, loads
from waystation.events.postgres import PostgresEventStore
from waystation.events.simulation import simulate
from waystation.projections.model import UNKNOWN_AGENT, AgentCounts
from waystation.projections.postgres import (
    PROJECTIONS,
    ProjectionRunner,
    agent_stats,
    catch_up,
    create_engine,
    projection_status,
    rebuild,
)
from waystation.settings import Settings

from ..support import Services, eventually, serving_cluster
from .test_agent_activity import expected_minutes, minute_rows
from .test_cli import run_cli

pytestmark = pytest.mark.integration


async def _streams(
    store: PostgresEventStore, task_ids: list[str]
) -> dict[str, list[RecordedEvent]]:
    return {t: await store.read_stream(t) for t in task_ids}


def _expected_paused(streams: dict[str, list[RecordedEvent]]) -> dict[str, dict[str, Any]]:
    """The paused-tasks rows the streams imply: every task paused or resumed and not finished."""
    rows = {}
    for task_id, events in streams.items():
        state = fold(task_id, events)
        if state.status not in ("paused", "resumed"):
            continue
        paused_event = max(
            (e for e in events if e.event_type == "TaskPaused"), key=lambda e: e.stream_version
        )
        recorded = [c for c in state.calls if c.subtask_id in state.results]
        rows[task_id] = {
            "agent": state.agent,
            "pause": state.pause,
            "waits_expected": len(state.calls),
            "waits_recorded": len(recorded),
            "paused_since": paused_event.recorded_at,
            "status": state.status,
            "waits": (
                [_open_wait(c) for c in state.outstanding] if state.status == "paused" else []
            ),
            "first_k": state.until,
            "agent_version": state.agent_version,
        }
    return rows


def _open_wait(wait: PendingCall) -> dict[str, Any]:
    """A wait as the row lists it: its kind, its deadline, a call's agent, a signal's name."""
    shown: dict[str, Any] = {
        "subtask_id": wait.subtask_id,
        "kind": wait.kind,
        "deadline_at": wait.deadline_at,
    }
    if wait.kind == "call":
        shown["agent"] = wait.agent
    if wait.name is not None:
        shown["name"] = wait.name
    return shown


def _expected_stats(streams: dict[str, list[RecordedEvent]]) -> dict[str, AgentCounts]:
    """The agent statistics the streams imply, counted event by event."""
    stats: dict[str, AgentCounts] = defaultdict(AgentCounts)
    for events in streams.values():
        parsed = [(e, parse(e)) for e in events]
        agent = next((p.agent for _, p in parsed if isinstance(p, TaskStarted)), UNKNOWN_AGENT)
        paused_at: dict[int, Any] = {}
        call_agents: dict[str, str] = {}
        paused = False
        for event, domain in parsed:
            if isinstance(domain, TaskPaused):
                paused = True
                stats[agent].paused_now += 1
                paused_at[domain.pause] = event.recorded_at
                call_agents |= {c.subtask_id: c.agent for c in domain.calls}
            elif isinstance(domain, TaskResumed):
                paused = False
                stats[agent].paused_now -= 1
                stats[agent].pauses_resumed += 1
                delta = event.recorded_at - paused_at[domain.pause]  # type: ignore[operator]
                stats[agent].pause_microseconds += delta // timedelta(microseconds=1)
            elif isinstance(domain, ResultRecorded) and domain.outcome == "timeout":
                if call_agents[domain.subtask_id]:  # a signal's wait is no call to an agent
                    stats[call_agents[domain.subtask_id]].timeouts += 1
            elif isinstance(domain, TaskCompleted):
                stats[agent].completed += 1
            elif isinstance(domain, TaskFailed):
                stats[agent].failed += 1
            elif isinstance(domain, TaskCancelled):
                stats[agent].cancelled += 1
                # whether it was paused, not whether it named calls: a task paused on signals
                # or timers alone has none to cancel
                stats[agent].paused_now -= 1 if paused else 0
    return dict(stats)


async def _paused_rows(engine: AsyncEngine) -> dict[str, dict[str, Any]]:
    async with engine.connect() as connection:
        result = await connection.execute(
            text(
                "SELECT task_id, agent, pause, waits_expected, waits_recorded, paused_since, "
                "status, waits, first_k, agent_version, earliest_deadline FROM paused_tasks"
            )
        )
        rows = {}
        for row in result.mappings():
            row = dict(row)
            earliest = row.pop("earliest_deadline")
            deadlines = [w["deadline_at"] for w in row["waits"]]
            assert (earliest.timestamp() if earliest else None) == pytest.approx(
                min(deadlines) if deadlines else None, abs=1e-5
            ), row
            rows[row.pop("task_id")] = row
        return rows


async def _until_caught_up(engine: AsyncEngine, timeout: float = 60) -> None:
    async def caught_up() -> bool:
        return all(s.behind == 0 for s in await projection_status(engine))

    await eventually(caught_up, timeout, "every projection to catch up with the log")


async def test_the_runner_under_8_concurrent_writers_equals_the_streams_and_a_rebuild(
    log_db: tuple[PostgresEventStore, AsyncEngine],
) -> None:
    store, engine = log_db
    seed = random.randrange(2**32)
    # small batches: many checkpoints land between the writers' commits
    runner = ProjectionRunner(engine, batch_size=37, poll_interval=0.2)
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))
    try:
        tasks = await simulate(
            store, tasks=400, writers=8, seed=seed, leave_paused=0.15, waits=True
        )
        assert set(runner.active) == set(PROJECTIONS), "the runner never became active"
        await _until_caught_up(engine)
    finally:
        stop.set()
        await running

    streams = await _streams(store, [t.task_id for t in tasks])
    statuses = Counter(fold(t, events).status for t, events in streams.items())
    assert statuses["paused"] > 10 and statuses["completed"] > 100, statuses
    expected = _expected_paused(streams)
    assert await _paused_rows(engine) == expected, f"seed {seed}"
    assert await agent_stats(engine) == _expected_stats(streams), f"seed {seed}"
    minutes = expected_minutes(streams)
    assert await minute_rows(engine) == minutes, f"seed {seed}"
    assert sum(sum(row["latency"]) for row in minutes.values()) > 50, "too few latencies"
    events = sum(len(e) for e in streams.values())
    assert sum(runner.applied.values()) == len(PROJECTIONS) * events, (
        "each projection applies each event once"
    )

    for projection in PROJECTIONS.values():
        report = await rebuild(engine, projection, check_only=True)
        assert report.identical, f"seed {seed}: {report.to_json()}"
        assert report.events == events


async def test_a_rebuild_finds_damage_to_the_live_tables_and_repairs_it(
    log_db: tuple[PostgresEventStore, AsyncEngine],
) -> None:
    store, engine = log_db
    await simulate(store, tasks=60, writers=2, seed=7, leave_paused=0.3, waits=True)
    async with engine.connect() as connection:
        for projection in PROJECTIONS.values():
            await catch_up(connection, projection)
        before = await _paused_rows(engine)
        stats_before = await agent_stats(engine)
        minutes_before = await minute_rows(engine)
        victim = sorted(before)[0]
        await connection.execute(text("DELETE FROM paused_tasks WHERE task_id = :t"), {"t": victim})
        await connection.execute(text("UPDATE agent_stats SET completed = completed + 5"))
        await connection.execute(text("UPDATE agent_minutes SET latency[50] = latency[50] + 1"))
        await connection.commit()

    paused = PROJECTIONS["paused_tasks"]
    checked = await rebuild(engine, paused, check_only=True)
    assert not checked.swapped
    assert [(d.table, d.only_live, d.only_rebuilt, d.sample_keys) for d in checked.differences] == [
        ("paused_tasks", 0, 1, (victim,))
    ]
    assert victim not in await _paused_rows(engine), "--check changed the live table"

    stats = PROJECTIONS["agent_stats"]
    checked = await rebuild(engine, stats, check_only=True)
    (difference,) = checked.differences
    assert difference.only_live == difference.only_rebuilt == len(stats_before)

    minutes = PROJECTIONS["agent_minutes"]
    checked = await rebuild(engine, minutes, check_only=True)
    (difference,) = checked.differences
    assert difference.only_live == difference.only_rebuilt == len(minutes_before)
    assert all(key.split()[0] in {a for a, _ in minutes_before} for key in difference.sample_keys)

    for projection in (paused, stats, minutes):
        repaired = await rebuild(engine, projection)
        assert repaired.swapped and not repaired.identical
        assert (await rebuild(engine, projection, check_only=True)).identical
    assert await _paused_rows(engine) == before
    assert await agent_stats(engine) == stats_before
    assert await minute_rows(engine) == minutes_before


@pytest.mark.timeout(180)
async def test_the_active_runner_wakes_on_notify_long_before_its_poll(services: Services) -> None:
    """On a PostgreSQL cluster of the test's own: the runner reads below the cluster-wide
    snapshot horizon, so a transaction of anyone else's (another test run on this machine)
    held open when the notification comes leaves the events to the next poll, and this test
    would measure that instead."""
    home = serving_cluster(
        services.admin_database_url, "a cluster with no other session holding the horizon"
    )
    async with PostgresCluster.scratch(home.version) as cluster:
        url = cluster.url("waystation_notify")
        await migrations.upgrade(url)
        store = PostgresEventStore.from_url(url, pool_size=5)
        engine = create_engine(url)
        try:
            await _wakes_on_notify(store, engine)
        finally:
            await engine.dispose()
            await store.close()


async def _wakes_on_notify(store: PostgresEventStore, engine: AsyncEngine) -> None:
    runner = ProjectionRunner(engine, poll_interval=60.0)
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))

    async def appended_events(prefix: str) -> int:
        tasks = await simulate(store, tasks=5, writers=1, seed=3, prefix=prefix, leave_paused=1.0)
        return sum(len(e) for e in (await _streams(store, [t.task_id for t in tasks])).values())

    try:
        await eventually(lambda: set(runner.active) == set(PROJECTIONS), 30, "an active runner")
        # a first batch, caught up: from then on the runner waits for a notification (or its
        # minute-long poll), whatever the time it took to get there
        first = await appended_events("before")
        await eventually(
            lambda: runner.applied["paused_tasks"] == first, 30, "the runner to catch up"
        )
        second = await appended_events("after")
        # well inside the poll interval: only the notification can have woken it
        await eventually(
            lambda: runner.applied["paused_tasks"] == first + second,
            20,
            "the runner to apply the second batch",
        )
    finally:
        stop.set()
        await running
    assert len(await _paused_rows(engine)) == 10


async def test_status_reports_how_far_behind_each_projection_is(
    log_db: tuple[PostgresEventStore, AsyncEngine],
) -> None:
    store, engine = log_db
    tasks = await simulate(store, tasks=10, writers=1, seed=5)
    events = sum(len(e) for e in (await _streams(store, [t.task_id for t in tasks])).values())
    statuses = {s.name: s for s in await projection_status(engine)}
    assert {n: (s.behind, s.events, s.active) for n, s in statuses.items()} == {
        n: (events, 0, False) for n in PROJECTIONS
    }
    assert all(s.lag_seconds > 0 for s in statuses.values())
    async with engine.connect() as connection:
        await catch_up(connection, PROJECTIONS["agent_stats"], batch_size=7)
    statuses = {s.name: s for s in await projection_status(engine)}
    assert (statuses["agent_stats"].behind, statuses["agent_stats"].events) == (0, events)
    assert statuses["agent_stats"].lag_seconds == 0
    assert statuses["paused_tasks"].behind == events


def _runner_process(settings: Settings, tmp_path: Path, name: str) -> WorkerProcess:
    return WorkerProcess.with_settings(
        settings,
        tmp_path / f"{name}.log",
        command=["projections", "run"],
        env={
            "WAYSTATION_PROJECTION_STANDBY_INTERVAL": "0.5",
            "WAYSTATION_PROJECTION_POLL_INTERVAL": "0.2",
            "WAYSTATION_PROJECTION_BATCH_SIZE": "50",
        },
    )


ACTIVE = "projection paused_tasks: this runner is active"


@pytest.mark.timeout(240)
async def test_killing_the_active_runner_hands_its_projection_to_another_instance(
    log_db: tuple[PostgresEventStore, AsyncEngine], settings: Settings, tmp_path: Path
) -> None:
    store, engine = log_db
    settings = settings.model_copy(
        update={"database_url": store.engine.url.render_as_string(False)}
    )
    runners = [_runner_process(settings, tmp_path, f"runner-{i}") for i in range(2)]
    logs = worker_logs(runners)
    seed = random.randrange(2**32)
    try:
        for runner in runners:
            runner.start()
        await eventually(lambda: bool(log_lines(runners, ACTIVE)), 30, "an active runner")
        (active,) = [r for r in runners if log_lines([r], ACTIVE)]
        (standby,) = [r for r in runners if r is not active]
        writing = asyncio.create_task(
            simulate(store, tasks=300, writers=4, seed=seed, leave_paused=0.15)
        )
        await eventually(
            lambda: _applied_some(engine), 30, "the active runner to apply some events"
        )
        assert not writing.done(), "the writers were done before the kill: proves nothing"
        active.kill()
        killed = time.monotonic()
        await eventually(lambda: bool(log_lines([standby], ACTIVE)), 30, f"a takeover\n{logs()}")
        took = time.monotonic() - killed
        tasks = await writing
        await _until_caught_up(engine)
    finally:
        for runner in runners:
            runner.stop(timeout=15)

    streams = await _streams(store, [t.task_id for t in tasks])
    assert await _paused_rows(engine) == _expected_paused(streams), f"seed {seed}\n{logs()}"
    assert await agent_stats(engine) == _expected_stats(streams), f"seed {seed}"
    for projection in PROJECTIONS.values():
        assert (await rebuild(engine, projection, check_only=True)).identical, f"seed {seed}"
    print(f"seed {seed}: the standby took over {took:.2f}s after the kill")


async def _applied_some(engine: AsyncEngine) -> bool:
    return any(s.events > 0 for s in await projection_status(engine))


async def test_the_cli_lists_paused_tasks_statistics_and_checks_a_rebuild(
    log_db: tuple[PostgresEventStore, AsyncEngine], settings: Settings
) -> None:
    store, engine = log_db
    settings = settings.model_copy(
        update={"database_url": store.engine.url.render_as_string(False)}
    )
    tasks = await simulate(store, tasks=80, writers=2, seed=11, leave_paused=0.3, waits=True)
    streams = await _streams(store, [t.task_id for t in tasks])
    behind = sum(len(e) for e in streams.values())

    shown = await asyncio.to_thread(run_cli, settings, "projections", "status", "--json")
    assert shown.returncode == 0, shown.stderr
    assert {p["name"]: p["behind"] for p in loads(shown.stdout)} == {
        "paused_tasks": behind,
        "agent_stats": behind,
        "agent_minutes": behind,
    }
    async with engine.connect() as connection:
        for projection in PROJECTIONS.values():
            await catch_up(connection, projection)

    expected = _expected_paused(streams)
    listed = await asyncio.to_thread(run_cli, settings, "tasks", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = loads(listed.stdout)
    assert {r["task_id"]: (r["agent"], r["pause"], r["status"]) for r in rows} == {
        t: (row["agent"], row["pause"], row["status"]) for t, row in expected.items()
    }
    assert {r["task_id"]: _waits_listed(r) for r in rows} == {
        t: [
            (w["subtask_id"], w["kind"], w.get("agent"), w.get("name"), w["deadline_at"])
            for w in row["waits"]
        ]
        for t, row in expected.items()
    }
    table = await asyncio.to_thread(run_cli, settings, "tasks", "--agent", "planner")
    planner = [t for t, row in expected.items() if row["agent"] == "planner"]
    assert sorted(line.split()[0] for line in table.stdout.splitlines()[1:]) == sorted(planner)
    await _the_cli_filters_on_waits(settings, expected)

    stats = await asyncio.to_thread(run_cli, settings, "status", "--json")
    assert stats.returncode == 0, stats.stderr
    report = loads(stats.stdout)
    want = _expected_stats(streams)
    assert {a: v["completed"] for a, v in report["agents"].items()} == {
        a: c.completed for a, c in want.items()
    }
    assert all(p["behind"] == 0 for p in report["projections"])
    readable = await asyncio.to_thread(run_cli, settings, "status")
    assert readable.stdout.splitlines()[0].split() == [
        "agent",
        "completed",
        "failed",
        "cancelled",
        "paused",
        "timeouts",
        "mean",
        "pause",
    ]

    checked = await asyncio.to_thread(
        run_cli, settings, "projections", "rebuild", "paused_tasks", "--check"
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "the live table matches the rebuild" in checked.stdout
    checked = await asyncio.to_thread(
        run_cli, settings, "projections", "rebuild", "agent_minutes", "--check"
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    async with engine.connect() as connection:
        await connection.execute(text("UPDATE paused_tasks SET pause = pause + 1"))
        await connection.commit()
    damaged = await asyncio.to_thread(
        run_cli, settings, "projections", "rebuild", "paused_tasks", "--check", "--json"
    )
    assert damaged.returncode == 1
    difference = loads(damaged.stdout)["differences"][0]
    assert (difference["only_live"], difference["only_rebuilt"]) == (len(expected),) * 2
    repaired = await asyncio.to_thread(run_cli, settings, "projections", "rebuild", "paused_tasks")
    assert repaired.returncode == 0 and "now holds the rebuilt rows" in repaired.stdout
    assert await _paused_rows(engine) == expected


def _waits_listed(row: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A row's waits as `tasks --json` lists them, deadlines back in seconds since the epoch."""
    return [
        (
            w["subtask_id"],
            w["kind"],
            w.get("agent"),
            w.get("name"),
            datetime.fromisoformat(w["deadline"]).timestamp(),
        )
        for w in row["waits"]
    ]


async def _the_cli_filters_on_waits(settings: Settings, expected: dict[str, Any]) -> None:
    """`tasks --waiting-for KIND` and `--signal NAME` list exactly the tasks with such an open
    wait, and the table says what each waits for."""

    def waiting(kind: str, name: str | None = None) -> set[str]:
        return {
            t
            for t, row in expected.items()
            if any(w["kind"] == kind and name in (None, w.get("name")) for w in row["waits"])
        }

    for kind in ("call", "signal", "timer"):
        listed = await asyncio.to_thread(
            run_cli, settings, "tasks", "--waiting-for", kind, "--json"
        )
        assert listed.returncode == 0, listed.stderr
        assert {r["task_id"] for r in loads(listed.stdout)} == waiting(kind), kind
        assert waiting(kind), f"no task waits for a {kind}: the filter is not tested"
    for name in ("approval", "webhook"):
        named = await asyncio.to_thread(run_cli, settings, "tasks", "--signal", name, "--json")
        assert {r["task_id"] for r in loads(named.stdout)} == waiting("signal", name), name
        assert waiting("signal", name) != waiting("signal"), "every task waits for one name"

    table = await asyncio.to_thread(run_cli, settings, "tasks", "--signal", "approval")
    header, *lines = table.stdout.splitlines()
    assert header.split()[-2:] == ["waiting", "for"]
    assert lines and all("signal approval" in line for line in lines), table.stdout
    first_k = [t for t, row in expected.items() if row["first_k"] and row["status"] == "paused"]
    listed = await asyncio.to_thread(run_cli, settings, "tasks")
    shown = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
    assert first_k and all(f"first {expected[t]['first_k']} of: " in shown[t] for t in first_k), (
        listed.stdout
    )

    mixed = await asyncio.to_thread(
        run_cli, settings, "tasks", "--signal", "approval", "--waiting-for", "timer"
    )
    assert mixed.returncode == 2 and "--signal" in mixed.stderr, mixed.stderr


async def test_rows_kept_before_the_projection_knew_waits_are_what_a_rebuild_gives(
    services: Services,
) -> None:
    """Revision 0009 fills the open waits, FirstK and agent version of the rows already there
    from their pauses, keeping their deadlines (extended ones too): the migrated table equals a
    rebuild from zero. Downgrading gives back the rows as they were."""
    url = fresh_database_url(services.admin_database_url)
    await migrations.upgrade(url, "0008")
    store = PostgresEventStore.from_url(url, pool_size=4)
    engine = create_engine(url)
    try:
        tasks = await simulate(store, tasks=80, writers=2, seed=11, leave_paused=0.4, waits=True)
        expected = _expected_paused(await _streams(store, [t.task_id for t in tasks]))
        assert any(row["first_k"] for row in expected.values()), "no FirstK pause to migrate"
        assert all(row["agent_version"] == "sim-2" for row in expected.values())
        assert {w["kind"] for row in expected.values() for w in row["waits"]} == {
            "call",
            "signal",
            "timer",
        }
        old_rows = {task_id: _as_before_0009(row) for task_id, row in expected.items()}
        async with engine.begin() as connection:
            await _write_rows_before_0009(connection, old_rows)
        await migrations.upgrade(url)

        assert await _paused_rows(engine) == expected
        report = await rebuild(engine, PROJECTIONS["paused_tasks"], check_only=True)
        assert report.identical, report.to_json()

        await asyncio.to_thread(alembic_command.downgrade, migrations._alembic_config(url), "0008")
        async with engine.connect() as connection:
            result = await connection.execute(
                text(
                    "SELECT task_id, calls_expected, calls_recorded, deadlines, status "
                    "FROM paused_tasks"
                )
            )
            downgraded = {row[0]: dict(row._mapping) for row in result}
        assert downgraded == {
            task_id: {
                "task_id": task_id,
                "calls_expected": row["calls_expected"],
                "calls_recorded": row["calls_recorded"],
                "deadlines": row["deadlines"],
                "status": row["status"],
            }
            for task_id, row in old_rows.items()
        }
    finally:
        await engine.dispose()
        await store.close()
        await migrations.drop_database(url)


def _as_before_0009(row: dict[str, Any]) -> dict[str, Any]:
    """A row as the paused-tasks projection kept it under revision 0008."""
    return {
        "agent": row["agent"],
        "pause": row["pause"],
        "calls_expected": row["waits_expected"],
        "calls_recorded": row["waits_recorded"],
        "paused_since": row["paused_since"],
        "status": row["status"],
        "deadlines": {w["subtask_id"]: w["deadline_at"] for w in row["waits"]},
    }


async def _write_rows_before_0009(connection: Any, rows: dict[str, dict[str, Any]]) -> None:
    """The rows, and the checkpoint at the end of the log: as a runner under 0008 left them."""
    for task_id, row in rows.items():
        deadlines = row["deadlines"]
        await connection.execute(
            text(
                """
                INSERT INTO paused_tasks (task_id, agent, pause, calls_expected, calls_recorded,
                                          earliest_deadline, paused_since, status, deadlines)
                VALUES (:task_id, :agent, :pause, :calls_expected, :calls_recorded,
                        to_timestamp(CAST(:earliest AS float8)), :paused_since, :status,
                        CAST(:deadlines_json AS jsonb))
                """
            ),
            {
                "task_id": task_id,
                **row,
                "earliest": min(deadlines.values()) if deadlines else None,
                "deadlines_json": dumps(deadlines).decode(),
            },
        )
    await connection.execute(
        text(
            """
            INSERT INTO projection_checkpoints (name, tx_id, global_position, events)
            SELECT 'paused_tasks', tx_id, global_position, (SELECT count(*) FROM events)
            FROM events ORDER BY tx_id DESC, global_position DESC LIMIT 1
            """
        )
    )
