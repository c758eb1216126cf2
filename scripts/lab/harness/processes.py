"""Processes of a run: worker subprocesses, the ``waystation`` command, and what they leave.

:class:`WorkerProcess` is one subprocess with an environment and a log file: a worker of an app
(``python -m waystation.cli worker --app APP``), another ``waystation`` command (``["projections",
"run"]``), or ``python -m MODULE ...`` of another module (the benchmark's Celery workers). Its
environment is whole: build a worker's from a :class:`~waystation.settings.Settings` with
:func:`worker_environment`, a script's process with a metrics port of its own with
:func:`run_environment`, or write the ``WAYSTATION_*`` variables out as the bench does.
Also: :func:`stop_all`, :func:`free_port`, :func:`run_tool` (a command whose failure is an
error), :func:`waystation_cli`, the ends of logs and the problems in them, and the counters a
worker writes to ``WAYSTATION_STATS_FILE`` when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

from waystation.events.codec import loads
from waystation.settings import Settings

ROOT = Path(__file__).resolve().parents[3]
"""The repository: the working directory of every process, and first on its PYTHONPATH."""


def worker_environment(settings: Settings, **overrides: str) -> dict[str, str]:
    """The ``WAYSTATION_*`` environment of a worker configured as ``settings`` (the fields the
    tests set), with ``overrides`` on top. Its metrics endpoint is off unless an override gives
    it a port: many workers run on one host here."""
    return {
        "WAYSTATION_DATABASE_URL": settings.database_url,
        "WAYSTATION_AMQP_URL": settings.amqp_url,
        "WAYSTATION_QUEUE_PREFIX": settings.queue_prefix,
        "WAYSTATION_BROKER_POLICY": settings.broker_policy,
        "WAYSTATION_OUTBOX_DELAY": str(settings.outbox_delay),
        "WAYSTATION_OUTBOX_POLL_INTERVAL": str(settings.outbox_poll_interval),
        "WAYSTATION_CONCURRENCY": str(settings.concurrency),
        "WAYSTATION_RESUME_IN_PLACE": str(settings.resume_in_place).lower(),
        "WAYSTATION_METRICS_PORT": "0",
        **overrides,
    }


def _with_root_on_path(environment: Mapping[str, str]) -> dict[str, str]:
    """``environment`` with the repository first on its PYTHONPATH (the scripts run from any
    directory; their packages live at the root)."""
    paths = [str(ROOT), *filter(None, [environment.get("PYTHONPATH")])]
    return {**environment, "PYTHONPATH": os.pathsep.join(paths)}


class WorkerProcess:
    """``python -m MODULE COMMAND...`` with ``env`` added to this process's environment, its
    output (stdout and stderr) appended to ``log_path``; named after that file.

    By default the worker of the example app (``waystation.cli worker --app
    waystation.example:app``); ``command`` gives another ``waystation`` command, ``module``
    another module (``celery``), ``cwd`` another working directory.
    """

    def __init__(
        self,
        env: Mapping[str, str],
        log_path: Path,
        *,
        app: str = "waystation.example:app",
        command: Sequence[str] | None = None,
        module: str = "waystation.cli",
        cwd: Path = ROOT,
    ) -> None:
        self.env = dict(env)
        self.log_path = log_path
        self.command = list(command) if command is not None else ["worker", "--app", app]
        self.module = module
        self.cwd = cwd
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @classmethod
    def with_settings(
        cls,
        settings: Settings,
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        app: str = "waystation.example:app",
        command: Sequence[str] | None = None,
    ) -> WorkerProcess:
        """A worker (or ``command``) configured as ``settings``, ``env`` on top."""
        return cls(worker_environment(settings, **(env or {})), log_path, app=app, command=command)

    @property
    def name(self) -> str:
        return self.log_path.stem

    def start(self) -> WorkerProcess:
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.command],
            env=_with_root_on_path({**os.environ, **self.env}),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.cwd,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            assert self.process is not None
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self._close_log()

    def terminate(self) -> None:
        """SIGTERM, without waiting (:meth:`wait` or :meth:`stop` wait)."""
        if self.alive():
            assert self.process is not None
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """Wait for the exit (SIGKILL after ``timeout``); the exit code."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)
        finally:
            self._close_log()

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM, then wait (SIGKILL after ``timeout``); the exit code."""
        self.terminate()
        return self.wait(timeout)

    async def wait_exit(self, timeout: float) -> int | None:
        """The exit code once the process exits by itself, or None after ``timeout`` seconds
        (it is left running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                return self.process.returncode
            await asyncio.sleep(0.05)
        return None

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


@contextlib.contextmanager
def app_workers(
    settings: Settings,
    app: str,
    log_dir: Path,
    env: Mapping[str, str] | None = None,
    count: int = 3,
) -> Iterator[list[WorkerProcess]]:
    """``count`` workers of ``app`` configured as ``settings`` (``env`` on top), not started,
    logging to ``log_dir/worker-<n>.log``; each is stopped (SIGTERM, then SIGKILL) at the end."""
    processes = [
        WorkerProcess.with_settings(settings, log_dir / f"worker-{n}.log", app=app, env=env)
        for n in range(count)
    ]
    try:
        yield processes
    finally:
        for process in processes:
            process.stop(timeout=15)


def stop_all(workers: Iterable[WorkerProcess], timeout: float = 30) -> dict[str, int | None]:
    """SIGTERM every worker at once, then wait for each; their exit codes by name."""
    workers = list(workers)
    for worker in workers:
        worker.terminate()
    deadline = time.monotonic() + timeout
    return {w.name: w.wait(max(0.1, deadline - time.monotonic())) for w in workers}


def free_port(host: str = "127.0.0.1", exclude: Iterable[int] = ()) -> int:
    """A TCP port nothing listens on right now (the system picks it: a bind to port 0), not one
    of ``exclude``. Free when asked, not reserved: whoever binds it next gets it."""
    taken = set(exclude)
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        if port not in taken:
            return port


async def run_tool(*args: str) -> str:
    """Run a command of this host; its output, or RuntimeError naming it with what it said."""
    process = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await process.communicate()
    except BaseException:
        # cancelled (Ctrl-C): the tool must not go on by itself, creating what nobody removes
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])}: {(err or out).decode().strip()}")
    return out.decode()


