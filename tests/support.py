"""Helpers shared by the tests: real services, isolated per run, and workers to run against them.

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
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlparse

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue
from sqlalchemy import text
from sqlalchemy.engine import make_url

from events import RecordedEvent, canonical
from events.codec import dumps, loads
from events.postgres import PostgresEventStore
from projections.audit import verify_stream
from workers.agent import App
from workers.client import Client
from workers.example import expected_total
from workers.runtime import Worker
from workers.settings import Settings
from workers.topology import apply_policy
from workers.wire import Names

ROOT = Path(__file__).resolve().parent.parent
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
    pytest.skip(message)


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


def fresh_database_url(admin_url: str) -> str:
    return (
        make_url(admin_url)
        .set(database=f"ws_test_{uuid.uuid4().hex[:10]}")
        .render_as_string(hide_password=False)
    )


def fresh_prefix() -> str:
    return f"wst-{uuid.uuid4().hex[:8]}."


async def delete_topology(amqp_url: str, prefix: str, agents: Iterable[str]) -> None:
    """Delete every queue and exchange a test's workers declared under ``prefix``."""
    names = Names(prefix)
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        for agent in agents:
            for queue in (names.tasks(agent), names.replies(agent)):
                await channel.queue_delete(queue)
        await channel.queue_delete(names.dead_letter_queue)
        await channel.exchange_delete(names.dead_letter_exchange)
    finally:
        await connection.close()


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
    """A worker running in this process for the duration of the block."""
    worker = Worker(app, settings, store, **kwargs)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


class WorkerProcess:
    """A real worker subprocess (``python -m workers.cli worker``) of the example app, or of
    another ``waystation`` command given as ``command`` (``["projections", "run"]``, say)."""

    def __init__(
        self,
        settings: Settings,
        *,
        app: str = "workers.example:app",
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        command: Sequence[str] | None = None,
    ) -> None:
        self.settings = settings
        self.app = app
        self.command = list(command) if command is not None else ["worker", "--app", app]
        self.extra_env = env or {}
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self) -> WorkerProcess:
        environment = dict(os.environ)
        environment.update(
            {
                "WAYSTATION_DATABASE_URL": self.settings.database_url,
                "WAYSTATION_AMQP_URL": self.settings.amqp_url,
                "WAYSTATION_QUEUE_PREFIX": self.settings.queue_prefix,
                "WAYSTATION_BROKER_POLICY": self.settings.broker_policy,
                "WAYSTATION_OUTBOX_DELAY": str(self.settings.outbox_delay),
                "WAYSTATION_OUTBOX_POLL_INTERVAL": str(self.settings.outbox_poll_interval),
                "WAYSTATION_CONCURRENCY": str(self.settings.concurrency),
                "WAYSTATION_RESUME_IN_PLACE": str(self.settings.resume_in_place).lower(),
                # many workers run at once here: a test that scrapes one gives it a port
                "WAYSTATION_METRICS_PORT": "0",
                "PYTHONPATH": str(ROOT),
            }
        )
        environment.update(self.extra_env)
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            [sys.executable, "-m", "workers.cli", *self.command],
            env=environment,
            stdout=self._log,
            stderr=self._log,
            cwd=ROOT,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.process is not None
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def terminate(self, timeout: float = 30) -> int | None:
        if self.process is None:
            return None
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)
        finally:
            if self._log not in (None, subprocess.DEVNULL):
                self._log.close()

    async def wait_exit(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                return self.process.returncode
            await asyncio.sleep(0.05)
        return None


async def wait_for_consumers(amqp_url: str, queue: str, count: int, timeout: float = 30) -> None:
    """Wait until ``queue`` has ``count`` consumers (workers finished starting)."""
    connection = await aio_pika.connect(amqp_url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            channel = await connection.channel()
            try:
                declared = await channel.declare_queue(queue, passive=True)
                consumers = declared.declaration_result.consumer_count
            except aio_pika.exceptions.ChannelClosed:
                consumers = 0
            await channel.close()
            if consumers >= count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{queue} has {consumers} consumers, wanted {count}")
            await asyncio.sleep(0.1)
    finally:
        await connection.close()


# ---- helpers of the integration flow, crash and multi-process tests ---------------------------


class RecordingClient(Client):
    """A :class:`Client` that also keeps every result message it receives, duplicates included.

    ``Client`` keeps the first result per task and only counts the rest; a test that must prove
    "exactly one distinct result" needs to see them all.
    """

    def __init__(self, amqp_url: str, *, queue_prefix: str = "waystation.") -> None:
        super().__init__(amqp_url, queue_prefix=queue_prefix)
        self.received: list[tuple[str | None, bytes]] = []
        self.redelivered: Counter[str | None] = Counter()
        """Per task, result messages the broker delivered to this client again."""

    async def __aenter__(self) -> RecordingClient:
        await self.connect()
        return self

    async def _on_result(self, message: AbstractIncomingMessage) -> None:
        self.received.append((message.correlation_id, bytes(message.body)))
        if message.redelivered:
            self.redelivered[message.correlation_id] += 1
        await super()._on_result(message)

    def bodies(self, task_id: str) -> list[bytes]:
        """Every result body received for ``task_id``, in arrival order."""
        return [body for correlation_id, body in self.received if correlation_id == task_id]

    def distinct_results(self, task_id: str) -> set[bytes]:
        return {canonical(loads(body)) for body in self.bodies(task_id)}


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


def chain_problems(events: Sequence[RecordedEvent]) -> list[str]:
    """What ``waystation verify`` finds wrong with one stream: versions, hash chain and the
    invariants (empty when it verifies)."""
    return [
        f"{p.stream_id} v{p.stream_version}: {p.kind}: {p.message}" for p in verify_stream(events)
    ]


async def declare_quorum_queue(channel: AbstractChannel, name: str) -> AbstractQueue:
    """Declare a queue the way Waystation does (durable quorum), e.g. for a test-played peer."""
    return await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})


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


