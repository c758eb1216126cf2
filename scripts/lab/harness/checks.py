"""What must hold after a run: every result once and right, every stream as the plan says.

Pure checks, so that a unit test can show each one fail:

* :func:`result_figures`: from every result message, the tasks without a result, with a wrong
  or a second, different one, and the repeats (and which the broker delivered again);
* :func:`log_figures`: from every event, the example orchestrator's tasks not completed exactly
  once, pauses recorded or resumed more than once, sub-tasks not claimed exactly once, and
  streams nobody planned;
* :func:`chain_problems`: what ``waystation verify`` finds wrong with one stream.

And on a test database: :func:`record_outbox_claims` with :func:`unexplained_repeats` (a result
repeated more often than relays and redeliveries explain was published twice by a worker), and
:func:`fanout_problems`, all of the above for one-round fan-out tasks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text

from waystation.events import RecordedEvent, canonical
from waystation.events.codec import loads
from waystation.events.postgres import PostgresEventStore
from waystation.example import expected_total
from waystation.projections.audit import verify_stream

from .clients import RecordingClient

EXAMPLES = 5
"""Task ids kept per problem in the figures, to look up with ``waystation history``."""


def chain_problems(events: Sequence[RecordedEvent]) -> list[str]:
    """What ``waystation verify`` finds wrong with one stream: versions, hash chain and the
    invariants (empty when it verifies)."""
    return [
        f"{p.stream_id} v{p.stream_version}: {p.kind}: {p.message}" for p in verify_stream(events)
    ]


# ---- results -------------------------------------------------------------------------------


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
    """Compare every result message (task id, body, redelivered) with ``expected`` (task id ->
    the ``result`` its ``ok`` answer must carry)."""
    bodies, redelivered_duplicates, unexpected, total = results_by_task(expected, messages)
    wrong = []
    for task_id, received in bodies.items():
        distinct = {canonical_or_raw(body) for body in received}
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


def results_by_task(
    expected: Collection[str], messages: Iterable[tuple[str | None, bytes, bool]]
) -> tuple[dict[str, list[bytes]], int, int, int]:
    """The bodies of every result message (task id, body, redelivered) of a task of
    ``expected``, by task id; and how many of them the broker delivered again after a first,
    how many are of no task of ``expected``, how many there were."""
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
    return bodies, redelivered_duplicates, unexpected, total


def canonical_or_raw(body: bytes) -> bytes:
    """A body as canonical JSON, or as it is when it is not JSON (so that two compare)."""
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
    """Tasks whose stream does not end in exactly one terminal event, the one expected
    (TaskCompleted; TaskFailed for those expected to fail), or that have no stream."""
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
        return len(self.problem_lines())

    def problem_lines(self) -> list[str]:
        """Every problem found, one line each."""
        return [
            *(f"{task_id}: not completed exactly once" for task_id in self.not_completed_once),
            *self.pauses_resumed_twice,
            *self.pauses_recorded_twice,
            *self.claims_not_once,
            *(f"{stream_id}: a stream nobody planned" for stream_id in self.unexpected_streams),
        ]

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


_TERMINAL = ("TaskCompleted", "TaskFailed", "TaskCancelled")

LogRow = tuple[str, str, str | None, int | None, str | None]
"""(stream id, event type, subtask id, pause, reason) of one event, in stream-version order."""


def log_row(event: RecordedEvent) -> LogRow:
    subtask, pause, reason = (event.data.get(key) for key in ("subtask_id", "pause", "reason"))
    return (
        event.stream_id,
        event.event_type,
        subtask if isinstance(subtask, str) else None,
        pause if isinstance(pause, int) else None,
        reason if isinstance(reason, str) else None,
    )


def unplanned_streams(
    task_ids: Sequence[str], streams: Mapping[str, Sequence[str]], k: int, rounds: int
) -> list[str]:
    """The streams (id -> event types, in order) that are neither one of the tasks' nor that of
    a sub-task of theirs run again: a researcher's task records nothing when it completes on
    its first delivery (G10); a retried or redelivered one (its worker was killed) records its
    completion, so its stream may exist, and then it is exactly ``TaskStarted``,
    ``TaskCompleted``. Sub-task ids are ``<task>:<pause>:<i>`` (``rounds`` pauses of ``k``)."""
    planned_subtasks = {
        f"{task_id}:{pause}:{i}"
        for task_id in task_ids
        for pause in range(1, rounds + 1)
        for i in range(k)
    }
    return sorted(
        stream_id
        for stream_id in set(streams) - set(task_ids)
        if stream_id not in planned_subtasks
        or list(streams[stream_id]) != ["TaskStarted", "TaskCompleted"]
    )


def log_figures(
    task_ids: Sequence[str],
    rows: Iterable[LogRow],
    k: int,
    rounds: int,
    *,
    failed: Collection[str] = (),
) -> LogFigures:
    """Check every task's stream against the example orchestrator's plan: ``rounds`` pauses of
    ``k`` calls each (sub-task ids ``<task>:<pause>:<i>``), each pause recorded and resumed
    once, each sub-task claimed once, one TaskCompleted as the last decisive event and no other
    terminal event (a TaskFailed instead for the tasks in ``failed``, whose last run fails);
    and no other stream but those of sub-tasks run again (:func:`unplanned_streams`)."""
    streams: dict[str, list[LogRow]] = {}
    for row in rows:
        streams.setdefault(row[0], []).append(row)
    figures = LogFigures(
        streams=len(streams),
        not_completed_once=[],
        pauses_resumed_twice=[],
        pauses_recorded_twice=[],
        claims_not_once=[],
        unexpected_streams=unplanned_streams(
            task_ids,
            {stream_id: [row[1] for row in events] for stream_id, events in streams.items()},
            k,
            rounds,
        ),
    )
    for task_id in task_ids:
        events = streams.get(task_id, [])
        figures.events.update(row[1] for row in events)
        figures.reply_ignored.update(row[4] or "?" for row in events if row[1] == "ReplyIgnored")
        decisive = [row[1] for row in events if row[1] != "ReplyIgnored"]
        terminal = "TaskFailed" if task_id in failed else "TaskCompleted"
        if [t for t in decisive if t in _TERMINAL] != [terminal] or decisive[-1] != terminal:
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


# ---- repeated results, against what explains them --------------------------------------------

_RECORD_OUTBOX_CLAIMS = [
    "CREATE TABLE IF NOT EXISTS test_outbox_claims (message_id text NOT NULL)",
    """
    CREATE OR REPLACE FUNCTION test_record_outbox_claim() RETURNS trigger AS $$
    BEGIN
        INSERT INTO test_outbox_claims (message_id) VALUES (NEW.message_id);
        RETURN NEW;
    END $$ LANGUAGE plpgsql
    """,
    """
    CREATE OR REPLACE TRIGGER test_record_outbox_claim AFTER UPDATE OF available_at ON outbox
    FOR EACH ROW EXECUTE FUNCTION test_record_outbox_claim()
    """,
]
_CLAIMS_OF = text(
    "SELECT message_id, count(*) FROM test_outbox_claims "
    "WHERE message_id = ANY(CAST(:ids AS text[])) GROUP BY message_id"
)


async def record_outbox_claims(store: PostgresEventStore) -> None:
    """Keep, in this test database, a row for every outbox row an outbox relay claims.

    The relay publishes only rows it claimed, so a message that comes twice without a claim
    behind the second was published twice by a worker itself: see :func:`unexplained_repeats`.
    A test-only trigger on the one statement that updates the outbox (the claim).
    """
    async with store.engine.begin() as connection:
        for statement in _RECORD_OUTBOX_CLAIMS:
            await connection.execute(text(statement))


async def relay_claims(store: PostgresEventStore, message_ids: Iterable[str]) -> Counter[str]:
    """How often a relay claimed each of these outbox messages (see record_outbox_claims)."""
    async with store.engine.connect() as connection:
        rows = await connection.execute(_CLAIMS_OF, {"ids": list(message_ids)})
        return Counter({message_id: int(count) for message_id, count in rows})


async def unexplained_repeats(
    store: PostgresEventStore, client: RecordingClient, task_ids: Iterable[str]
) -> list[str]:
    """Results are delivered at least once, not at random: a task's result message may come
    again only as often as a relay claimed it to publish again (its writer died, or forgot the
    row late) or the broker delivered it to the client again. A repeat beyond those is a
    worker publishing a result twice. Needs :func:`record_outbox_claims` before the run."""
    received = Counter(task_id for task_id, _ in client.received)
    ids = list(task_ids)
    claims = await relay_claims(store, [f"{task_id}:result" for task_id in ids])
    problems = []
    for task_id in ids:
        repeats = received[task_id] - 1
        explained = claims[f"{task_id}:result"] + client.redelivered[task_id]
        if repeats > explained:
            problems.append(
                f"{task_id}: result repeated {repeats} times, relayed {claims[f'{task_id}:result']}"
                f", redelivered {client.redelivered[task_id]}"
            )
    return problems


def result_messages(client: RecordingClient) -> str:
    """The result messages of a run, for a test's report."""
    tasks = len({task_id for task_id, _ in client.received})
    return (
        f"result messages {len(client.received)} (repeated {len(client.received) - tasks}; "
        f"redelivered {client.redelivered.total()})"
    )


