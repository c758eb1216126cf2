"""The broker side of a run: a deployment's queues, and ``rabbitmqctl`` for what AMQP can't do.

Over AMQP: the queues workers declare under a prefix (:func:`topology_queues`), waiting until
they have their consumers, their depths and consumer counts, and deleting them afterwards.

With ``rabbitmqctl`` (a broker on this host only): the connections a client opened and closing
them, messages delivered and not yet settled, a virtual host of a run's own (so that closing
*every* connection hits nothing else on the broker), and Waystation's delivery-limit policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from urllib.parse import quote, unquote, urlparse

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractQueue

from waystation.brokers.amqp.topology import apply_policy
from waystation.policies import WAIT_STEPS_MS
from waystation.protocol.wire import Names
from waystation.settings import Settings

from .processes import run_tool

# ---- a deployment's queues ----------------------------------------------------------------


DEFAULT_REPLY_SHARDS: int = Settings.model_fields["reply_shards"].default
"""The reply shards per agent of workers with default settings (``waystation.runtime.routing``)."""


def deployment_names(prefix: str) -> Names:
    """The names of a deployment whose workers run with default settings."""
    return Names(prefix, DEFAULT_REPLY_SHARDS)


def fresh_prefix() -> str:
    """A queue prefix of its own, for one test's deployment."""
    return f"wst-{uuid.uuid4().hex[:8]}."


def topology_queues(names: Names, agents: Iterable[str]) -> list[str]:
    """The queues workers of ``agents`` declare: tasks and replies of each (with ``names``'
    reply shards), then dead letters."""
    queues = []
    for agent in agents:
        queues += [names.tasks(agent), *names.reply_queues(agent)]
    return [*queues, names.dead_letter_queue]


async def declare_quorum_queue(channel: AbstractChannel, name: str) -> AbstractQueue:
    """Declare a queue the way Waystation does (durable quorum), e.g. for a test-played peer."""
    return await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})


async def delete_topology(
    amqp_url: str, prefix: str, agents: Iterable[str], *, reply_shards: int | None = None
) -> None:
    """Delete every queue and the exchange that workers of ``agents`` declare under ``prefix``
    (with ``reply_shards`` shards per agent: by default, the workers' default count)."""
    names = Names(prefix, DEFAULT_REPLY_SHARDS if reply_shards is None else reply_shards)
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        for queue in topology_queues(names, agents):
            await channel.queue_delete(queue)
        await channel.exchange_delete(names.dead_letter_exchange)
        # the retries' wait queues a test's workers may have declared (waystation.policies)
        for step in WAIT_STEPS_MS:
            if step > 60_000:
                break
            await channel.queue_delete(names.wait(step))
            await channel.exchange_delete(names.wait(step))
    finally:
        await connection.close()


async def _counts(connection: AbstractConnection, queue: str) -> tuple[int, int] | None:
    """(messages ready, consumers) of ``queue``; None when it does not exist."""
    channel = await connection.channel()
    try:
        declared = await channel.declare_queue(queue, passive=True)
        result = declared.declaration_result
        return int(result.message_count or 0), int(result.consumer_count or 0)
    except aio_pika.exceptions.ChannelClosed:
        return None
    finally:
        with contextlib.suppress(Exception):
            await channel.close()


