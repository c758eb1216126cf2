"""The bench's setup and cleanup: :class:`Bench`, what a run holds (its options, URLs, logs,
every worker it started, the databases and queue prefixes still to remove, Celery's side), a
fresh migrated database and queue prefix per run (:meth:`Bench.fresh`), the machine it runs on,
and the cleanup whatever stops the run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from scripts.lab.harness.broker import delete_topology
from scripts.lab.harness.database import with_database
from scripts.lab.harness.processes import ROOT, WorkerProcess, stop_all
from waystation import migrations
from waystation.example import app as example_app
from waystation.settings import Settings

from . import server_versions, system_busy_seconds
from .drive import BenchFailure

AGENTS = tuple(example_app.agents)


class Bench:
    """What a bench run holds; each mode and session adds to it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        base = Settings()
        self.amqp_url = base.amqp_url
        self.admin_url = base.database_url
        self.logs = ROOT / Path(args.json).parent / "logs"
        self.scratch = Path(tempfile.mkdtemp(prefix="waystation-bench-"))
        self.next_n = 0
        self.all_workers: list[WorkerProcess] = []
        self.cleanups: list[tuple[str, str]] = []
        """(database URL, queue prefix) of each run, for the cleanup."""
        self.stopping = False
        self.celery: Any = None
        """The :class:`_bench.celery_job.CelerySide` with ``--compare celery``."""

    def interrupt(self) -> None:
        """On SIGINT/SIGTERM: submit nothing more, and SIGTERM the workers now."""
        self.stopping = True
        for worker in self.all_workers:
            worker.terminate()
        if self.celery is not None:
            self.celery.interrupt()

    async def machine(self) -> dict[str, Any]:
        """What the figures were measured on: CPUs, Python, the servers' versions, the load."""
        versions = await server_versions(self.admin_url, self.amqp_url)
        return {
            "nproc": os.cpu_count(),
            "cpu": _cpu_model(),
            "python": platform.python_version(),
            "uvloop": _has_uvloop(),
            "postgresql": versions["postgresql"],
            "rabbitmq": versions["rabbitmq"],
            "loadavg_at_start": list(os.getloadavg()),
        }

    async def start_celery(self) -> dict[str, Any]:
        """Celery's side (``--compare celery``): its workers, Redis and vhost; what it started."""
        a = self.args
        try:
            from .celery_job import CelerySide
        except ImportError as error:
            raise BenchFailure(
                f"--compare celery needs the bench extra ({error}); scripts/bench installs it"
            ) from None
        self.celery = CelerySide(
            amqp_url=self.amqp_url,
            k=a.k,
            work_ms=a.work_ms,
            workers=a.workers,
            pool=a.celery_pool,
            threads=a.celery_threads,
            prefetch=a.celery_prefetch,
            queue_type=a.celery_queue_type,
            timeout=a.timeout,
            logs=self.logs,
            stopping=lambda: self.stopping,
        )
        started: dict[str, Any] = await self.celery.start()
        return started

    async def fresh(self, what: str) -> tuple[str, str, float]:
        """A migrated database and a queue prefix of their own (removed by :meth:`cleanup_run`),
        and how busy the machine was with other work before starting."""
        tag = uuid.uuid4().hex[:10]
        database_url = with_database(self.admin_url, f"waystation_bench_{tag}")
        prefix = f"bench-{tag}."
        self.cleanups.append((database_url, prefix))
        await migrations.upgrade(database_url)
        other_load = await _busy_cores(1.0)
        print(
            f"{what}: database waystation_bench_{tag}, prefix {prefix}; machine busy with "
            f"other work: {other_load:.2f} cores",
            flush=True,
        )
        if other_load > 0.25:
            print(
                f"{what}: WARNING: other processes use {other_load:.2f} of "
                f"{os.cpu_count()} cores; these figures are not comparable",
                flush=True,
            )
        return database_url, prefix, other_load

    async def cleanup_run(self, database_url: str, prefix: str) -> None:
        errors = []
        try:
            await delete_topology(self.amqp_url, prefix, AGENTS)
        except Exception as error:
            errors.append(f"deleting queues of {prefix}: {error}")
        try:
            await migrations.drop_database(database_url)
        except Exception as error:
            errors.append(f"dropping {database_url.rsplit('/', 1)[1]}: {error}")
        with contextlib.suppress(ValueError):
            self.cleanups.remove((database_url, prefix))
        if errors:
            raise RuntimeError("; ".join(errors))

    async def cleanup(self) -> None:
        """Whatever is left after an error or Ctrl-C: workers, queues, databases, Celery's
        workers, Redis and vhost."""
        leftover = [w for w in self.all_workers if w.alive()]
        if leftover:
            stop_all(leftover, timeout=15)
        if self.celery is not None:
            try:
                await self.celery.cleanup()
            except Exception as error:
                print(f"cleanup: celery: {error}", file=sys.stderr)
        for database_url, prefix in list(self.cleanups):
            try:
                await self.cleanup_run(database_url, prefix)
            except Exception as error:
                print(f"cleanup: {error}", file=sys.stderr)
        with contextlib.suppress(OSError):
            for path in self.scratch.iterdir():
                path.unlink()
            self.scratch.rmdir()


async def _busy_cores(seconds: float) -> float:
    """Cores the machine kept busy over ``seconds`` while the bench itself was idle."""
    before = system_busy_seconds()
    await asyncio.sleep(seconds)
    return (system_busy_seconds() - before) / seconds


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
