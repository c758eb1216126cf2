"""What the page of a task shows (``waystation.console.pages.task``), read from its stream: its
timeline with the state after each event, its call tree, its open signal waits.

Everything but the call tree comes from the one read of the task's stream the page makes,
through the functions ``waystation history``, ``state`` and ``verify`` use
(``waystation.projections``), so the page and the CLI say the same things. The call tree needs
the streams of the task's relatives: one query for them all, bounded (:data:`MAX_CHILDREN`). A
child's id is the id of the call that asked for it (``parent:pause:index``,
``waystation.events.task.subtask_id``) and every event of a call tree names its root (metadata
``correlation_id``), so the ancestors are read off the id and checked against the log, and the
children off the task's own pauses.

The state after every event of a short stream is folded in one pass (``states_after``). Each
step of that fold copies the state's maps, and written out whole for each of thousands of events
the states would make a page of megabytes, so a long stream shows the state after its last event
and after one chosen on demand (``?state_at=<version>``), still in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from waystation.events.model import RecordedEvent
    from waystation.events.task import TaskState
    from waystation.projections.history import PastState, PauseSpan, TimelineEntry

__all__ = [
    "INLINE_STATES",
    "MAX_CHILDREN",
    "Relative",
    "Row",
    "Tree",
    "call_tree",
    "cancel_reason",
    "rows_of",
    "signal_waits",
]

MAX_CHILDREN = 200
"""Children of a task the call tree reads and shows, at most (a note says how many more)."""
INLINE_STATES = 100
"""Streams up to this many events show the whole state after each event; longer ones show the
state after the last event and, on demand, after one chosen event (a state per event of a
stream of thousands costs seconds and megabytes)."""

_TERMINAL = ("TaskCompleted", "TaskFailed", "TaskCancelled")


@dataclass(frozen=True, slots=True)
class Row:
    """One event of the timeline, with the state after it."""

    entry: TimelineEntry
    time: str
    actors: list[tuple[str, str]]
    """Who: (what, name) pairs: the person or tool that acted, the worker that wrote the event,
    the AMQP user of the message that caused it, a signal's sender."""
    waited: str | None
    state_line: str | None
    """The state after the event in a line, when the page has it (:func:`_states`)."""
    state: dict[str, Any] | None
    """The whole state after the event (``waystation state --json``), when shown."""
    open: bool = False


@dataclass(frozen=True, slots=True)
class Relative:
    """A task of the call tree: an ancestor, or a call of this task with what became of it."""

    task_id: str
    agent: str | None = None
    in_log: bool = False
    """Whether the log has its stream (a task that never paused, or a peer that is not a
    Waystation agent, has none)."""
    status: str | None = None
    """Its own stream's word: completed, failed, cancelled, or in progress."""
    outcome: str | None = None
    """For a call: what this task recorded of it (ok, error, timeout, given up, waiting)."""
    pause: int | None = None


@dataclass(slots=True)
class Tree:
    ancestors: list[Relative] = field(default_factory=list)
    """From the root down to the parent; empty for a root task."""
    children: list[Relative] = field(default_factory=list)
    more_children: int = 0


def _iso_time(moment: datetime | None) -> str:
    if moment is None:
        return "?"
    return moment.astimezone(UTC).isoformat(" ", "milliseconds")[:23]


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if value < 60 else f"{value / 60:.1f} min"


def _actors(event: RecordedEvent, entry: TimelineEntry) -> list[tuple[str, str]]:
    metadata = event.metadata
    shown = [
        (label, value)
        for label, value in (
            ("by", metadata.get("actor")),
            ("worker", entry.actor),
            ("AMQP user", metadata.get("amqp_user")),
        )
        if isinstance(value, str) and value
    ]
    if entry.sender and entry.sender != metadata.get("amqp_user"):
        shown.append(("sender", entry.sender))
    return shown


def _waited(
    entry: TimelineEntry, span: PauseSpan | None, finished: bool, now: datetime
) -> str | None:
    """How long the pause an event opens or closes waited (or has waited so far)."""
    if span is None:
        return None
    if entry.pause_seconds is not None:
        return _seconds(entry.pause_seconds)
    if span.resumed_version is None and span.paused_at is not None:
        if finished:
            return "never resumed"
        return f"waiting for {_seconds((now - span.paused_at).total_seconds())}"
    return None


def _state_line(state: TaskState) -> str:
    parts = [state.status]
    if state.pause:
        parts.append(f"pause #{state.pause}")
    if state.status == "paused":
        parts.append(f"{len(state.outstanding)} open")
    if state.results:
        parts.append(f"{len(state.results)} result(s)")
    return ", ".join(parts)


def _states(
    task_id: str, events: list[RecordedEvent], state_at: int | None
) -> dict[int, PastState]:
    """The states the page shows, by version: after every event of a short stream; after the
    last event of a long one, and after ``state_at`` when it names one of its events. Either
    way one pass over the stream."""
    from waystation.events.task import fold
    from waystation.projections.history import PastState, states_after

    if len(events) <= INLINE_STATES:
        return {past.state.version: past for past in states_after(task_id, events)}
    index = {event.stream_version: i for i, event in enumerate(events)}
    wanted = sorted({len(events) - 1, index.get(state_at or 0, len(events) - 1)})
    shown: dict[int, PastState] = {}
    state, done = None, 0
    for at in wanted:
        state = fold(task_id, events[done : at + 1], start=state)
        shown[events[at].stream_version] = PastState(state, events[at], events[at].global_position)
        done = at + 1
    return shown


