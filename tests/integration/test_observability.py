"""What an operator watches: a running worker's /metrics and /healthz, its JSON logs, and a trace
id that travels from the publisher through every peer call into the log and `history`."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aio_pika import Message
from prometheus_client.parser import text_string_to_metric_families

from scripts.lab.harness.processes import (
    WorkerProcess,
    free_port,
    metrics_env,
    stats_env,
    worker_counters,
)
from waystation.client import Client
from waystation.events.postgres import PostgresEventStore
from waystation.example import expected_total
from waystation.observability.tracing import trace_hex
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import eventually, start_example_workers
from .test_cli import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

K = 3


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


def exported(text: str, family: str) -> bool:
    """Whether the scrape declares the metric ``family`` (it may have no series yet)."""
    return any(f.name == family for f in text_string_to_metric_families(text))


def value(text: str, name: str, *, absent: float | None = None, **labels: str) -> float:
    """The sample ``name`` with exactly these labels, which must exist; or, with ``absent``
    given, that value when no such series exists yet (a labelled counter never incremented),
    as long as its family is exported at all."""
    found = [v for n, ls, v in samples(text) if n == name and ls == labels]
    assert len(found) <= 1, (name, labels, found)
    if found:
        return found[0]
    family = name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    assert absent is not None, f"no series {name}{labels} in the scrape"
    assert exported(text, family), f"{family} is not exported at all"
    return absent


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


def json_log(path: Path) -> list[dict[str, object]]:
    """The worker's log: JSON lines (a log file is not a terminal, so ``auto`` means JSON)."""
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


@pytest.mark.timeout(120)
async def test_metrics_of_a_running_worker_move_as_tasks_flow(
    settings: Settings, store: PostgresEventStore, tmp_path: Path
) -> None:
    port = free_port()
    worker = WorkerProcess.with_settings(
        settings,
        tmp_path / "worker.log",
        env={
            **metrics_env(port),
            **stats_env(tmp_path / "worker.stats.json"),
        },
    )
    base = f"http://127.0.0.1:{port}"
    tasks = 20
    try:
        await start_example_workers(settings, [worker])
        status, body = await get(f"{base}/healthz")
        health = orjson.loads(body)
        assert status == 200, body
        assert health["status"] == "ok" and health["state"] == "serving", health
        assert health["broker"] is True and health["database"] is True, health
        # tasks, replies and reply shards of both example agents
        assert health["consumers"] == 2 * (2 + settings.reply_shards), health

        _, before = await get(f"{base}/metrics")
        assert value(before, "waystation_healthy") == 1, "the same check as /healthz"
        async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
            ids = [await client.submit("orchestrator", {"n": n, "k": K}) for n in range(tasks)]
            results = [await client.result(task_id, 60) for task_id in ids]
            totals = [r.result["total"] for r in results]
            assert totals == [expected_total(n, K) for n in range(tasks)]
            # a message no worker can use: dead-lettered, and counted
            channel = await client._connection.channel()  # type: ignore[union-attr]
            await channel.default_exchange.publish(
                Message(b"{not json", message_id="observability-bad-body"),
                routing_key=Names(settings.queue_prefix).tasks("orchestrator"),
            )
        dead = {"reason": "invalid-json"}

        async def dead_lettered() -> bool:
            _, text = await get(f"{base}/metrics")
            return value(text, "waystation_dead_letters_total", absent=0, **dead) == 1

        await eventually(dead_lettered, 20, "the bad message to be dead-lettered")

        async def backlog_read() -> bool:
            # the database's outbox, read at scrape time: rows are forgotten shortly after they
            # are published, so the gauge falls to what the table holds once all is quiet
            _, text = await get(f"{base}/metrics")
            backlog = await store.outbox_size(deployment=settings.queue_prefix)
            return value(text, "waystation_outbox_backlog") == backlog

        await eventually(backlog_read, 20, "the outbox backlog gauge to match the table")
        _, after = await get(f"{base}/metrics")
    finally:
        code = worker.stop()
    assert code == 0
    counters = worker_counters([worker])
    assert counters, "the worker wrote no counters when it stopped"

    def moved(name: str, *, absent: float | None = None, **labels: str) -> float:
        """How far a series moved during the run: it exists at the end (unless ``absent`` says
        what its absence means); before the first task it may not exist yet."""
        return value(after, name, absent=absent, **labels) - value(before, name, absent=0, **labels)

    ack = {"outcome": "ack"}
    assert moved("waystation_messages_total", agent="orchestrator", kind="task", **ack) == tasks
    assert moved("waystation_messages_total", agent="researcher", kind="task", **ack) == tasks * K
    assert moved("waystation_messages_total", agent="orchestrator", kind="result", **ack) == (
        tasks * K
    )
    # resumed in place with their last replies (WAYSTATION_RESUME_IN_PLACE): no resume messages
    assert (
        moved("waystation_messages_total", absent=0, agent="orchestrator", kind="resume", **ack)
        == 0
    )
    assert (
        moved("waystation_messages_total", agent="orchestrator", kind="task", outcome="dead-letter")
        == 1
    )
    for event_type, per_task in [
        ("TaskStarted", 1),
        ("TaskPaused", 1),
        ("SubtaskClaimed", K),
        ("ResultRecorded", K),
        ("TaskResumed", 1),
        ("TaskCompleted", 1),
    ]:
        assert moved("waystation_events_appended_total", event_type=event_type) == (
            tasks * per_task
        ), event_type
    assert moved("waystation_tasks_finished_total", agent="orchestrator", status="completed") == (
        tasks
    )
    assert moved("waystation_checkpoint_seconds_count") == tasks, "one checkpoint per pause"
    assert moved("waystation_checkpoint_seconds_sum") > 0
    assert moved("waystation_resume_latency_seconds_count") == tasks
    assert value(after, "waystation_messages_in_flight") == 0
    # no projection runner runs here: both projections are behind by at least these events
    # (the database is the whole test run's, so other tests' events count too)
    appended = value(after, "waystation_events_appended_total", event_type="TaskStarted")
    assert appended == tasks
    for projection in ("paused_tasks", "agent_stats"):
        lag = value(after, "waystation_projection_lag_events", projection=projection)
        assert lag >= appended, projection
    # exported from the start, even at zero, and it agrees with the worker's own count
    conflicts = counters.get("version_conflicts", 0)
    assert value(before, "waystation_version_conflicts_total") == 0
    assert value(after, "waystation_version_conflicts_total") == conflicts
    assert value(after, "waystation_call_timeouts_total", absent=0, agent="researcher") == 0


