"""The settings take the database URLs people have (``postgresql://``, ``postgres://``) and map
them to the asyncpg driver; a URL naming another driver or database is refused, saying what to
write, and never with its password; ``waystation --version`` answers."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from waystation.cli import main
from waystation.settings import Settings, asyncpg_url


@pytest.mark.parametrize(
    ("given", "used"),
    [
        ("postgresql://me@db.example:5433/log", "postgresql+asyncpg://me@db.example:5433/log"),
        ("postgres://me:pw@db/log?ssl=require", "postgresql+asyncpg://me:pw@db/log?ssl=require"),
        ("postgresql+asyncpg://me@db/log", "postgresql+asyncpg://me@db/log"),
    ],
)
def test_plain_postgresql_urls_are_mapped_to_asyncpg(given: str, used: str) -> None:
    assert asyncpg_url(given) == used
    assert Settings(database_url=given).database_url == used


def test_the_environment_variable_takes_the_plain_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WAYSTATION_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
    assert Settings().database_url == "postgresql+asyncpg://postgres@127.0.0.1:5432/test"


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("postgresql+psycopg://me:hunter2@db/log", "names the driver 'psycopg'"),
        ("postgresql+psycopg2://me:hunter2@db/log", "names the driver 'psycopg2'"),
        ("mysql://me:hunter2@db/log", "is not a PostgreSQL URL"),
        ("hunter2-not-a-url", "is not a database URL"),
    ],
)
def test_other_urls_are_refused_saying_what_to_write_without_the_password(
    given: str, says: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(database_url=given)
    message = str(refused.value)
    assert says in message and "database_url" in message
    assert "postgresql://" in message
    assert "hunter2" not in message


def test_version_prints_the_installed_distribution_version() -> None:
    answer = CliRunner().invoke(main, ["--version"])
    assert answer.exit_code == 0
    assert answer.output == f"waystation {version('waystation')}\n"
