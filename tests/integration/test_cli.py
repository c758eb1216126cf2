"""The ``waystation`` command, run as a user runs it: a subprocess against the real services."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import orjson
import pytest

from scripts.lab.harness.broker import wait_for_consumers
from scripts.lab.harness.database import fresh_database_url
from scripts.lab.harness.processes import ROOT, WorkerProcess
from waystation import migrations
from waystation.example import expected_total
from waystation.settings import Settings

from ..support import Services

WAYSTATION = str(Path(sys.executable).parent / "waystation")


def run_cli(
    settings: Settings, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(
        WAYSTATION_DATABASE_URL=settings.database_url,
        WAYSTATION_AMQP_URL=settings.amqp_url,
        WAYSTATION_QUEUE_PREFIX=settings.queue_prefix,
    )
    return subprocess.run(
        [WAYSTATION, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


COMMANDS = [
    ("worker",),
    ("submit",),
    ("cancel",),
    ("signal",),
    ("dead-letters", "list"),
    ("dead-letters", "replay"),
    ("verify",),
    ("history",),
    ("export",),
    ("state",),
    ("tasks",),
    ("status",),
    ("result",),
    ("projections", "run"),
    ("projections", "status"),
    ("projections", "rebuild"),
    ("db", "upgrade"),
    ("schema",),
    ("agents",),
    ("console",),
]


def test_help_names_every_command(settings: Settings) -> None:
    shown = run_cli(settings, "--help")
    assert shown.returncode == 0
    listed = {line.split()[0] for line in shown.stdout.split("Commands:")[1].splitlines() if line}
    assert listed == {command[0] for command in COMMANDS}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_explains_itself_and_each_of_its_options(
    settings: Settings, command: tuple[str, ...]
) -> None:
    from waystation.cli import main

    shown = run_cli(settings, *command, "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"Usage: waystation {' '.join(command)}")
    found = main
    for name in command:
        found = found.commands[name]  # type: ignore[attr-defined]
    assert found.help, f"{command} has no description"
    for option in found.params:
        if isinstance(option, click.Option):
            assert option.help, f"{' '.join(command)} {option.opts[0]} has no help text"
            assert option.opts[0] in shown.stdout


async def test_db_upgrade_creates_a_missing_database_with_the_log(
    services: Services, settings: Settings
) -> None:
    url = fresh_database_url(services.admin_database_url)
    try:
        done = await asyncio.to_thread(
            run_cli, settings.model_copy(update={"database_url": url}), "db", "upgrade"
        )
        assert done.returncode == 0, done.stderr
        assert "newest schema" in done.stdout
        again = await asyncio.to_thread(
            run_cli, settings.model_copy(update={"database_url": url}), "db", "upgrade"
        )
        assert again.returncode == 0, again.stderr
    finally:
        await migrations.drop_database(url)


@pytest.mark.slow
async def test_submit_waits_for_and_prints_the_result(settings: Settings, tmp_path: Path) -> None:
    worker = WorkerProcess.with_settings(settings, tmp_path / "worker.log").start()
    try:
        await wait_for_consumers(settings.amqp_url, [settings.queue_prefix + "orchestrator"], 1)
        done = await asyncio.to_thread(
            run_cli, settings, "submit", "orchestrator", '{"n": 3, "k": 4}'
        )
        assert done.returncode == 0, done.stderr
        answer = orjson.loads(done.stdout)
        assert answer["status"] == "ok"
        assert answer["result"] == {"n": 3, "total": expected_total(3, 4)}

        queued = await asyncio.to_thread(
            run_cli,
            settings,
            "submit",
            "researcher",
            '{"x": 7}',
            "--no-wait",
            "--task-id",
            "cli-no-wait",
        )
        assert queued.returncode == 0, queued.stderr
        assert orjson.loads(queued.stdout) == {"task_id": "cli-no-wait"}
        assert worker.stop() == 0, "a worker stopped with SIGTERM exits 0"
    finally:
        worker.stop()


def test_submit_rejects_input_that_is_not_json(settings: Settings) -> None:
    done = run_cli(settings, "submit", "orchestrator", "{not json")
    assert done.returncode == 2
    assert "not JSON" in done.stderr


async def test_dead_letters_can_be_listed_then_replayed_after_the_cause_is_fixed(
    settings: Settings, store: Any
) -> None:
    """A task over the size limit is dead-lettered; once the limit is raised, a replay runs it."""
    from scripts.lab.harness.clients import RecordingClient
    from waystation.example import app

    from ..support import eventually, running_worker

    strict = settings.model_copy(update={"max_message_bytes": 64})
    big = {"n": 2, "k": 3, "padding": "x" * 200}
    async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        async with running_worker(app, strict, store) as worker:
            task_id = await client.submit("orchestrator", big)
            await eventually(
                lambda: worker.stats.counters.get("dead_letter.too-large") == 1,
                within=20,
                what="the big task to be dead-lettered",
            )
        await eventually(lambda: len(client.bodies(task_id)) == 1, 10, "the error result")
        assert orjson.loads(client.bodies(task_id)[0])["error"]["type"] == "too-large"

        for _ in range(2):  # listing leaves them in place
            listed = await asyncio.to_thread(run_cli, settings, "dead-letters", "list", "--json")
            assert listed.returncode == 0, listed.stderr
            (letter,) = orjson.loads(listed.stdout)
            assert letter["reason"] == "too-large"
            assert letter["message_id"] == task_id
            assert letter["queue"] == settings.queue_prefix + "orchestrator"

        async with running_worker(app, settings, store):
            replayed = await asyncio.to_thread(
                run_cli, settings, "dead-letters", "replay", "--reason", "too-large"
            )
            assert replayed.returncode == 0, replayed.stderr
            assert "replayed 1 message(s)" in replayed.stdout
            await eventually(lambda: len(client.bodies(task_id)) == 2, 20, "the replayed result")
        answer = orjson.loads(client.bodies(task_id)[1])
        assert answer["status"] == "ok"
        assert answer["result"] == {"n": 2, "total": expected_total(2, 3)}
        empty = await asyncio.to_thread(run_cli, settings, "dead-letters", "list", "--json")
        assert orjson.loads(empty.stdout) == []


async def test_alembic_itself_migrates_from_the_project_root(services: Services) -> None:
    """docs/agents.md: `alembic upgrade head` works too, configured by [tool.alembic] in
    pyproject.toml."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    url = fresh_database_url(services.admin_database_url)
    await migrations.ensure_database(url)
    try:
        env = dict(os.environ, WAYSTATION_DATABASE_URL=url)
        done = await asyncio.to_thread(
            subprocess.run,
            [str(Path(sys.executable).parent / "alembic"), "upgrade", "head"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        engine = create_async_engine(url)
        try:
            async with engine.connect() as connection:
                version = await connection.scalar(text("SELECT version_num FROM alembic_version"))
        finally:
            await engine.dispose()
        heads = sorted(
            p.name.split("_")[0] for p in (ROOT / "migrations" / "versions").glob("0*.py")
        )
        assert version == heads[-1]
    finally:
        await migrations.drop_database(url)


@pytest.mark.parametrize(
    ("database", "says"),
    [("missing", "does not exist"), ("unreachable", "Connection refused")],
)
@pytest.mark.parametrize("command", [("history", "some-task"), ("verify",), ("result", "t")])
def test_a_command_that_cannot_use_the_event_log_says_so_in_one_line(
    settings: Settings, database: str, says: str, command: tuple[str, ...]
) -> None:
    base = settings.database_url.rsplit("/", 1)[0]
    url = (
        f"{base}/waystation_no_such_database"
        if database == "missing"
        else "postgresql+asyncpg://postgres@127.0.0.1:1/waystation"
    )
    done = run_cli(settings.model_copy(update={"database_url": url}), *command)
    assert done.returncode == 4, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("waystation: the event log cannot be used")
    assert says in line and "WAYSTATION_DATABASE_URL" in line
