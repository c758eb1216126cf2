"""A task's history, read for people: its timeline, its pauses, and its state at a past point.
Pure functions of a stream's events (``waystation.projections.audit.read_streams`` reads them).

``timeline`` turns the stream into one readable entry per event, with how long each pause lasted:
what each pause waits for (peer calls, signals, timers, the first k of them) and the agent
version that paused, each signal with its sender and the wait that took it (or that it was
kept, or refused and why), a timer firing, and the waits a resume gave up. A signal or a cancel
whose publisher named who acted (the metadata's ``actor``, ``console:alice``) says so, and so
does a dead-letter replay in the operations stream (``DeadLettersReplayed``).

``state_as_of`` is what ``waystation.events.task.fold`` said about a task at a past position or
time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from waystation.events.codec import canonical
from waystation.events.model import (
    DeadLettersReplayed,
    DeadlineExtended,
    DomainEvent,
    PendingCall,
    RecordedEvent,
    ReplyIgnored,
    ResultRecorded,
    SignalReceived,
    SignalRefused,
    SubtaskClaimed,
    TaskCancelled,
    TaskCompleted,
    TaskFailed,
    TaskPaused,
    TaskResumed,
    TaskStarted,
    UnknownEvent,
)
from waystation.events.task import TaskState, fold

from .audit import _parsed
from .waits import describe_claim, describe_pause

__all__ = [
    "PastState",
    "PauseSpan",
    "TimelineEntry",
    "pauses",
    "state_as_of",
    "states_after",
    "timeline",
]


# ---- timeline ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PauseSpan:
    """One pause of a task: when it paused, when it resumed (None while it still waits)."""

    pause: int
    paused_version: int
    paused_at: datetime | None
    resumed_version: int | None = None
    resumed_at: datetime | None = None
    agent_version: str | None = None
    """The version of the agent's code that paused, when the pause records one."""

    @property
    def seconds(self) -> float | None:
        if self.paused_at is None or self.resumed_at is None:
            return None
        return (self.resumed_at - self.paused_at).total_seconds()

    def to_json(self) -> dict[str, Any]:
        return {
            "pause": self.pause,
            "paused_version": self.paused_version,
            "paused_at": _iso(self.paused_at),
            "resumed_version": self.resumed_version,
            "resumed_at": _iso(self.resumed_at),
            "seconds": self.seconds,
            "agent_version": self.agent_version,
        }


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    """One event of a task's history, for people."""

    version: int
    recorded_at: datetime | None
    event_type: str
    actor: str | None
    """The worker that wrote the event (its metadata's ``worker_id``)."""
    summary: str
    pause_seconds: float | None = None
    """On a ``TaskPaused`` and its ``TaskResumed``: how long that pause lasted."""
    trace_id: str | None = None
    """The trace the event was written under (its metadata's ``trace_id``)."""
    sender: str | None = None
    """On a ``SignalReceived`` or ``SignalRefused``: who sent the signal (the AMQP user)."""
    acted_by: str | None = None
    """Who acted, when the event records one (its metadata's ``actor``: the person or tool
    behind a cancel, a signal or a dead-letter replay, ``console:alice``); ``actor`` above is
    the worker."""

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "recorded_at": _iso(self.recorded_at),
            "event_type": self.event_type,
            "actor": self.actor,
            "summary": self.summary,
            "pause_seconds": self.pause_seconds,
            "trace_id": self.trace_id,
            "sender": self.sender,
            "acted_by": self.acted_by,
        }


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def pauses(events: Sequence[RecordedEvent]) -> list[PauseSpan]:
    """Every pause of the stream with its resume, in pause order."""
    spans: dict[int, PauseSpan] = {}
    for event in events:
        parsed = _parsed(event)
        if isinstance(parsed, TaskPaused) and parsed.pause not in spans:
            spans[parsed.pause] = PauseSpan(
                parsed.pause,
                event.stream_version,
                event.recorded_at,
                agent_version=parsed.agent_version,
            )
        elif isinstance(parsed, TaskResumed):
            span = spans.get(parsed.pause)
            if span is not None and span.resumed_version is None:
                spans[parsed.pause] = replace(
                    span, resumed_version=event.stream_version, resumed_at=event.recorded_at
                )
    return [spans[number] for number in sorted(spans)]


def _short(value: Any, limit: int = 60) -> str:
    try:
        text = canonical(value).decode()
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _from(sender: str | None, actor: str | None) -> str:
    """Who sent a signal: `` from guest (console:alice)``, `` from guest``, `` from
    console:alice``, or nothing."""
    if sender and actor:
        return f" from {sender} ({actor})"
    return f" from {sender or actor}" if sender or actor else ""