_RECORD_OUTBOX_CLAIMS = [
    "CREATE TABLE IF NOT EXISTS test_outbox_claims (message_id text NOT NULL)",
    """
    CREATE OR REPLACE FUNCTION test_record_outbox_claim() RETURNS trigger AS $$
    BEGIN
        INSERT INTO test_outbox_claims (message_id) VALUES (NEW.message_id);
        RETURN NEW;
    END $$ LANGUAGE plpgsql
    """,
    """
    CREATE OR REPLACE TRIGGER test_record_outbox_claim AFTER UPDATE OF available_at ON outbox
    FOR EACH ROW EXECUTE FUNCTION test_record_outbox_claim()
    """,
]
_CLAIMS_OF = text(
    "SELECT message_id, count(*) FROM test_outbox_claims "
    "WHERE message_id = ANY(CAST(:ids AS text[])) GROUP BY message_id"
)


async def record_outbox_claims(store: PostgresEventStore) -> None:
    """Keep, in this test database, a row for every outbox row an outbox relay claims.

    The relay publishes only rows it claimed, so a message that comes twice without a claim
    behind the second was published twice by a worker itself: see :func:`unexplained_repeats`.
    A test-only trigger on the one statement that updates the outbox (the claim).
    """
    async with store.engine.begin() as connection:
        for statement in _RECORD_OUTBOX_CLAIMS:
            await connection.execute(text(statement))


async def relay_claims(store: PostgresEventStore, message_ids: Iterable[str]) -> Counter[str]:
    """How often a relay claimed each of these outbox messages (see record_outbox_claims)."""
    async with store.engine.connect() as connection:
        rows = await connection.execute(_CLAIMS_OF, {"ids": list(message_ids)})
        return Counter({message_id: int(count) for message_id, count in rows})


async def unexplained_repeats(
    store: PostgresEventStore, client: RecordingClient, task_ids: Iterable[str]
) -> list[str]:
    """Results are delivered at least once, not at random: a task's result message may come
    again only as often as a relay claimed it to publish again (its writer died, or forgot the
    row late) or the broker delivered it to the client again. A repeat beyond those is a
    worker publishing a result twice. Needs :func:`record_outbox_claims` before the run."""
    received = Counter(task_id for task_id, _ in client.received)
    ids = list(task_ids)
    claims = await relay_claims(store, [f"{task_id}:result" for task_id in ids])
    problems = []
    for task_id in ids:
        repeats = received[task_id] - 1
        explained = claims[f"{task_id}:result"] + client.redelivered[task_id]
        if repeats > explained:
            problems.append(
                f"{task_id}: result repeated {repeats} times, relayed {claims[f'{task_id}:result']}"
                f", redelivered {client.redelivered[task_id]}"
            )
    return problems