async def waystation_cli(
    arguments: Sequence[str], env: Mapping[str, str], timeout: float = 60
) -> tuple[int | None, str]:
    """Run the ``waystation`` command installed beside this Python (else ``python -m
    waystation.cli``) with ``env`` (WAYSTATION_* settings) added: (exit code, stdout and stderr)."""
    installed = Path(sys.executable).with_name("waystation")
    command = [str(installed)] if installed.exists() else [sys.executable, "-m", "waystation.cli"]
    process = await asyncio.create_subprocess_exec(
        *command,
        *arguments,
        env=_with_root_on_path({**os.environ, **env}),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout)
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise
    return process.returncode, output.decode(errors="replace")


# ---- logs ------------------------------------------------------------------------------------


def tail(path: Path | None, lines: int = 40) -> str:
    """The end of a process's log file, for assertion messages."""
    if path is None or not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def worker_logs(workers: Sequence[WorkerProcess], lines: int = 15) -> Callable[[], str]:
    """A function returning the end of every worker's log, for assertion messages."""

    def logs() -> str:
        return "\n".join(f"--- {w.log_path.name}:\n{tail(w.log_path, lines)}" for w in workers)

    return logs


def log_lines(workers: Sequence[WorkerProcess], needle: str) -> list[str]:
    """Every line of the workers' logs that contains ``needle``."""
    found: list[str] = []
    for worker in workers:
        if worker.log_path.exists():
            found.extend(
                line
                for line in worker.log_path.read_text(errors="replace").splitlines()
                if needle in line
            )
    return found


_PROBLEM = re.compile(
    rb' (WARNING|ERROR|CRITICAL) |"level": ?"(WARNING|ERROR|CRITICAL)"'
    rb"|Traceback \(most recent call last\)"
)
"""A problem line in a text log, or in a JSON-lines log (``WAYSTATION_LOG_FORMAT=json``)."""


def log_problems(paths: Iterable[Path], keep: int = 5) -> tuple[int, list[str]]:
    """How many WARNING/ERROR lines and tracebacks the logs hold, and the first few."""
    count, first = 0, list[str]()
    for path in paths:
        with contextlib.suppress(OSError), open(path, "rb") as log:
            for line in log:
                if _PROBLEM.search(line):
                    count += 1
                    if len(first) < keep:
                        first.append(f"{path.name}: {line.decode(errors='replace').rstrip()[:300]}")
    return count, first


# ---- what a worker serves and writes -----------------------------------------------------------


def metrics_env(port: int) -> dict[str, str]:
    """Environment that makes a worker serve ``/metrics`` and ``/healthz`` on 127.0.0.1:``port``."""
    return {"WAYSTATION_METRICS_PORT": str(port), "WAYSTATION_METRICS_HOST": "127.0.0.1"}


def run_environment(
    name: str,
    ports: dict[str, int],
    *,
    database_url: str,
    amqp_url: str,
    queue_prefix: str,
    **overrides: str,
) -> dict[str, str]:
    """The ``WAYSTATION_*`` environment of the process ``name`` of a script's run (the demo's,
    the chaos run's): the run's database, broker and queue prefix, a metrics port of its own (a
    free one that none in ``ports`` has, recorded there under ``name``) and text logs (readable
    when they are kept); ``overrides`` on top."""
    port = free_port(exclude=ports.values())
    ports[name] = port
    return {
        "WAYSTATION_DATABASE_URL": database_url,
        "WAYSTATION_AMQP_URL": amqp_url,
        "WAYSTATION_QUEUE_PREFIX": queue_prefix,
        **metrics_env(port),
        "WAYSTATION_LOG_FORMAT": "text",
        **overrides,
    }


def stats_env(path: Path) -> dict[str, str]:
    """Environment that makes a worker write its counters to ``path`` when it stops."""
    return {"WAYSTATION_STATS_FILE": str(path)}


def stats_counters(paths: Iterable[Path]) -> Counter[str]:
    """The counters written to these stats files, summed; a file that is missing or unreadable
    (its worker was killed, or is still writing it) counts nothing."""
    total: Counter[str] = Counter()
    for path in paths:
        with contextlib.suppress(OSError, ValueError, KeyError):
            total.update(loads(path.read_bytes())["counters"])
    return total


def worker_counters(workers: Sequence[WorkerProcess]) -> Counter[str]:
    """The counters the (stopped) workers wrote to their ``WAYSTATION_STATS_FILE``, summed."""
    return stats_counters(
        Path(w.env["WAYSTATION_STATS_FILE"]) for w in workers if "WAYSTATION_STATS_FILE" in w.env
    )