def _actor(event: RecordedEvent) -> str | None:
    actor = event.metadata.get("actor")
    return actor if isinstance(actor, str) else None


def _signal(
    received: SignalReceived, taken_by: tuple[str, int] | None, version: int, actor: str | None
) -> str:
    sender = _from(received.sender, actor)
    what = f"signal {received.name} ({received.signal_id}){sender} {_short(received.payload, 40)}"
    if taken_by is None:
        return f"{what}: kept, no wait has taken it"
    wait, at = taken_by
    if at == version + 1:
        return f"{what}: taken by {wait}"
    return f"{what}: kept, then taken by {wait} at v{at}"


def _summary(
    event: RecordedEvent,
    parsed: DomainEvent | None,
    span: PauseSpan | None,
    waits: Mapping[str, PendingCall],
    taken: Mapping[str, tuple[str, int]],
) -> str:
    if parsed is None:
        return f"unreadable {event.event_type} event"
    if isinstance(parsed, TaskStarted):
        return f"started {parsed.agent} with input {_short(parsed.input)}"
    if isinstance(parsed, TaskPaused):
        return f"paused #{parsed.pause} {describe_pause(parsed)}"
    if isinstance(parsed, SubtaskClaimed):
        return describe_claim(parsed, waits.get(parsed.subtask_id))
    if isinstance(parsed, ResultRecorded):
        return f"result {parsed.outcome} for {parsed.subtask_id}"
    if isinstance(parsed, TaskResumed):
        seconds = span.seconds if span is not None else None
        after = f" after {seconds:.3f} s" if seconds is not None else ""
        given_up = ", ".join(c.subtask_id for c in parsed.abandoned)
        gave_up = f", giving up {given_up}" if given_up else ""
        return f"resumed from pause #{parsed.pause}{after}{gave_up}"
    if isinstance(parsed, SignalReceived):
        return _signal(parsed, taken.get(parsed.signal_id), event.stream_version, _actor(event))
    if isinstance(parsed, SignalRefused):
        sender = _from(parsed.sender, _actor(event))
        detail = f" ({parsed.detail})" if parsed.detail else ""
        return f"refused signal {parsed.name} ({parsed.signal_id}){sender}: {parsed.reason}{detail}"
    if isinstance(parsed, TaskCompleted):
        return "completed"
    if isinstance(parsed, TaskFailed):
        return f"failed: {_short(parsed.error)}"
    if isinstance(parsed, TaskCancelled):
        reason = f": {parsed.reason}" if parsed.reason else ""
        pending = f" ({len(parsed.pending)} call(s) still pending)" if parsed.pending else ""
        by = f" by {_actor(event)}" if _actor(event) else ""
        return f"cancelled{by}{reason}{pending}"
    if isinstance(parsed, DeadLettersReplayed):
        of = f" of reason {parsed.reason}" if parsed.reason else ""
        by = f" by {parsed.actor}" if parsed.actor else ""
        return f"replayed {parsed.count} dead letter(s){of} to {', '.join(parsed.queues)}{by}"
    if isinstance(parsed, DeadlineExtended):
        moment = datetime.fromtimestamp(parsed.deadline_at).astimezone().isoformat()
        return f"deadline of {parsed.subtask_id} extended to {moment}"
    if isinstance(parsed, ReplyIgnored):
        outcome = f" {parsed.outcome}" if parsed.outcome else ""
        return f"ignored {parsed.reason}{outcome} reply for {parsed.subtask_id}"
    if isinstance(parsed, UnknownEvent):
        if parsed.reason == "unknown-type" and parsed.type_name.startswith("penguiflow."):
            # a PenguiFlow record (workers/contrib/penguiflow): its fields of note, as they are
            shown = {
                k: v
                for k, v in event.data.items()
                if k in {"kind", "node_name", "task_id", "id", "key", "token", "trace_id"}
                and v is not None
            }
            detail = " ".join(f"{k}={_short(v, 40)}" for k, v in shown.items())
            return f"{parsed.type_name.removeprefix('penguiflow.')} {detail}".rstrip()
        if parsed.reason == "unknown-type":
            return f"event of unknown type {parsed.type_name}"
        return (
            f"{parsed.type_name} of schema v{parsed.stored_version}, which this code cannot "
            f"read ({parsed.reason})"
        )
    return event.event_type


_SIGNALS = (SignalReceived, SignalRefused)


