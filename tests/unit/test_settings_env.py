"""The ``WAYSTATION_*`` variables as the command reads them: an invalid value names its variable,
an unknown name is an error with the name it most resembles, a URL is never printed with its
password, and every exit code is documented (issue 30, items 1 and 2)."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from aiormq.exceptions import ProbableAuthenticationError
from asyncpg.exceptions import (
    CannotConnectNowError,
    InvalidCatalogNameError,
    InvalidPasswordError,
    TooManyConnectionsError,
)
from click.testing import CliRunner
from sqlalchemy.exc import DBAPIError

from waystation.brokers.port import BrokerUnavailable
from waystation.cli import main
from waystation.cli.exits import EXIT_CODES, EXIT_CONFIG, explain
from waystation.cli.wiring import _command_line_variables
from waystation.observability.logs import (
    JsonFormatter,
    TextFormatter,
    redact,
    redact_url,
    redacting_excepthook,
)
from waystation.settings import Settings, unknown_variables, variable_of

ROOT = Path(__file__).resolve().parents[2]


def invoke(*args: str, **env: str) -> tuple[int, str]:
    """``waystation ARGS`` in this process, with ``env`` added to the environment."""
    done = CliRunner().invoke(main, list(args), env=env)
    assert done.exception is None or isinstance(done.exception, SystemExit), done.exc_info
    return done.exit_code, done.output


def test_a_misspelled_variable_is_an_error_that_suggests_the_setting() -> None:
    code, output = invoke("status", WAYSTATION_CONCURENCY="8")
    assert code == EXIT_CONFIG
    assert "WAYSTATION_CONCURENCY is not a setting; did you mean WAYSTATION_CONCURRENCY?" in output
    assert "Traceback" not in output


def test_an_unknown_variable_like_nothing_known_is_named_without_a_guess() -> None:
    # (compared with the shared prefix, any two names would look alike: X "resembled" APP)
    found = unknown_variables({"WAYSTATION_X": "1", "HOME": "/root"}, {"WAYSTATION_APP"})
    assert found == [("WAYSTATION_X", None)]
    assert unknown_variables({"WAYSTATION_LOGLEVEL": "1"}, {"WAYSTATION_LOG_LEVEL"}) == [
        ("WAYSTATION_LOGLEVEL", "WAYSTATION_LOG_LEVEL")
    ]


def test_an_invalid_value_names_the_variable_not_the_field() -> None:
    code, output = invoke("status", WAYSTATION_CONCURRENCY="0")
    assert code == EXIT_CONFIG
    [line] = output.strip().splitlines()
    assert line.startswith("waystation: WAYSTATION_CONCURRENCY=0: ")
    assert "greater than or equal to 1" in line
    assert "Traceback" not in output


def test_an_invalid_option_names_the_option() -> None:
    code, output = invoke("worker", "--app", "waystation.example:app", "--concurrency", "0")
    assert code == EXIT_CONFIG
    assert "waystation: --concurrency=0: " in output


@pytest.mark.parametrize(
    "url", ["amqps//guest:sekret@127.0.0.1:5672/", "http://guest:sekret@host/", "amqp:///vhost"]
)
def test_a_malformed_amqp_url_is_refused_at_once_without_its_password(url: str) -> None:
    code, output = invoke("submit", "orchestrator", WAYSTATION_AMQP_URL=url)
    assert code == EXIT_CONFIG
    assert "WAYSTATION_AMQP_URL" in output
    assert "sekret" not in output


def test_the_variables_the_options_read_and_the_harness_s_are_known() -> None:
    code, output = invoke(
        "status",
        "--help",
        WAYSTATION_APP="waystation.example:app",
        WAYSTATION_LOG_LEVEL="info",
        WAYSTATION_LOG_FORMAT="text",
        WAYSTATION_TEST_ANYTHING="1",
        WAYSTATION_SIM_SEEDS="10",
    )
    assert code == 0, output
    found = unknown_variables(
        {"WAYSTATION_APP": "x", "WAYSTATION_TEST_DATABASE_URL": "x", "WAYSTATION_SIM_SEEDS": "1"},
        {"WAYSTATION_APP"},
    )
    assert found == []


_READ = re.compile(
    r"""(?:environ(?:\.get)?[\[(]|getenv\(|envvar=|^\s*-?\s*)["']?(WAYSTATION_[A-Z0-9_]+)""",
    re.MULTILINE,
)


def test_every_variable_the_project_reads_is_known() -> None:
    """What the code, the scripts, the tests and compose read (os.environ, click's envvar,
    compose's environment lists): none of them may be refused as unknown."""
    read: set[str] = set()
    for folder in ("workers", "events", "projections", "migrations", "scripts", "tests", "compose"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".yml", ".yaml", ".env"} and path.is_file():
                read.update(_READ.findall(path.read_text(errors="replace")))
    read |= {name for name in re.findall(r"WAYSTATION_[A-Z0-9_]+", _constants()) if name}
    assert "WAYSTATION_CONCURRENCY" in read and "WAYSTATION_SIM_SEEDS" in read  # (it looked)
    known = {variable_of(field) for field in Settings.model_fields}
    with main.make_context("waystation", ["status"]):
        known |= _command_line_variables()
    assert unknown_variables(dict.fromkeys(read, "1"), known) == []


def _constants() -> str:
    """Variable names kept in constants (``TEST_SPANS_FILE = "WAYSTATION_TEST_SPANS_FILE"``)."""
    path = ROOT / "workers" / "observability" / "tracing" / "provider.py"
    return path.read_text()


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("amqp://guest:sekret@127.0.0.1:1/", "amqp://guest:***@127.0.0.1:1/"),
        ("amqps//guest:sekret@host:5672/", "amqps//guest:***@host:5672/"),
        ("failed postgresql+asyncpg://u:s:e@h/db.", "failed postgresql+asyncpg://u:***@h/db."),
        ("URL('amqp://guest:sekret@h/')", "URL('amqp://guest:***@h/')"),
        ("amqp://guest@host/", "amqp://guest@host/"),
        ("mail me at a@b", "mail me at a@b"),
    ],
)
def test_a_url_is_shown_without_its_password(text: str, shown: str) -> None:
    assert redact(text) == shown
    assert redact_url(text) == shown


@pytest.mark.parametrize("formatter", [JsonFormatter(), TextFormatter()])
def test_no_log_line_carries_a_password_not_even_in_its_traceback(
    formatter: logging.Formatter,
) -> None:
    try:
        raise ConnectionError("cannot connect to amqp://guest:sekret@127.0.0.1:1/")
    except ConnectionError:
        record = logging.LogRecord(
            "aio_pika", logging.ERROR, __file__, 1, "retrying %s", ("amqp://u:sekret@h/",), None
        )
        record.exc_info = sys.exc_info()
    line = formatter.format(record)
    assert "sekret" not in line
    assert "guest:***@" in line and "u:***@" in line


def test_an_uncaught_exception_is_printed_without_a_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    error = _raised(RuntimeError("cannot use amqp://guest:sekret@host/"))
    redacting_excepthook(type(error), error, error.__traceback__)
    printed = capsys.readouterr().err
    assert "Traceback" in printed and "RuntimeError" in printed
    assert "sekret" not in printed and "amqp://guest:***@host/" in printed


def test_every_exit_code_is_in_the_help_and_the_troubleshooting_guide() -> None:
    code, shown = invoke("--help")
    assert code == 0
    guide = (ROOT / "docs" / "troubleshooting.md").read_text()
    for exit_code, meaning in EXIT_CODES.items():
        assert f"{exit_code}  {meaning}" in shown
        assert f"| {exit_code} | {meaning} |" in guide, f"exit code {exit_code} in the guide"


def _raised(
    error: BaseException, wrap: Callable[[BaseException], Exception] | None = None
) -> BaseException:
    """``error`` as a library raises it: with its traceback, wrapped by ``wrap`` when given."""
    try:
        try:
            raise error
        except BaseException as inner:
            if wrap is None:
                raise
            raise wrap(inner) from inner
    except BaseException as raised:
        return raised


def _settings() -> Settings:
    return Settings(
        database_url=f"postgresql://postgres:{SECRET}@db:5432/w",
        amqp_url=f"amqp://guest:{SECRET}@mq:5672/",
    )


SECRET = "sekret-pw"


@pytest.mark.parametrize(
    ("error", "code", "transient", "says"),
    [
        (CannotConnectNowError("the database system is starting up"), 4, True, "starting up"),
        (TooManyConnectionsError("sorry, too many clients already"), 4, True, "too many"),
        (InvalidPasswordError("password authentication failed"), 4, False, "refused the login"),
        (InvalidCatalogNameError('database "w" does not exist'), 4, False, "db upgrade"),
        (ProbableAuthenticationError("ACCESS_REFUSED - Login was refused"), 5, False, "login"),
        (ConnectionRefusedError(111, "Connection refused"), 5, True, "cannot reach it"),
    ],
)
def test_a_failure_is_told_with_its_code_and_whether_a_worker_tries_again(
    error: Exception, code: int, transient: bool, says: str
) -> None:
    """The failures a starting worker meets, as the drivers raise them (wrapped by SQLAlchemy,
    by the broker port): a server starting up is tried again, a wrong password is not."""
    if isinstance(error, ConnectionRefusedError):
        raised = _raised(_raised(error), lambda inner: BrokerUnavailable(str(inner)))
    elif type(error).__module__.startswith("asyncpg"):
        raised = _raised(error, lambda inner: DBAPIError("connect", None, inner))
    else:
        raised = _raised(error)
    failure = explain(raised, _settings())
    assert failure is not None
    assert (failure.exit_code, failure.transient) == (code, transient)
    assert says in failure.message and SECRET not in failure.message


def test_an_error_no_user_can_cause_is_not_explained_away() -> None:
    assert explain(_raised(ValueError("a bug")), _settings()) is None