def rows_of(
    task_id: str, events: list[RecordedEvent], state_at: int | None, now: datetime
) -> tuple[list[Row], TaskState]:
    """The timeline with the states shown (:func:`_states`), and the task's state now."""
    from waystation.projections.history import pauses, timeline

    spans = {span.paused_version: span for span in pauses(events)}
    spans.update({s.resumed_version: s for s in spans.values() if s.resumed_version is not None})
    states = _states(task_id, events, state_at)
    final = states[events[-1].stream_version].state
    rows = []
    for event, entry in zip(events, timeline(events), strict=True):
        version = event.stream_version
        past = states.get(version)
        rows.append(
            Row(
                entry=entry,
                time=_iso_time(entry.recorded_at),
                actors=_actors(event, entry),
                waited=_waited(entry, spans.get(version), final.finished, now),
                state_line=_state_line(past.state) if past is not None else None,
                state=past.to_json() if past is not None else None,
                open=version == state_at,
            )
        )
    return rows, final


def _ancestor_ids(task_id: str, root_id: str | None) -> list[str]:
    """The ids from the root down to the parent of ``task_id``: each call's id is its
    callee's task id, ``<caller>:<pause>:<index>``."""
    from waystation.events.task import parse_subtask_id

    if not root_id or root_id == task_id:
        return []
    chain: list[str] = []
    current = task_id
    while current != root_id and len(chain) < 100:
        try:
            current, _, _ = parse_subtask_id(current)
        except ValueError:
            break
        chain.append(current)
    if root_id not in chain:
        chain.append(root_id)  # the id does not lead to the root: show the root still
    return chain[::-1]


async def _streams(engine: AsyncEngine, ids: list[str]) -> dict[str, tuple[str | None, str]]:
    """For each of ``ids`` the log has a stream of: its agent and its status, in one query."""
    if not ids:
        return {}
    async with engine.connect() as connection:
        result = await connection.execute(
            text(
                "SELECT stream_id, max(data->>'agent') FILTER (WHERE event_type = 'TaskStarted'), "
                "max(event_type) FILTER (WHERE event_type = ANY(CAST(:terminal AS text[]))) "
                "FROM events WHERE stream_id = ANY(CAST(:ids AS text[])) GROUP BY stream_id"
            ),
            {"ids": ids, "terminal": list(_TERMINAL)},
        )
        return {
            row[0]: (row[1], row[2].removeprefix("Task").lower() if row[2] else "in progress")
            for row in result
        }


def _outcome(state: TaskState, call_id: str) -> str:
    result = state.results.get(call_id)
    if result is not None:
        return result.outcome
    if call_id in state.abandoned:
        return "given up"
    if state.status == "cancelled":
        return "cancelled with the task"
    return "waiting"


async def call_tree(
    engine: AsyncEngine, task_id: str, events: list[RecordedEvent], state: TaskState
) -> Tree:
    """The task's ancestors and its calls (at most :data:`MAX_CHILDREN`), with their streams."""
    from waystation.events.model import TaskPaused, parse

    calls = [
        (paused.pause, call)
        for event in events
        if event.event_type == "TaskPaused" and isinstance(paused := parse(event), TaskPaused)
        for call in paused.calls
        if call.kind == "call"
    ]
    ancestors = _ancestor_ids(task_id, state.root_id)
    shown = calls[:MAX_CHILDREN]
    streams = await _streams(engine, [*ancestors, *(call.subtask_id for _, call in shown)])
    tree = Tree(more_children=len(calls) - len(shown))
    for ancestor in ancestors:
        agent, status = streams.get(ancestor, (None, None))
        tree.ancestors.append(Relative(ancestor, agent, ancestor in streams, status))
    for pause, call in shown:
        _, status = streams.get(call.subtask_id, (None, None))
        tree.children.append(
            Relative(
                call.subtask_id,
                call.agent,
                call.subtask_id in streams,
                status,
                _outcome(state, call.subtask_id),
                pause,
            )
        )
    return tree


def signal_waits(state: TaskState) -> list[dict[str, Any]]:
    """The open signal waits, as the signal form (``_signal_form.html``) takes them."""
    if state.status != "paused":
        return []
    return [
        {
            "name": wait.name,
            "signal_schema": wait.signal_schema,
            "subtask_id": wait.subtask_id,
            "deadline_at": wait.deadline_at,
        }
        for wait in state.outstanding
        if wait.kind == "signal"
    ]


def cancel_reason(events: list[RecordedEvent]) -> str | None:
    for event in reversed(events):
        if event.event_type == "TaskCancelled":
            reason = event.data.get("reason")
            return reason if isinstance(reason, str) else None
    return None
