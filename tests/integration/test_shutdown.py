"""Graceful shutdown of real worker processes: SIGTERM and SIGINT, busy and idle.

A worker that receives SIGTERM or SIGINT stops consuming, lets the messages it holds reach their
next commit within ``WAYSTATION_SHUTDOWN_GRACE`` seconds, and exits 0. Nothing is lost on the
way: with another worker running, or a replacement started once it has gone, every task of the
run completes exactly once (one distinct right result; each sub-task claimed once, the pause
resumed once, the task completed once; hash chains verify).

The example app's researchers work 200 to 400 ms per call here, so a worker holds a full
prefetch of them when the signal arrives (the test checks that messages were waiting in the
researcher queue at that moment, which means every consumer's prefetch was full, and that the
broker counted unacked messages on the worker's connection just before).
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from scripts.lab.harness.broker import consumer_count, queue_depth, unacked_messages_of
from scripts.lab.harness.checks import fanout_problems, record_outbox_claims, result_messages
from scripts.lab.harness.clients import DurableResultCollector
from scripts.lab.harness.processes import (
    WorkerProcess,
    log_lines,
    stats_env,
    worker_counters,
    worker_logs,
)
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import (
    Services,
    eventually,
    fanout_inputs,
    paused_count,
    require,
    settle_run,
    start_example_workers,
    worker_connection_name,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

K = 3
GRACE = 30.0
"""Room for a busy worker to drain on a slow machine: the test checks that the grace period
did not run out (the worker logs it when it does), not how many seconds the drain took."""
SIGNALS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="SIGINT")]
GRACE_EXPIRED = "still in flight after the grace period"
DRAINS = [
    pytest.param(signal.SIGTERM, "replacement", id="replacement-SIGTERM"),
    pytest.param(signal.SIGINT, "peer", id="peer-SIGINT"),
]
"""Each signal and each successor once: both signals take the same drain (the idle test below
runs each on its own), so their four combinations would repeat two runs of ~15 s each."""


def _worker(settings: Settings, tmp_path: Path, name: str, grace: float) -> WorkerProcess:
    return WorkerProcess.with_settings(
        settings,
        tmp_path / f"{name}.log",
        env={
            "WAYSTATION_SHUTDOWN_GRACE": str(grace),
            **stats_env(tmp_path / f"{name}.stats.json"),
        },
    )


async def _signal_and_wait(worker: WorkerProcess, signum: int, within: float) -> tuple[int, float]:
    """Send ``signum``; the exit code and the seconds it took to exit (fails after ``within``)."""
    assert worker.process is not None
    signalled = time.monotonic()
    worker.process.send_signal(signum)
    code = await worker.wait_exit(within)
    took = time.monotonic() - signalled
    assert code is not None, f"the worker did not exit within {within}s of {signum!r}"
    return code, took


@pytest.mark.timeout(540)
@pytest.mark.parametrize(("signum", "successor"), DRAINS)
async def test_a_busy_worker_drains_exits_0_and_no_task_is_lost(
    signum: signal.Signals,
    successor: str,
    settings: Settings,
    store: PostgresEventStore,
    tmp_path: Path,
    services: Services,
) -> None:
    """Signal a worker holding a full prefetch of work; it drains within the grace period and
    exits 0. Another worker (``peer``, running all along, or ``replacement``, started after the
    first one exited) finishes the run; every task completes exactly once."""
    require(services.rabbitmqctl, "counting the messages a signalled worker holds")
    tasks = 150
    seed = random.randrange(2**32)
    names = Names(settings.queue_prefix)
    victim = _worker(settings, tmp_path, "victim", GRACE)
    other = _worker(settings, tmp_path, successor, GRACE)
    everyone = [victim, other]
    logs = worker_logs(everyone)
    try:
        await record_outbox_claims(store)
        await start_example_workers(settings, [victim, other] if successor == "peer" else [victim])
        async with DurableResultCollector(
            settings.amqp_url, queue_prefix=settings.queue_prefix
        ) as collector:
            inputs = fanout_inputs("sig", tasks, K, (200.0, 400.0), seed)
            task_ids = list(inputs)
            for task_id, spec in inputs.items():
                await collector.submit("orchestrator", spec, task_id=task_id)
            await eventually(
                lambda: len(collector.results) >= tasks // 10, 60, "a tenth of the results"
            )
            # the victim must be busy when signalled: holding unacked work while researcher
            # calls wait in the queue (a condition waited for, not one sample that a busy
            # machine can catch between two bursts)
            sampled: dict[str, int] = {}

            async def busy() -> bool:
                sampled["unacked"] = await unacked_messages_of(worker_connection_name(victim))
                sampled["waiting"] = await queue_depth(settings.amqp_url, names.tasks("researcher"))
                return sampled["unacked"] > 0 and sampled["waiting"] > 0

            await eventually(busy, 120, "researcher calls waiting while the victim holds work")
            unacked, waiting = sampled["unacked"], sampled["waiting"]
            done_at_signal = len(collector.results)
            # counted before the signal: during the drain a peer may well finish the rest
            paused = await paused_count(store, task_ids)
            code, took = await _signal_and_wait(victim, signum, GRACE + 10)

            assert code == 0, f"exit code {code} after {signum!r}\n{logs()}"
            assert log_lines([victim], "stopping"), f"no 'stopping' logged\n{logs()}"
            assert not log_lines([victim], GRACE_EXPIRED), f"grace period expired\n{logs()}"
            assert done_at_signal < tasks and paused > 0, "the run was over at the signal"

            if successor == "replacement":
                await start_example_workers(settings, [other])
            await settle_run(settings, store, collector, task_ids, logs)

        problems, ignored = await fanout_problems(store, collector, inputs, K)
        settled = {k: v for k, v in worker_counters([victim]).items() if k.startswith("settled_")}
        report = (
            f"seed {seed}: {signum.name} with {done_at_signal}/{tasks} results in, "
            f"{waiting} researcher calls waiting, {unacked} unacked on the victim; it exited "
            f"{code} after {took:.2f}s (settled {settled}); {paused} tasks paused then; "
            f"{result_messages(collector)}; ReplyIgnored {dict(ignored)}"
        )
        print(report)
        assert not problems, f"{report}\n{len(problems)} problems, first: {problems[:10]}\n{logs()}"
        assert settled.get("settled_ack", 0) > 0, f"the victim settled nothing\n{logs()}"
        assert other.alive(), f"the {successor} died\n{logs()}"
        assert other.stop(timeout=GRACE + 5) == 0, f"the {successor} did not exit 0"
    finally:
        for worker in everyone:
            worker.stop(timeout=GRACE + 5)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", SIGNALS)
async def test_an_idle_worker_exits_0_without_waiting_out_its_grace_period(
    signum: signal.Signals, settings: Settings, tmp_path: Path
) -> None:
    grace = 120.0  # far beyond what exiting takes, on any machine
    worker = _worker(settings, tmp_path, "idle", grace)
    names = Names(settings.queue_prefix)
    try:
        await start_example_workers(settings, [worker])
        code, took = await _signal_and_wait(worker, signum, grace / 2)
        print(f"idle worker: {signum.name} -> exit {code} after {took:.2f}s")
        assert code == 0, f"exit code {code}\n{worker_logs([worker])()}"
        assert log_lines([worker], "stopping")
        # it left the consumer group
        for queue in (names.tasks("orchestrator"), names.tasks("researcher")):
            assert await consumer_count(settings.amqp_url, queue) == 0, f"{queue} still consumed"
    finally:
        worker.stop(timeout=15)


@pytest.mark.timeout(600)
async def test_a_worker_whose_work_outlasts_the_grace_period_exits_0_and_its_work_is_redone(
    settings: Settings, store: PostgresEventStore, tmp_path: Path, services: Services
) -> None:
    """The grace period bounds the shutdown: messages still in flight when it ends are not
    acked, go back to their queue when the connection closes, and a replacement completes
    every task exactly once."""
    require(services.rabbitmqctl, "counting the messages a signalled worker holds")
    grace = 1.0
    call_seconds = 20.0  # far longer than the grace: an exit before they end did not wait
    names = Names(settings.queue_prefix)
    tasks = 5  # 15 researcher calls: all in flight at once (prefetch 16)
    seed = random.randrange(2**32)
    victim = _worker(settings, tmp_path, "victim", grace)
    replacement = _worker(settings, tmp_path, "replacement", GRACE)
    everyone = [victim, replacement]
    logs = worker_logs(everyone)
    try:
        await record_outbox_claims(store)
        await start_example_workers(settings, [victim])
        async with DurableResultCollector(
            settings.amqp_url, queue_prefix=settings.queue_prefix
        ) as collector:
            work_ms = call_seconds * 1000
            inputs = fanout_inputs("grace", tasks, K, (work_ms, work_ms), seed)
            task_ids = list(inputs)
            for task_id, spec in inputs.items():
                await collector.submit("orchestrator", spec, task_id=task_id)

            async def all_paused() -> bool:
                return await paused_count(store, task_ids) == tasks

            async def calls_taken() -> bool:
                return await queue_depth(settings.amqp_url, names.tasks("researcher")) == 0

            await eventually(all_paused, 60, "every task to pause")
            await eventually(calls_taken, 60, "the victim to take every researcher call")
            unacked = await unacked_messages_of(worker_connection_name(victim))
            code, took = await _signal_and_wait(victim, signal.SIGTERM, 60)
            assert unacked > 0, "the broker saw nothing unacked on the victim's connection"
            assert not collector.results, "a task completed before the signal: proves nothing"
            assert code == 0, f"exit code {code}\n{logs()}"
            # the calls began before the signal: exiting before they could end means it did not
            # wait for them (a check of order, not of speed: the margin is many seconds)
            assert took < call_seconds, f"took {took:.1f}s: it waited for the calls\n{logs()}"
            expired = log_lines([victim], GRACE_EXPIRED)
            assert expired, f"the grace period did not expire\n{logs()}"

            await start_example_workers(settings, [replacement])
            await settle_run(settings, store, collector, task_ids, logs)

        problems, _ = await fanout_problems(store, collector, inputs, K)
        print(
            f"seed {seed}: grace {grace}s, exited {code} after {took:.2f}s "
            f"({expired[0].split(' WARNING ')[-1]}); {unacked} unacked at the signal"
        )
        assert not problems, f"{len(problems)} problems, first: {problems[:10]}\n{logs()}"
    finally:
        for worker in everyone:
            worker.stop(timeout=GRACE + 5)
