"""What a newcomer meets when a URL, a setting or an agent's name is wrong, run as they run it:
the ``waystation`` command as a subprocess against the real services (issue 30, items 1 and 2).

Each failure ends in one line naming the setting or argument, with its documented exit code
and no traceback (the traceback only at ``--log-level debug``); a long-running process tries a
service that may come up again, one line per attempt, and stops on SIGTERM or SIGINT in every
phase; no output ever shows a URL's password.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from yarl import URL

from scripts.lab.harness.database import fresh_database_url
from scripts.lab.harness.processes import ROOT, worker_environment
from waystation import migrations
from waystation.cli.exits import EXIT_BROKER, EXIT_CONFIG, EXIT_NO_ROUTE, EXIT_STORE
from waystation.settings import Settings

from ..support import Services, eventually

WAYSTATION = str(Path(sys.executable).parent / "waystation")
PASSWORD = "sekret-pw"
REFUSED_BROKER = f"amqp://guest:{PASSWORD}@127.0.0.1:1/"
MALFORMED_BROKER = f"amqps//guest:{PASSWORD}@127.0.0.1:5672/"
REFUSED_DATABASE = f"postgresql://postgres:{PASSWORD}@127.0.0.1:1/waystation"


def environment(settings: Settings, **changes: str) -> dict[str, str]:
    """The environment of a command of this test: its settings, none of the caller's other
    ``WAYSTATION_*`` variables (the harness's own excepted), and ``changes``."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("WAYSTATION_") or name.startswith("WAYSTATION_TEST_")
    }
    env.update(
        worker_environment(
            settings,
            **{"WAYSTATION_BROKER_POLICY": "none", "WAYSTATION_LOG_FORMAT": "text", **changes},
        )
    )
    return env