def timeline(events: Sequence[RecordedEvent]) -> list[TimelineEntry]:
    """One readable entry per event of a task's stream, in stream order."""
    spans = {span.pause: span for span in pauses(events)}
    parsed_events = [_parsed(event) for event in events]
    # the wait that took each signal, and where: the claim naming it
    taken = {
        p.message_id: (p.subtask_id, e.stream_version)
        for e, p in zip(events, parsed_events, strict=True)
        if isinstance(p, SubtaskClaimed) and p.message_id is not None
    }
    waits: dict[str, PendingCall] = {}
    entries = []
    for event, parsed in zip(events, parsed_events, strict=True):
        if isinstance(parsed, TaskPaused):
            waits.update((w.subtask_id, w) for w in parsed.calls)
        span: PauseSpan | None = None
        if isinstance(parsed, TaskPaused | TaskResumed):
            span = spans.get(parsed.pause)
            if span is not None and event.stream_version not in (
                span.paused_version,
                span.resumed_version,
            ):
                span = None  # a second pause or resume of the same number (verify reports it)
        actor = event.metadata.get("worker_id")
        trace = event.metadata.get("trace_id")
        entries.append(
            TimelineEntry(
                version=event.stream_version,
                recorded_at=event.recorded_at,
                event_type=event.event_type,
                actor=actor if isinstance(actor, str) else None,
                summary=_summary(event, parsed, span, waits, taken),
                pause_seconds=span.seconds if span is not None else None,
                trace_id=trace if isinstance(trace, str) else None,
                sender=parsed.sender if isinstance(parsed, _SIGNALS) else None,
                acted_by=_actor(event),
            )
        )
    return entries


# ---- state as of a past point --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PastState:
    """A task's state folded from its events up to a point: a position, a time, or both."""

    state: TaskState
    last_event: RecordedEvent | None
    """The last event included (None when none is at or before the point)."""
    position: int | None = None
    at: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        state, last = self.state, self.last_event
        return {
            "task_id": state.task_id,
            "as_of": {"position": self.position, "at": _iso(self.at)},
            "last_event": None
            if last is None
            else {
                "version": last.stream_version,
                "event_type": last.event_type,
                "global_position": last.global_position,
                "recorded_at": _iso(last.recorded_at),
            },
            "status": state.status,
            "agent": state.agent,
            "pause": state.pause,
            "version": state.version,
            "state": dict(state.state),
            "first_k": state.until,
            "agent_version": state.agent_version,
            "outstanding": [
                {
                    "subtask_id": call.subtask_id,
                    "kind": call.kind,
                    "agent": call.agent,
                    "name": call.name,
                    "deadline_at": call.deadline_at,
                    "input": call.input,
                }
                for call in state.outstanding
            ],
            "results": [
                {
                    "subtask_id": result.subtask_id,
                    "kind": result.kind,
                    "agent": result.agent,
                    "name": result.name,
                    "sender": result.sender,
                    "outcome": result.outcome,
                    "value": result.value,
                    "error": result.error,
                }
                for result in state.results.values()
            ],
            "abandoned": sorted(state.abandoned),
            "kept_signals": [
                {
                    "signal_id": signal_id,
                    "name": state.signals[signal_id].name,
                    "sender": state.signals[signal_id].sender,
                }
                for signal_id in state.kept
            ],
            "result": state.result,
            "error": state.error,
        }


def state_as_of(
    task_id: str,
    events: Sequence[RecordedEvent],
    *,
    position: int | None = None,
    at: datetime | None = None,
) -> PastState:
    """``fold`` of the task's events with ``global_position <= position`` and ``recorded_at <=
    at`` (each bound only when given; a naive ``at`` is taken as UTC).

    ``recorded_at`` is when the writing transaction started, so a time names what had been
    decided by then, not what was visible at that instant.
    """
    if at is not None and at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    included = [
        event
        for event in events
        if (position is None or event.global_position <= position)
        and (at is None or (event.recorded_at is not None and event.recorded_at <= at))
    ]
    return PastState(
        state=fold(task_id, included),
        last_event=included[-1] if included else None,
        position=position,
        at=at,
    )


def states_after(task_id: str, events: Sequence[RecordedEvent]) -> Iterator[PastState]:
    """The task's state after each of its events, in stream order, folded in one pass: each
    state goes on from the one before (``fold(..., start=)``), so a stream of n events costs n
    steps, not the n folds from scratch of calling :func:`state_as_of` at every position (a
    console shows the state after every event of a task of thousands)."""
    state: TaskState | None = None
    for event in events:
        state = fold(task_id, (event,), start=state)
        yield PastState(state=state, last_event=event, position=event.global_position)