@pytest.mark.timeout(60)
def test_a_worker_whose_metrics_port_is_taken_says_so_and_exits_non_zero(
    settings: Settings, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = WorkerProcess.with_settings(
            settings,
            tmp_path / "worker.log",
            env=metrics_env(port),
        ).start()
        assert worker.process is not None
        worker.process.wait(45)
        code = worker.stop()
    log = (tmp_path / "worker.log").read_text()
    assert code == 1
    assert "Traceback" not in log, "an operator's mistake, told in one line"
    assert f"cannot serve metrics on 127.0.0.1:{port}" in log, log
    assert "WAYSTATION_METRICS_PORT" in log


@pytest.mark.timeout(120)
async def test_a_trace_id_travels_through_every_peer_call_into_events_logs_and_history(
    settings: Settings, store: PostgresEventStore, tmp_path: Path
) -> None:
    log_path = tmp_path / "worker.log"
    worker = WorkerProcess.with_settings(settings, log_path, env={"WAYSTATION_LOG_LEVEL": "DEBUG"})
    trace = "trace-7f3a-observability"
    w3c_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        await start_example_workers(settings, [worker])
        async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
            given = await client.submit("orchestrator", {"n": 1, "k": K}, trace_id=trace)
            assert (await client.result(given, 60)).ok
            # a publisher that speaks W3C Trace Context only
            channel = await client._connection.channel()  # type: ignore[union-attr]
            w3c = "observability-w3c-task"
            await channel.default_exchange.publish(
                Message(
                    orjson.dumps({"n": 2, "k": K}),
                    message_id=w3c,
                    content_type="application/json",
                    headers={"traceparent": f"00-{w3c_trace}-00f067aa0ba902b7-01"},
                ),
                routing_key=Names(settings.queue_prefix).tasks("orchestrator"),
            )
            plain = await client.submit("orchestrator", {"n": 3, "k": K})
            assert (await client.result(plain, 60)).ok

        async def w3c_done() -> bool:
            return any(e.event_type == "TaskCompleted" for e in await store.read_stream(w3c))

        await eventually(w3c_done, 30, "the W3C-traced task to complete")
    finally:
        assert worker.stop() == 0

    for task_id, expected in [(given, trace), (w3c, w3c_trace), (plain, plain)]:
        events = await store.read_stream(task_id)
        assert len(events) == 4 + 2 * K
        assert {e.metadata.get("trace_id") for e in events} == {expected}, task_id

    lines = json_log(log_path)
    # each line prints the trace id the task's spans have, and the one it was given
    traced = [line for line in lines if line.get("trace_id") == trace_hex(trace)]
    assert {line.get("waystation_trace_id") for line in traced} == {trace}
    messages = [str(line["message"]) for line in traced]
    handled = {message.split(" ")[0] for message in messages if "ack after" in message}
    assert handled == {"task", "result"}, traced
    assert any(message.startswith("resumed in place") for message in messages), traced
    subtasks = {line.get("subtask_id") for line in traced} - {None}
    assert subtasks == {f"{given}:1:{i}" for i in range(K)}, "each peer call's lines name it"
    researcher_lines = [line for line in traced if "for researcher" in str(line["message"])]
    assert {line["task_id"] for line in researcher_lines} == subtasks
    assert all(line["worker_id"] == lines[-1]["worker_id"] for line in lines)
    assert {line.get("task_id") for line in traced} >= {given}
    # a W3C trace id is printed as it is; a task without a trace prints its own id's
    for task_id, printed in [(w3c, w3c_trace), (plain, trace_hex(plain))]:
        of_it = [line for line in lines if str(line.get("task_id", "")).startswith(task_id)]
        assert of_it and {line.get("trace_id") for line in of_it} == {printed}, of_it

    shown = await asyncio.to_thread(run_cli, settings, "history", given)
    assert shown.returncode == 0, shown.stderr
    assert f"trace {trace}" in shown.stdout.splitlines()[0]
    shown = await asyncio.to_thread(run_cli, settings, "history", given, "--json")
    as_json = orjson.loads(shown.stdout)
    assert as_json["trace_ids"] == [trace]
    assert {entry["trace_id"] for entry in as_json["events"]} == {trace}