async def queue_counts(amqp_url: str, queues: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(messages ready, consumers) of each queue that exists."""
    found: dict[str, tuple[int, int]] = {}
    connection = await aio_pika.connect(amqp_url)
    try:
        for queue in queues:
            counts = await _counts(connection, queue)
            if counts is not None:
                found[queue] = counts
    finally:
        await connection.close()
    return found


async def queue_depths(amqp_url: str, queues: Sequence[str]) -> dict[str, int]:
    """Messages ready (delivered to no consumer) in each queue that exists."""
    return {queue: ready for queue, (ready, _) in (await queue_counts(amqp_url, queues)).items()}


async def _counts_of(amqp_url: str, queue: str) -> tuple[int, int]:
    counts = await queue_counts(amqp_url, [queue])
    if queue not in counts:
        raise LookupError(f"there is no queue {queue}")
    return counts[queue]


async def queue_depth(amqp_url: str, queue: str) -> int:
    """Messages ready (delivered to no consumer) in ``queue``, which must exist."""
    return (await _counts_of(amqp_url, queue))[0]


async def consumer_count(amqp_url: str, queue: str) -> int:
    """Consumers of ``queue`` (which must exist) right now."""
    return (await _counts_of(amqp_url, queue))[1]


async def wait_for_consumers(
    amqp_url: str,
    queues: Sequence[str],
    count: int,
    within: float = 60,
    alive: Callable[[], bool] | None = None,
) -> None:
    """Wait until every queue has ``count`` consumers (the workers finished starting); fail at
    once when ``alive()`` says a worker exited."""
    connection = await aio_pika.connect(amqp_url)
    try:
        deadline = time.monotonic() + within
        while True:
            counts = [(await _counts(connection, queue) or (0, 0))[1] for queue in queues]
            if min(counts) >= count:
                return
            if alive is not None and not alive():
                raise RuntimeError("a worker exited while starting (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"consumers on {list(queues)}: {counts}, wanted {count} each")
            await asyncio.sleep(0.1)
    finally:
        await connection.close()


# ---- rabbitmqctl ---------------------------------------------------------------------------


async def run_rabbitmqctl(*args: str) -> str:
    """Run ``rabbitmqctl`` on this host (local brokers only); its output, or RuntimeError."""
    return await run_tool("rabbitmqctl", *args)


def vhost_of(amqp_url: str) -> str:
    path = urlparse(amqp_url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


@contextlib.asynccontextmanager
async def temporary_vhost(amqp_url: str) -> AsyncIterator[tuple[str, str]]:
    """A RabbitMQ virtual host of the caller's own: yields ``(vhost, its AMQP URL)``; deleted
    after, with everything in it.

    A run that closes *all* connections (``rabbitmqctl close_all_connections``) scopes the
    outage to this vhost, so that it hits every connection of the system under test and
    nothing else that shares the broker.
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


async def connection_pids(connection_name: str) -> list[str]:
    """The broker's ids of every connection a client opened under ``connection_name``."""
    listing = await run_rabbitmqctl(
        "list_connections", "-q", "--no-table-headers", "pid", "client_properties"
    )
    marker = f'{{"connection_name","{connection_name}"}}'
    return [line.split("\t", 1)[0] for line in listing.splitlines() if marker in line]


async def close_broker_connections(connection_name: str) -> int:
    """Force-close (``rabbitmqctl close_connection``) every broker connection of that client
    name; how many were closed."""
    pids = await connection_pids(connection_name)
    for pid in pids:
        await run_rabbitmqctl("close_connection", pid, "closed by a Waystation test")
    return len(pids)


async def unacked_messages_of(connection_name: str) -> int:
    """Messages the broker has delivered to that client and not yet seen settled."""
    pids = set(await connection_pids(connection_name))
    channels = await run_rabbitmqctl(
        "list_channels", "-q", "--no-table-headers", "connection", "messages_unacknowledged"
    )
    total = 0
    for line in channels.splitlines():
        pid, _, unacked = line.partition("\t")
        if pid in pids:
            total += int(unacked)
    return total


async def busy_queues(amqp_url: str, prefix: str) -> dict[str, tuple[int, int]]:
    """Queues of the deployment under ``prefix`` that hold messages, ready or delivered and
    not yet settled, dead letters aside: ``{queue: (ready, unacked)}``."""
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


# ---- hostile publishers and a broker that says no ----------------------------------------


async def publish_raw_properties(
    amqp_url: str, routing_key: str, body: bytes, properties: bytes, *, exchange: str = ""
) -> None:
    """Publish ``body`` with ``properties`` as raw AMQP bytes (a content header's, from its
    property flags on), whatever they hold: what a hostile or broken client library sends and
    no well-behaved one can. Returns once the broker has routed it (a round trip on the same
    channel after it); raises when the broker closed the channel or connection instead."""
    import aiormq
    import aiormq.abc
    import pamqp.commands
    import pamqp.frame

    connection = await aiormq.connect(amqp_url)
    try:
        channel = await connection.channel()
        method = pamqp.frame.marshal(
            pamqp.commands.Basic.Publish(exchange=exchange, routing_key=routing_key), channel.number
        )
        payload = b"".join((b"\x00\x3c\x00\x00", len(body).to_bytes(8, "big"), properties))
        header = b"".join(
            (b"\x02", channel.number.to_bytes(2, "big"), len(payload).to_bytes(4, "big"), payload)
        )
        content = b"".join(
            (b"\x03", channel.number.to_bytes(2, "big"), len(body).to_bytes(4, "big"), body)
        )
        raw = method + header + b"\xce" + content + b"\xce"
        await connection.write_queue.put(aiormq.abc.ChannelFrame(payload=raw, should_close=False))
        await channel.basic_qos(prefetch_count=1)  # after the publish, on the same channel
    finally:
        await connection.close()


async def _max_message_size() -> int:
    found = await run_rabbitmqctl("eval", "application:get_env(rabbit, max_message_size).")
    match = re.search(r"\{ok,(\d+)\}", found)
    return int(match.group(1)) if match else 134_217_728


@contextlib.asynccontextmanager
async def broker_size_limit(limit: int) -> AsyncIterator[None]:
    """RabbitMQ's ``max_message_size`` set to ``limit`` bytes for the block (the whole broker's:
    a test that needs it runs alone), then set back."""
    before = await _max_message_size()
    await run_rabbitmqctl("eval", f"application:set_env(rabbit, max_message_size, {limit}).")
    try:
        yield
    finally:
        await run_rabbitmqctl("eval", f"application:set_env(rabbit, max_message_size, {before}).")


# ---- the broker's activity (its global counters) --------------------------------------------


_COUNTERS_EXPR = (
    "M = rabbit_global_counters:overview(), "
    "P = maps:get([{protocol,amqp091}], M), "
    "Q = maps:get([{protocol,amqp091},{queue_type,rabbit_quorum_queue}], M), "
    "C = maps:get([{protocol,amqp091},{queue_type,rabbit_classic_queue}], M), "
    "[maps:get(messages_routed_total, P), maps:get(messages_delivered_total, Q), "
    "maps:get(messages_delivered_total, C), maps:get(messages_redelivered_total, Q)]."
)


def broker_counters() -> dict[str, int] | None:
    """RabbitMQ's global message counters (whole broker), or None when rabbitmqctl can't tell."""
    if shutil.which("rabbitmqctl") is None:
        return None
    try:
        out = subprocess.run(
            ["rabbitmqctl", "eval", _COUNTERS_EXPR], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"\[(\d+),(\d+),(\d+),(\d+)\]", out.stdout.replace(" ", "").replace("\n", ""))
    if out.returncode != 0 or not found:
        return None
    routed, quorum, classic, redelivered = (int(g) for g in found.groups())
    return {"routed": routed, "delivered": quorum + classic, "redelivered": redelivered}
