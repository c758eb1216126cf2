"""The pieces of ``scripts/chaos`` that are not the run itself.

* :func:`plan_faults`: when each fault lands, a pure function of the seed: the kinds shuffled,
  one per equal slice of the results, at a random point of its slice, after a random delay.
* :class:`ChaosCollector`: the durable result collector of the tests, keeping each message's
  ``redelivered`` flag too, so that a result the broker delivered again (the collector's ack was
  lost with its connection) is told apart from one a worker published twice.
* :func:`probe_health`: one worker's ``/healthz`` (healthy, and messages in its handlers).
* :func:`result_figures` and :func:`log_figures`: what is missing, wrong or duplicated, from the
  result messages and from the event log. Pure functions, so that a unit test can show each
  check fail.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aio_pika.abc import AbstractIncomingMessage

from events import canonical
from events.codec import loads
from tests.support import DurableResultCollector

__all__ = [
    "FAULT_KINDS",
    "ChaosCollector",
    "Health",
    "LogFigures",
    "PlannedFault",
    "ResultFigures",
    "log_figures",
    "plan_faults",
    "probe_health",
    "result_figures",
]

FAULT_KINDS = ("kill", "close", "pg-restart")
EXAMPLES = 5
"""Task ids kept per problem in the figures, to look up with ``waystation history``."""


# ---- the fault plan ------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    """``kill`` (SIGKILL a worker, start a replacement), ``close`` (every broker connection of
    the run's vhost) or ``pg-restart`` (the run's PostgreSQL cluster stopped and started)."""
    after_results: int
    """It lands once this many results are in..."""
    delay: float
    """...and this many seconds later (a random moment in whatever is in flight)."""


def plan_faults(
    results_span: int, kills: int, closes: int, pg_restarts: int, seed: int
) -> list[PlannedFault]:
    """The faults in the order they land, spread over the first ``results_span`` results: the
    span is cut into one equal slice per fault, each fault lands at a random point of its slice
    (so no two pile up, and none waits for the end)."""
    kinds = ["kill"] * kills + ["close"] * closes + ["pg-restart"] * pg_restarts
    rng = random.Random(seed)
    rng.shuffle(kinds)
    width = results_span / max(1, len(kinds))
    return [
        PlannedFault(
            kind,
            max(1, int(width * (index + rng.random()))),
            round(rng.uniform(0.0, 1.0), 3),
        )
        for index, kind in enumerate(kinds)
    ]


# ---- results -------------------------------------------------------------------------------


class ChaosCollector(DurableResultCollector):
    """:class:`~tests.support.DurableResultCollector`, keeping each message's redelivered flag
    in ``redelivered`` (parallel to ``received``)."""

    def __init__(self, amqp_url: str, *, queue_prefix: str) -> None:
        super().__init__(amqp_url, queue_prefix=queue_prefix, queue_name="chaos-results")
        self.redelivered: list[bool] = []
        self._arrived = asyncio.Condition()

    async def _on_result(self, message: AbstractIncomingMessage) -> None:
        self.redelivered.append(bool(message.redelivered))
        await super()._on_result(message)
        async with self._arrived:
            self._arrived.notify_all()

    def answered(self) -> int:
        """Tasks with a result so far."""
        return len(self._results)

    async def wait_answered(self, count: int) -> None:
        """Until at least ``count`` tasks have a result."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: len(self._results) >= count)

    def messages(self) -> list[tuple[str | None, bytes, bool]]:
        """Every result message: (task id, body, whether the broker redelivered it)."""
        return [
            (task_id, body, redelivered)
            for (task_id, body), redelivered in zip(self.received, self.redelivered, strict=True)
        ]


