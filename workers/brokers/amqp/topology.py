"""RabbitMQ topology, declared idempotently by every worker at start.

Queues are durable quorum queues declared without arguments that could later need changing:
the delivery limit and the dead-letter exchange are set by a policy, because a queue's declare
arguments are fixed for its life while a policy can be changed at any time (and RabbitMQ 3.10
has no default delivery limit). The policy matches every queue of the prefix except the
dead-letter queue itself.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import shutil
from collections.abc import Iterable
from urllib.parse import quote

import aio_pika
from aio_pika.abc import AbstractChannel
from aiormq.abc import FieldTable
from yarl import URL

from waystation.events.codec import dumps
from waystation.protocol.wire import Names
from waystation.runtime.verdicts import crash_limit

__all__ = [
    "PolicyNotApplied",
    "amqp_user_of",
    "apply_policy",
    "clear_policy",
    "declare",
    "management_url_of",
    "policy_definition",
    "vhost_of",
]

log = logging.getLogger(__name__)

QUORUM: FieldTable = {"x-queue-type": "quorum"}


async def declare(channel: AbstractChannel, names: Names, agents: Iterable[str]) -> None:
    """Declare the dead-letter exchange and queue, and each agent's task and reply queues (with
    its reply shards)."""
    dlx = await channel.declare_exchange(
        names.dead_letter_exchange, aio_pika.ExchangeType.FANOUT, durable=True
    )
    dead = await channel.declare_queue(names.dead_letter_queue, durable=True, arguments=QUORUM)
    await dead.bind(dlx)
    for agent in agents:
        await channel.declare_queue(names.tasks(agent), durable=True, arguments=QUORUM)
        for queue in names.reply_queues(agent):
            await channel.declare_queue(queue, durable=True, arguments=QUORUM)


def wait_queue_arguments(milliseconds: int) -> FieldTable:
    """A retry's wait queue: its messages expire after ``milliseconds`` and go, at least once, to
    the default exchange with their own routing key (the queue they wait to return to). These
    arguments take precedence over the deployment's policy, whose dead-letter exchange they
    replace. At-least-once dead-lettering needs ``reject-publish`` overflow (RabbitMQ 3.10+)."""
    return {
        **QUORUM,
        "x-message-ttl": milliseconds,
        "x-dead-letter-exchange": "",
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }


def policy_definition(names: Names, delivery_limit: int) -> tuple[str, dict[str, object]]:
    """The policy's pattern and definition (also what compose's definitions file holds).

    Waystation counts attempts and fails a task at its own limits (``waystation.runtime.settle``);
    the broker's ``delivery-limit`` is a backstop past those (a message the workers never get to
    settle at all), set one above the crash limit so that Waystation's own reason comes first.
    """
    dead = re.escape(names.dead_letter_queue)
    pattern = f"^{re.escape(names.prefix)}(?!{dead[len(re.escape(names.prefix)) :]}$)"
    return pattern, {
        "delivery-limit": crash_limit(delivery_limit) + 1,
        "dead-letter-exchange": names.dead_letter_exchange,
    }


class PolicyNotApplied(RuntimeError):
    """The queue policy could not be applied as ``WAYSTATION_BROKER_POLICY`` asks. ``transient``:
    it may pass by itself (the management API not reachable yet: compose may start a worker
    before RabbitMQ's plugin answers), so a starting worker tries again."""

    def __init__(self, message: str, *, setting: str, transient: bool = False) -> None:
        super().__init__(message)
        self.setting = setting
        self.transient = transient


async def _rabbitmqctl(*args: str) -> None:
    process = await asyncio.create_subprocess_exec(
        "rabbitmqctl", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        raise PolicyNotApplied(
            f"rabbitmqctl {args[0]} failed: {(err or out).decode().strip()}",
            setting="WAYSTATION_BROKER_POLICY",
        )


def vhost_of(amqp_url: str) -> str:
    """The virtual host an AMQP URL names (``/`` when it names none)."""
    return URL(amqp_url).path.removeprefix("/") or "/"


def amqp_user_of(amqp_url: str) -> str:
    """The user an AMQP URL connects as (RabbitMQ's default, ``guest``, when it names none)."""
    return URL(amqp_url).user or "guest"


def management_url_of(amqp_url: str) -> str:
    """RabbitMQ's management API on the broker an AMQP URL names: its host, port 15672, and the
    URL's user and password (RabbitMQ's defaults, guest/guest, when it has none)."""
    url = URL(amqp_url)
    return str(
        URL.build(
            scheme="http",
            user=url.user or "guest",
            password=url.password or "guest",
            host=url.host or "127.0.0.1",
            port=15672,
        )
    )


async def _put_policy(
    management_url: str, vhost: str, name: str, pattern: str, definition: dict[str, object]
) -> None:
    """Set a policy through the management HTTP API (what ``rabbitmqctl set_policy`` does)."""
    import aiohttp  # here: only this path needs an HTTP client (it takes ~0.3 s to import)

    base = URL(management_url)
    endpoint = f"{base.with_user(None).with_path('')}/api/policies/{quote(vhost, safe='')}/"
    body = {"pattern": pattern, "definition": definition, "priority": 0, "apply-to": "queues"}
    credentials = f"{base.user or 'guest'}:{base.password or 'guest'}".encode()
    headers = {"Authorization": f"Basic {base64.b64encode(credentials).decode()}"}
    timeout = aiohttp.ClientTimeout(total=30)
    try:
        async with (
            aiohttp.ClientSession(headers=headers, timeout=timeout) as session,
            session.put(endpoint + quote(name, safe=""), json=body) as response,
        ):
            if response.status >= 300:
                raise PolicyNotApplied(
                    f"the management API at {base.with_user(None)} refused the policy {name!r} "
                    f"({response.status}: {(await response.text()).strip()})",
                    setting="WAYSTATION_MANAGEMENT_URL",
                )
    except (aiohttp.ClientError, TimeoutError) as error:
        raise PolicyNotApplied(
            f"cannot reach RabbitMQ's management API at {base.with_user(None)} to set the "
            f"policy {name!r} ({type(error).__name__}: {error}); is its management plugin "
            "enabled there?",
            setting="WAYSTATION_MANAGEMENT_URL",
            transient=True,
        ) from error


async def apply_policy(
    names: Names,
    delivery_limit: int,
    mode: str = "auto",
    *,
    vhost: str = "/",
    management_url: str | None = None,
) -> bool:
    """Apply the queue policy in ``vhost``; True when applied, False when left to the broker's
    definitions. ``management``: through the management API at ``management_url``;
    ``rabbitmqctl``: with rabbitmqctl on this host; ``auto``: rabbitmqctl when installed."""
    if mode == "none":
        return False
    pattern, definition = policy_definition(names, delivery_limit)
    if mode == "management":
        if management_url is None:
            raise ValueError("WAYSTATION_BROKER_POLICY=management needs a management API URL")
        await _put_policy(management_url, vhost, names.policy_name, pattern, definition)
        return True
    if shutil.which("rabbitmqctl") is None:
        if mode == "rabbitmqctl":
            raise PolicyNotApplied(
                "WAYSTATION_BROKER_POLICY=rabbitmqctl but rabbitmqctl is not installed here",
                setting="WAYSTATION_BROKER_POLICY",
            )
        log.warning(
            "rabbitmqctl not found: the delivery-limit policy %r is not applied here; set "
            "WAYSTATION_BROKER_POLICY=management, or set it in the broker's definitions",
            names.policy_name,
        )
        return False
    await _rabbitmqctl(
        "set_policy",
        "-p",
        vhost,
        "--apply-to",
        "queues",
        "--priority",
        "0",
        names.policy_name,
        pattern,
        dumps(definition).decode(),
    )
    return True


async def clear_policy(names: Names, *, vhost: str = "/") -> None:
    if shutil.which("rabbitmqctl") is not None:
        await _rabbitmqctl("clear_policy", "-p", vhost, names.policy_name)
