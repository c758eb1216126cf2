"""The compose deployment, run without Docker: the processes ``compose/compose.yaml`` would start,
with its commands and environment, in its order, checked with its own health check command; then
the README's compose commands, each as the processes it stands for.

What differs from a container, and only that: the host names and credentials of the URLs are the
local services', the queue prefix and database are this test's own (in a RabbitMQ vhost of its
own), and each process gets its own metrics port (a container has its own network namespace).
Where the local broker has no management plugin, the management API the workers set their queue
policy through (``WAYSTATION_BROKER_POLICY=management``) is a stand-in that applies what it is
sent with ``rabbitmqctl``, as the plugin would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from scripts.lab.harness.broker import (
    fresh_prefix,
    run_rabbitmqctl,
    temporary_vhost,
    wait_for_consumers,
)
from scripts.lab.harness.database import fresh_database_url
from scripts.lab.harness.processes import WorkerProcess, free_port, stop_all, tail, waystation_cli
from waystation import migrations
from waystation.protocol.wire import Names

from ..conftest import EXAMPLE_AGENTS
from ..documents import README, ROOT, code_blocks
from ..support import Services, management_api, require

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COMPOSE = yaml.safe_load((ROOT / "compose" / "compose.yaml").read_text())
IMAGE = "waystation:latest"


def _readme_compose_commands() -> list[list[str]]:
    """The README's ``docker compose -f compose/compose.yaml ...`` lines, as their arguments."""
    commands = []
    for block in code_blocks(README.read_text()):
        for line in block.code.splitlines():
            words = shlex.split(line, comments=True)
            if words[:4] == ["docker", "compose", "-f", "compose/compose.yaml"]:
                commands.append(words[4:])
    assert commands, "the README has no compose commands"
    return commands


class ManagementStandIn:
    """``PUT /api/policies/{vhost}/{name}`` of RabbitMQ's management API, applied with
    rabbitmqctl; keeps what it applied."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, str, dict[str, Any]]] = []

    async def put_policy(self, request: web.Request) -> web.Response:
        *_, vhost, name = (unquote(part) for part in request.raw_path.split("/"))
        body = await request.json()
        await run_rabbitmqctl(
            "set_policy", "-p", vhost, "--apply-to", body["apply-to"], "--priority",
            str(body["priority"]), name, body["pattern"], json.dumps(body["definition"]),
        )  # fmt: skip
        self.applied.append((vhost, name, body))
        return web.Response(status=201)


@dataclass
class Deployment:
    """The compose services as local processes."""

    environment: dict[str, str]
    logs: Path
    processes: dict[str, list[tuple[WorkerProcess, int]]] = field(default_factory=dict)

    def start(self, service: str) -> tuple[WorkerProcess, int]:
        """One more replica of ``service``, with compose's command; (process, metrics port)."""
        spec = COMPOSE["services"][service]
        assert spec["image"] == IMAGE and spec["environment"] == COMPOSE["x-waystation-env"]
        replicas = self.processes.setdefault(service, [])
        port = free_port(exclude=[p for ps in self.processes.values() for _, p in ps])
        process = WorkerProcess(
            {**self.environment, "WAYSTATION_METRICS_PORT": str(port)},
            self.logs / f"{service}-{len(replicas) + 1}.log",
            command=spec["command"],
        ).start()
        replicas.append((process, port))
        return process, port

    def all(self) -> list[tuple[WorkerProcess, int]]:
        return [replica for replicas in self.processes.values() for replica in replicas]


async def healthy(service: str, port: int) -> None:
    """Compose's own health check of ``service``, on this replica's port, until it passes or its
    start period and retries are used up."""
    check = COMPOSE["services"][service]["healthcheck"]
    test = check["test"]
    assert test[:2] == ["CMD", "python"]
    compose_port = COMPOSE["x-waystation-env"]["WAYSTATION_METRICS_PORT"]
    command = [sys.executable, *(w.replace(f":{compose_port}/", f":{port}/") for w in test[2:])]
    seconds = lambda text: float(text.removesuffix("s"))  # noqa: E731
    deadline = (
        time.monotonic()
        + seconds(check["start_period"])
        + check["retries"] * seconds(check["interval"])
    )
    while True:
        process = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        if await process.wait() == 0:
            return
        assert time.monotonic() < deadline, f"{service} on port {port} never became healthy"
        await asyncio.sleep(0.5)