@dataclass
class ResultFigures:
    messages: int
    """Result messages received, duplicates included."""
    answered: int
    """Submitted tasks with at least one result."""
    missing: list[str]
    """Submitted tasks without any result."""
    wrong: list[str]
    """Tasks with a result other than the expected one, or with two different results."""
    duplicates: int
    """Result messages beyond the first of their task (repeats of the same result)."""
    duplicates_redelivered: int
    """Of those, delivered again by the broker (the collector's ack died with its connection)."""
    duplicated_tasks: list[str]
    unexpected: int
    """Result messages of no submitted task."""

    @property
    def duplicates_published(self) -> int:
        """Duplicates the workers published more than once."""
        return self.duplicates - self.duplicates_redelivered

    def to_json(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "answered": self.answered,
            "missing": len(self.missing),
            "wrong": len(self.wrong),
            "duplicates": self.duplicates,
            "duplicates_redelivered_to_collector": self.duplicates_redelivered,
            "duplicates_published_again": self.duplicates_published,
            "unexpected": self.unexpected,
            "examples": {
                "missing": self.missing[:EXAMPLES],
                "wrong": self.wrong[:EXAMPLES],
                "duplicated": self.duplicated_tasks[:EXAMPLES],
            },
        }


def result_figures(
    expected: Mapping[str, Any], messages: Iterable[tuple[str | None, bytes, bool]]
) -> ResultFigures:
    """Compare every result message with ``expected`` (task id -> the ``result`` its ``ok``
    answer must carry)."""
    bodies: dict[str, list[bytes]] = {}
    redelivered_duplicates = unexpected = total = 0
    for task_id, body, redelivered in messages:
        total += 1
        if task_id is None or task_id not in expected:
            unexpected += 1
            continue
        seen = bodies.setdefault(task_id, [])
        if seen and redelivered:
            redelivered_duplicates += 1
        seen.append(body)
    wrong = []
    for task_id, received in bodies.items():
        distinct = {_canonical_or_raw(body) for body in received}
        want = canonical({"status": "ok", "result": expected[task_id]})
        if len(distinct) != 1 or _answer(received[0]) != want:
            wrong.append(task_id)
    duplicated = [t for t, received in bodies.items() if len(received) > 1]
    return ResultFigures(
        messages=total,
        answered=len(bodies),
        missing=[t for t in expected if t not in bodies],
        wrong=wrong,
        duplicates=sum(len(bodies[t]) - 1 for t in duplicated),
        duplicates_redelivered=redelivered_duplicates,
        duplicated_tasks=duplicated,
        unexpected=unexpected,
    )


def _canonical_or_raw(body: bytes) -> bytes:
    try:
        return canonical(loads(body))
    except Exception:
        return body


def _answer(body: bytes) -> bytes | None:
    """A result body's status and result (what must not differ), canonical; None if unreadable."""
    try:
        decoded = loads(body)
        return canonical({"status": decoded.get("status"), "result": decoded.get("result")})
    except Exception:
        return None


# ---- the event log -------------------------------------------------------------------------


@dataclass
class LogFigures:
    streams: int
    not_completed_once: list[str]
    """Tasks whose stream does not end in exactly one TaskCompleted (or that have no stream)."""
    pauses_resumed_twice: list[str]
    """``task pause N: k resumes`` for every pause resumed more than once."""
    pauses_recorded_twice: list[str]
    claims_not_once: list[str]
    """``subtask: k claims`` for every sub-task of the plan not claimed exactly once, and
    every claim of a sub-task outside the plan."""
    unexpected_streams: list[str]
    events: Counter[str] = field(default_factory=Counter)
    reply_ignored: Counter[str] = field(default_factory=Counter)

    def problems(self) -> int:
        return (
            len(self.not_completed_once)
            + len(self.pauses_resumed_twice)
            + len(self.pauses_recorded_twice)
            + len(self.claims_not_once)
            + len(self.unexpected_streams)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "streams": self.streams,
            "tasks_not_completed_once": len(self.not_completed_once),
            "pauses_resumed_twice": len(self.pauses_resumed_twice),
            "pauses_recorded_twice": len(self.pauses_recorded_twice),
            "subtasks_not_claimed_once": len(self.claims_not_once),
            "unexpected_streams": len(self.unexpected_streams),
            "events": dict(sorted(self.events.items())),
            "reply_ignored": dict(sorted(self.reply_ignored.items())),
            "examples": {
                "not_completed_once": self.not_completed_once[:EXAMPLES],
                "pauses_resumed_twice": self.pauses_resumed_twice[:EXAMPLES],
                "pauses_recorded_twice": self.pauses_recorded_twice[:EXAMPLES],
                "subtasks_not_claimed_once": self.claims_not_once[:EXAMPLES],
                "unexpected_streams": self.unexpected_streams[:EXAMPLES],
            },
        }


