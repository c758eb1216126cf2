"""What only the benchmark measures, for scripts/bench.py (not part of the library), and its
phases: :mod:`.setup` (the run's state, fresh databases and prefixes, the machine, Celery's side,
the cleanup), :mod:`.session` (one worker session and its figures), :mod:`.drive` (the drivers
that keep parents in flight), :mod:`.modes` (throughput, single, curve, memory),
:mod:`.append`, :mod:`.statestore` and :mod:`.rebuild` (the modes without workers), and
:mod:`.report` (the summary and the table, whose rows :mod:`.figures` defines); the Celery side
(:mod:`.celery_job`, :mod:`.celery_app`, :mod:`.redis_server`), the chart (:mod:`.chart`).

CPU time and resident memory from /proc, the database's activity counters (the cost per
parent), the servers' versions and percentiles. Worker processes, queues, databases, checks,
RabbitMQ's global counters, what is paused right now and :func:`run_guarded` (a run whose
cleanup happens whatever stops it) are the harness the scripts share with each other and with
the tests: :mod:`scripts.lab.harness`. Standard library and the project's own dependencies only
(the Celery side of the bench, which needs the ``bench`` extra, is in :mod:`_bench.celery_job`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aio_pika
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from scripts.lab.harness.database import with_database

__all__ = [
    "cpu_per_parent_ms",
    "cpu_snapshot",
    "database_counters",
    "percentile",
    "process_cpu_seconds",
    "process_tree",
    "rabbitmq_pid",
    "rss_mb",
    "server_versions",
    "system_busy_seconds",
    "wait_for_backends_gone",
]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ---- the database's activity ----------------------------------------------------------------


async def database_counters(admin_url: str, database: str) -> dict[str, int]:
    """pg_stat_database counters of ``database``, read from the ``postgres`` database."""
    engine = create_async_engine(with_database(admin_url, "postgres"), isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as connection:
            row = (
                await connection.execute(
                    text(
                        "SELECT xact_commit, xact_rollback, sessions FROM pg_stat_database "
                        "WHERE datname = :d"
                    ),
                    {"d": database},
                )
            ).one_or_none()
    finally:
        await engine.dispose()
    if row is None:
        return {"xact_commit": 0, "xact_rollback": 0, "sessions": 0}
    return {"xact_commit": int(row[0]), "xact_rollback": int(row[1]), "sessions": int(row[2])}


async def wait_for_backends_gone(
    admin_url: str,
    database: str,
    within: float = 10,
) -> None:
    """Wait until no backend is connected to ``database`` (each flushes its stats on exit)."""
    engine = create_async_engine(with_database(admin_url, "postgres"), isolation_level="AUTOCOMMIT")
    try:
        deadline = time.monotonic() + within
        async with engine.connect() as connection:
            while time.monotonic() < deadline:
                count = await connection.scalar(
                    text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d"),
                    {"d": database},
                )
                if not count:
                    break
                await asyncio.sleep(0.1)
    finally:
        await engine.dispose()
    await asyncio.sleep(0.3)  # the last exiting backend's stats reach shared memory


async def server_versions(admin_url: str, amqp_url: str) -> dict[str, str | None]:
    versions: dict[str, str | None] = {"postgresql": None, "rabbitmq": None}
    with contextlib.suppress(Exception):
        engine = create_async_engine(with_database(admin_url, "postgres"))
        try:
            async with engine.connect() as connection:
                versions["postgresql"] = str(await connection.scalar(text("SHOW server_version")))
        finally:
            await engine.dispose()
    with contextlib.suppress(Exception):
        broker = await aio_pika.connect(amqp_url)
        try:
            properties: Any = broker.transport.connection.server_properties  # type: ignore[union-attr]
            version = properties.get("version")
            versions["rabbitmq"] = version.decode() if isinstance(version, bytes) else str(version)
        finally:
            await broker.close()
    return versions


# ---- CPU -----------------------------------------------------------------------------------


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (all its threads) in seconds, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # after "pid (comm)": state is field 3, utime field 14, stime field 15
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants now (a prefork pool's children), from
    /proc/<pid>/task/*/children; empty when ``pid`` is gone."""
    found: list[int] = []
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        found.append(current)
        for tid in tasks:
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/{current}/task/{tid}/children") as children:
                    pending += [int(child) for child in children.read().split()]
    return found


def cpu_snapshot(groups: Mapping[str, Sequence[int] | None]) -> dict[str, float | None]:
    """CPU seconds used so far by each group of processes (None when the group is unknown or one
    of its processes is gone), by this process (``bench``: the client, every thread) and by the
    whole machine (``machine``)."""
    snapshot: dict[str, float | None] = {}
    for name, pids in groups.items():
        seconds = [process_cpu_seconds(pid) for pid in pids or ()]
        snapshot[name] = (
            None if not seconds or None in seconds else sum(s for s in seconds if s is not None)
        )
    own = resource.getrusage(resource.RUSAGE_SELF)
    snapshot["bench"] = own.ru_utime + own.ru_stime
    snapshot["machine"] = system_busy_seconds()
    return snapshot


def cpu_per_parent_ms(
    before: Mapping[str, float | None], after: Mapping[str, float | None], parents: int
) -> dict[str, float | None]:
    """Milliseconds of CPU per parent of each group between two :func:`cpu_snapshot` calls."""
    per_parent: dict[str, float | None] = {}
    for name, start in before.items():
        end = after.get(name)
        per_parent[name] = (
            None if start is None or end is None or parents <= 0 else (end - start) * 1000 / parents
        )
    return per_parent


def rss_mb(pid: int) -> float | None:
    """Resident memory (VmRSS) of a process in MiB, from /proc/<pid>/status; None when gone."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024  # kB
    return None


def rabbitmq_pid() -> int | None:
    """The broker's beam.smp (the oldest one: rabbitmqctl runs short-lived ones too)."""
    best: tuple[int, int] | None = None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as comm:
                if comm.read().strip() != "beam.smp":
                    continue
            with open(f"/proc/{entry}/stat") as stat:
                start = int(stat.read().rsplit(")", 1)[1].split()[19])
        except (OSError, ValueError, IndexError):
            continue
        if best is None or start < best[0]:
            best = (start, int(entry))
    return best[1] if best else None


def system_busy_seconds() -> float:
    """CPU seconds spent not idle by the whole machine (all cores), from /proc/stat."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    busy = sum(values[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / CLOCK_TICKS


# ---- statistics ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
