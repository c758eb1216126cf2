"""Outages of the services under load: every broker connection closed, PostgreSQL restarted.

Three worker processes of the example app serve 200 orchestrator tasks (K=3 researchers each,
20 to 30 ms of work per call, except 5 tasks whose calls take 10 s so that the outage certainly
meets paused tasks). Once the first results are in (so many tasks are paused and
many messages are in flight), one service goes away:

* RabbitMQ: ``rabbitmqctl close_all_connections`` in a vhost of the test's own, which cuts off
  every worker *and* the test's publisher at once, and nothing else that shares the broker.
  Workers reconnect (robust connections), what they had unacked is redelivered, and acks on the
  dead channels fail.
* PostgreSQL: a fast shutdown, 2 s down, started again, of a scratch cluster of the test's own
  (another test run on this machine must not see its database go away). Workers retry the
  statements that failed (``StoreUnavailable``) in place with backoff, without requeueing the
  message (which would burn its delivery limit), and the outbox relay publishes what a commit
  implied when its writer could not. A worker signalled during the outage exits 0 in time.

Either way every task must answer with one distinct, right result (a result message repeated no
more often than the outbox relays and the broker's redeliveries explain), and its stream must
show each sub-task claimed once, the pause resumed once, the task completed once, and a hash
chain that verifies. The delivery-limit policy is applied as in production, so a message requeued in
a loop would end in the dead-letter queue, which must stay empty.

Results are collected through a durable reply queue of the test's own
(``DurableResultCollector``): ``waystation.client.Client``'s exclusive reply queue is deleted with
its connection, and results published before it reconnects are lost (see that class).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from pathlib import Path

import pytest

from scripts.lab.harness.broker import (
    apply_queue_policy,
    broker_connections,
    close_all_broker_connections,
    queue_depth,
    temporary_vhost,
    wait_for_consumers,
)
from scripts.lab.harness.checks import fanout_problems, record_outbox_claims, result_messages
from scripts.lab.harness.clients import DurableResultCollector
from scripts.lab.harness.database import PostgresCluster
from scripts.lab.harness.processes import (
    WorkerProcess,
    log_lines,
    stats_env,
    worker_counters,
    worker_logs,
)
from waystation import migrations
from waystation.brokers.amqp.topology import clear_policy
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import (
    Services,
    eventually,
    fanout_inputs,
    paused_count,
    require,
    serving_cluster,
    settle_run,
    start_example_workers,
    worker_connection_name,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASKS = 200
K = 3
WORKERS = 3
WORK_MS = (20.0, 30.0)
# A few tasks whose calls take far longer than the rest of the run: on a fast machine the 200
# tasks can all be done in the second or two that rabbitmqctl takes to start, and an outage
# after the end proves nothing. These are still paused when it starts, with a wide margin.
SLOW = 5
SLOW_MS = 10_000.0


def _workers(settings: Settings, tmp_path: Path) -> list[WorkerProcess]:
    return [
        WorkerProcess.with_settings(
            settings,
            tmp_path / f"worker-{i}.log",
            env=stats_env(tmp_path / f"worker-{i}.stats.json"),
        )
        for i in range(WORKERS)
    ]


def _counters(workers: list[WorkerProcess]) -> str:
    """What the stopped workers counted, for the report (redeliveries, retries, relays...)."""
    counters = worker_counters(workers)
    return "counters " + ", ".join(f"{k}={v}" for k, v in sorted(counters.items()))


async def _submit_and_wait_for(
    collector: DurableResultCollector, inputs: dict[str, dict[str, float | int]], results: int
) -> None:
    """Submit every task, then wait until ``results`` of them have answered."""
    await asyncio.gather(
        *(collector.submit("orchestrator", spec, task_id=t) for t, spec in inputs.items())
    )
    await eventually(lambda: len(collector.results) >= results, 60, f"{results} results")


# each outage test's timeout covers the sum of its own waits, so that a slow run fails with
# the wait that ran out and the workers' logs, not with pytest-timeout's stack dump


@pytest.mark.timeout(480)
async def test_200_tasks_survive_every_broker_connection_being_closed(
    settings: Settings, store: PostgresEventStore, services: Services, tmp_path: Path
) -> None:
    require(services.rabbitmqctl, "closing every broker connection")
    seed = random.randrange(2**32)
    async with temporary_vhost(services.amqp_url) as (vhost, amqp_url):
        settings = settings.model_copy(update={"amqp_url": amqp_url})
        names = Names(settings.queue_prefix)
        await apply_queue_policy(vhost, names, delivery_limit=5)
        workers = _workers(settings, tmp_path)
        logs = worker_logs(workers)
        started = time.monotonic()
        try:
            await record_outbox_claims(store)
            await start_example_workers(settings, workers)
            async with DurableResultCollector(
                settings.amqp_url, queue_prefix=settings.queue_prefix
            ) as collector:
                connected = await broker_connections(vhost)
                expected_names = {worker_connection_name(w) for w in workers}
                expected_names.add(collector.connection_name)
                assert expected_names <= set(connected), (
                    f"connections in {vhost}: {connected}, wanted {expected_names}"
                )
                inputs = fanout_inputs("rmq", TASKS, K, WORK_MS, seed, slow=SLOW, slow_ms=SLOW_MS)
                task_ids = list(inputs)
                # early: rabbitmqctl takes a second or so to start, and the run goes on meanwhile
                await _submit_and_wait_for(collector, inputs, TASKS // 20)
                await close_all_broker_connections(vhost)
                closed_at = time.monotonic() - started
                # measured after the close: at most what was done when it happened
                done_at_close = len(collector.results)
                paused = await paused_count(store, task_ids)
                assert done_at_close < TASKS and paused > 0, (
                    f"the run was over when the connections closed ({closed_at:.1f}s in, "
                    f"{done_at_close} results, {paused} paused): this proves nothing"
                )

                await settle_run(settings, store, collector, task_ids, logs)
                all_results_at = time.monotonic() - started
                # every worker came back and consumes again
                await wait_for_consumers(
                    settings.amqp_url,
                    [names.tasks("orchestrator"), names.replies("orchestrator")],
                    WORKERS,
                    within=20,
                )
                await eventually(lambda: collector.reconnects >= 1, 20, "the client to reconnect")

            problems, ignored = await fanout_problems(store, collector, inputs, K)
            dead = await queue_depth(settings.amqp_url, names.dead_letter_queue)
            unroutable = log_lines(workers, "unroutable")
            failed_acks = log_lines(workers, "could not ack")
            assert all(w.alive() for w in workers), f"a worker died\n{logs()}"
            codes = [w.stop(timeout=15) for w in workers]
            report = (
                f"seed {seed}: closed {len(connected)} connections at {closed_at:.1f}s with "
                f"{done_at_close}/{TASKS} results in and {paused} tasks paused; all results at "
                f"{all_results_at:.1f}s; {result_messages(collector)}; "
                f"acks that failed on a dead channel {len(failed_acks)}; "
                f"ReplyIgnored {dict(ignored)}; dead letters {dead}; {_counters(workers)}"
            )
            print(report)
            assert not problems, (
                f"{report}\n{len(problems)} problems, first: {problems[:10]}\n{logs()}"
            )
            assert not unroutable, f"results were dropped as unroutable: {unroutable[:5]}"
            assert dead == 0, f"{report}\nmessages were dead-lettered\n{logs()}"
            assert codes == [0] * WORKERS, f"exit codes {codes} after the outage\n{logs()}"
        finally:
            for worker in workers:
                worker.stop(timeout=15)


@pytest.mark.timeout(480)
async def test_200_tasks_survive_a_postgresql_restart(
    settings: Settings, services: Services, tmp_path: Path
) -> None:
    home = serving_cluster(settings.database_url, "restarting PostgreSQL")
    # the delivery limit as in production: a message requeued in a loop is dead-lettered, and
    # the dead-letter queue must stay empty (without the policy that check proves nothing)
    require(services.rabbitmqctl, "the delivery-limit policy of the PostgreSQL restart")
    seed = random.randrange(2**32)
    names = Names(settings.queue_prefix)
    # The restart hits a scratch cluster of the same version, not the one serving the rest of
    # the suite: another test run on this machine must not see its database go away.
    async with PostgresCluster.scratch(home.version) as cluster:
        settings = settings.model_copy(
            update={
                "database_url": cluster.url("waystation_outage"),
                "broker_policy": "rabbitmqctl",
            }
        )
        await migrations.upgrade(settings.database_url)
        store = PostgresEventStore.from_url(settings.database_url, pool_size=5)
        workers = _workers(settings, tmp_path)
        logs = worker_logs(workers)
        started = time.monotonic()
        try:
            await record_outbox_claims(store)
            await start_example_workers(settings, workers)
            async with DurableResultCollector(
                settings.amqp_url, queue_prefix=settings.queue_prefix
            ) as collector:
                inputs = fanout_inputs("pg", TASKS, K, WORK_MS, seed, slow=SLOW, slow_ms=SLOW_MS)
                task_ids = list(inputs)
                await _submit_and_wait_for(collector, inputs, TASKS // 4)
                paused = await paused_count(store, task_ids)
                done_at_stop = len(collector.results)
                try:
                    await cluster.stop()
                    stopped_at = time.monotonic() - started
                    await asyncio.sleep(2.0)  # the outage itself: 2 s down
                    done_while_down = len(collector.results) - done_at_stop
                finally:
                    await cluster.ensure_running()
                restarted_at = time.monotonic() - started
                # the test's own pooled connections died with the server
                await store.engine.dispose()
                assert paused > 0, "no task was paused when PostgreSQL stopped: proves nothing"
                assert done_at_stop < TASKS, "every task was done before the outage"

                await settle_run(settings, store, collector, task_ids, logs)
                all_results_at = time.monotonic() - started

            problems, ignored = await fanout_problems(store, collector, inputs, K)
            dead = await queue_depth(settings.amqp_url, names.dead_letter_queue)
            retries = log_lines(workers, "event log unavailable")
            requeued = log_lines(workers, "failed; requeueing")
            retried_by = sum(1 for w in workers if log_lines([w], "event log unavailable"))
            assert all(w.alive() for w in workers), f"a worker died\n{logs()}"
            codes = [w.stop(timeout=15) for w in workers]
            report = "; ".join(
                [
                    f"seed {seed}: stopped PostgreSQL at {stopped_at:.1f}s with "
                    f"{done_at_stop}/{TASKS} results in and {paused} tasks paused",
                    f"{done_while_down} results while it stopped or was down",
                    f"running again at {restarted_at:.1f}s",
                    f"all results at {all_results_at:.1f}s",
                    f"in-place retries logged {len(retries)} (by {retried_by} workers)",
                    f"requeued on errors {len(requeued)}",
                    result_messages(collector),
                    f"ReplyIgnored {dict(ignored)}",
                    f"dead letters {dead}",
                    _counters(workers),
                ]
            )
            print(report)
            assert not problems, (
                f"{report}\n{len(problems)} problems, first: {problems[:10]}\n{logs()}"
            )
            assert retries, f"{report}\nno worker retried a failed statement in place\n{logs()}"
            assert not requeued, (
                f"{report}\nan outage error was not recognised as StoreUnavailable (requeued "
                f"instead of retried in place): {requeued[:5]}\n{logs()}"
            )
            assert dead == 0, f"{report}\nmessages were dead-lettered\n{logs()}"
            assert codes == [0] * WORKERS, f"exit codes {codes} after the outage\n{logs()}"
        finally:
            for worker in workers:
                worker.stop(timeout=15)
            await store.close()
            with contextlib.suppress(RuntimeError):  # no worker got to set it
                await clear_policy(names)


@pytest.mark.timeout(540)
async def test_a_worker_signalled_while_postgresql_is_down_exits_0_and_nothing_is_lost(
    settings: Settings, services: Services, tmp_path: Path
) -> None:
    """SIGTERM during a database outage (a rolling restart during a failover, say): the worker
    stops retrying, hands back what it holds, and exits 0 within the grace period; once
    PostgreSQL is back a replacement completes every task exactly once. Two tasks' calls take
    10 s, so the outage certainly meets work however fast the machine runs the rest: their
    replies come while the database is down."""
    home = serving_cluster(settings.database_url, "stopping PostgreSQL")
    require(services.rabbitmqctl, "waiting for the deployment to go quiet")
    grace = 30.0
    tasks = 100
    seed = random.randrange(2**32)
    async with PostgresCluster.scratch(home.version) as cluster:
        settings = settings.model_copy(
            update={"database_url": cluster.url("waystation_outage"), "shutdown_grace": grace}
        )
        await migrations.upgrade(settings.database_url)
        store = PostgresEventStore.from_url(settings.database_url, pool_size=5)
        env = {"WAYSTATION_SHUTDOWN_GRACE": str(grace)}
        victim = WorkerProcess.with_settings(settings, tmp_path / "victim.log", env=env)
        replacement = WorkerProcess.with_settings(settings, tmp_path / "replacement.log", env=env)
        logs = worker_logs([victim, replacement])
        try:
            await record_outbox_claims(store)
            await start_example_workers(settings, [victim])
            async with DurableResultCollector(
                settings.amqp_url, queue_prefix=settings.queue_prefix
            ) as collector:
                inputs = fanout_inputs("pgsig", tasks, K, WORK_MS, seed, slow=2, slow_ms=SLOW_MS)
                task_ids = list(inputs)
                await _submit_and_wait_for(collector, inputs, tasks // 4)
                try:
                    await cluster.stop()
                    await eventually(
                        lambda: bool(log_lines([victim], "event log unavailable")),
                        60,
                        "the worker to retry a failed statement",
                    )
                    done_at_signal = len(collector.results)
                    assert victim.process is not None
                    signalled = time.monotonic()
                    victim.process.send_signal(signal.SIGTERM)
                    code = await victim.wait_exit(grace + 30)
                    took = time.monotonic() - signalled
                finally:
                    await cluster.ensure_running()
                await store.engine.dispose()
                assert code == 0, f"exit code {code} after SIGTERM during the outage\n{logs()}"
                assert took < grace, f"took {took:.1f}s to exit, grace is {grace}s\n{logs()}"
                assert done_at_signal < tasks, "every task was done before the outage"
                assert not log_lines([victim], "still in flight after the grace period"), logs()

                await start_example_workers(settings, [replacement])
                await settle_run(settings, store, collector, task_ids, logs)

            problems, _ = await fanout_problems(store, collector, inputs, K)
            report = (
                f"seed {seed}: SIGTERM while PostgreSQL was down with {done_at_signal}/{tasks} "
                f"results in; exited {code} after {took:.2f}s; "
                f"{result_messages(collector)}"
            )
            print(report)
            assert not problems, (
                f"{report}\n{len(problems)} problems, first: {problems[:10]}\n{logs()}"
            )
        finally:
            for worker in (victim, replacement):
                worker.stop(timeout=15)
            await store.close()
