"""The projections as pure functions: a batch of the log's events in, rows changed out.

A runner (``waystation.projections.postgres``) reads the log in commit order as :class:`FeedEvent`
records, each carrying the few fields a projection needs plus two facts looked up in the same stream
(the task's agent from its ``TaskStarted``, and for a resume or a timeout the pause it belongs to).
The folds here turn a batch into row changes; the runner writes them set-based, with its
checkpoint, in one transaction. Nothing here does I/O, so a batch applied to the rows it
touches gives the same rows however the log is cut into batches: rebuilding from position zero
reproduces the live tables (G8).

* Paused tasks: one row per task that has paused and not finished. ``status`` is ``paused``
  while it waits for results, ``resumed`` once its pause has what it waits for and it runs
  again; the row goes when the task completes, fails or is cancelled. A paused row lists its
  open waits (:class:`OpenWait`: a peer call and its agent, a signal and its name, a timer),
  each with its deadline, so that an operator sees what each task waits for and until when.
  ``waits_expected`` counts the pause's waits of every kind and ``waits_recorded`` those with a
  result; a ``FirstK`` pause (``first_k``) resumes before every wait has one, and its resume
  gives the others up, so a resumed row may show fewer results than waits.
* Agent statistics: counters per agent, added up (the fold returns increments): tasks
  completed, failed and cancelled (as the log records them: tasks that paused at least once, or
  every task with ``WAYSTATION_AUDIT_ALL_TASKS``), tasks paused now, calls *to* the agent that
  timed out, pauses resumed and their total duration in microseconds (an integer, so the sum is
  exact in any order).
* Agent activity by the minute (``agent_minutes``): tasks started, completed, failed and
  cancelled per agent and minute, with a histogram of latencies; its fold, and why it keeps
  only a day of rows, are in :mod:`waystation.projections.activity`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from .waits import wait_label

__all__ = [
    "UNKNOWN_AGENT",
    "AgentCounts",
    "FeedEvent",
    "OpenWait",
    "PausedTask",
    "PausedTaskChanges",
    "fold_agent_stats",
    "fold_paused_tasks",
    "open_waits",
]

UNKNOWN_AGENT = "?"
"""The agent of a task whose stream has no ``TaskStarted`` (cancelled before it ever ran)."""

_TERMINAL = frozenset({"TaskCompleted", "TaskFailed", "TaskCancelled"})


@dataclass(frozen=True, slots=True)
class OpenWait:
    """One wait a paused task has open: a peer call (``agent``), a signal (``name``) or a
    timer, and its deadline (a timer's: the moment it fires), in seconds since the epoch."""

    subtask_id: str
    kind: str
    deadline_at: float
    agent: str | None = None
    name: str | None = None

    @property
    def label(self) -> str:
        """What the wait is for, in a word or two: ``call researcher``, ``signal approval``,
        ``timer``."""
        return wait_label(self.kind, self.agent, self.name)

    def to_json(self) -> dict[str, Any]:
        shown: dict[str, Any] = {
            "subtask_id": self.subtask_id,
            "kind": self.kind,
            "deadline_at": self.deadline_at,
        }
        if self.agent is not None:
            shown["agent"] = self.agent
        if self.name is not None:
            shown["name"] = self.name
        return shown

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OpenWait:
        return cls(
            subtask_id=data["subtask_id"],
            kind=data["kind"],
            deadline_at=data["deadline_at"],
            agent=data.get("agent"),
            name=data.get("name"),
        )


def open_waits(calls: Iterable[Mapping[str, Any]]) -> tuple[OpenWait, ...]:
    """The waits of a ``TaskPaused``'s stored ``calls`` (a wait stored without a kind, as every
    wait was before signals and timers, is a call; only a call has an agent)."""
    waits = []
    for call in calls:
        kind = call.get("kind") or "call"
        waits.append(
            OpenWait(
                subtask_id=call["subtask_id"],
                kind=kind,
                deadline_at=call["deadline_at"],
                agent=call.get("agent") if kind == "call" else None,
                name=call.get("name"),
            )
        )
    return tuple(waits)


@dataclass(frozen=True, slots=True)
class FeedEvent:
    """One event of the log as the projections see it."""

    tx_id: int
    global_position: int
    stream_id: str
    event_type: str
    recorded_at: datetime
    task_agent: str | None = None
    """The agent of the stream's ``TaskStarted``; None when the stream has none."""
    subtask_id: str | None = None
    pause: int | None = None
    outcome: str | None = None
    """A ``ResultRecorded``'s outcome: ok, error or timeout."""
    deadline_at: float | None = None
    """A ``DeadlineExtended``'s new deadline (seconds since the epoch)."""
    waits: tuple[OpenWait, ...] | None = None
    """A ``TaskPaused``'s waits, in order."""
    first_k: int | None = None
    """A ``TaskPaused``'s ``FirstK`` (``until``), when it has one."""
    agent_version: str | None = None
    """A ``TaskPaused``'s agent version, when it records one."""
    while_paused: bool = False
    """For a ``TaskCancelled``: the task was paused (its latest pause had not resumed). Not
    ``pending``, which names only the calls to cancel: a task paused on signals or timers alone
    has none."""
    paused_at: datetime | None = None
    """For a ``TaskResumed``: when the pause it ends began."""
    call_agent: str | None = None
    """For a timed-out ``ResultRecorded``: the agent that was called ("" for a signal's wait)."""
    started_at: datetime | None = None
    """For a ``TaskCompleted`` or ``TaskFailed``: when the stream's ``TaskStarted`` was recorded,
    if in an earlier transaction (one recorded with the finish tells nothing of how long the
    task took)."""


@dataclass(frozen=True, slots=True)
class PausedTask:
    """A row of the paused-tasks projection."""

    task_id: str
    agent: str
    pause: int
    waits_expected: int
    """The pause's waits, of every kind."""
    waits_recorded: int
    """The pause's waits with a result."""
    paused_since: datetime
    status: str
    """``paused`` (waiting for results) or ``resumed`` (running again)."""
    waits: tuple[OpenWait, ...] = ()
    """The waits still open, in the pause's order (none once resumed)."""
    first_k: int | None = None
    """The pause resumes after this many successes (``FirstK``); None: once every wait ends."""
    agent_version: str | None = None
    """The agent version the pause recorded."""

    @property
    def earliest_deadline(self) -> float | None:
        return min(w.deadline_at for w in self.waits) if self.waits else None


@dataclass(frozen=True, slots=True)
class PausedTaskChanges:
    upserts: dict[str, PausedTask]
    deletes: set[str]


def fold_paused_tasks(
    rows: Mapping[str, PausedTask], events: Iterable[FeedEvent]
) -> PausedTaskChanges:
    """Apply a batch to the rows of the tasks it touches (``rows``: their current state)."""
    current: dict[str, PausedTask | None] = dict(rows)
    touched: set[str] = set()
    for event in events:
        task_id = event.stream_id
        row = current.get(task_id)
        kind = event.event_type
        if kind == "TaskPaused":
            waits = event.waits or ()
            row = PausedTask(
                task_id=task_id,
                agent=event.task_agent or UNKNOWN_AGENT,
                pause=event.pause or 0,
                waits_expected=len(waits),
                waits_recorded=0,
                paused_since=event.recorded_at,
                status="paused",
                waits=waits,
                first_k=event.first_k,
                agent_version=event.agent_version,
            )
        elif row is None:
            continue
        elif kind == "ResultRecorded" and _is_open(row, event.subtask_id):
            waits = tuple(w for w in row.waits if w.subtask_id != event.subtask_id)
            row = replace(row, waits_recorded=row.waits_recorded + 1, waits=waits)
        elif kind == "DeadlineExtended" and _is_open(row, event.subtask_id):
            assert event.deadline_at is not None
            waits = tuple(
                replace(w, deadline_at=event.deadline_at) if w.subtask_id == event.subtask_id else w
                for w in row.waits
            )
            row = replace(row, waits=waits)
        elif kind == "TaskResumed":
            # a FirstK pause's resume gives up the waits still open: none is open any more
            row = replace(row, status="resumed", waits=())
        elif kind in _TERMINAL:
            row = None
        else:
            continue
        current[task_id] = row
        touched.add(task_id)
    upserts = {t: r for t in touched if (r := current[t]) is not None}
    deletes = {t for t in touched if current[t] is None and t in rows}
    return PausedTaskChanges(upserts, deletes)


def _is_open(row: PausedTask, subtask_id: str | None) -> bool:
    return any(w.subtask_id == subtask_id for w in row.waits)


@dataclass(slots=True)
class AgentCounts:
    """Increments (or totals) of one agent's statistics."""

    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    paused_now: int = 0
    timeouts: int = 0
    pauses_resumed: int = 0
    pause_microseconds: int = 0

    @property
    def mean_pause_seconds(self) -> float | None:
        if not self.pauses_resumed:
            return None
        return self.pause_microseconds / self.pauses_resumed / 1e6

    def to_json(self) -> dict[str, Any]:
        """The totals as ``waystation status --json`` shows them (the mean, not the sum, of
        the pauses)."""
        return {
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "paused_now": self.paused_now,
            "timeouts": self.timeouts,
            "pauses_resumed": self.pauses_resumed,
            "mean_pause_seconds": self.mean_pause_seconds,
        }


def _microseconds(start: datetime, end: datetime) -> int:
    delta = end - start
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def fold_agent_stats(events: Iterable[FeedEvent]) -> dict[str, AgentCounts]:
    """The increments a batch adds to each agent's counters."""
    counts: dict[str, AgentCounts] = {}

    def of(agent: str | None) -> AgentCounts:
        key = agent or UNKNOWN_AGENT
        found = counts.get(key)
        if found is None:
            found = counts[key] = AgentCounts()
        return found

    for event in events:
        kind = event.event_type
        if kind == "TaskPaused":
            of(event.task_agent).paused_now += 1
        elif kind == "TaskResumed":
            agent = of(event.task_agent)
            agent.paused_now -= 1
            agent.pauses_resumed += 1
            if event.paused_at is not None:
                agent.pause_microseconds += _microseconds(event.paused_at, event.recorded_at)
        elif kind == "ResultRecorded" and event.outcome == "timeout" and event.call_agent != "":
            # a signal's wait that timed out has no agent (""): it was no call to one
            of(event.call_agent).timeouts += 1
        elif kind == "TaskCompleted":
            of(event.task_agent).completed += 1
        elif kind == "TaskFailed":
            of(event.task_agent).failed += 1
        elif kind == "TaskCancelled":
            agent = of(event.task_agent)
            agent.cancelled += 1
            if event.while_paused:
                agent.paused_now -= 1
    return counts
