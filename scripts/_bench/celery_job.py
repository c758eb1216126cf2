"""The Celery side of ``scripts/bench --compare celery``: the same job, side by side.

:class:`CelerySide` runs the job of :mod:`_bench.celery_app` (a parent that replaces itself with
a chord of K children and a summing callback) on the same machine, in the same invocation:

* broker: the local RabbitMQ, in a vhost of its own (``waystation-bench-<random>``, deleted at the
  end) made with ``rabbitmqctl``; where that is not possible, the default vhost with queue and
  exchange names of its own (deleted at the end);
* result backend: a Redis server the bench starts itself on a free port (no persistence) and
  kills at the end (:mod:`_bench.redis_server`); ``redis-server`` from PATH, else installed with
  ``apt-get`` when possible;
* ``--workers`` worker processes: ``celery worker --pool solo`` each (default), or one prefork
  worker with ``--concurrency`` = ``--workers`` (``--celery-pool prefork``), or ``--workers``
  processes of ``--celery-threads`` threads (``--celery-pool threads``); fresh processes for
  each session and Redis flushed, like the Waystation side's fresh workers. The default is the
  fastest measured here (2,000 parents, 100 in flight, 2 workers, quiet machine): 2 solo workers
  with ``worker_prefetch_multiplier`` 64 did 136-145 parents/s, against 90-95 at Celery's
  default multiplier of 4, 131-145 at 256 (with a longer tail), 98-107 for prefork ``-c 2`` (its
  parent process relays every task to a child: more CPU per task) and 105-120 for 2 processes of
  4 threads (the GIL); at 64 the machine's two cores are busy, so more prefetch gains nothing;
* the client: Celery's own (``send_task`` then ``AsyncResult.get``) in a thread per parent in
  flight in the bench process (each thread with its own result consumer, Celery's default; one
  shared thread-safe backend was slower), its CPU measured (``bench_client_cpu_ms_per_parent``:
  about 1.6 ms per parent, against 0.5 ms for the Waystation client).

Needs the ``bench`` extra (``celery[redis]``); ``scripts/bench`` installs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import urllib.parse
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aio_pika

from scripts.lab.harness.broker import broker_counters, queue_depths, wait_for_consumers
from scripts.lab.harness.processes import ROOT, WorkerProcess, log_problems, stop_all

from . import cpu_per_parent_ms, cpu_snapshot, process_tree, rabbitmq_pid
from .drive import BenchFailure, measure
from .redis_server import RedisServer, redis_server_binary

__all__ = ["POOLS", "CelerySide"]

POOLS = ("solo", "prefork", "threads")


def _rabbitmqctl(*args: str) -> bool:
    if shutil.which("rabbitmqctl") is None:
        return False
    try:
        done = subprocess.run(
            ["rabbitmqctl", *args], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _with_vhost(amqp_url: str, vhost: str) -> str:
    parts = urllib.parse.urlsplit(amqp_url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + urllib.parse.quote(vhost, safe="")))


class CelerySide:
    """The Celery job's sessions, and everything they need started and removed."""

    def __init__(
        self,
        *,
        amqp_url: str,
        k: int,
        work_ms: float,
        workers: int,
        pool: str,
        threads: int = 4,
        prefetch: int = 4,
        queue_type: str,
        timeout: float,
        logs: Path,
        stopping: Callable[[], bool],
    ) -> None:
        self.base_amqp_url = amqp_url
        self.k = k
        self.work_ms = work_ms
        self.workers = workers
        self.pool = pool
        self.threads = threads
        self.prefetch = prefetch
        self.queue_type = queue_type
        self.timeout = timeout
        self.logs = logs
        self.stopping = stopping
        tag = uuid.uuid4().hex[:8]
        self.vhost: str | None = f"waystation-bench-{tag}"
        self.queue = f"waystation-bench-celery-{tag}"
        self.amqp_url = amqp_url
        self.redis: RedisServer | None = None
        self.processes: list[WorkerProcess] = []
        self.scratch = Path(tempfile.mkdtemp(prefix="waystation-bench-celery-"))
        self.stats_files: dict[str, Path] = {}
        """Where each worker writes its counts of received messages on shutdown, by name."""
        self.next_n = itertools.count(10_000_000)
        """Parent numbers of this side (apart from the Waystation side's, for readable logs)."""

    # -- set-up and clean-up --

    async def start(self) -> dict[str, Any]:
        """Start Redis and make the vhost; what was started (for the JSON)."""
        import celery

        binary, how = redis_server_binary()
        if binary is None:
            raise BenchFailure(f"--compare celery needs a Redis server: {how}")
        self.redis = RedisServer(binary, self.logs / "celery-redis.log").start()
        assert self.vhost is not None
        if _rabbitmqctl("add_vhost", self.vhost) and _rabbitmqctl(
            "set_permissions", "-p", self.vhost, _amqp_user(self.base_amqp_url), ".*", ".*", ".*"
        ):
            self.amqp_url = _with_vhost(self.base_amqp_url, self.vhost)
        else:
            print(
                "bench: celery: rabbitmqctl cannot make a vhost; using the default vhost with "
                f"queue {self.queue}",
                flush=True,
            )
            _rabbitmqctl("delete_vhost", self.vhost)
            self.vhost = None
        info = self.redis.client().info("server")
        return {
            "celery": celery.__version__,
            "redis_server": info.get("redis_version"),
            "redis_binary": how,
            "pool": self.pool,
            "worker_processes": 1 if self.pool == "prefork" else self.workers,
            "concurrency_per_process": {"solo": 1, "threads": self.threads}.get(
                self.pool, self.workers
            ),
            "prefetch_multiplier": self.prefetch,
            "queue_type": self.queue_type,
            "vhost": self.vhost,
            "acks_late": True,
            "client": "send_task + AsyncResult.get, one thread per parent in flight",
        }

    def interrupt(self) -> None:
        for process in self.processes:
            process.terminate()

    async def cleanup(self) -> None:
        """Stop the workers and Redis; delete the vhost (or the queue)."""
        alive = [p for p in self.processes if p.alive()]
        if alive:
            stop_all(alive, timeout=15)
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self.vhost is not None:
            if not _rabbitmqctl("delete_vhost", self.vhost):
                print(f"cleanup: could not delete vhost {self.vhost}", flush=True)
        else:
            with contextlib.suppress(Exception):
                connection = await aio_pika.connect(self.amqp_url)
                try:
                    channel = await connection.channel()
                    await channel.queue_delete(self.queue)
                    await channel.exchange_delete(self.queue)
                finally:
                    await connection.close()

    # -- one session --

    def _start_workers(self, label: str) -> list[WorkerProcess]:
        assert self.redis is not None
        env = {
            "BENCH_CELERY_BROKER": self.amqp_url,
            "BENCH_CELERY_BACKEND": self.redis.url,
            "BENCH_CELERY_QUEUE": self.queue,
            "BENCH_CELERY_QUEUE_TYPE": self.queue_type,
            "BENCH_CELERY_PREFETCH": str(self.prefetch),
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT / "scripts"), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        common = [
            "-A",
            "_bench.celery_app",
            "worker",
            "-Q",
            self.queue,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel",
            "WARNING",
        ]
        if self.pool == "solo":
            shapes = [
                [*common, "--pool", "solo", "-n", f"{label}-{index}@%h"]
                for index in range(self.workers)
            ]
        elif self.pool == "threads":
            shapes = [
                [*common, "--pool", "threads", "-c", str(self.threads), "-n", f"{label}-{index}@%h"]
                for index in range(self.workers)
            ]
        else:
            shapes = [[*common, "--pool", "prefork", "-c", str(self.workers), "-n", f"{label}@%h"]]
        started = []
        for index, command in enumerate(shapes):
            stats = self.scratch / f"{label}-worker{index}.json"
            stats.unlink(missing_ok=True)
            self.stats_files[f"{label}-worker{index}"] = stats
            process = WorkerProcess(
                {**env, "BENCH_CELERY_STATS_FILE": str(stats)},
                self.logs / f"{label}-worker{index}.log",
                command=command,
                module="celery",
                cwd=ROOT / "scripts",
            ).start()
            started.append(process)
            self.processes.append(process)
        return started

    def _one(
        self, app: Any, executor: ThreadPoolExecutor, abandon: threading.Event
    ) -> Callable[[], Any]:
        """One parent through Celery's own client, in a thread of ``executor``; a thread stops
        waiting for its result about a second after ``abandon`` or an interrupt (Celery calls
        ``on_interval`` between its waits; a ``get`` that timed out and is called again can miss
        its result, so there is one ``get`` per parent)."""
        from celery.exceptions import TimeoutError as CeleryTimeout

        from waystation.example import expected_total

        from .celery_app import PARENT

        k, work_ms = self.k, self.work_ms

        def give_up() -> None:
            if self.stopping() or abandon.is_set():
                raise BenchFailure("stopped")

        def blocking() -> None:
            n = next(self.next_n)
            result = app.send_task(PARENT, (n, k, work_ms))
            try:
                value = result.get(timeout=self.timeout, on_interval=give_up)
            except CeleryTimeout:
                raise BenchFailure(
                    f"celery: no result for parent n={n} within {self.timeout}s (see {self.logs})"
                ) from None
            if value != {"n": n, "total": expected_total(n, k)}:
                raise BenchFailure(f"celery: wrong result for parent n={n}: {value!r}")

        loop = asyncio.get_running_loop()

        async def one() -> None:
            await loop.run_in_executor(executor, blocking)

        return one

    async def session(
        self,
        label: str,
        *,
        in_flight: int,
        warmup: int,
        measured: int | None = None,
        seconds: float | None = None,
    ) -> dict[str, Any]:
        """Fresh Celery workers; ``warmup`` parents; then ``measured`` parents, or a window of
        ``seconds`` (after ``warmup`` completions) when ``measured`` is None; their figures."""
        from .celery_app import make_app

        assert self.redis is not None
        redis = self.redis.client()
        redis.flushall()
        redis_before = int(redis.info("stats")["total_commands_processed"])
        broker_before = broker_counters()
        workers = self._start_workers(label)
        consumers = 1 if self.pool == "prefork" else self.workers
        app = make_app(self.amqp_url, self.redis.url, self.queue, self.queue_type, self.prefetch)
        executor = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="celery-client")
        abandon = threading.Event()
        broker_pid = rabbitmq_pid()

        def snapshot() -> dict[str, float | None]:
            return cpu_snapshot(
                {
                    "workers": [pid for w in workers for pid in process_tree(w.pid)],
                    "broker": [broker_pid] if broker_pid else None,
                    "redis": [self.redis.pid] if self.redis and self.redis.pid else None,
                }
            )

        try:
            await wait_for_consumers(
                self.amqp_url,
                [self.queue],
                consumers,
                alive=lambda: all(w.alive() for w in workers),
            )
            result = await measure(
                self._one(app, executor, abandon),
                in_flight,
                warmup=warmup,
                measured=measured,
                seconds=seconds,
                snapshot=snapshot,
                stopping=self.stopping,
            )
            dead = [w.name for w in workers if not w.alive()]
            if dead:
                raise BenchFailure(f"celery worker(s) {', '.join(dead)} died (see {self.logs})")
        finally:
            abandon.set()  # after a failure: the other threads stop waiting
            executor.shutdown(wait=False, cancel_futures=True)
            exits = stop_all(workers)
            app.close()
        redis_after = int(redis.info("stats")["total_commands_processed"])
        broker_after = broker_counters()
        leftover = {q: n for q, n in (await queue_depths(self.amqp_url, [self.queue])).items() if n}
        received: dict[str, int] = {}
        for worker in workers:
            stats = self.stats_files.pop(worker.name)
            if not stats.exists():
                raise BenchFailure(f"celery worker {worker.name} wrote no stats; exits: {exits}")
            for name, count in json.loads(stats.read_text())["received"].items():
                received[name] = received.get(name, 0) + int(count)
            stats.unlink()
        per_parent = cpu_per_parent_ms(result.before, result.after, result.measured)
        parents_total = result.total
        problems, first_problems = log_problems(w.log_path for w in workers)
        return {
            **result.figures(),
            "in_flight": in_flight,
            "worker_cpu_ms_per_parent": per_parent["workers"],
            "broker_cpu_ms_per_parent": per_parent["broker"],
            "redis_cpu_ms_per_parent": per_parent["redis"],
            "bench_client_cpu_ms_per_parent": per_parent["bench"],
            "machine_cpu_ms_per_parent": per_parent["machine"],
            "messages_per_parent": sum(received.values()) / parents_total,
            "messages_received": received,
            "broker_routed_per_parent": (
                (broker_after["routed"] - broker_before["routed"]) / parents_total
                if broker_before and broker_after
                else None
            ),
            "redis_commands_per_parent": (redis_after - redis_before) / parents_total,
            "worker_exit_codes": exits,
            "worker_log_problems": problems,
            "worker_log_first_problems": first_problems,
            "leftover_messages": leftover,
        }


def _amqp_user(amqp_url: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlsplit(amqp_url).username or "guest")
