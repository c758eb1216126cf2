"""Helpers of the tests alone (pytest): the services of a run, what a test requires beyond
them, and the scenarios the integration tests play. What the scripts share with the tests
(processes, queues, databases, clients, checks) is in :mod:`scripts.lab.harness`.

Services: ``WAYSTATION_TEST_DATABASE_URL`` / ``WAYSTATION_TEST_AMQP_URL`` when set; else
testcontainers when a Docker engine answers; else the local services (127.0.0.1).

Whatever a test needs beyond them (the services themselves, ``rabbitmqctl``, the PostgreSQL
cluster tools) it asks for with :func:`require`: a missing capability skips the test locally,
saying exactly what is missing, and fails it under CI (``CI`` set to anything), where a skip
would pass unnoticed. That rule lives there and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue
from aiohttp import web
from sqlalchemy import text

from scripts.lab.harness.broker import busy_queues, unacked_messages_of, wait_for_consumers
from scripts.lab.harness.clients import RecordingClient
from scripts.lab.harness.database import PostgresCluster
from scripts.lab.harness.processes import WorkerProcess
from waystation.agent import App
from waystation.events.codec import dumps
from waystation.events.postgres import PostgresEventStore
from waystation.protocol.wire import Names
from waystation.runtime.compose import production_worker
from waystation.runtime.worker import Worker
from waystation.settings import Settings

LOCAL_DATABASE_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
LOCAL_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"

WINDOW = 2.0
"""Seconds of an outbox delay, a lease or a deadline that a test must still see in force at its
next statement: that statement certainly comes sooner, on a slow and busy machine too."""


@dataclass(frozen=True)
class Capability:
    """Something a test needs beyond its fixtures: a tool on this host, a service, a privilege."""

    name: str
    missing: str | None = None
    """Exactly what is missing, or None when the capability is here."""

    def __bool__(self) -> bool:
        # ``if services.rabbitmqctl:`` would silently run a weaker test: ask require() instead
        raise TypeError(f"use require() to depend on {self.name}, not its truth value")


def require(capability: Capability, why: str) -> None:
    """Go on when ``capability`` is here; otherwise fail under CI and skip elsewhere.

    Under CI (the ``CI`` variable set to anything non-empty) every capability must be present,
    so a test that cannot run fails rather than skipping out of sight. Locally the skip names
    what is missing, so a developer knows what to install.
    """
    if capability.missing is None:
        return
    message = f"{why} needs {capability.name}, but {capability.missing}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (under CI a missing capability fails)", pytrace=False)
    pytest.skip(message, allow_module_level=True)  # a whole module may need it


def penguiflow_capability() -> Capability:
    """PenguiFlow, the optional extra ``waystation[penguiflow]`` (``scripts/bootstrap`` installs
    it with the test dependencies)."""
    try:
        import penguiflow.state  # noqa: F401
    except ImportError as error:
        return Capability("PenguiFlow (pip install -e '.[penguiflow]')", f"it is missing: {error}")
    return Capability("PenguiFlow")


def otel_capability() -> Capability:
    """OpenTelemetry's SDK, the optional extra ``waystation[otel]`` (``scripts/bootstrap``
    installs it with the test dependencies)."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as error:
        return Capability("OpenTelemetry (pip install -e '.[otel]')", f"it is missing: {error}")
    return Capability("OpenTelemetry")


@dataclass(frozen=True)
class Services:
    admin_database_url: str
    """A URL whose server lets us create and drop databases."""
    amqp_url: str
    rabbitmqctl: Capability
    """``rabbitmqctl`` on this host, reaching this broker (local services only)."""