LogRow = tuple[str, str, str | None, int | None, str | None]
"""(stream id, event type, subtask id, pause, reason) of one event, in stream-version order."""


def log_figures(task_ids: Sequence[str], rows: Iterable[LogRow], k: int, rounds: int) -> LogFigures:
    """Check every task's stream against the example orchestrator's plan: ``rounds`` pauses of
    ``k`` calls each (sub-task ids ``<task>:<pause>:<i>``), each pause recorded and resumed
    once, each sub-task claimed once, one TaskCompleted as the last decisive event.

    A researcher's task (a sub-task) records nothing when it completes on its first delivery
    (G10); a retried or redelivered one (its worker was killed) records its completion, so its
    stream may exist: then it must be exactly ``TaskStarted``, ``TaskCompleted``."""
    streams: dict[str, list[LogRow]] = {}
    for row in rows:
        streams.setdefault(row[0], []).append(row)
    planned_subtasks = {
        f"{task_id}:{pause}:{i}"
        for task_id in task_ids
        for pause in range(1, rounds + 1)
        for i in range(k)
    }
    figures = LogFigures(
        streams=len(streams),
        not_completed_once=[],
        pauses_resumed_twice=[],
        pauses_recorded_twice=[],
        claims_not_once=[],
        unexpected_streams=sorted(
            stream_id
            for stream_id in set(streams) - set(task_ids)
            if stream_id not in planned_subtasks
            or [row[1] for row in streams[stream_id]] != ["TaskStarted", "TaskCompleted"]
        ),
    )
    for task_id in task_ids:
        events = streams.get(task_id, [])
        figures.events.update(row[1] for row in events)
        figures.reply_ignored.update(row[4] or "?" for row in events if row[1] == "ReplyIgnored")
        decisive = [row[1] for row in events if row[1] != "ReplyIgnored"]
        if decisive.count("TaskCompleted") != 1 or decisive[-1] != "TaskCompleted":
            figures.not_completed_once.append(task_id)
        for kind, problems in (
            ("TaskResumed", figures.pauses_resumed_twice),
            ("TaskPaused", figures.pauses_recorded_twice),
        ):
            per_pause = Counter(row[3] for row in events if row[1] == kind)
            problems.extend(
                f"{task_id} pause {pause}: {count} {kind}"
                for pause, count in sorted(per_pause.items(), key=lambda item: item[0] or 0)
                if count > 1
            )
        claims = Counter(row[2] for row in events if row[1] == "SubtaskClaimed")
        planned = [f"{task_id}:{pause}:{i}" for pause in range(1, rounds + 1) for i in range(k)]
        figures.claims_not_once.extend(
            f"{subtask}: {claims[subtask]} claims" for subtask in planned if claims[subtask] != 1
        )
        figures.claims_not_once.extend(
            f"{subtask}: {count} claims (not planned)"
            for subtask, count in claims.items()
            if subtask not in planned
        )
    return figures


# ---- a worker's health ---------------------------------------------------------------------


@dataclass(frozen=True)
class Health:
    healthy: bool
    in_flight: int | None
    """Messages in the worker's handlers right now (None when it did not say)."""


async def probe_health(session: aiohttp.ClientSession, port: int) -> Health:
    """``GET /healthz`` of the worker listening on ``port`` (unhealthy when it does not answer)."""
    try:
        async with session.get(
            f"http://127.0.0.1:{port}/healthz", timeout=aiohttp.ClientTimeout(total=3)
        ) as response:
            body = loads(await response.read())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return Health(False, None)
    in_flight = body.get("in_flight") if isinstance(body, dict) else None
    return Health(response.status == 200, in_flight if isinstance(in_flight, int) else None)