def one_shot(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``waystation ARGS``; a command that hangs fails the test (the limit is generous)."""
    return subprocess.run(
        [WAYSTATION, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=90
    )


def failed_in_one_line(done: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """Assert ``done`` ended with ``code`` and one line on stderr holding ``words``; that line."""
    output = done.stdout + done.stderr
    assert done.returncode == code, (done.returncode, output)
    assert "Traceback" not in output
    assert PASSWORD not in output
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("waystation: ")
    for word in words:
        assert word in line, (word, line)
    return line


def password_url(url: str) -> str:
    return str(URL(url).with_password(PASSWORD))


async def worker_stopped_at_once(env: dict[str, str], code: int) -> str:
    """Run a worker in ``env``; assert it ended by itself with ``code``, without a traceback or
    the password; its last line (after the migrations' lines, if it got that far)."""
    done = await asyncio.to_thread(one_shot, env, "worker", "--app", "waystation.example:app")
    output = done.stdout + done.stderr
    assert done.returncode == code, output
    assert "Traceback" not in output and PASSWORD not in output
    return done.stderr.strip().splitlines()[-1]


def missing_database(settings: Settings) -> str:
    base = URL(settings.database_url.replace("+asyncpg", "")).with_password(PASSWORD)
    return str(base.with_path("/waystation_newcomer_missing"))


class Service:
    """A long-running ``waystation`` process at debug level, its output in a file."""

    def __init__(self, env: dict[str, str], log: Path, *args: str) -> None:
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [WAYSTATION, "--log-level", "debug", *args],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def shows(self, text: str) -> None:
        def seen() -> bool:
            if text in self.output():
                return True
            assert self.process.poll() is None, (
                f"exited {self.process.returncode}:\n{self.output()}"
            )
            return False

        await eventually(seen, 60, f"{text!r} in the output")

    async def exit_code(self) -> int:
        return await asyncio.to_thread(self.process.wait, 60)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


async def tried_again_then_stopped(
    env: dict[str, str], log: Path, *command: str, signum: int = signal.SIGTERM
) -> str:
    """The output of a service that met a failure which may pass, said it tries again, and
    stopped with exit code 0 on ``signum``, in that phase."""
    service = Service(env, log, *command)
    try:
        await service.shows("trying again")
        service.process.send_signal(signum)
        assert await service.exit_code() == 0, service.output()
    finally:
        service.kill()
    output = service.output()
    assert PASSWORD not in output
    return output


# ---- a long-running process -----------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_worker_whose_broker_refuses_connections_tries_again_and_stops_on_a_signal(
    settings: Settings, tmp_path: Path, signum: signal.Signals
) -> None:
    env = environment(settings, WAYSTATION_AMQP_URL=REFUSED_BROKER)
    output = await tried_again_then_stopped(
        env, tmp_path / "worker.log", "worker", "--app", "waystation.example:app", signum=signum
    )
    assert "the broker cannot be used" in output and "WAYSTATION_AMQP_URL" in output
    assert "amqp://guest:***@127.0.0.1:1/" in output
    assert "Traceback" in output  # at debug level, each attempt's traceback (redacted)


async def test_a_worker_whose_management_api_is_not_up_tries_again_and_stops_on_sigterm(
    settings: Settings, tmp_path: Path
) -> None:
    # compose applies the queue policy through RabbitMQ's management API, which may answer
    # after the broker does: a worker tries again in one line, as for the broker itself
    env = environment(
        settings,
        WAYSTATION_BROKER_POLICY="management",
        WAYSTATION_MANAGEMENT_URL=f"http://guest:{PASSWORD}@127.0.0.1:1/",
    )
    output = await tried_again_then_stopped(
        env, tmp_path / "worker.log", "worker", "--app", "waystation.example:app"
    )
    assert "the broker's queue policy cannot be applied" in output
    assert "WAYSTATION_MANAGEMENT_URL" in output and "http://127.0.0.1:1" in output


class SilentBroker:
    """A server that accepts connections and never answers (another service on the broker's
    port, a broker that hangs): a client waits in the AMQP handshake."""

    def __init__(self) -> None:
        self.accepted = asyncio.Event()
        self._held: list[asyncio.StreamWriter] = []

    async def _hold(self, _: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._held.append(writer)
        self.accepted.set()


@pytest_asyncio.fixture
async def silent_broker() -> AsyncIterator[tuple[SilentBroker, str]]:
    silent = SilentBroker()
    server = await asyncio.start_server(silent._hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield silent, f"amqp://guest:{PASSWORD}@127.0.0.1:{port}/"
    for writer in silent._held:
        writer.close()
    server.close()


async def test_a_worker_stuck_connecting_to_a_silent_broker_stops_on_sigterm(
    settings: Settings, tmp_path: Path, silent_broker: tuple[SilentBroker, str]
) -> None:
    silent, url = silent_broker
    env = environment(settings, WAYSTATION_AMQP_URL=url)
    worker = Service(env, tmp_path / "worker.log", "worker", "--app", "waystation.example:app")
    try:
        await worker.shows("connecting to the broker")
        await asyncio.wait_for(silent.accepted.wait(), 60)
        worker.process.send_signal(signal.SIGTERM)
        assert await worker.exit_code() == 0, worker.output()
    finally:
        worker.kill()
    assert PASSWORD not in worker.output()


async def test_a_one_shot_command_on_a_silent_broker_gives_up_in_one_line(
    settings: Settings, silent_broker: tuple[SilentBroker, str]
) -> None:
    env = environment(settings, WAYSTATION_AMQP_URL=silent_broker[1])
    done = await asyncio.to_thread(one_shot, env, "submit", "orchestrator")
    failed_in_one_line(done, EXIT_BROKER, "no answer within", "WAYSTATION_AMQP_URL")


@pytest.mark.parametrize(
    "command", [("worker", "--app", "waystation.example:app"), ("projections", "run")], ids=" ".join
)
async def test_a_service_whose_database_is_down_tries_again_and_stops_on_sigterm(
    settings: Settings, tmp_path: Path, command: tuple[str, ...]
) -> None:
    env = environment(settings, WAYSTATION_DATABASE_URL=REFUSED_DATABASE)
    output = await tried_again_then_stopped(env, tmp_path / "service.log", *command)
    assert "cannot reach PostgreSQL" in output and "WAYSTATION_DATABASE_URL" in output


async def test_a_worker_with_a_malformed_broker_url_stops_at_once_without_its_password(
    settings: Settings, tmp_path: Path
) -> None:
    env = environment(settings, WAYSTATION_AMQP_URL=MALFORMED_BROKER)
    worker = Service(env, tmp_path / "worker.log", "worker", "--app", "waystation.example:app")
    try:
        assert await worker.exit_code() == EXIT_CONFIG, worker.output()
    finally:
        worker.kill()
    output = worker.output()
    assert PASSWORD not in output
    assert "Traceback" not in output
    assert "WAYSTATION_AMQP_URL is not an AMQP URL" in output


async def test_a_worker_the_broker_refuses_to_log_in_stops_at_once_in_one_line(
    settings: Settings, tmp_path: Path
) -> None:
    env = environment(settings, WAYSTATION_AMQP_URL=password_url(settings.amqp_url))
    last = await worker_stopped_at_once(env, EXIT_BROKER)
    # logged as the worker's other lines are (JSON in a container), text here
    assert " ERROR waystation the broker cannot be used: it refused the login" in last
    assert "WAYSTATION_AMQP_URL" in last


# ---- one-shot commands ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command", [("status",), ("tasks",), ("projections", "status")], ids=" ".join
)
def test_a_one_shot_command_on_a_missing_database_says_how_to_create_it(
    settings: Settings, command: tuple[str, ...]
) -> None:
    env = environment(settings, WAYSTATION_DATABASE_URL=missing_database(settings))
    failed_in_one_line(
        one_shot(env, *command),
        EXIT_STORE,
        "does not exist",
        "WAYSTATION_DATABASE_URL",
        "waystation db upgrade",
        "postgres:***@",
    )


@pytest_asyncio.fixture
async def empty_database(services: Services) -> AsyncIterator[str]:
    """A database that exists, but was never migrated."""
    url = fresh_database_url(services.admin_database_url)
    await migrations.ensure_database(url)
    yield url
    await migrations.drop_database(url)


@pytest.mark.parametrize("command", [("status",), ("tasks",), ("history", "t")], ids=" ".join)
def test_a_one_shot_command_on_a_database_never_migrated_says_how_to_migrate_it(
    settings: Settings, empty_database: str, command: tuple[str, ...]
) -> None:
    env = environment(settings, WAYSTATION_DATABASE_URL=empty_database)
    failed_in_one_line(
        one_shot(env, *command), EXIT_STORE, "never migrated", "waystation db upgrade"
    )


@pytest.mark.parametrize("command", [("status",), ("history", "some-task")], ids=" ".join)
def test_a_one_shot_command_on_a_database_that_is_down_fails_in_one_line(
    settings: Settings, command: tuple[str, ...]
) -> None:
    env = environment(settings, WAYSTATION_DATABASE_URL=REFUSED_DATABASE)
    failed_in_one_line(
        one_shot(env, *command), EXIT_STORE, "Connection refused", "WAYSTATION_DATABASE_URL"
    )


def test_debug_level_adds_the_traceback_without_the_password(settings: Settings) -> None:
    env = environment(settings, WAYSTATION_DATABASE_URL=missing_database(settings))
    done = one_shot(env, "--log-level", "debug", "status")
    assert done.returncode == EXIT_STORE, done.stderr
    assert "Traceback" in done.stderr and "InvalidCatalogNameError" in done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("waystation: the event log cannot")


@pytest.mark.parametrize(
    ("url", "code", "says"),
    [
        ("refused", EXIT_BROKER, "Connection refused"),
        ("password", EXIT_BROKER, "refused the login"),
        ("vhost", EXIT_BROKER, "'waystation_no_such_vhost'"),
        ("malformed", EXIT_CONFIG, "WAYSTATION_AMQP_URL is not an AMQP URL"),
    ],
)
@pytest.mark.parametrize(
    "command", [("submit", "orchestrator"), ("dead-letters", "list")], ids=" ".join
)
def test_a_one_shot_command_whose_broker_cannot_be_used_fails_in_one_line(
    settings: Settings, url: str, code: int, says: str, command: tuple[str, ...]
) -> None:
    amqp_url = {
        "refused": REFUSED_BROKER,
        "password": password_url(settings.amqp_url),
        "vhost": str(URL(settings.amqp_url).with_path("/waystation_no_such_vhost")),
        "malformed": MALFORMED_BROKER,
    }[url]
    env = environment(settings, WAYSTATION_AMQP_URL=amqp_url)
    failed_in_one_line(one_shot(env, *command), code, says, "WAYSTATION_AMQP_URL")


@pytest.mark.parametrize("delay", [(), ("--delay", "2")], ids=["now", "delayed"])
def test_submit_to_an_agent_no_worker_serves_names_it_and_what_to_do(
    settings: Settings, delay: tuple[str, ...]
) -> None:
    # a delayed submit asks whether the queue exists before it publishes (the wait queue would
    # take the task and drop it later): the same line and code as the broker's NO_ROUTE
    done = one_shot(environment(settings), "submit", "orchestratr", '{"n": 1}', *delay)
    line = failed_in_one_line(
        done, EXIT_NO_ROUTE, "agent 'orchestratr'", "WAYSTATION_QUEUE_PREFIX", "waystation agents"
    )
    assert settings.queue_prefix in line


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("WAYSTATION_CONCURRENCY", "lots", "WAYSTATION_CONCURRENCY=lots: input should be"),
        ("WAYSTATION_CONCURENCY", "8", "did you mean WAYSTATION_CONCURRENCY?"),
        ("WAYSTATION_DATABASE_URL", f"mysql://root:{PASSWORD}@h/db", "WAYSTATION_DATABASE_URL"),
    ],
)
def test_a_bad_or_unknown_variable_is_named_in_one_line(
    settings: Settings, variable: str, value: str, says: str
) -> None:
    env = environment(settings, **{variable: value})
    failed_in_one_line(one_shot(env, "status"), EXIT_CONFIG, says)