def docker_engine_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def reachable(url: str, default_port: int) -> bool:
    parsed = urlparse(url.replace("+asyncpg", ""))
    try:
        with socket.create_connection(
            (parsed.hostname or "127.0.0.1", parsed.port or default_port), timeout=3
        ):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def started_services() -> Iterator[Services]:
    """The services for this test run (containers are stopped when the run ends)."""
    database_url = os.environ.get("WAYSTATION_TEST_DATABASE_URL")
    amqp_url = os.environ.get("WAYSTATION_TEST_AMQP_URL")
    if database_url or amqp_url or not docker_engine_available():
        if amqp_url:
            missing: str | None = (
                "the broker is given by WAYSTATION_TEST_AMQP_URL, and rabbitmqctl only reaches "
                "the broker of this host"
            )
        elif shutil.which("rabbitmqctl") is None:
            missing = "rabbitmqctl is not on PATH (install rabbitmq-server here)"
        else:
            missing = None
        yield Services(
            admin_database_url=database_url or LOCAL_DATABASE_URL,
            amqp_url=amqp_url or LOCAL_AMQP_URL,
            rabbitmqctl=Capability("rabbitmqctl", missing),
        )
        return
    from testcontainers.postgres import PostgresContainer
    from testcontainers.rabbitmq import RabbitMqContainer

    with (
        PostgresContainer("postgres:15", driver="asyncpg") as postgres,
        RabbitMqContainer("rabbitmq:3.10") as rabbit,
    ):
        params = rabbit.get_connection_params()
        yield Services(
            admin_database_url=postgres.get_connection_url(),
            amqp_url=f"amqp://guest:guest@{params.host}:{params.port}/",
            rabbitmqctl=Capability(
                "rabbitmqctl",
                "the services run in testcontainers (a Docker engine answered), and rabbitmqctl "
                "cannot reach the broker inside its container",
            ),
        )


def serving_cluster(database_url: str, why: str) -> PostgresCluster:
    """The local cluster serving ``database_url``, which a test ``why`` needs (a scratch cluster
    of the same version is made with the same tools): see :func:`require`."""
    found = PostgresCluster.find(database_url)
    require(
        Capability(
            "a local PostgreSQL cluster managed with postgresql-common",
            found if isinstance(found, str) else None,
        ),
        why,
    )
    assert isinstance(found, PostgresCluster)
    return found


# ---- workers in this process, and waiting ------------------------------------------------------


async def count_rows(
    store: PostgresEventStore, table: str, where: str = "true", **params: Any
) -> int:
    async with store.engine.connect() as connection:
        return int(
            await connection.scalar(text(f"SELECT count(*) FROM {table} WHERE {where}"), params)
            or 0
        )


@contextlib.asynccontextmanager
async def running_worker(
    app: App, settings: Settings, store: PostgresEventStore, **kwargs: Any
) -> AsyncIterator[Worker]:
    """A worker running in this process for the duration of the block (the production one,
    ``waystation.runtime.compose``; ``kwargs`` go to it)."""
    worker = production_worker(app, settings, store, **kwargs)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


def counter(worker: Worker, name: str) -> int:
    return worker.stats.counters.get(name, 0)


