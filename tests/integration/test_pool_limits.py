"""Pool limits (``waystation.runtime.limits``) on 3 worker processes and the real services:
``concurrency`` counted across the pool (start and end times of every run prove it), a killed
holder's slot coming back within the lease time, ``rate`` never exceeded in any window, waiting that
burns no attempt; and both shown by ``waystation agents`` and checked at start.

The agents are ``tests/apps/pool_limits.py``; every run appends its start and end to a file all
processes share."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.lab.harness.clients import RecordingClient
from scripts.lab.harness.processes import WorkerProcess, app_workers, log_lines, worker_logs
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import eventually, start_workers, stream_types
from .test_policies import waystation

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.apps.pool_limits:app"
AGENTS = ["gate", "holder", "metered"]
LEASE_SECONDS = 3.0
"""The workers' ``WAYSTATION_SLOT_LEASE_SECONDS``: a killed holder's slot is free this long after
its last renewal at the latest."""


@dataclass(frozen=True)
class Run:
    task_id: str
    started: float
    ended: float | None
    """None: the run never ended (its worker was killed)."""
    pid: int
    admitted: float | None = None
    """The database's time the run took its rate slot (``metered`` only)."""


def runs(path: Path) -> dict[str, list[Run]]:
    """Every run of every task, in start order (a process writes a run's lines in order)."""
    starts: dict[tuple[str, int], list[list[str]]] = {}
    ends: dict[tuple[str, int], list[float]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        what, task, at, pid, *extra = line.split()
        if what == "start":
            starts.setdefault((task, int(pid)), []).append([at, *extra])
        else:
            ends.setdefault((task, int(pid)), []).append(float(at))
    found: dict[str, list[Run]] = {}
    for (task, pid), started in starts.items():
        ended = ends.get((task, pid), [])
        for index, (at, *extra) in enumerate(started):
            found.setdefault(task, []).append(
                Run(
                    task,
                    float(at),
                    ended[index] if index < len(ended) else None,
                    pid,
                    float(extra[0]) if extra else None,
                )
            )
    return {task: sorted(task_runs, key=lambda r: r.started) for task, task_runs in found.items()}


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that overlap at one instant (one ending as another starts: apart)."""
    points = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, step in points:  # an end (-1) sorts before a start (+1) at the same instant
        now += step
        most = max(most, now)
    return most


@pytest.fixture
def workers(
    settings: Settings, extra_agents: list[str], runs_file: Path, tmp_path: Path
) -> Iterator[list[WorkerProcess]]:
    extra_agents.extend(AGENTS)
    env = {
        "POOL_RUNS": str(runs_file),
        "WAYSTATION_SLOT_LEASE_SECONDS": str(LEASE_SECONDS),
        "WAYSTATION_LIMIT_WAIT_MAX": "0.5",
    }
    with app_workers(settings, APP, tmp_path, env) as processes:
        yield processes


async def start(settings: Settings, workers: list[WorkerProcess]) -> Callable[[], str]:
    """Start the workers; a function returning the end of their logs."""
    names = Names(settings.queue_prefix)
    await start_workers(settings, workers, [names.tasks(agent) for agent in AGENTS])
    return worker_logs(workers)


async def test_concurrency_2_never_has_more_than_2_runs_at_once_across_3_workers(
    settings: Settings,
    workers: list[WorkerProcess],
    runs_file: Path,
    store: PostgresEventStore,
) -> None:
    logs = await start(settings, workers)
    async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        ids = [await client.submit("gate", {"seconds": 0.3}) for _ in range(12)]
        results = [await client.result(task_id, timeout=120) for task_id in ids]
        for result in results:
            # retries=0: had a wait counted as a failed attempt, the task would have failed
            assert result.ok and result.result == {"ran": result.task_id}, f"{result}\n{logs()}"
            assert len(client.distinct_results(result.task_id)) == 1
    found = runs(runs_file)
    assert sorted(found) == sorted(ids)
    intervals = []
    for task_id in ids:
        [run] = found[task_id]  # each ran once: waiting runs nothing
        assert run.ended is not None
        intervals.append((run.started, run.ended))
        # a task that waited is recorded (a copy may exist), once
        assert await stream_types(store, task_id) in ([], ["TaskStarted", "TaskCompleted"])
    assert most_at_once(intervals) <= 2, sorted(intervals)
    # the limit was reached: tasks waited for it, in the broker
    assert log_lines(workers, "in the broker"), logs()
    assert {run.pid for task_id in ids for run in found[task_id]} <= {w.pid for w in workers}


async def test_a_killed_holders_slot_comes_back_within_the_lease_time(
    settings: Settings, workers: list[WorkerProcess], runs_file: Path
) -> None:
    logs = await start(settings, workers)
    async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        first = await client.submit("holder", {"hold": True})
        await eventually(lambda: first in runs(runs_file), 60, "the holder's run to start")
        [holding] = runs(runs_file)[first]
        second = await client.submit("holder", {})
        # the one slot is held by a live run: the second task waits (in the broker)
        await eventually(
            lambda: log_lines(workers, f"task {second} waits"), 60, "the second task to wait"
        )
        assert second not in runs(runs_file)
        victim = next(w for w in workers if w.pid == holding.pid)
        killed_at = time.time()
        victim.kill()
        done = await client.result(second, timeout=120)
        again = await client.result(first, timeout=120)
    assert done.ok and again.ok, f"{done} {again}\n{logs()}"
    found = runs(runs_file)
    # (the second task runs twice when the kill lands between the broker's confirm of one of
    # its waiting copies and the ack of the delivery it replaces: the crash window of G1)
    run, *_ = found[second]
    assert all(r.started >= killed_at for r in found[second]), "taken while its holder lived"
    came_back = run.started - killed_at
    # free LEASE_SECONDS after the last renewal at the latest, then the waiting tasks' next
    # tries (each wait at most 0.5 s); the margin is for a slow machine, not part of the bound
    assert came_back < LEASE_SECONDS + 20, f"the slot came back after {came_back:.1f}s"
    # the killed run was run again, and never beside another live one
    killed, *reruns = found[first]
    assert killed.ended is None and reruns and all(r.pid != holding.pid for r in reruns)
    live = [(r.started, r.ended) for r in [*found[second], *reruns] if r.ended is not None]
    assert most_at_once(live) == 1, live


async def test_a_rate_of_3_per_3s_is_never_exceeded_in_any_window(
    settings: Settings, workers: list[WorkerProcess], runs_file: Path
) -> None:
    logs = await start(settings, workers)
    async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        ids = [await client.submit("metered", {}) for _ in range(7)]
        results = [await client.result(task_id, timeout=120) for task_id in ids]
    assert all(result.ok for result in results), f"{results}\n{logs()}"
    found = runs(runs_file)
    admitted = []
    for task_id in ids:
        [run] = found[task_id]
        assert run.admitted is not None and run.admitted <= run.started, run
        admitted.append(run.admitted)
    admitted.sort()
    # at most 3 in any window of 3 s: any 4 consecutive admissions span 3 s or more. (Checked
    # on the database's times: a run's own start lags its admission by however long the
    # worker takes to call the handler, which a test cannot bound)
    for first, fourth in zip(admitted, admitted[3:], strict=False):
        assert fourth - first >= 3.0, admitted
    assert admitted[-1] - admitted[0] >= 6.0  # 7 starts: three windows at least


def test_waystation_agents_shows_concurrency_and_rate(settings: Settings) -> None:
    listed = waystation(settings, "agents", "--app", APP, "--json")
    assert listed.returncode == 0, listed.stderr
    by_agent = {row["agent"]: row for row in json.loads(listed.stdout)["agents"]}
    assert by_agent["gate"]["concurrency"] == 2 and by_agent["gate"]["rate"] is None
    assert by_agent["metered"]["rate"] == {"count": 3, "per": 3.0}
    assert by_agent["metered"]["concurrency"] is None
    table = waystation(settings, "agents", "--app", APP)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    header = lines[0]
    assert "concurrency" in header and "rate" in header
    [metered] = [line for line in lines if line.startswith("metered ")]
    assert "3/3s" in metered.split()
    [gate] = [line for line in lines if line.startswith("gate ")]
    column = header.index("concurrency")
    assert gate[column:].split()[0] == "2"


def test_a_bad_concurrency_or_rate_is_refused_at_start_with_a_clear_error(
    settings: Settings,
) -> None:
    for command in (["agents"], ["worker"]):
        refused = waystation(settings, *command, "--app", "tests.apps.bad_limits:app")
        assert refused.returncode != 0
        assert "rate must be a Rate or a string like '10/s'" in refused.stderr, refused.stderr
