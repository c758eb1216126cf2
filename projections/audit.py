"""Audit of the event log: verify a stream, and read it as a timeline. Pure functions, but for
``read_streams``, which reads the log through the store's port.

``verify_stream`` checks one task's stream as the log holds it: contiguous versions from 1, the
hash chain (each ``prev_hash`` links to the event before, each ``hash`` matches the content), and
the invariants of the task's state machine (docs/guarantees.md): a sub-task is claimed at most once
(G2), a pause is resumed at most once and only after every one of its calls has a result (G3),
every result follows its claim, and nothing but audit-only events follows a terminal event.

``verify_stream`` also checks part of a stream (``partial=True``, e.g. a position range of an
export): the chain is then anchored at the first event's stored ``prev_hash``, and an invariant is
checked only where the events it needs are there, that is for the pauses whose ``TaskPaused`` is
among them. Events whose values were redacted (``redacted_versions``) keep their links and
invariants checked, but their content hash cannot be recomputed: it covers the secret.

``timeline`` turns the stream into one readable entry per event, with how long each pause lasted.

``state_as_of`` is what ``waystation.events.task.fold`` said about a task at a past position or
time.

``read_streams`` gives the audit its input: one task's stream, or every stream of the log.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence, Set
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from waystation.events.codec import GENESIS_HASH, canonical, chain_hash
from waystation.events.model import (
    DeadlineExtended,
    DomainEvent,
    RecordedEvent,
    ReplyIgnored,
    ResultRecorded,
    SubtaskClaimed,
    TaskCancelled,
    TaskCompleted,
    TaskFailed,
    TaskPaused,
    TaskResumed,
    TaskStarted,
    UnknownEvent,
    parse,
)
from waystation.events.store import EventStore, Position
from waystation.events.task import TaskState, fold

__all__ = [
    "PastState",
    "PauseSpan",
    "Problem",
    "TimelineEntry",
    "pauses",
    "read_streams",
    "state_as_of",
    "timeline",
    "verify_stream",
]


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a stream, at the event where it shows."""

    stream_id: str
    stream_version: int
    kind: str
    """``version-gap``, ``broken-link``, ``hash-mismatch``, ``unreadable``, ``double-claim``,
    ``double-result``, ``result-without-claim``, ``double-resume``, ``early-resume``,
    ``after-terminal``, ``foreign-event``, ``unsupported-version`` (a schema version this code
    cannot read, see ``waystation.events.upcasting``: its invariants could not be checked), or, in
    an export only, ``bad-redaction`` (see ``waystation.projections.export``)."""
    message: str

    def __str__(self) -> str:
        return f"{self.stream_id} v{self.stream_version}: {self.kind}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {
            "stream_id": self.stream_id,
            "stream_version": self.stream_version,
            "kind": self.kind,
            "message": self.message,
        }


def _parsed(event: RecordedEvent) -> DomainEvent | None:
    try:
        return parse(event)
    except Exception:  # tampered or malformed data: reported as unreadable
        return None


