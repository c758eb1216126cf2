"""The README's examples run as written: its agent module under the worker command it gives, then
its Python publisher and its Node publisher against that worker, each printing what the README
shows."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
import pytest_asyncio

from scripts.lab.harness.broker import wait_for_consumers
from scripts.lab.harness.processes import WorkerProcess, tail, worker_environment
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..documents import README, ROOT, block_after, code_blocks
from ..support import Capability, require

pytestmark = pytest.mark.integration

TEXT = README.read_text()
AMQPLIB = "0.10.9"
"""The amqplib the Node example was checked with (``npm install amqplib``)."""
NODE_EXAMPLE = "// publish.js: submit one task to the orchestrator and print its result"
NODE_MODULES = ROOT / ".venv" / "node-examples"
"""Where the test installs it, once (``.venv`` is the project's own, ignored by git)."""


def _worker_command() -> list[str]:
    """The arguments of the README's ``waystation worker`` command for its agent module."""
    for block in code_blocks(TEXT):
        for line in block.code.splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0].endswith("waystation") and "myagents:app" in words:
                return words[1:]
    raise AssertionError("the README gives no command running myagents:app")


@pytest_asyncio.fixture
async def readme_worker(settings: Settings, tmp_path: Path) -> AsyncIterator[Path]:
    """The README's agent module, served by the README's worker command; yields its directory."""
    agents, _ = block_after(TEXT, "# myagents.py")
    (tmp_path / "myagents.py").write_text(agents.code)
    worker = WorkerProcess(
        worker_environment(settings, WAYSTATION_SHUTDOWN_GRACE="1"),
        tmp_path / "worker.log",
        command=_worker_command(),
        cwd=tmp_path,
    ).start()
    names = Names(settings.queue_prefix)
    try:
        await wait_for_consumers(
            settings.amqp_url,
            [names.tasks("orchestrator"), names.replies("orchestrator"), names.tasks("researcher")],
            1,
            alive=worker.alive,
        )
        yield tmp_path
    finally:
        assert worker.stop(30) == 0, tail(worker.log_path)


def _publisher_environment(settings: Settings) -> dict[str, str]:
    return {
        **os.environ,
        "WAYSTATION_AMQP_URL": settings.amqp_url,
        "WAYSTATION_QUEUE_PREFIX": settings.queue_prefix,
    }


async def _run(command: list[str], cwd: Path, env: dict[str, str]) -> str:
    process = await asyncio.create_subprocess_exec(
        *command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 90)
    assert process.returncode == 0, err.decode()
    return out.decode()


@pytest.mark.timeout(180)
async def test_the_python_publisher_prints_what_the_readme_shows(
    settings: Settings, readme_worker: Path
) -> None:
    publisher, output = block_after(TEXT, "# publish.py")
    (readme_worker / "publish.py").write_text(publisher.code)
    printed = await _run(
        [sys.executable, "publish.py"], readme_worker, _publisher_environment(settings)
    )
    assert printed == output.code


def _node_capability() -> Capability:
    if shutil.which("node") is None or shutil.which("npm") is None:
        return Capability("Node.js and npm", "node or npm is not installed")
    if not (NODE_MODULES / "node_modules" / "amqplib").exists():
        done = subprocess.run(
            [
                "npm",
                "install",
                "--no-audit",
                "--no-fund",
                "--prefix",
                str(NODE_MODULES),
                f"amqplib@{AMQPLIB}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            return Capability("amqplib", f"npm install amqplib failed: {done.stderr[-500:]}")
    return Capability("Node.js with amqplib")


@pytest.mark.timeout(420)
async def test_the_node_publisher_prints_what_the_readme_shows(
    settings: Settings, readme_worker: Path
) -> None:
    require(_node_capability(), "the README's Node example")
    publisher, output = block_after(TEXT, NODE_EXAMPLE)
    (readme_worker / "publish.js").write_text(publisher.code)
    environment = {
        **_publisher_environment(settings),
        "NODE_PATH": str(NODE_MODULES / "node_modules"),
    }
    printed = await _run(["node", "publish.js"], readme_worker, environment)
    assert printed == output.code


def test_the_policies_example_declares_what_its_comments_say(tmp_path: Path) -> None:
    """The README's policies module, as ``waystation agents --app policies:app --json`` (the
    command it names) reads it from the directory that holds it."""
    assert "`waystation agents --app policies:app`" in TEXT
    policies, _ = block_after(TEXT, "# policies.py")
    (tmp_path / "policies.py").write_text(policies.code)
    listed = subprocess.run(
        [sys.executable, "-m", "waystation.cli", "agents", "--app", "policies:app", "--json"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    (quote,) = orjson.loads(listed.stdout)["agents"]
    assert quote == {
        "agent": "quote",
        "retries": 3,
        "backoff": {"initial": 1, "factor": 2, "maximum": 30, "jitter": 0.1},
        "time_limit": 20,
        "concurrency": 2,
        "rate": {"count": 10, "per": 60},
        "default_call_timeout": None,
        "keep_results": False,
        "signals": [],
        "version": None,
    }
