"""The demo: 3 workers, 200 fan-out tasks, one worker SIGKILLed mid-run, everything checked.

It makes its own database (``waystation_demo``, dropped first if a previous demo left it) and its
own queues (prefix ``demo.``), starts three worker processes of the example app, submits 200
``orchestrator`` tasks (each fans out to 3 ``researcher`` peers that work 30 ms), kills one worker
with SIGKILL halfway and starts a replacement, waits for every result, and then checks:

* every result is correct and there is exactly one per task;
* the event log: per task exactly one TaskResumed, one TaskCompleted and 3 SubtaskClaimed, and
  every stream's hash chain verifies.

It stops the workers with SIGTERM, deletes its queues, drops its database, and exits 0 only if
everything held.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench import (
    WorkerProcess,
    broker_counters,
    delete_topology,
    log_problems,
    run_guarded,
    stop_all,
    topology_queues,
    wait_for_consumers,
    with_database,
)

import migrations
from events import GENESIS_HASH, chain_hash
from events.postgres import PostgresEventStore
from workers import topology
from workers.client import Client
from workers.example import app as example_app
from workers.example import expected_total
from workers.settings import Settings
from workers.wire import Names

TASKS = 200
K = 3
WORK_MS = 30
WORKERS = 3
SUBMIT_PER_S = 50.0
"""Submission pace, so the run lasts a few seconds and the kill lands in the middle of it."""
KILL_AFTER = TASKS // 2
BURST = 30
"""The tasks before the kill are submitted at once, so the killed worker surely has work."""
KILL_DELAY = 0.05
RESULT_TIMEOUT = 45.0
DATABASE = "waystation_demo"
PREFIX = "demo."
AGENTS = tuple(example_app.agents)


class Demo:
    def __init__(self) -> None:
        base = Settings()
        self.amqp_url = base.amqp_url
        self.database_url = with_database(base.database_url, DATABASE)
        self.names = Names(PREFIX)
        self.logs = Path(tempfile.mkdtemp(prefix="waystation-demo-"))
        self.workers: list[WorkerProcess] = []
        self.started = time.monotonic()
        policy = os.environ.get("WAYSTATION_BROKER_POLICY", "auto")
        self.policy = (
            policy
            if policy != "auto"
            else ("rabbitmqctl" if shutil.which("rabbitmqctl") else "none")
        )

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:5.1f}s] {text}", flush=True)

    def start_worker(self) -> WorkerProcess:
        number = len(self.workers) + 1
        worker = WorkerProcess(
            f"worker{number}",
            {
                "WAYSTATION_DATABASE_URL": self.database_url,
                "WAYSTATION_AMQP_URL": self.amqp_url,
                "WAYSTATION_QUEUE_PREFIX": PREFIX,
                "WAYSTATION_BROKER_POLICY": self.policy,
                "WAYSTATION_WORKER_ID": f"demo-worker{number}",
            },
            self.logs / f"worker{number}.log",
        ).start()
        self.workers.append(worker)
        return worker

    def interrupt(self) -> None:
        """On SIGINT/SIGTERM: SIGTERM the workers now (the cleanup waits for them)."""
        for worker in self.workers:
            worker.terminate()

    def alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.alive()]

    async def wait_ready(self, count: int) -> None:
        await wait_for_consumers(
            self.amqp_url,
            topology_queues(self.names, AGENTS)[:-1],
            count,
            within=60,
            alive=lambda: all(w.alive() for w in self.workers),
        )

    # ---- the run ---------------------------------------------------------------------------------

    async def run(self) -> list[str]:
        """Everything; the list of failed checks (empty when all held)."""
        print(
            f"Waystation demo: {WORKERS} workers, {TASKS} orchestrator tasks fanning out to {K} "
            f"researchers ({WORK_MS} ms of work each), one worker SIGKILLed mid-run."
        )
        await migrations.drop_database(self.database_url)
        with contextlib.suppress(Exception):
            await delete_topology(self.amqp_url, PREFIX, AGENTS)  # a previous demo cut short
        await migrations.upgrade(self.database_url)
        self.say(f"database {DATABASE} created and migrated; queues prefixed {PREFIX!r}")
        for _ in range(WORKERS):
            self.start_worker()
        await self.wait_ready(WORKERS)
        self.say(
            f"{WORKERS} workers consuming (pids {', '.join(str(w.pid) for w in self.workers)})"
        )

        failures: list[str] = []
        broker_before = broker_counters()
        async with Client(self.amqp_url, queue_prefix=PREFIX) as client:
            task_ids: dict[str, int] = {}
            killed: WorkerProcess | None = None

            async def submit_all() -> None:
                nonlocal killed
                for n in range(TASKS):
                    task_ids[
                        await client.submit("orchestrator", {"n": n, "k": K, "work_ms": WORK_MS})
                    ] = n
                    if n + 1 == KILL_AFTER:
                        # the burst just before is in the works: kill a worker in the middle of it
                        await asyncio.sleep(KILL_DELAY)
                        killed = self.workers[1]
                        killed.kill()
                        self.say(
                            f"submitted {n + 1}/{TASKS} (the last {BURST} at once): "
                            f"SIGKILL {killed.name} (pid {killed.pid}) mid-run"
                        )
                        replacement = self.start_worker()
                        self.say(f"started {replacement.name} (pid {replacement.pid}) in its place")
                    if not KILL_AFTER - BURST <= n + 1 < KILL_AFTER:
                        await asyncio.sleep(1 / SUBMIT_PER_S)

            submitter = asyncio.create_task(submit_all())
            deadline = time.monotonic() + TASKS / SUBMIT_PER_S + RESULT_TIMEOUT
            while True:
                await asyncio.sleep(1.0)
                done = sum(1 for t in task_ids if t in client.results)
                self.say(
                    f"completed {done:3d}/{len(task_ids):3d} submitted "
                    f"({len(self.alive())} workers alive)"
                )
                if submitter.done():
                    submitter.result()  # raise its error, if any
                    if done == TASKS:
                        break
                if time.monotonic() > deadline:
                    failures.append(
                        f"only {done} of {TASKS} results within {RESULT_TIMEOUT:.0f}s "
                        f"after the last submission"
                    )
                    break
            if not submitter.done():
                submitter.cancel()
            await asyncio.sleep(0.5)  # a duplicate result, if any, has time to arrive
            results = {t: client.results[t] for t in task_ids if t in client.results}
            duplicates = client.duplicates

        broker_after = broker_counters()
        # ---- checks ----
        self.say(
            ("all results in" if len(results) == TASKS else f"{len(results)} results in")
            + "; checking them and the event log"
        )
        wrong = [
            (task_ids[t], r)
            for t, r in results.items()
            if not r.ok or r.result != {"n": task_ids[t], "total": expected_total(task_ids[t], K)}
        ]
        check(
            failures,
            not wrong,
            f"all {len(results)} results correct (total = expected_total(n, {K}))",
            f"{len(wrong)} wrong results, e.g. {wrong[:3]}",
        )
        check(
            failures,
            len(results) == len(task_ids) == TASKS,
            f"{len(results)} distinct results for {len(task_ids)} submitted tasks "
            f"({duplicates} duplicate deliveries ignored by the client)",
            f"{len(results)} distinct results for {len(task_ids)} submitted tasks",
        )
        failures += await self.check_log(list(task_ids))

        codes = stop_all(self.alive(), timeout=30)
        self.say(
            "workers stopped with SIGTERM: "
            + ", ".join(f"{name} exit {code}" for name, code in codes.items())
        )
        check(
            failures,
            all(code == 0 for code in codes.values()),
            "every surviving worker exited 0",
            f"worker exit codes {codes}",
        )
        recovery = _recovery_lines(sorted(self.logs.glob("*.log")))
        if broker_before and broker_after:
            recovery["messages RabbitMQ redelivered (broker-wide counter)"] = (
                broker_after["redelivered"] - broker_before["redelivered"]
            )
        print(
            "       recovery seen in the worker logs: "
            + (", ".join(f"{what}: {n}" for what, n in recovery.items()) or "none")
        )
        problems, first = log_problems(sorted(self.logs.glob("*.log")))
        print(f"       worker logs: {problems} warning/error lines" + (":" if first else ""))
        for line in first:
            print(f"         {line}")
        return failures

    async def check_log(self, task_ids: list[str]) -> list[str]:
        failures: list[str] = []
        store = PostgresEventStore.from_url(self.database_url, pool_size=4)
        try:
            counts: collections.Counter[str] = collections.Counter()
            bad_counts: list[str] = []
            broken_chains: list[str] = []
            moved = 0
            writers: collections.Counter[str] = collections.Counter()
            for task_id in task_ids:
                events = await store.read_stream(task_id)
                types = collections.Counter(e.event_type for e in events)
                counts.update(types)
                if (types["TaskCompleted"], types["TaskResumed"], types["SubtaskClaimed"]) != (
                    1,
                    1,
                    K,
                ):
                    bad_counts.append(f"{task_id}: {dict(types)}")
                previous = GENESIS_HASH
                for event in events:
                    if (
                        event.prev_hash != previous
                        or chain_hash(previous, event.hash_body()) != event.hash
                    ):
                        broken_chains.append(f"{task_id} v{event.stream_version}")
                        break
                    previous = event.hash
                by_type = {e.event_type: e.metadata.get("worker_id") for e in events}
                writers.update(str(e.metadata.get("worker_id")) for e in events)
                if by_type.get("TaskPaused") != by_type.get("TaskCompleted"):
                    moved += 1
            streams = await _count_streams(store)
        finally:
            await store.close()
        check(
            failures,
            not bad_counts,
            f"every task's stream has exactly 1 TaskCompleted, 1 TaskResumed "
            f"and {K} SubtaskClaimed",
            f"{len(bad_counts)} streams with other counts, e.g. {bad_counts[:3]}",
        )
        check(
            failures,
            not broken_chains,
            f"hash chains of all {len(task_ids)} streams verify",
            f"{len(broken_chains)} broken hash chains, e.g. {broken_chains[:3]}",
        )
        check(
            failures,
            streams == len(task_ids),
            f"the log holds {streams} streams, one per task (researchers record nothing)",
            f"the log holds {streams} streams for {len(task_ids)} tasks",
        )
        print(f"       events: {dict(sorted(counts.items()))}")
        print(f"       events written per worker: {dict(sorted(writers.items()))}")
        print(f"       tasks paused on one worker and completed on another: {moved}")
        return failures

    async def cleanup(self) -> None:
        leftover = self.alive()
        if leftover:
            stop_all(leftover, timeout=15)
        errors = []
        try:
            await delete_topology(self.amqp_url, PREFIX, AGENTS)
        except Exception as problem:
            errors.append(f"deleting the demo queues: {problem}")
        if self.policy == "rabbitmqctl":
            with contextlib.suppress(Exception):
                await topology.clear_policy(self.names)
        try:
            await migrations.drop_database(self.database_url)
        except Exception as problem:
            errors.append(f"dropping {DATABASE}: {problem}")
        for message in errors:
            print(f"cleanup: {message}", file=sys.stderr)


async def _count_streams(store: PostgresEventStore) -> int:
    from sqlalchemy import text

    async with store.engine.connect() as connection:
        return int(
            await connection.scalar(text("SELECT count(DISTINCT stream_id) FROM events")) or 0
        )


_RECOVERY = {
    "outbox messages republished by the relay": re.compile(rb"outbox relay published (\d+)"),
    "redeliveries recognised": re.compile(
        rb"redelivered after its checkpoint|already recorded by another"
    ),
    "resumes already done": re.compile(rb"resume of .* already done"),
    "replies not applied (duplicate or late)": re.compile(rb"not applied: "),
}


def _recovery_lines(paths: list[Path]) -> dict[str, int]:
    """What the workers logged about redeliveries and the outbox relay (INFO lines)."""
    found: collections.Counter[str] = collections.Counter()
    for path in paths:
        with contextlib.suppress(OSError), open(path, "rb") as log:
            for line in log:
                for what, pattern in _RECOVERY.items():
                    match = pattern.search(line)
                    if match:
                        found[what] += int(match.group(1)) if match.groups() else 1
    return dict(found)


def check(failures: list[str], ok: bool, good: str, bad: str) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {good if ok else bad}", flush=True)
    if not ok:
        failures.append(bad)


def main() -> int:
    demo = Demo()
    failures, error, interrupted = run_guarded(demo.run, demo.cleanup, demo.interrupt, name="demo")
    elapsed = time.monotonic() - demo.started
    if interrupted:
        shutil.rmtree(demo.logs, ignore_errors=True)
        print(
            f"demo: interrupted; workers stopped, queues deleted, database {DATABASE} dropped",
            file=sys.stderr,
        )
        return 130
    if error is not None:
        print(
            f"\ndemo: FAILED after {elapsed:.1f}s: {type(error).__name__}: {error}", file=sys.stderr
        )
        if not isinstance(error, (TimeoutError, RuntimeError)):
            traceback.print_exception(error)
        print(f"  worker logs kept in {demo.logs}", file=sys.stderr)
        return 1
    if failures:
        print(f"\ndemo: FAILED after {elapsed:.1f}s:", file=sys.stderr)
        for failure in failures:
            print(f"  - {failure}", file=sys.stderr)
        print(f"  worker logs kept in {demo.logs}", file=sys.stderr)
        return 1
    if "--keep-logs" in sys.argv[1:]:
        print(f"worker logs kept in {demo.logs}")
    else:
        shutil.rmtree(demo.logs, ignore_errors=True)
    print(f"\ndemo: everything held ({elapsed:.1f}s); queues deleted, database {DATABASE} dropped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