def result_messages(client: RecordingClient) -> str:
    """The result messages of a run, for a test's report."""
    tasks = len({task_id for task_id, _ in client.received})
    return (
        f"result messages {len(client.received)} (repeated {len(client.received) - tasks}; "
        f"redelivered {client.redelivered.total()})"
    )


def tail(path: Path | None, lines: int = 40) -> str:
    """The end of a worker's log file, for assertion messages."""
    if path is None or not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


async def close_broker_connections(connection_name: str) -> int:
    """Force-close (``rabbitmqctl close_connection``) every broker connection of that client name.

    Local brokers only (``Services.rabbitmqctl``). Returns how many connections were closed.
    """
    pids = await _connection_pids(connection_name)
    for pid in pids:
        await run_rabbitmqctl("close_connection", pid, "closed by a Waystation test")
    return len(pids)


# ---- helpers of the outage and shutdown tests --------------------------------------------------


async def run_rabbitmqctl(*args: str) -> str:
    """Run ``rabbitmqctl`` on this host (local brokers only); its output, or RuntimeError."""
    process = await asyncio.create_subprocess_exec(
        "rabbitmqctl", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {args[0]}: {(err or out).decode().strip()}")
    return out.decode()


@contextlib.asynccontextmanager
async def temporary_vhost(amqp_url: str) -> AsyncIterator[tuple[str, str]]:
    """A RabbitMQ virtual host of the test's own: yields ``(vhost, its AMQP URL)``; deleted after.

    A test that closes *all* connections (``rabbitmqctl close_all_connections``) scopes the
    outage to this vhost, so that it hits every connection of the system under test and
    nothing else that shares the broker. Local brokers only (``Services.rabbitmqctl``).
    """
    parsed = urlparse(amqp_url)
    vhost = f"wst-{uuid.uuid4().hex[:8]}"
    await run_rabbitmqctl("add_vhost", vhost)
    try:
        await run_rabbitmqctl(
            "set_permissions", "-p", vhost, parsed.username or "guest", ".*", ".*", ".*"
        )
        yield vhost, parsed._replace(path=f"/{quote(vhost, safe='')}").geturl()
    finally:
        await run_rabbitmqctl("delete_vhost", vhost)


async def apply_queue_policy(vhost: str, names: Names, delivery_limit: int = 5) -> None:
    """Apply Waystation's delivery-limit and dead-letter policy to ``names`` in ``vhost``."""
    await apply_policy(names, delivery_limit, "rabbitmqctl", vhost=vhost)


async def broker_connections(vhost: str) -> list[str]:
    """The client-given ``connection_name`` of every connection open in ``vhost``."""
    listing = await run_rabbitmqctl(
        "list_connections", "-q", "--no-table-headers", "vhost", "client_properties"
    )
    names = []
    for line in listing.splitlines():
        found, _, properties = line.partition("\t")
        if found != vhost:
            continue
        match = re.search(r'\{"connection_name","([^"]*)"\}', properties)
        names.append(match.group(1) if match else "(unnamed)")
    return names


async def close_all_broker_connections(vhost: str) -> None:
    """``rabbitmqctl close_all_connections`` in ``vhost``: every client of it is cut off."""
    await run_rabbitmqctl(
        "close_all_connections", "--vhost", vhost, "test: every connection closed"
    )


async def _connection_pids(connection_name: str) -> list[str]:
    """The broker's ids of every connection a client opened under ``connection_name``."""
    listing = await run_rabbitmqctl(
        "list_connections", "-q", "--no-table-headers", "pid", "client_properties"
    )
    marker = f'{{"connection_name","{connection_name}"}}'
    return [line.split("\t", 1)[0] for line in listing.splitlines() if marker in line]


async def unacked_messages_of(connection_name: str) -> int:
    """Messages the broker has delivered to that client and not yet seen settled (rabbitmqctl)."""
    pids = set(await _connection_pids(connection_name))
    channels = await run_rabbitmqctl(
        "list_channels", "-q", "--no-table-headers", "connection", "messages_unacknowledged"
    )
    total = 0
    for line in channels.splitlines():
        pid, _, unacked = line.partition("\t")
        if pid in pids:
            total += int(unacked)
    return total


def vhost_of(amqp_url: str) -> str:
    path = urlparse(amqp_url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


async def busy_queues(amqp_url: str, prefix: str) -> dict[str, tuple[int, int]]:
    """Queues of the deployment under ``prefix`` that hold messages, ready or delivered and
    not yet settled, dead letters aside: ``{queue: (ready, unacked)}`` (rabbitmqctl)."""
    listing = await run_rabbitmqctl(
        "list_queues",
        "-p",
        vhost_of(amqp_url),
        "-q",
        "--no-table-headers",
        "name",
        "messages_ready",
        "messages_unacknowledged",
    )
    dead = Names(prefix).dead_letter_queue
    busy: dict[str, tuple[int, int]] = {}
    for line in listing.splitlines():
        name, ready, unacked = line.split("\t")
        if name.startswith(prefix) and name != dead and (int(ready) or int(unacked)):
            busy[name] = (int(ready), int(unacked))
    return busy


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


async def _queue_counts(amqp_url: str, queue: str) -> tuple[int, int]:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        result = declared.declaration_result
        return int(result.message_count or 0), int(result.consumer_count or 0)
    finally:
        await connection.close()


async def queue_depth(amqp_url: str, queue: str) -> int:
    """Messages ready (not delivered to any consumer) in ``queue``."""
    return (await _queue_counts(amqp_url, queue))[0]


async def consumer_count(amqp_url: str, queue: str) -> int:
    """Consumers of ``queue`` right now."""
    return (await _queue_counts(amqp_url, queue))[1]


async def _run_tool(*args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await process.communicate()
    except BaseException:
        # cancelled (Ctrl-C): the tool must not go on by itself, creating what nobody removes
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])}: {(err or out).decode().strip()}")
    return out.decode()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