async def eventually(
    predicate: Callable[[], Awaitable[bool] | bool],
    within: float,
    what: str,
    interval: float = 0.05,
) -> None:
    """Wait until ``predicate()`` is true; fail naming ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        outcome = predicate()
        if inspect.isawaitable(outcome):
            outcome = await outcome
        if outcome:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(interval)


async def stream_types(store: PostgresEventStore, stream_id: str) -> list[str]:
    return [event.event_type for event in await store.read_stream(stream_id)]


# ---- the test plays a peer or a publisher ------------------------------------------------------


async def take(
    queue: AbstractQueue, count: int, within: float = 20
) -> list[AbstractIncomingMessage]:
    """Get and ack ``count`` messages from ``queue``, waiting up to ``within`` seconds."""
    taken: list[AbstractIncomingMessage] = []
    deadline = time.monotonic() + within
    while len(taken) < count:
        message = await queue.get(fail=False)
        if message is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"{queue.name}: got {len(taken)} messages, wanted {count}")
            await asyncio.sleep(0.02)
            continue
        await message.ack()
        taken.append(message)
    return taken


async def publish_reply(
    channel: AbstractChannel,
    request: AbstractIncomingMessage,
    body: Any,
    *,
    message_id: str | None = None,
) -> None:
    """Answer a peer request the way any AMQP peer does: same correlation id, to its reply_to."""
    assert request.reply_to, "a request names its reply queue"
    await channel.default_exchange.publish(
        aio_pika.Message(
            dumps(body),
            message_id=message_id,
            correlation_id=request.correlation_id,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        ),
        routing_key=request.reply_to,
        mandatory=True,
    )


async def publish_raw(
    channel: AbstractChannel, routing_key: str, body: bytes, **properties: Any
) -> None:
    """Publish ``body`` byte for byte (persistent, mandatory) with these AMQP properties; what
    a publisher in another language, or a broken one, could send.

    aio-pika (aiormq) gives every message it publishes a random ``message_id`` when it has none:
    to send one truly without, use :func:`publish_with_pika`.
    """
    await channel.default_exchange.publish(
        aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, **properties),
        routing_key=routing_key,
        mandatory=True,
    )


async def publish_with_pika(
    amqp_url: str, routing_key: str, body: bytes, **properties: Any
) -> None:
    """Publish with pika (a blocking client, in a thread), which sends exactly the properties
    given, none added. Confirmed and mandatory, like the rest."""
    import pika

    def publish() -> None:
        connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            channel.basic_publish(
                exchange="",
                routing_key=routing_key,
                body=body,
                properties=pika.BasicProperties(delivery_mode=2, **properties),
                mandatory=True,
            )
        finally:
            connection.close()

    await asyncio.to_thread(publish)


async def dead_letters(
    channel: AbstractChannel, names: Names, count: int, within: float = 20
) -> list[AbstractIncomingMessage]:
    """Take ``count`` messages from the deployment's dead-letter queue (it must exist)."""
    queue = await channel.declare_queue(names.dead_letter_queue, passive=True)
    return await take(queue, count, within)


# ---- fan-out runs of worker processes ----------------------------------------------------------


def fanout_inputs(
    label: str,
    tasks: int,
    k: int,
    work_ms: tuple[float, float],
    seed: int,
    *,
    slow: int = 0,
    slow_ms: float = 0.0,
) -> dict[str, dict[str, float | int]]:
    """Inputs of ``tasks`` example orchestrator tasks (K researchers, work in ``work_ms``).

    The first ``slow`` tasks (submitted first) take ``slow_ms`` per call instead: an outage test
    uses them so that some tasks are certainly still paused when the outage starts, however fast
    the machine runs the rest.
    """
    rng = random.Random(seed)
    return {
        f"{label}-{seed}-{i}": {
            "n": i,
            "k": k,
            "work_ms": slow_ms if i < slow else round(rng.uniform(*work_ms), 1),
        }
        for i in range(tasks)
    }


async def start_example_workers(settings: Settings, workers: Sequence[WorkerProcess]) -> None:
    """Start the example app's worker processes and wait until each consumes every queue (its
    reply shards too: a worker is serving, and healthy, once it consumes all of them)."""
    names = Names(settings.queue_prefix, settings.reply_shards)
    queues = [
        q
        for agent in ("orchestrator", "researcher")
        for q in (names.tasks(agent), *names.reply_queues(agent))
    ]
    await start_workers(settings, workers, queues)


async def start_workers(
    settings: Settings, workers: Sequence[WorkerProcess], queues: Sequence[str]
) -> None:
    """Start worker processes and wait until each consumes every one of ``queues``; fail at once
    when one exits meanwhile."""
    for worker in workers:
        worker.start()
    await wait_for_consumers(
        settings.amqp_url, queues, len(workers), alive=lambda: all(w.alive() for w in workers)
    )


_OUTBOX_OF = text("SELECT count(*) FROM outbox WHERE stream_id = ANY(CAST(:ids AS text[]))")
_PAUSED_OF = text(
    """
    SELECT count(*) FROM (
        SELECT stream_id FROM events WHERE stream_id = ANY(CAST(:ids AS text[]))
        GROUP BY stream_id
        HAVING bool_or(event_type = 'TaskPaused') AND NOT bool_or(event_type = 'TaskCompleted')
    ) AS paused
    """
)


async def outbox_rows_of(store: PostgresEventStore, task_ids: Sequence[str]) -> int:
    """Outbox rows of these tasks' streams not yet published and forgotten."""
    async with store.engine.connect() as connection:
        return int(await connection.scalar(_OUTBOX_OF, {"ids": list(task_ids)}) or 0)


