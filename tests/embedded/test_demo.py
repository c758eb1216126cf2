"""The demo runs anywhere: ``scripts/demo --embedded`` without RabbitMQ or PostgreSQL, and
``scripts/demo`` falls back to it, saying so in one line, when the configured services cannot be
reached. Both as a newcomer runs them: as commands, in a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from ..documents import ROOT

TIMEOUT = 100
"""The embedded demo takes about 7 s here; a run that hangs fails instead of stalling."""


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _passed(run: subprocess.CompletedProcess[str]) -> str:
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "demo: everything held" in run.stdout
    assert "result                        PASSED" in run.stdout
    return output


def test_the_embedded_demo_passes_and_says_what_it_simulates() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--embedded"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
    )
    output = _passed(run)
    assert "in-memory broker and log standing in for RabbitMQ and PostgreSQL" in output
    # the same story: several workers, a kill mid-run whose paused tasks the others finish
    assert "3 workers consuming" in output
    assert "killed worker-2 mid-run, holding" in output
    assert "ok    killed -> replaced            worker-2 -> worker-4" in output
    assert "ok   verify_stream (what waystation verify runs) on every stream" in output
    assert "cannot reach" not in output


def test_the_demo_runs_embedded_when_the_services_cannot_be_reached() -> None:
    """Through the command itself (``scripts/demo``: bootstrap, services, the demo), with
    the URLs pointing at closed ports."""
    amqp, database = _closed_port(), _closed_port()
    environment = {
        **os.environ,
        "WAYSTATION_AMQP_URL": f"amqp://guest:guest@127.0.0.1:{amqp}/",
        "WAYSTATION_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{database}/waystation",
    }
    run = subprocess.run(
        [str(ROOT / "scripts" / "demo")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env=environment,
    )
    _passed(run)
    first = run.stdout.splitlines()[0]
    assert first == (
        f"demo: cannot reach RabbitMQ at 127.0.0.1:{amqp} or PostgreSQL at 127.0.0.1:{database}; "
        "running the embedded demo instead (one process, in-memory broker and log)"
    )
    assert "Waystation demo, embedded:" in run.stdout


def test_settings_the_demo_cannot_use_are_named_without_a_traceback() -> None:
    environment = {**os.environ, "WAYSTATION_DATABASE_URL": "mysql://root@127.0.0.1/shop"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env=environment,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    assert run.stderr.startswith("demo: WAYSTATION_DATABASE_URL: ")
    assert "is not a PostgreSQL URL" in run.stderr