PG_TOOLS = ("pg_lsclusters", "pg_ctlcluster", "pg_createcluster", "pg_dropcluster")


@dataclass(frozen=True)
class PostgresCluster:
    """A local PostgreSQL cluster managed with Debian's postgresql-common tools."""

    version: str
    name: str
    port: int

    @classmethod
    def serving(cls, database_url: str, why: str) -> PostgresCluster:
        """The local cluster serving ``database_url``, which a test ``why`` needs (a scratch
        cluster of the same version is made with the same tools): see :func:`require`."""
        found = cls.find(database_url)
        require(
            Capability(
                "a local PostgreSQL cluster managed with postgresql-common",
                found if isinstance(found, str) else None,
            ),
            why,
        )
        assert isinstance(found, PostgresCluster)
        return found

    @classmethod
    def find(cls, database_url: str) -> PostgresCluster | str:
        """The cluster, or exactly what is missing to use one."""
        absent = [tool for tool in PG_TOOLS if shutil.which(tool) is None]
        if absent:
            return f"{', '.join(absent)} not on PATH (install postgresql-common here)"
        url = make_url(database_url)
        if url.host not in (None, "", "localhost", "127.0.0.1", "::1"):
            return f"the test database is on {url.host}, not on this host"
        if os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name != "postgres":
            return "pg_createcluster and pg_ctlcluster need root or the postgres user"
        port = str(url.port or 5432)
        listing = subprocess.run(
            ["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=False
        ).stdout
        for line in listing.splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[2] == port:
                return cls(fields[0], fields[1], int(fields[2]))
        return f"pg_lsclusters lists no cluster on port {port} (testcontainers, say)"

    @classmethod
    @contextlib.asynccontextmanager
    async def scratch(cls, version: str) -> AsyncIterator[PostgresCluster]:
        """A new, running cluster of ``version`` (trust auth, a free port); dropped after.

        A test that stops PostgreSQL stops this one, so nothing else using the machine's
        server (another test run, say) notices. Needs root or the postgres user.
        """
        cluster = cls(version, f"wst_{uuid.uuid4().hex[:8]}", _free_port())
        try:
            await _run_tool(
                "pg_createcluster",
                version,
                cluster.name,
                "--port",
                str(cluster.port),
                "--start",
                "--",
                "--auth=trust",
            )
        except BaseException:
            # failed or cancelled half-way: remove whatever it created
            with contextlib.suppress(Exception):
                await _run_tool("pg_dropcluster", "--stop", version, cluster.name)
            raise
        try:
            yield cluster
        finally:
            await _run_tool("pg_dropcluster", "--stop", version, cluster.name)

    def url(self, database: str) -> str:
        """An asyncpg URL of ``database`` on this cluster (user postgres)."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    async def _ctl(self, action: str, *options: str) -> None:
        await _run_tool(
            "pg_ctlcluster", "--skip-systemctl-redirect", *options, self.version, self.name, action
        )

    async def online(self) -> bool:
        listing = await _run_tool("pg_lsclusters", "--no-header")
        for line in listing.splitlines():
            fields = line.split()
            if fields[:2] == [self.version, self.name]:
                return len(fields) > 3 and fields[3] == "online"
        return False

    async def stop(self) -> None:
        """Fast shutdown: every session is terminated, open transactions roll back."""
        await self._ctl("stop", "--mode", "fast")

    async def start(self) -> None:
        await self._ctl("start")

    async def ensure_running(self) -> None:
        if not await self.online():
            await self.start()


class DurableResultCollector(RecordingClient):
    """A publisher whose results survive its own broker connection being closed.

    :class:`~workers.client.Client` replies to an exclusive, auto-delete queue: the broker
    deletes it with the client's connection and the client re-declares it only when it has
    reconnected, so a result published in between is unroutable and dropped by the worker
    (and anything already in the queue goes with it). A test that closes every connection must
    measure the workers, not that window. This client's reply queue is a named durable quorum
    queue (``<prefix>test-results``) consumed with manual acks over a robust connection: results
    wait there while it reconnects, and one delivered but not yet acked when the connection
    dropped comes again (kept in ``received``; counted in ``duplicates``). It submits like
    ``Client`` (same wire format) and records like :class:`RecordingClient`. ``reconnects``
    counts how often the connection came back.
    """

    def __init__(
        self,
        amqp_url: str,
        *,
        queue_prefix: str = "waystation.",
        queue_name: str = "test-results",
        reconnect_interval: float = 1.0,
    ) -> None:
        super().__init__(amqp_url, queue_prefix=queue_prefix)
        self.queue_name = f"{queue_prefix}{queue_name}"
        self.connection_name = f"waystation test results {self.queue_name}"
        self.reconnects = 0
        self._reconnect_interval = reconnect_interval

    async def __aenter__(self) -> DurableResultCollector:
        await self.connect()
        return self

    async def connect(self) -> None:
        connection = await aio_pika.connect_robust(
            self.amqp_url,
            client_properties={"connection_name": self.connection_name},
            reconnect_interval=self._reconnect_interval,
        )
        connection.reconnect_callbacks.add(self._on_reconnect)
        self._connection = connection
        self._channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        self._reply_queue = await declare_quorum_queue(self._channel, self.queue_name)
        await self._reply_queue.consume(self._on_result)

    def _on_reconnect(self, *_: Any) -> None:
        self.reconnects += 1

    async def _on_result(self, message: AbstractIncomingMessage) -> None:
        await super()._on_result(message)
        try:
            await message.ack()
        except (
            aio_pika.exceptions.AMQPError,
            aio_pika.exceptions.ChannelInvalidStateError,
            ConnectionError,
        ):
            pass  # the channel died first: the broker delivers it again (a duplicate)

    async def close(self, *, delete_queue: bool = True) -> None:
        await super().close()
        if delete_queue:
            connection = await aio_pika.connect(self.amqp_url)
            try:
                await (await connection.channel()).queue_delete(self.queue_name)
            finally:
                await connection.close()


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
    """Start the example app's worker processes and wait until each consumes every queue."""
    names = Names(settings.queue_prefix)
    for worker in workers:
        worker.start()
    for queue in (
        names.tasks("orchestrator"),
        names.replies("orchestrator"),
        names.tasks("researcher"),
    ):
        await wait_for_consumers(settings.amqp_url, queue, len(workers))


def worker_logs(workers: Sequence[WorkerProcess], lines: int = 15) -> Callable[[], str]:
    """A function returning the end of every worker's log, for assertion messages."""

    def logs() -> str:
        return "\n".join(
            f"--- {w.log_path.name}:\n{tail(w.log_path, lines)}" for w in workers if w.log_path
        )

    return logs


def log_lines(workers: Sequence[WorkerProcess], needle: str) -> list[str]:
    """Every line of the workers' logs that contains ``needle``."""
    found: list[str] = []
    for worker in workers:
        if worker.log_path is not None and worker.log_path.exists():
            found.extend(
                line
                for line in worker.log_path.read_text(errors="replace").splitlines()
                if needle in line
            )
    return found


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


async def fanout_problems(
    store: PostgresEventStore,
    collector: RecordingClient,
    inputs: dict[str, dict[str, float | int]],
    k: int,
) -> tuple[list[str], Counter[str]]:
    """Everything wrong with the results and streams of one-round example orchestrator tasks.

    Each task must have one distinct, correct result, repeated no more often than the relays
    and the broker explain (:func:`unexplained_repeats`: the run recorded outbox claims); its
    stream: K sub-tasks claimed once
    each, one pause resumed once, completed once as its last decisive event, nothing else
    (audit-only ``ReplyIgnored`` aside), and a hash chain that verifies. Also returns the
    ``ReplyIgnored`` reasons seen.
    """
    expected = [
        "TaskStarted",
        "TaskPaused",
        *["SubtaskClaimed", "ResultRecorded"] * k,
        "TaskResumed",
        "TaskCompleted",
    ]
    problems = await unexplained_repeats(store, collector, inputs)
    ignored: Counter[str] = Counter()
    results = collector.results
    for task_id, spec in inputs.items():
        n = int(spec["n"])
        result = results.get(task_id)
        if (
            result is None
            or not result.ok
            or result.result != {"n": n, "total": expected_total(n, k)}
        ):
            problems.append(f"{task_id}: wrong result {result}")
        if len(collector.distinct_results(task_id)) != 1:
            problems.append(f"{task_id}: distinct results {collector.bodies(task_id)}")
        events = await store.read_stream(task_id)
        types = [e.event_type for e in events]
        ignored.update(e.data["reason"] for e in events if e.event_type == "ReplyIgnored")
        decisive = [t for t in types if t != "ReplyIgnored"]
        claims = Counter(e.data["subtask_id"] for e in events if e.event_type == "SubtaskClaimed")
        if claims != Counter(f"{task_id}:1:{i}" for i in range(k)):
            problems.append(f"{task_id}: claims {dict(claims)}")
        if types.count("TaskResumed") != 1 or types.count("TaskPaused") != 1:
            problems.append(
                f"{task_id}: {types.count('TaskPaused')} pauses, "
                f"{types.count('TaskResumed')} resumes"
            )
        if types.count("TaskCompleted") != 1 or not decisive or decisive[-1] != "TaskCompleted":
            problems.append(f"{task_id}: not completed exactly once: {types}")
        if decisive != expected:
            problems.append(f"{task_id}: stream {types}")
        problems.extend(chain_problems(events))
    return problems, ignored


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


def stats_env(path: Path) -> dict[str, str]:
    """Environment that makes a worker write its counters to ``path`` when it stops."""
    return {"WAYSTATION_STATS_FILE": str(path)}


def worker_counters(workers: Sequence[WorkerProcess]) -> Counter[str]:
    """The counters the (stopped) workers wrote to their ``WAYSTATION_STATS_FILE``, summed."""
    total: Counter[str] = Counter()
    for worker in workers:
        path = worker.extra_env.get("WAYSTATION_STATS_FILE")
        if path and Path(path).exists():
            total.update(loads(Path(path).read_bytes())["counters"])
    return total


# ---- helpers of the deadline, cancellation, failure and bad-input tests ------------------------


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


def counter(worker: Worker, name: str) -> int:
    return worker.stats.counters.get(name, 0)
