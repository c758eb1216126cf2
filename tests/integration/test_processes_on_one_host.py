"""Several processes on one host, as the README runs them: with WAYSTATION_METRICS_PORT unset each
``waystation worker`` and ``projections run`` takes the first free port from 9464 and logs it,
so that two workers and a runner all run and each serves /metrics on its own port. A port that is
set explicitly and taken is a one-line error naming the setting, and exit status 1.

(It used to be 9464 for all, and the second process exited: the port was taken.)
"""

from __future__ import annotations

import socket
from pathlib import Path

import aiohttp
import orjson
import pytest

from scripts.lab.harness.processes import WorkerProcess, stop_all, worker_environment
from waystation.observability.metrics import DEFAULT_PORTS
from waystation.settings import Settings

from ..support import eventually, start_example_workers

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def default_environment(settings: Settings) -> dict[str, str]:
    """A process's environment as the README's has it: no metrics port set."""
    environment = worker_environment(settings)
    del environment["WAYSTATION_METRICS_PORT"]
    return environment


def metrics_port(log_path: Path) -> int | None:
    """The port the process logged it serves /metrics on (its JSON log), if it did yet."""
    for line in log_path.read_bytes().splitlines():
        if line.startswith(b"{"):
            port = orjson.loads(line).get("metrics_port")
            if port is not None:
                return int(port)
    return None


async def scrape(port: int, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}") as response,
    ):
        return response.status, await response.text()


@pytest.mark.timeout(180)
async def test_two_workers_and_a_projection_runner_with_default_settings_all_serve_metrics(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WAYSTATION_METRICS_PORT", raising=False)
    environment = default_environment(settings)
    workers = [WorkerProcess(environment, tmp_path / f"worker-{i}.log") for i in range(2)]
    runner = WorkerProcess(environment, tmp_path / "runner.log", command=["projections", "run"])
    processes = [*workers, runner]
    try:
        runner.start()
        await start_example_workers(settings, workers)

        def all_logged_a_port() -> bool:
            assert all(p.alive() for p in processes), "a process exited"
            return all(metrics_port(p.log_path) is not None for p in processes)

        await eventually(all_logged_a_port, 60, "every process to log its metrics port")
        ports = [metrics_port(p.log_path) for p in processes]
        assert len(set(ports)) == 3, ports
        assert all(port in DEFAULT_PORTS for port in ports if port is not None), ports
        for process, port in zip(processes, ports, strict=True):
            assert port is not None
            status, text = await scrape(port, "/metrics")
            assert status == 200, (process.name, text)
            assert "waystation_healthy" in text, process.name

            async def healthy(port: int = port) -> bool:
                status, body = await scrape(port, "/healthz")
                return status == 200 and orjson.loads(body)["status"] == "ok"

            await eventually(healthy, 60, f"{process.name} healthy on :{port}")
        assert all(p.alive() for p in processes)
    finally:
        codes = stop_all(processes)
    assert codes == {p.name: 0 for p in processes}, codes
    for process in processes:
        log = process.log_path.read_text()
        assert "Traceback" not in log, log
        assert "the first free port from 9464: WAYSTATION_METRICS_PORT is unset" in log, log


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["worker"], ["projections", "run"]], ids=" ".join)
async def test_a_metrics_port_set_and_taken_is_a_one_line_error_and_exit_status_1(
    command: list[str], settings: Settings, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        environment = {
            **worker_environment(settings),
            "WAYSTATION_METRICS_PORT": str(port),
            "WAYSTATION_METRICS_HOST": "127.0.0.1",
        }
        if command == ["worker"]:
            command = ["worker", "--app", "waystation.example:app"]
        process = WorkerProcess(environment, tmp_path / "process.log", command=command).start()
        code = await process.wait_exit(90)
        process.stop()
    log = process.log_path.read_text()
    assert code == 1, log
    assert "Traceback" not in log, log
    [line] = [line for line in log.splitlines() if "cannot serve metrics" in line]
    message = orjson.loads(line)["message"]
    assert message.startswith(f"cannot serve metrics on 127.0.0.1:{port} ("), message
    assert f"WAYSTATION_METRICS_PORT={port}" in message, message
    assert "leave it unset to take the first free one from 9464" in message, message