async def published_everything(store: PostgresEventStore, task_ids: Sequence[str]) -> None:
    """Wait until every message the tasks' events imply is published: an outbox row is deleted
    only after the broker confirmed its message, so what is not in a queue now never will be
    (G4 puts every implied message in the outbox)."""

    async def drained() -> bool:
        return await outbox_rows_of(store, task_ids) == 0

    await eventually(drained, 30, "the tasks' outbox rows to be published")


async def paused_count(store: PostgresEventStore, task_ids: Sequence[str]) -> int:
    """How many of these tasks are paused (checkpointed, not completed) right now."""
    async with store.engine.connect() as connection:
        return int(await connection.scalar(_PAUSED_OF, {"ids": list(task_ids)}) or 0)


async def settle_run(
    settings: Settings,
    store: PostgresEventStore,
    collector: RecordingClient,
    task_ids: Sequence[str],
    logs: Callable[[], str],
    within: float = 60,
) -> None:
    """Wait for every result, then until the deployment is quiet: stray republishes handled,
    so that the log read next is final (rabbitmqctl: see :func:`deployment_quiet`)."""
    try:
        await eventually(lambda: len(collector.results) == len(task_ids), within, "every result")
    except AssertionError as error:
        missing = [t for t in task_ids if t not in collector.results]
        raise AssertionError(
            f"{error}; {len(missing)} missing, e.g. {missing[:5]}\n{logs()}"
        ) from None

    await deployment_quiet(settings, store, task_ids)


async def deployment_quiet(
    settings: Settings, store: PostgresEventStore, task_ids: Sequence[str], within: float = 60
) -> None:
    """Wait until nothing more can happen to these tasks: no outbox row left to publish and no
    message of the deployment in a queue or in a worker's hands (rabbitmqctl).

    A message a worker handles is unacked until its commit; what the commit implies is in the
    outbox until the broker confirmed it (the publish may still be under way after the ack).
    So a look at rows, then queues, then rows again finds any message still to come, unless a
    publish lands in the second between the queue listing and the second look: hence two such
    looks in a row, both quiet.
    """
    busy: dict[str, tuple[int, int]] = {}
    rows = 0
    quiet_looks = 0

    async def looks_quiet() -> bool:
        nonlocal busy, rows
        rows = await outbox_rows_of(store, task_ids)
        if rows:
            return False
        busy = await busy_queues(settings.amqp_url, settings.queue_prefix)
        if busy:
            return False
        rows = await outbox_rows_of(store, task_ids)
        return rows == 0

    async def quiet() -> bool:
        nonlocal quiet_looks
        quiet_looks = quiet_looks + 1 if await looks_quiet() else 0
        return quiet_looks == 2

    try:
        await eventually(quiet, within, "the deployment to go quiet", interval=0.2)
    except AssertionError as error:
        raise AssertionError(f"{error}: {rows} outbox rows, queues {busy}") from None


def worker_connection_name(worker: WorkerProcess) -> str:
    """The name a worker process gives its broker connection."""
    return f"waystation worker {socket.gethostname()}-{worker.pid}"


async def freeze_holding_work(worker: WorkerProcess, attempts: int = 30) -> int:
    """Freeze ``worker`` (SIGSTOP) at a moment it holds deliveries it has not settled, and
    return how many (rabbitmqctl). A frozen process settles nothing, so that is exactly the
    work a kill or a closed connection meets next. 0 if it never held any when looked at;
    the worker is then left running."""
    assert worker.process is not None
    for _ in range(attempts):
        worker.process.send_signal(signal.SIGSTOP)
        held = await unacked_messages_of(worker_connection_name(worker))
        if held:
            return held
        worker.process.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.1)
    return 0


@contextlib.asynccontextmanager
async def management_api(
    put_policy: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[int]:
    """A stand-in of RabbitMQ's management API on a free local port (yielded) whose ``PUT
    /api/policies/{vhost}/{name}`` is ``put_policy``."""
    app = web.Application()
    app.router.add_put("/api/policies/{vhost}/{name}", put_policy)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()