async def fanout_problems(
    store: PostgresEventStore,
    collector: RecordingClient,
    inputs: dict[str, dict[str, float | int]],
    k: int,
) -> tuple[list[str], Counter[str]]:
    """Everything wrong with the results and streams of one-round example orchestrator tasks.

    Each task must have one distinct, correct result (:func:`result_figures`), repeated no more
    often than the relays and the broker explain (:func:`unexplained_repeats`: the run recorded
    outbox claims); its stream: what :func:`log_figures` checks, exactly the events of one
    round of K calls (audit-only ``ReplyIgnored`` aside), and a hash chain that verifies. Also
    returns the ``ReplyIgnored`` reasons seen.
    """
    planned = [
        "TaskStarted",
        "TaskPaused",
        *["SubtaskClaimed", "ResultRecorded"] * k,
        "TaskResumed",
        "TaskCompleted",
    ]
    expected = {
        task_id: {"n": int(spec["n"]), "total": expected_total(int(spec["n"]), k)}
        for task_id, spec in inputs.items()
    }
    results = result_figures(expected, collector.messages())
    problems = await unexplained_repeats(store, collector, inputs)
    problems.extend(f"{task_id}: no result" for task_id in results.missing)
    problems.extend(
        f"{task_id}: wrong or two different results {collector.bodies(task_id)}"
        for task_id in results.wrong
    )
    streams = {task_id: await store.read_stream(task_id) for task_id in inputs}
    log = log_figures(
        list(inputs), [log_row(e) for events in streams.values() for e in events], k, rounds=1
    )
    problems.extend(log.problem_lines())
    for task_id, events in streams.items():
        types = [e.event_type for e in events]
        if [t for t in types if t != "ReplyIgnored"] != planned:
            problems.append(f"{task_id}: stream {types}")
        problems.extend(chain_problems(events))
    return problems, log.reply_ignored
