"""The acceptance test: real worker processes, one SIGKILLed mid-run, every task exactly once.

Three worker processes of the example app serve 300 orchestrator tasks (K=3 researchers each,
20 to 50 ms of work per call, so many tasks are paused at any moment). Once about a third of the
results are in, one worker is frozen at a moment it holds deliveries it has not settled (the
broker counts them), SIGKILLed, and a replacement started. Every task must still answer with
one distinct, right result (repeated no more often than the outbox relays and the broker
explain), and its stream must show every sub-task claimed once, the pause resumed once, the
task completed once, and a hash chain that verifies. The same holds when a worker's broker
connection is force-closed mid-run, also while it holds deliveries (it reconnects; what it had
in flight is redelivered, and its acks on the dead channel fail).
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import pytest

from scripts.lab.harness.broker import close_broker_connections, wait_for_consumers
from scripts.lab.harness.checks import fanout_problems, record_outbox_claims, result_messages
from scripts.lab.harness.clients import RecordingClient
from scripts.lab.harness.processes import WorkerProcess, worker_logs
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import (
    Services,
    eventually,
    fanout_inputs,
    freeze_holding_work,
    paused_count,
    require,
    settle_run,
    start_example_workers,
    worker_connection_name,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASKS = 300
K = 3


@pytest.mark.timeout(480)
async def test_300_tasks_survive_a_worker_killed_while_it_holds_work(
    settings: Settings, store: PostgresEventStore, services: Services, tmp_path: Path
) -> None:
    require(services.rabbitmqctl, "showing that the kill met work in flight")
    seed = random.randrange(2**32)
    workers = [
        WorkerProcess.with_settings(settings, tmp_path / f"worker-{i}.log") for i in range(3)
    ]
    replacement = WorkerProcess.with_settings(settings, tmp_path / "worker-replacement.log")
    everyone = [*workers, replacement]
    logs = worker_logs(everyone)
    started = time.monotonic()
    try:
        await record_outbox_claims(store)
        await start_example_workers(settings, workers)
        async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
            inputs = fanout_inputs("mp", TASKS, K, (20.0, 50.0), seed)
            task_ids = list(inputs)
            await asyncio.gather(
                *(client.submit("orchestrator", inputs[t], task_id=t) for t in task_ids)
            )
            await eventually(
                lambda: len(client.results) >= TASKS // 3, 60, "a third of the results"
            )
            victim = workers[1]
            held = await freeze_holding_work(victim)
            paused = await paused_count(store, task_ids)
            done_at_kill = len(client.results)
            victim.kill()
            killed_at = time.monotonic() - started
            assert held > 0, f"the victim never held a delivery when looked at\n{logs()}"
            assert paused > 0, "no task was paused when the worker was killed: this proves nothing"
            assert done_at_kill < TASKS, "the run was over when the worker was killed"
            replacement.start()
            await settle_run(settings, store, client, task_ids, logs, within=120)
            all_results_at = time.monotonic() - started

        problems, ignored = await fanout_problems(store, client, inputs, K)
        report = (
            f"seed {seed}: killed a worker holding {held} unsettled deliveries at "
            f"{killed_at:.1f}s with {done_at_kill}/{TASKS} results in and {paused} tasks paused; "
            f"all results at {all_results_at:.1f}s; {result_messages(client)}; "
            f"ReplyIgnored {dict(ignored)}"
        )
        print(report)
        assert not problems, f"{report}\n{len(problems)} problems, first: {problems[:10]}\n{logs()}"
        assert victim.process is not None and victim.process.returncode == -signal.SIGKILL
        for worker in (workers[0], workers[2], replacement):
            assert worker.alive(), f"a surviving worker died\n{logs()}"
    finally:
        workers[1].kill()  # frozen, if the test failed before its kill
        for worker in everyone:
            worker.stop(timeout=15)


@pytest.mark.timeout(480)
async def test_a_worker_whose_broker_connection_is_closed_mid_run_reconnects_and_repeats_nothing(
    settings: Settings, store: PostgresEventStore, services: Services, tmp_path: Path
) -> None:
    require(services.rabbitmqctl, "closing a worker's broker connection")
    tasks = 150
    seed = random.randrange(2**32)
    workers = [
        WorkerProcess.with_settings(settings, tmp_path / f"worker-{i}.log") for i in range(2)
    ]
    logs = worker_logs(workers)
    try:
        await record_outbox_claims(store)
        await start_example_workers(settings, workers)
        async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
            # 5 slow tasks: rabbitmqctl takes a second or more to start, and on a fast machine
            # the rest of the run can be over by the time the connection closes
            inputs = fanout_inputs("mp", tasks, K, (20.0, 50.0), seed, slow=5, slow_ms=8000.0)
            task_ids = list(inputs)
            await asyncio.gather(
                *(client.submit("orchestrator", inputs[t], task_id=t) for t in task_ids)
            )
            await eventually(
                lambda: len(client.results) >= tasks // 3, 60, "a third of the results"
            )
            victim = workers[0]
            assert victim.process is not None
            held = await freeze_holding_work(victim)
            paused = await paused_count(store, task_ids)
            done_at_close = len(client.results)
            try:
                closed = await close_broker_connections(worker_connection_name(victim))
            finally:
                victim.process.send_signal(signal.SIGCONT)  # it finds its connection gone
            assert held > 0, f"the victim never held a delivery when looked at\n{logs()}"
            assert closed == 1, f"closed {closed} connections of the victim"
            assert done_at_close < tasks, "the run was over when the connection closed"
            assert paused > 0, "no task was paused when the connection closed: this proves nothing"
            await settle_run(settings, store, client, task_ids, logs, within=120)
            # the victim came back: it consumes again
            await wait_for_consumers(
                settings.amqp_url, [Names(settings.queue_prefix).tasks("orchestrator")], 2
            )

        problems, ignored = await fanout_problems(store, client, inputs, K)
        report = (
            f"seed {seed}: closed the connection of a worker holding {held} unsettled deliveries "
            f"with {done_at_close}/{tasks} results in and {paused} tasks paused; "
            f"{result_messages(client)}; ReplyIgnored {dict(ignored)}"
        )
        print(report)
        assert not problems, f"{report}\n{len(problems)} problems, first: {problems[:10]}\n{logs()}"
        assert all(w.alive() for w in workers), f"a worker died\n{logs()}"
    finally:
        for worker in workers:
            if worker.process is not None and worker.alive():
                worker.process.send_signal(signal.SIGCONT)
            worker.stop(timeout=15)
