# mypy: disable-error-code="untyped-decorator"
"""The Celery app of ``scripts/bench --compare celery``: the same fan-out/fan-in job in Celery.

``parent(n, k)`` replaces itself with a chord of ``k`` ``child(n + i)`` tasks whose callback
``total`` sums their answers; the replacement takes over the parent's task id, so the parent's
result (what the client waits for) is the callback's ``{"n": n, "total": ...}``, the same value
as the Waystation example app's orchestrator (:func:`waystation.example.expected_total`).

The Celery worker processes import this module (``celery -A _bench.celery_app worker``) and read
their configuration from the environment, set by :mod:`_bench.celery_job`:
``BENCH_CELERY_BROKER`` (an AMQP URL, the bench's own vhost), ``BENCH_CELERY_BACKEND`` (a Redis
URL, a Redis the bench started), ``BENCH_CELERY_QUEUE``, ``BENCH_CELERY_QUEUE_TYPE`` and
``BENCH_CELERY_PREFETCH``. The bench's client builds its own app with :func:`make_app` and sends
tasks by name.

Each worker counts the task messages it received from the broker, by task name, and writes them
to ``BENCH_CELERY_STATS_FILE`` (JSON) when it shuts down: the bench's messages per parent.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any

from celery import Celery, Task, chord, signals

__all__ = ["PARENT", "app", "make_app"]

PARENT = "waystation_bench.parent"
CHILD = "waystation_bench.child"
TOTAL = "waystation_bench.total"


def make_app(
    broker: str, backend: str, queue: str, queue_type: str = "classic", prefetch: int = 4
) -> Celery:
    """A Celery app of the standard reliable configuration: RabbitMQ broker with persistent
    messages and durable queues (Celery's defaults), Redis result backend (a chord's counter in
    Redis), late acknowledgement; JSON; no remote control, events or heartbeats (nothing but
    the job on the broker). ``prefetch`` is ``worker_prefetch_multiplier`` (Celery's default 4;
    its documentation advises a higher one for many short tasks)."""
    celery = Celery("waystation_bench", broker=broker, backend=backend)
    celery.conf.update(
        task_acks_late=True,
        task_default_queue=queue,
        task_default_queue_type=queue_type,
        worker_prefetch_multiplier=prefetch,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=3600,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        broker_connection_retry_on_startup=True,
        # levels as words between spaces, which the bench's log scan looks for
        worker_log_format="%(asctime)s %(levelname)s %(processName)s %(message)s",
        worker_task_log_format="%(asctime)s %(levelname)s %(processName)s %(task_name)s "
        "%(message)s",
    )
    return celery


app = make_app(
    os.environ.get("BENCH_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672//"),
    os.environ.get("BENCH_CELERY_BACKEND", "redis://127.0.0.1:6379/0"),
    os.environ.get("BENCH_CELERY_QUEUE", "waystation-bench"),
    os.environ.get("BENCH_CELERY_QUEUE_TYPE", "classic"),
    int(os.environ.get("BENCH_CELERY_PREFETCH", "4")),
)


@app.task(name=PARENT, bind=True)
def parent(self: Task, n: int, k: int = 3, work_ms: float = 0.0) -> Any:
    """Fan out to ``k`` children and hand the parent's id to the chord's callback."""
    return self.replace(chord([child.s(n + i, work_ms) for i in range(k)], total.s(n=n)))


@app.task(name=CHILD)
def child(x: int, work_ms: float = 0.0) -> int:
    """The researcher: ``x * x`` after ``work_ms`` of simulated work (a sleep)."""
    if work_ms > 0:
        time.sleep(work_ms / 1000)
    return x * x


@app.task(name=TOTAL)
def total(answers: list[int], n: int) -> dict[str, int]:
    return {"n": n, "total": sum(answers)}


_received: Counter[str] = Counter()


@signals.task_received.connect
def _count_received(request: Any = None, **_: Any) -> None:
    _received[getattr(request, "name", None) or "?"] += 1


@signals.worker_shutdown.connect
def _write_stats(**_: Any) -> None:
    path = os.environ.get("BENCH_CELERY_STATS_FILE")
    if path:
        with open(path, "w") as stats:
            json.dump({"received": dict(_received)}, stats)
