"""Per-agent policies (``waystation.policies``) on 3 worker processes and the real services: retries
spaced by their backoff (waiting in the broker, whichever worker takes the retry), a run past its
time limit cancelled and counted as a failed attempt, ``Permanent`` failing at once; and
``waystation agents`` as a subprocess, with a policy that cannot work refused at start.

The agents are ``tests/apps/policies.py``; every run appends a line (task, start, end, pid) to a
file all processes share."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aio_pika.abc import AbstractChannel

from scripts.lab.harness.clients import RecordingClient
from scripts.lab.harness.processes import (
    ROOT,
    WorkerProcess,
    app_workers,
    worker_environment,
    worker_logs,
)
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import dead_letters, start_workers, stream_types

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.apps.policies:app"
AGENTS = ["flaky", "slow", "refuses"]


def runs(path: Path, task_id: str) -> list[tuple[float, float, int]]:
    """(start, end, pid) of each run of ``task_id``, in start order."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        task, started, ended, pid = line.split()
        if task == task_id:
            found.append((float(started), float(ended), int(pid)))
    return sorted(found)


@pytest.fixture
def workers(
    settings: Settings, extra_agents: list[str], runs_file: Path, tmp_path: Path
) -> Iterator[list[WorkerProcess]]:
    extra_agents.extend(AGENTS)
    with app_workers(settings, APP, tmp_path, {"POLICY_RUNS": str(runs_file)}) as processes:
        yield processes


async def start(settings: Settings, workers: list[WorkerProcess]) -> None:
    names = Names(settings.queue_prefix)
    await start_workers(settings, workers, [names.tasks(agent) for agent in AGENTS])


async def test_retries_are_spaced_by_their_backoff_across_three_workers(
    settings: Settings, workers: list[WorkerProcess], runs_file: Path
) -> None:
    await start(settings, workers)
    logs = worker_logs(workers)
    async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        results = [await client.call("flaky", {"n": n}, timeout=60) for n in range(3)]
    for result in results:
        assert result.ok and result.result == {"runs": 3}, f"{result}\n{logs()}"
        first, second, third = runs(runs_file, result.task_id)
        # backoff 1 s, then 2 s: a retry never starts before its delay is up (the delay is
        # rounded up to the broker's next wait step, never down)
        assert second[0] - first[1] >= 1.0, (first, second)
        assert third[0] - second[1] >= 2.0, (second, third)
        assert len(client.distinct_results(result.task_id)) == 1
    pids = {pid for result in results for _, _, pid in runs(runs_file, result.task_id)}
    assert pids <= {w.pid for w in workers}


async def test_a_run_past_its_time_limit_is_retried_then_fails(
    settings: Settings,
    workers: list[WorkerProcess],
    runs_file: Path,
    store: PostgresEventStore,
    amqp_channel: AbstractChannel,
) -> None:
    await start(settings, workers)
    logs = worker_logs(workers)
    async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        result = await client.call("slow", {}, timeout=60)
    assert result.status == "error", f"{result}\n{logs()}"
    assert result.error["type"] == "TimeLimitExceeded"
    assert "time_limit of 1s" in result.error["message"]
    recorded = runs(runs_file, result.task_id)
    assert len(recorded) == 2, recorded  # the first run and its one retry
    for started, ended, _ in recorded:
        # cut at its limit (1 s on the loop's clock; the wall clock may read a hair less)
        assert 0.9 <= ended - started < 30, "a run was not cut at its time limit"
    # the failure is recorded before the message is settled (dead-lettered)
    assert await stream_types(store, result.task_id) == ["TaskStarted", "TaskFailed"]
    [dead] = await dead_letters(amqp_channel, Names(settings.queue_prefix), 1)
    assert (dead.headers or {})["x-waystation-reason"] == "handler-failed"
    assert dead.message_id == result.task_id


async def test_permanent_fails_at_once_without_a_retry(
    settings: Settings, workers: list[WorkerProcess], runs_file: Path, store: PostgresEventStore
) -> None:
    await start(settings, workers)
    async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        result = await client.call("refuses", {}, timeout=60)
    assert result.status == "error"
    assert result.error == {"type": "Permanent", "message": "this input will never work"}
    assert len(runs(runs_file, result.task_id)) == 1  # retries=5, yet one run
    assert await stream_types(store, result.task_id) == ["TaskStarted", "TaskFailed"]


def waystation(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "waystation.cli", *args],
        env={**worker_environment(settings), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_waystation_agents_lists_each_agent_with_its_policies(settings: Settings) -> None:
    listed = waystation(settings, "agents", "--app", APP, "--json")
    assert listed.returncode == 0, listed.stderr
    by_agent = {row["agent"]: row for row in json.loads(listed.stdout)["agents"]}
    assert by_agent["flaky"]["retries"] == 3
    assert by_agent["flaky"]["backoff"] == {
        "initial": 1.0,
        "factor": 2.0,
        "maximum": 10.0,
        "jitter": 0.0,
    }
    assert by_agent["slow"]["time_limit"] == 1.0
    assert by_agent["refuses"]["retries"] == 5
    # no pool limits unless declared (tests/integration/test_pool_limits.py lists some)
    assert {(row["concurrency"], row["rate"]) for row in by_agent.values()} == {(None, None)}
    table = waystation(settings, "agents", "--app", APP)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:2] == ["agent", "retries"]
    assert any(line.split()[:2] == ["slow", "1"] and "1s" in line for line in lines)
    columns = ["concurrency", "rate", "calls", "results", "signals", "version"]
    assert lines[0].split()[-6:] == columns
    assert {row["keep_results"] for row in by_agent.values()} == {False}
    # no signals declared, no version: each row ends "if paused  -  -"
    assert all(line.split()[-4:] == ["if", "paused", "-", "-"] for line in lines[1:])
    # the example app, whose agents declare no retries: WAYSTATION_DELIVERY_LIMIT's
    default = waystation(settings, "agents", "--app", "waystation.example:app", "--json")
    assert {row["retries"] for row in json.loads(default.stdout)["agents"]} == {
        settings.delivery_limit - 1
    }


def test_a_policy_that_cannot_work_is_refused_at_start_with_a_clear_error(
    settings: Settings,
) -> None:
    listed = waystation(settings, "agents", "--app", "tests.apps.bad_policy:app")
    assert listed.returncode != 0
    assert "backoff maximum (1.0) must be at least its initial (5.0)" in listed.stderr
    worker = waystation(settings, "worker", "--app", "tests.apps.bad_policy:app")
    assert worker.returncode != 0
    assert "backoff maximum (1.0) must be at least its initial (5.0)" in worker.stderr