@pytest_asyncio.fixture
async def deployment(services: Services, tmp_path: Path) -> AsyncIterator[Deployment]:
    require(services.rabbitmqctl, "the compose topology (its vhost and queue policy)")
    async with temporary_vhost(services.amqp_url) as (_, amqp_url):
        database_url = fresh_database_url(services.admin_database_url)  # `migrate` creates it
        environment = {
            **COMPOSE["x-waystation-env"],
            "WAYSTATION_DATABASE_URL": database_url,
            "WAYSTATION_AMQP_URL": amqp_url,
            "WAYSTATION_QUEUE_PREFIX": fresh_prefix(),
        }
        async with contextlib.AsyncExitStack() as stack:
            if not await _listening(15672):
                stand_in = ManagementStandIn()
                port = await stack.enter_async_context(management_api(stand_in.put_policy))
                environment["WAYSTATION_MANAGEMENT_URL"] = f"http://guest:guest@127.0.0.1:{port}"
            running = Deployment(environment, tmp_path)
            try:
                yield running
            finally:
                codes = stop_all([process for process, _ in running.all()])
                await migrations.drop_database(database_url)
            assert set(codes.values()) <= {0}, codes


async def _listening(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


@pytest.mark.timeout(420)
async def test_the_compose_deployment_starts_and_serves_as_written(
    deployment: Deployment,
) -> None:
    environment = deployment.environment
    names = Names(environment["WAYSTATION_QUEUE_PREFIX"])
    queues = [names.tasks(agent) for agent in EXAMPLE_AGENTS] + [names.replies("orchestrator")]
    handled = []
    for command in _readme_compose_commands():
        verb = command[0]
        if verb == "up" and "--scale" not in command:
            # `migrate` runs to completion first; then the replicas compose starts
            migrate = COMPOSE["services"]["migrate"]["command"]
            code, output = await waystation_cli(migrate, environment)
            assert code == 0, output
            for service in ("worker", "projections"):
                for _ in range(COMPOSE["services"][service]["deploy"]["replicas"]):
                    deployment.start(service)
            for service, replicas in deployment.processes.items():
                for _, port in replicas:
                    await healthy(service, port)
        elif verb == "ps":
            for service, replicas in deployment.processes.items():
                for process, port in replicas:
                    assert process.alive(), tail(process.log_path)
                    await healthy(service, port)
        elif verb == "exec":
            service, program, *arguments = command[1:]
            assert program == "waystation" and service in deployment.processes
            code, output = await waystation_cli(arguments, environment)
            assert code == 0, output
            if arguments[0] == "submit":
                answer = json.loads(output.strip().splitlines()[-1])
                assert answer["status"] == "ok" and answer["result"]["total"] == 29, output
            elif arguments[0] == "status":
                assert "paused_tasks" in output and "active" in output, output
        elif verb == "up":
            (wanted,) = (int(c.split("=")[1]) for c in command if c.startswith("worker="))
            assert wanted <= COMPOSE["x-waystation-budget"]["max_workers"]
            while len(deployment.processes["worker"]) < wanted:
                _, port = deployment.start("worker")
                await healthy("worker", port)
            await wait_for_consumers(environment["WAYSTATION_AMQP_URL"], queues, wanted)
        elif verb == "logs":
            for process, _ in deployment.processes[command[-1]]:
                lines = process.log_path.read_text().splitlines()
                assert lines and all(json.loads(line)["worker_id"] for line in lines[-5:])
        elif verb == "down":
            codes = stop_all([process for process, _ in deployment.all()], timeout=20)
            assert set(codes.values()) == {0}, codes
        else:
            raise AssertionError(f"the README's `docker compose {shlex.join(command)}` is untested")
        handled.append(verb)
    assert handled[0] == "up" and handled[-1] == "down"

    policies = await run_rabbitmqctl(
        "list_policies", "-p", _vhost(environment["WAYSTATION_AMQP_URL"]), "--formatter", "json"
    )
    (policy,) = (p for p in json.loads(policies) if p["name"] == names.policy_name)
    definition = policy["definition"]
    if isinstance(definition, str):
        definition = json.loads(definition)
    limit = int(environment["WAYSTATION_DELIVERY_LIMIT"])
    assert definition["delivery-limit"] == 2 * limit + 1  # one above the crash limit
    assert definition["dead-letter-exchange"] == names.dead_letter_exchange


def _vhost(amqp_url: str) -> str:
    return unquote(amqp_url.rsplit("/", 1)[1]) or "/"
