"""What ``pip install waystation`` puts on a machine: one top-level name, ``waystation``, whose
import loads no broker or database driver, and nothing of the repository under its old names."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import waystation

ROOT = Path(__file__).resolve().parents[2]
DRIVERS = ("aio_pika", "aiormq", "pamqp", "sqlalchemy", "asyncpg", "alembic")
OLD_NAMES = ("workers", "events", "projections", "migrations")


def test_importing_waystation_loads_no_broker_or_database_driver() -> None:
    code = (
        "import sys, waystation, waystation.events\n"
        "from waystation import App, Call, Complete, Pause, Settings\n"
        f"print(','.join(sorted(m for m in {DRIVERS!r} if m in sys.modules)))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    ).stdout.strip()
    assert loaded == "", f"import waystation loaded {loaded}"


def test_the_client_and_the_worker_load_when_first_named() -> None:
    code = (
        "import sys, waystation\n"
        "before = 'aio_pika' in sys.modules\n"
        "client, worker = waystation.Client, waystation.Worker\n"
        "print(before, 'aio_pika' in sys.modules, client.__module__, worker.__module__)\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    ).stdout.split()
    assert shown == ["False", "True", "waystation.client", "waystation.runtime.worker"]
    with pytest.raises(AttributeError, match="no attribute 'Clients'"):
        _ = waystation.Clients  # type: ignore[attr-defined]


def test_no_module_of_waystation_is_loaded_under_an_old_top_level_name() -> None:
    """Every module of the package imports; none of them reaches ``workers``, ``events``,
    ``projections`` or ``migrations`` as top-level names (which, run from the repository, would
    load the same files a second time as other modules)."""
    code = (
        "import importlib, pkgutil, sys\n"
        "skip = ('waystation.migrations.env', 'waystation.migrations.versions.')\n"
        "names = []\n"
        # (an editable install maps the sub-packages from other folders: walk each one)
        "for root in ('waystation', 'waystation.events', 'waystation.projections'):\n"
        "    package = importlib.import_module(root)\n"
        "    names += [i.name for i in pkgutil.walk_packages(package.__path__, root + '.')]\n"
        "assert len(names) > 40, names\n"
        "for name in names:\n"
        "    if name.startswith(skip) or name == 'waystation.cli.__main__':\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as error:\n"  # an optional extra's adapter (penguiflow, otel)
        "        if getattr(error, 'name', '') and error.name.split('.')[0] in "
        "('penguiflow', 'opentelemetry'):\n"
        "            continue\n"
        "        raise\n"
        f"print(','.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({OLD_NAMES!r}))))\n"
    )
    # run from the repository's root, where the old names would be importable from the folders
    shown = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.strip()
    assert shown == ""


def _imported_modules(source: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(), filename=str(source))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_scripts_import_nothing_from_the_tests() -> None:
    """The scripts and the tests share ``scripts/lab``; the dependency runs one way only."""
    sources = sorted((ROOT / "scripts").rglob("*.py"))
    assert len(sources) > 20, sources
    reaching = {
        str(source.relative_to(ROOT)): sorted(
            name for name in _imported_modules(source) if name.split(".")[0] == "tests"
        )
        for source in sources
    }
    assert {path: names for path, names in reaching.items() if names} == {}


def test_the_import_walker_sees_an_import_from_the_tests(tmp_path: Path) -> None:
    source = tmp_path / "script.py"
    source.write_text("import os\nfrom tests.harness import broker\nfrom . import sibling\n")
    assert _imported_modules(source) == {"os", "tests.harness"}


@pytest.mark.slow
def test_a_wheel_of_the_checkout_installs_only_waystation_at_top_level(tmp_path: Path) -> None:
    # built from a copy: a build writes its own files next to the sources
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--disable-pip-version-check",
            "--wheel-dir",
            str(tmp_path),
            str(source),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("waystation-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"waystation"}
    for expected in (
        "waystation/__init__.py",
        "waystation/cli/__main__.py",
        "waystation/events/__init__.py",
        "waystation/projections/__init__.py",
        "waystation/migrations/env.py",
        "waystation/migrations/script.py.mako",
    ):
        assert expected in names, expected
    assert any(n.startswith("waystation/migrations/versions/0") for n in names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "waystation = waystation.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


LONG_MODULE = 420
"""Lines past which a module of the package says in its docstring why it stays one module."""


def test_every_long_module_says_why_it_is_one() -> None:
    sources = [
        path
        for folder in ("workers", "events", "projections")
        for path in sorted((ROOT / folder).rglob("*.py"))
    ]
    assert len(sources) > 60, sources
    unexplained = []
    for source in sources:
        text = source.read_text()
        if text.count("\n") <= LONG_MODULE:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if "Why one module" not in docstring and "Over 400 lines" not in docstring:
            unexplained.append(str(source.relative_to(ROOT)))
    assert unexplained == []
