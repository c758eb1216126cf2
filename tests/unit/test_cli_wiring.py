"""``waystation.cli.wiring``: what every command builds the same way."""

from __future__ import annotations

import importlib

import pytest

from waystation.cli.wiring import run


async def _import_a_missing_module() -> None:
    importlib.import_module("waystation_no_such_module")


def test_a_command_that_fails_to_import_reports_that_error() -> None:
    # the event loop falls back to asyncio only when uvloop itself is missing, not when the
    # command's own code raises ImportError
    with pytest.raises(ModuleNotFoundError, match="waystation_no_such_module"):
        run(_import_a_missing_module())


def test_run_returns_what_the_command_returns() -> None:
    async def answer() -> int:
        return 42

    assert run(answer()) == 42
