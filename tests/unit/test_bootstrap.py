"""``scripts/bootstrap`` installs what it is asked for: ``demo`` the package alone, ``test`` (the
default) the dev extra, and a test install satisfies the demo. Run on a copy of the script with a
``.venv/bin/python`` that only records what pip is asked to install."""

from __future__ import annotations

import hashlib
import shutil
import stat
import subprocess
from pathlib import Path

from ..documents import ROOT

STAMP = ".venv/.waystation-installed"


def _checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap", tmp_path / "scripts" / "bootstrap")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "pip.log"}\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def _hash(checkout: Path) -> str:
    return hashlib.sha256((checkout / "pyproject.toml").read_bytes()).hexdigest()


def _bootstrap(checkout: Path, *profile: str) -> tuple[int, list[str]]:
    """(exit code, what pip was asked to install, ``-e`` targets)."""
    (checkout / "pip.log").unlink(missing_ok=True)
    run = subprocess.run(
        [str(checkout / "scripts" / "bootstrap"), *profile],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in run.stderr
    log = checkout / "pip.log"
    calls = log.read_text().splitlines() if log.exists() else []
    return run.returncode, [c.split(" -e ")[1] for c in calls if " -e " in c]


def test_the_demo_installs_the_package_alone_and_the_tests_the_dev_extra(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path)
    assert _bootstrap(checkout, "demo") == (0, ["."])
    assert (checkout / STAMP).read_text().split() == ["demo", _hash(checkout)]
    assert _bootstrap(checkout, "demo") == (0, [])  # up to date
    assert _bootstrap(checkout) == (0, [".[dev]"])  # the default is test
    assert (checkout / STAMP).read_text().split() == ["test", _hash(checkout)]


def test_a_test_install_satisfies_the_demo_until_pyproject_changes(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path)
    assert _bootstrap(checkout, "test") == (0, [".[dev]"])
    assert _bootstrap(checkout, "demo") == (0, [])
    assert _bootstrap(checkout, "test") == (0, [])
    with open(checkout / "pyproject.toml", "a") as pyproject:
        pyproject.write("# changed\n")
    assert _bootstrap(checkout, "demo") == (0, ["."])


def test_an_unknown_purpose_is_a_usage_error(tmp_path: Path) -> None:
    run = subprocess.run(
        [str(_checkout(tmp_path) / "scripts" / "bootstrap"), "everything"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "usage: scripts/bootstrap [demo|test]" in run.stderr
