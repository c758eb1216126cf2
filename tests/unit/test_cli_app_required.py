"""``worker``, ``agents`` and ``schema`` serve the app they are given and no other: without
``--app`` or ``WAYSTATION_APP`` they stop with a usage error saying how to name one, before
connecting to anything."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from waystation.cli import main


@pytest.mark.parametrize("command", [["worker"], ["agents"], ["schema", "orchestrator"]])
def test_without_an_app_the_command_says_how_to_name_one(
    command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WAYSTATION_APP", raising=False)
    answer = CliRunner().invoke(main, command)
    assert answer.exit_code == 2, answer.output
    assert "--app module:attribute, or WAYSTATION_APP" in answer.output
    assert "--app waystation.example:app" in answer.output


def test_the_app_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WAYSTATION_APP", "waystation.example:app")
    listed = CliRunner().invoke(main, ["agents", "--json"])
    assert listed.exit_code == 0, listed.output
    assert '"agent":"orchestrator"' in listed.output
    described = CliRunner().invoke(main, ["schema", "orchestrator"])
    assert described.exit_code == 0, described.output
    assert '"agent":"orchestrator"' in described.output