async def test_a_worker_whose_database_role_does_not_exist_stops_at_once_in_one_line(
    settings: Settings,
) -> None:
    """A login PostgreSQL refuses cannot pass by itself: the worker does not try it again."""
    url = URL(settings.database_url.replace("+asyncpg", ""))
    env = environment(
        settings,
        WAYSTATION_DATABASE_URL=str(
            url.with_user("waystation_no_such_role").with_password(PASSWORD)
        ),
    )
    line = await worker_stopped_at_once(env, EXIT_STORE)
    assert "the event log cannot be used: PostgreSQL at" in line and "refused the login" in line
    assert "WAYSTATION_DATABASE_URL" in line and "waystation_no_such_role:***@" in line


@pytest_asyncio.fixture
async def role_without_createdb(services: Services) -> AsyncIterator[str]:
    """A role that may log in but not create a database."""
    name = f"waystation_newcomer_{os.getpid()}"
    admin = await asyncpg.connect(services.admin_database_url.replace("+asyncpg", ""))
    try:
        await admin.execute(f'DROP ROLE IF EXISTS "{name}"')
        await admin.execute(f'CREATE ROLE "{name}" LOGIN NOCREATEDB')
        yield name
    finally:
        await admin.execute(f'DROP ROLE IF EXISTS "{name}"')
        await admin.close()


async def test_a_worker_that_may_not_create_its_missing_database_stops_at_once(
    settings: Settings, role_without_createdb: str
) -> None:
    url = URL(missing_database(settings)).with_user(role_without_createdb)
    env = environment(settings, WAYSTATION_DATABASE_URL=str(url))
    line = await worker_stopped_at_once(env, EXIT_STORE)
    assert "does not allow it" in line and "right to create the database" in line
