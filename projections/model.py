"""The projections as pure functions: a batch of the log's events in, rows changed out.

A runner (``waystation.projections.postgres``) reads the log in commit order as :class:`FeedEvent`
records, each carrying the few fields a projection needs plus two facts looked up in the same stream
(the task's agent from its ``TaskStarted``, and for a resume or a timeout the pause it belongs to).
The folds here turn a batch into row changes; the runner writes them set-based, with its
checkpoint, in one transaction. Nothing here does I/O, so a batch applied to the rows it
touches gives the same rows however the log is cut into batches: rebuilding from position zero
reproduces the live tables (G8).

* Paused tasks: one row per task that has paused and not finished. ``status`` is ``paused``
  while it waits for results, ``resumed`` once every result is in and it runs again; the row
  goes when the task completes, fails or is cancelled.
* Agent statistics: counters per agent, added up (the fold returns increments): tasks
  completed, failed and cancelled (as the log records them: tasks that paused at least once, or
  every task with ``WAYSTATION_AUDIT_ALL_TASKS``), tasks paused now, calls *to* the agent that
  timed out, pauses resumed and their total duration in microseconds (an integer, so the sum is
  exact in any order).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

__all__ = [
    "UNKNOWN_AGENT",
    "AgentCounts",
    "FeedEvent",
    "PausedTask",
    "PausedTaskChanges",
    "fold_agent_stats",
    "fold_paused_tasks",
]

UNKNOWN_AGENT = "?"
"""The agent of a task whose stream has no ``TaskStarted`` (cancelled before it ever ran)."""

_TERMINAL = frozenset({"TaskCompleted", "TaskFailed", "TaskCancelled"})


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
    deadlines: Mapping[str, float] | None = None
    """A ``TaskPaused``'s calls: sub-task id to deadline."""
    pending: int = 0
    """A ``TaskCancelled``'s calls still pending (more than 0: it was cancelled while paused)."""
    paused_at: datetime | None = None
    """For a ``TaskResumed``: when the pause it ends began."""
    call_agent: str | None = None
    """For a timed-out ``ResultRecorded``: the agent that was called."""


@dataclass(frozen=True, slots=True)
class PausedTask:
    """A row of the paused-tasks projection."""

    task_id: str
    agent: str
    pause: int
    calls_expected: int
    calls_recorded: int
    paused_since: datetime
    status: str
    """``paused`` (waiting for results) or ``resumed`` (running again)."""
    deadlines: Mapping[str, float] = field(default_factory=dict)
    """The calls still waiting for a result, with their deadlines."""

    @property
    def earliest_deadline(self) -> float | None:
        return min(self.deadlines.values()) if self.deadlines else None


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
            deadlines = dict(event.deadlines or {})
            row = PausedTask(
                task_id=task_id,
                agent=event.task_agent or UNKNOWN_AGENT,
                pause=event.pause or 0,
                calls_expected=len(deadlines),
                calls_recorded=0,
                paused_since=event.recorded_at,
                status="paused",
                deadlines=deadlines,
            )
        elif row is None:
            continue
        elif kind == "ResultRecorded" and event.subtask_id in row.deadlines:
            deadlines = {k: v for k, v in row.deadlines.items() if k != event.subtask_id}
            row = replace(row, calls_recorded=row.calls_recorded + 1, deadlines=deadlines)
        elif kind == "DeadlineExtended" and event.subtask_id in row.deadlines:
            assert event.subtask_id is not None and event.deadline_at is not None
            row = replace(row, deadlines={**row.deadlines, event.subtask_id: event.deadline_at})
        elif kind == "TaskResumed":
            row = replace(row, status="resumed", deadlines={})
        elif kind in _TERMINAL:
            row = None
        else:
            continue
        current[task_id] = row
        touched.add(task_id)
    upserts = {t: r for t in touched if (r := current[t]) is not None}
    deletes = {t for t in touched if current[t] is None and t in rows}
    return PausedTaskChanges(upserts, deletes)


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
        elif kind == "ResultRecorded" and event.outcome == "timeout":
            of(event.call_agent).timeouts += 1
        elif kind == "TaskCompleted":
            of(event.task_agent).completed += 1
        elif kind == "TaskFailed":
            of(event.task_agent).failed += 1
        elif kind == "TaskCancelled":
            agent = of(event.task_agent)
            agent.cancelled += 1
            if event.pending:
                agent.paused_now -= 1
    return counts
