"""A worker process SIGKILLed at each step boundary loses nothing and does nothing twice (G1, G4).

Worker A runs with ``WAYSTATION_FAULT_POINT`` and kills itself there (workers/runtime/faults.py);
worker B then starts normally and must finish the task from what A left: the log, unacked messages
(which the broker redelivers) and outbox rows (which B's relay publishes after ``outbox_delay``).
The stream is read once the deployment is quiet, so whatever B republished has been handled; the
result may come twice only when B's relay published it again.
"""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import pytest

from scripts.lab.harness.broker import wait_for_consumers
from scripts.lab.harness.checks import (
    chain_problems,
    record_outbox_claims,
    result_messages,
    unexplained_repeats,
)
from scripts.lab.harness.clients import RecordingClient
from scripts.lab.harness.processes import WorkerProcess, tail
from waystation.events.postgres import PostgresEventStore
from waystation.example import expected_total
from waystation.protocol.wire import Names
from waystation.settings import Settings

from ..support import Services, deployment_quiet, require

pytestmark = [pytest.mark.integration, pytest.mark.slow]

K = 3
EXPECTED = [
    "TaskStarted",
    "TaskPaused",
    *["SubtaskClaimed", "ResultRecorded"] * K,
    "TaskResumed",
    "TaskCompleted",
]

WINDOWS = [
    # (fault point, on which hit, resume in place): what A leaves behind
    ("pause.committed", 1, True),  # the pause, its requests only as outbox rows, the task unacked
    ("pause.published", 1, True),  # the requests published, the task unacked
    ("reply.committed", 1, True),  # the first claim committed, its reply unacked
    # resumed in place: the last reply's handler run done, nothing of it recorded, reply unacked
    ("resume.in-place", 1, True),
    # resumed in place: the last claim, TaskResumed and TaskCompleted committed in one append,
    # the result unpublished, the last reply unacked
    ("reply.committed", K, True),
    ("reply.published", K, True),  # the result published, the last reply unacked
    # resume by message (WAYSTATION_RESUME_IN_PLACE=false)
    ("reply.committed", K, False),  # the last claim and TaskResumed committed, resume unpublished
    ("reply.published", K, False),  # the resume published, the last reply unacked
    ("resume.committed", 1, False),  # TaskCompleted committed, result unpublished, resume unacked
    ("resume.published", 1, False),  # the result published, the resume unacked
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("point", "after", "in_place"),
    WINDOWS,
    ids=[f"{p}-{n}-{'in-place' if i else 'by-message'}" for p, n, i in WINDOWS],
)
async def test_a_worker_killed_in_a_crash_window_loses_nothing_and_repeats_nothing(
    point: str,
    after: int,
    in_place: bool,
    settings: Settings,
    store: PostgresEventStore,
    services: Services,
    tmp_path: Path,
) -> None:
    require(services.rabbitmqctl, "waiting for the deployment to go quiet")
    settings = settings.model_copy(update={"resume_in_place": in_place})
    names = Names(settings.queue_prefix)
    logs = {"A": tmp_path / "worker-a.log", "B": tmp_path / "worker-b.log"}
    a = WorkerProcess.with_settings(
        settings,
        logs["A"],
        env={"WAYSTATION_FAULT_POINT": point, "WAYSTATION_FAULT_AFTER": str(after)},
    )
    b = WorkerProcess.with_settings(settings, logs["B"])

    def context() -> str:
        return "\n".join(f"--- worker {n} log:\n{tail(p)}" for n, p in logs.items())

    n = 6
    try:
        async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
            await record_outbox_claims(store)
            a.start()
            await wait_for_consumers(settings.amqp_url, [names.tasks("orchestrator")], 1)
            task_id = await client.submit("orchestrator", {"n": n, "k": K})
            code = await a.wait_exit(60)
            assert code == -signal.SIGKILL, f"worker A did not die at {point}: {code}\n{context()}"

            b.start()
            try:
                result = await client.result(task_id, timeout=60)
            except TimeoutError:
                raise AssertionError(f"no result after a crash at {point}\n{context()}") from None
            assert result.ok and result.result == {"n": n, "total": expected_total(n, K)}

            await deployment_quiet(settings, store, [task_id])

            events = await store.read_stream(task_id)
            types = [e.event_type for e in events]
            audit = Counter(
                (e.data["reason"], e.data["subtask_id"])
                for e in events
                if e.event_type == "ReplyIgnored"
            )
            report = (
                f"crash at {point} (hit {after}): stream {types}, ReplyIgnored {dict(audit)}, "
                f"{result_messages(client)}"
            )
            print(report)
            assert [t for t in types if t != "ReplyIgnored"] == EXPECTED, f"{report}\n{context()}"
            assert all(reason == "duplicate" for reason, _ in audit), report
            assert chain_problems(events) == [], report
            assert len(client.distinct_results(task_id)) == 1, report
            assert not await unexplained_repeats(store, client, [task_id]), report
            assert b.alive(), f"worker B died\n{context()}"
    finally:
        a.kill()
        a.stop()
        b.stop()