def verify_stream(
    events: Sequence[RecordedEvent],
    *,
    partial: bool = False,
    redacted_versions: Set[int] = frozenset(),
) -> list[Problem]:
    """Everything wrong with one stream's events (in version order); empty when it verifies.

    ``partial``: the events may start after version 1 (the module docstring says what is then
    checked). ``redacted_versions``: the versions whose content hash is not checked.
    """
    problems: list[Problem] = []
    if not events:
        return problems
    stream_id = events[0].stream_id
    expected_version = events[0].stream_version if partial else 1
    previous_hash = events[0].prev_hash if partial else GENESIS_HASH
    calls_of_pause: dict[int, tuple[str, ...]] = {}
    claimed: set[str] = set()
    results: set[str] = set()
    resumed: set[int] = set()
    terminal: RecordedEvent | None = None

    def seen(pause: int) -> bool:
        """Whether every event of ``pause`` from its TaskPaused on is among ``events``."""
        return not partial or pause in calls_of_pause

    for event in events:
        version = event.stream_version

        def problem(kind: str, message: str, version: int = version) -> None:
            problems.append(Problem(stream_id, version, kind, message))

        if event.stream_id != stream_id:
            problem("foreign-event", f"event of stream {event.stream_id!r} in {stream_id!r}")
        if version != expected_version:
            problem("version-gap", f"expected version {expected_version}, found {version}")
        expected_version = version + 1
        if event.prev_hash != previous_hash:
            problem(
                "broken-link",
                f"prev_hash {event.prev_hash.hex()[:16]}… does not link to the previous event's "
                f"hash {previous_hash.hex()[:16]}…",
            )
        previous_hash = event.hash
        if version not in redacted_versions:
            try:
                computed = chain_hash(event.prev_hash, event.hash_body())
            except (TypeError, ValueError) as error:
                problem("hash-mismatch", f"{event.event_type} cannot be hashed: {error}")
            else:
                if computed != event.hash:
                    problem(
                        "hash-mismatch",
                        f"{event.event_type}: stored hash {event.hash.hex()[:16]}… does not "
                        f"match its content (computed {computed.hex()[:16]}…)",
                    )

        parsed = _parsed(event)
        if parsed is None:
            if version not in redacted_versions:  # a redaction may replace a field it needs
                problem("unreadable", f"{event.event_type} data does not parse: {event.data!r}")
            continue
        if isinstance(parsed, UnknownEvent) and parsed.reason != "unknown-type":
            problem(
                "unsupported-version",
                f"{event.event_type} schema v{event.schema_version} cannot be read by this code "
                f"({parsed.reason}); its invariants were not checked",
            )
            continue
        if terminal is not None and not type(parsed).audit_only:
            problem(
                "after-terminal",
                f"{event.event_type} after the terminal {terminal.event_type} "
                f"at v{terminal.stream_version}",
            )
        if type(parsed).terminal and terminal is None:
            terminal = event

        if isinstance(parsed, TaskPaused):
            calls_of_pause[parsed.pause] = tuple(c.subtask_id for c in parsed.calls)
        elif isinstance(parsed, SubtaskClaimed):
            if parsed.subtask_id in claimed:
                problem("double-claim", f"{parsed.subtask_id} claimed a second time")
            claimed.add(parsed.subtask_id)
        elif isinstance(parsed, ResultRecorded):
            if parsed.subtask_id not in claimed and seen(parsed.pause):
                problem(
                    "result-without-claim",
                    f"result for {parsed.subtask_id} with no SubtaskClaimed before it",
                )
            if parsed.subtask_id in results:
                problem("double-result", f"a second result for {parsed.subtask_id}")
            results.add(parsed.subtask_id)
        elif isinstance(parsed, TaskResumed):
            if parsed.pause in resumed:
                problem("double-resume", f"pause #{parsed.pause} resumed a second time")
            resumed.add(parsed.pause)
            if parsed.pause not in calls_of_pause:
                if seen(parsed.pause):
                    problem("early-resume", f"resumed pause #{parsed.pause}, which never paused")
            else:
                missing = [s for s in calls_of_pause[parsed.pause] if s not in results]
                if missing:
                    problem(
                        "early-resume",
                        f"resumed pause #{parsed.pause} before the results of {', '.join(missing)}",
                    )
    return problems


# ---- timeline ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PauseSpan:
    """One pause of a task: when it paused, when it resumed (None while it still waits)."""

    pause: int
    paused_version: int
    paused_at: datetime | None
    resumed_version: int | None = None
    resumed_at: datetime | None = None

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

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "recorded_at": _iso(self.recorded_at),
            "event_type": self.event_type,
            "actor": self.actor,
            "summary": self.summary,
            "pause_seconds": self.pause_seconds,
            "trace_id": self.trace_id,
        }


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def pauses(events: Sequence[RecordedEvent]) -> list[PauseSpan]:
    """Every pause of the stream with its resume, in pause order."""
    spans: dict[int, PauseSpan] = {}
    for event in events:
        parsed = _parsed(event)
        if isinstance(parsed, TaskPaused) and parsed.pause not in spans:
            spans[parsed.pause] = PauseSpan(parsed.pause, event.stream_version, event.recorded_at)
        elif isinstance(parsed, TaskResumed):
            span = spans.get(parsed.pause)
            if span is not None and span.resumed_version is None:
                spans[parsed.pause] = PauseSpan(
                    span.pause,
                    span.paused_version,
                    span.paused_at,
                    event.stream_version,
                    event.recorded_at,
                )
    return [spans[number] for number in sorted(spans)]


def _short(value: Any, limit: int = 60) -> str:
    try:
        text = canonical(value).decode()
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _seconds(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".") if value < 10 else f"{value:.0f}"


def _agents(paused: TaskPaused) -> str:
    counts = Counter(call.agent for call in paused.calls)
    return ", ".join(f"{agent} ×{n}" if n > 1 else agent for agent, n in counts.items())


def _summary(event: RecordedEvent, parsed: DomainEvent | None, span: PauseSpan | None) -> str:
    if parsed is None:
        return f"unreadable {event.event_type} event"
    if isinstance(parsed, TaskStarted):
        return f"started {parsed.agent} with input {_short(parsed.input)}"
    if isinstance(parsed, TaskPaused):
        timeouts = [
            c.deadline_at - c.dispatched_at for c in parsed.calls if c.dispatched_at is not None
        ]
        deadline = f" (deadline in {_seconds(max(timeouts))} s)" if timeouts else ""
        return f"paused #{parsed.pause} calling {_agents(parsed)}{deadline}"
    if isinstance(parsed, SubtaskClaimed):
        how = "" if parsed.message_id is not None else " (no reply message: its deadline passed)"
        return f"claimed {parsed.subtask_id}{how}"
    if isinstance(parsed, ResultRecorded):
        return f"result {parsed.outcome} for {parsed.subtask_id}"
    if isinstance(parsed, TaskResumed):
        seconds = span.seconds if span is not None else None
        after = f" after {seconds:.3f} s" if seconds is not None else ""
        return f"resumed from pause #{parsed.pause}{after}"
    if isinstance(parsed, TaskCompleted):
        return "completed"
    if isinstance(parsed, TaskFailed):
        return f"failed: {_short(parsed.error)}"
    if isinstance(parsed, TaskCancelled):
        reason = f": {parsed.reason}" if parsed.reason else ""
        pending = f" ({len(parsed.pending)} call(s) still pending)" if parsed.pending else ""
        return f"cancelled{reason}{pending}"
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


def timeline(events: Sequence[RecordedEvent]) -> list[TimelineEntry]:
    """One readable entry per event of a task's stream, in stream order."""
    spans = {span.pause: span for span in pauses(events)}
    entries = []
    for event in events:
        parsed = _parsed(event)
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
                summary=_summary(event, parsed, span),
                pause_seconds=span.seconds if span is not None else None,
                trace_id=trace if isinstance(trace, str) else None,
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
            "outstanding": [
                {
                    "subtask_id": call.subtask_id,
                    "agent": call.agent,
                    "deadline_at": call.deadline_at,
                    "input": call.input,
                }
                for call in state.outstanding
            ],
            "results": [
                {
                    "subtask_id": result.subtask_id,
                    "agent": result.agent,
                    "outcome": result.outcome,
                    "value": result.value,
                    "error": result.error,
                }
                for result in state.results.values()
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


# ---- reading the log -----------------------------------------------------------------------------


async def read_streams(
    store: EventStore, task_id: str | None = None, *, page_size: int = 1000
) -> dict[str, list[RecordedEvent]]:
    """The events of one task (an empty list when it is not in the log), or of the whole log,
    read page by page in commit order, by stream, each stream in version order."""
    if task_id is not None:
        return {task_id: await store.read_stream(task_id)}
    streams: dict[str, list[RecordedEvent]] = {}
    after = Position()
    while batch := await store.read_all(after, limit=page_size):
        for event in batch:
            streams.setdefault(event.stream_id, []).append(event)
        after = Position.of(batch[-1])
    for events in streams.values():
        events.sort(key=lambda e: e.stream_version)
    return streams
