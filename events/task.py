"""The task as a pure state machine.

``fold`` turns a task's events into a :class:`TaskState`; the ``decide_*`` functions take a state
and an input (a handler's outcome, a peer's reply) and return the events to append. Nothing here
does I/O, reads a clock or draws a random number: time comes in as an argument, and every id is
derived from ids already known, so the same inputs always give the same events. That is what makes
a re-run after a crash write exactly what the first run wrote, which the log then recognises as a
duplicate, and lets the property tests explore every interleaving.

Over 400 lines on purpose: ``fold`` and the ``decide_*`` functions are two halves of one set of
rules (each decision reads the state ``fold`` builds, its claims, calls and status, and writes the
events ``fold`` reads next), so they stay in one module, to be read and changed together; the
outcome types and the ids are the vocabulary both use.

A task's life::

    new ──run──▶ (no events: completed without the log)
     │
     └─run─▶ paused(1) ──replies──▶ resumed(1) ──run──▶ paused(2) … ──run──▶ completed
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from types import MappingProxyType
from typing import Any, Literal

from .codec import canonical, dumps, unstorable
from .model import (
    CancelledCall,
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
    parse,
)

__all__ = [
    "MAX_IGNORED_REPLIES",
    "MAX_TASK_ID_BYTES",
    "Call",
    "CallResult",
    "Complete",
    "FirstK",
    "InvalidTransition",
    "MessageTooLarge",
    "Outcome",
    "Pause",
    "Signal",
    "Sleep",
    "TaskState",
    "Wait",
    "apply_delta",
    "decide_cancel",
    "decide_extension",
    "decide_failure",
    "decide_outcome",
    "decide_reply",
    "decide_signal",
    "decide_timeout",
    "event_id",
    "fold",
    "over_ignored_limit",
    "parse_subtask_id",
    "subtask_id",
]

MAX_AGENT_NAME = 200
"""Longest agent name a call may name (its queue name is at most 255 bytes with the prefix)."""
MAX_IGNORED_REPLIES = 100
"""Replies a task's stream records as ignored (``ReplyIgnored``: duplicates, late replies,
replies to calls it never made), at most. Anyone who may publish to an agent's reply queue can
send them, naming any task: past this many, they are no longer recorded (the worker
dead-letters them instead), so that no publisher can grow a stream, which is read and folded
whole, without bound."""
MAX_KEPT_SIGNALS = 100
"""Signals a task keeps that no wait took yet, at most; a signal past this many is refused
(``SignalRefused``, ``too-many``), so that no sender can grow a stream without bound."""
MAX_SIGNAL_NAME = 200
DEFAULT_SIGNAL_TIMEOUT = 86_400.0
"""How long a ``Signal`` without a timeout is waited for: a day."""
MAX_WAIT_SECONDS = 366 * 86_400.0
"""The longest a signal or a timer may be waited for (a call is bounded by
``WAYSTATION_MAX_CALL_DURATION``)."""
MAX_TASK_ID_BYTES = 200
"""Longest task id (UTF-8 bytes). It travels in AMQP short strings of at most 255 bytes, and
Waystation derives ids of up to 55 bytes more from it (``:result``, ``:resume:<pause>``, a
call's ``:<pause>:<index>`` and its ``:cancel``). A call's sub-task id is its callee's task
id, so a call tree grows it at every level: a pause whose sub-task ids would be longer fails."""

_EVENT_NAMESPACE = uuid.UUID("6f1f8a52-3c7e-4f43-9a57-7f3b2c1d0e11")
_NAMESPACE_BYTES = _EVENT_NAMESPACE.bytes
_VERSION_5 = (~(0xC000 << 48 | 0xF000 << 64) & (1 << 128) - 1, 0x8000 << 48 | 5 << 76)
"""Which bits of a SHA-1 prefix a version 5 UUID keeps, and the variant and version it sets."""

Status = Literal["new", "paused", "resumed", "completed", "failed", "cancelled"]


class InvalidTransition(Exception):
    """The input does not apply to the task in its current state (a caller's mistake)."""


class StateTooLarge(InvalidTransition):
    """A pause's update would make the agent's state larger than the limit it may have."""


class MessageTooLarge(InvalidTransition):
    """A result or a call's input is larger than a message may be: it could never be sent."""


# ---- what a handler returns ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """A call to a peer agent: its name, its input, and an optional timeout in seconds."""

    agent: str
    input: Any = None
    timeout: float | None = None


@dataclass(frozen=True, slots=True)
class Signal:
    """Wait for a signal named ``name`` sent to the task from outside (a person's approval, a
    webhook), for at most ``timeout`` seconds (a day when None). Its result is the signal's
    payload, or a timeout. ``schema``: the JSON Schema of the payload, recorded on the wait
    (the worker fills it from the agent's declared signal model)."""

    name: str
    timeout: float | None = None
    schema: Any = None


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds``, or until ``until`` (seconds since the epoch, or an aware datetime).

    Nothing holds the task meanwhile: whichever worker sweeps when the timer is due resumes it.
    Its result is ok, with no value."""

    seconds: float | None = None
    until: Any = None


Wait = Call | Signal | Sleep


@dataclass(frozen=True, slots=True)
class FirstK:
    """Resume once ``k`` waits of the pause succeeded (``FirstK(1)``: the first), or as soon as
    ``k`` can no longer be reached; the waits still open then are given up (calls cancelled)."""

    k: int


@dataclass(frozen=True, slots=True)
class Pause:
    """Pause the task until its waits have their results.

    ``calls``: the waits, in order: peer ``Call`` s, ``Signal`` s, ``Sleep`` s, in any mix.
    ``until``: ``FirstK(k)`` resumes after the first ``k`` successes; None (the default) once
    every wait has its result. ``update`` is the change to the agent's state, applied key by
    key: a value replaces the key, ``None`` deletes it. Everything else in the state stays as it
    was.
    """

    calls: Sequence[Wait]
    update: Mapping[str, Any] = field(default_factory=dict)
    until: FirstK | None = None


@dataclass(frozen=True, slots=True)
class Complete:
    """Finish the task with ``result`` (any JSON value)."""

    result: Any = None


Outcome = Pause | Complete


@dataclass(frozen=True, slots=True)
class CallResult:
    """The recorded result of one wait, as a resumed handler receives it.

    ``outcome`` is ``cancelled`` for a wait a ``FirstK`` pause gave up when it resumed. A
    signal's ``value`` is its payload, ``sender`` who sent it; ``name`` is the signal's."""

    subtask_id: str
    agent: str
    outcome: Literal["ok", "error", "timeout", "cancelled"]
    value: Any = None
    error: Any = None
    kind: str = "call"
    name: str | None = None
    sender: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


# ---- ids -----------------------------------------------------------------------------------------


def subtask_id(task_id: str, pause: int, index: int) -> str:
    """The id of call ``index`` of pause ``pause``: stable across re-runs of the same pause."""
    return f"{task_id}:{pause}:{index}"


def parse_subtask_id(value: str) -> tuple[str, int, int]:
    """``(task_id, pause, index)`` of a sub-task id; ``ValueError`` when it is not one."""
    task_id, pause, index = value.rsplit(":", 2)
    # only what subtask_id writes: int() alone would also take "01", "+1", " 1", "1_0" or "١"
    if (
        not task_id
        or not all(part.isascii() and part.isdigit() for part in (pause, index))
        or any(len(part) > 1 and part.startswith("0") for part in (pause, index))
    ):
        raise ValueError(f"not a sub-task id: {value!r}")
    return task_id, int(pause), int(index)


def event_id(stream_id: str, causation_key: str, index: int) -> uuid.UUID:
    """The id of the ``index``-th event appended for ``causation_key`` (what caused it).

    The same cause gives the same ids, so appending a re-run's events again is recognised.
    """
    # uuid.uuid5, without its import and checks on every call (one per event appended)
    name = f"{stream_id}\x1f{causation_key}\x1f{index}".encode()
    keep, set_bits = _VERSION_5
    digest = hashlib.sha1(_NAMESPACE_BYTES + name, usedforsecurity=False).digest()
    return uuid.UUID(int=int.from_bytes(digest[:16]) & keep | set_bits)


# ---- state ---------------------------------------------------------------------------------------


def apply_delta(state: Mapping[str, Any], delta: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with ``delta`` applied: values replace keys, ``None`` deletes them."""
    merged = dict(state)
    for key, value in delta.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def _minimal_delta(state: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    for key, value in update.items():
        if not isinstance(key, str):
            raise InvalidTransition(f"state keys must be strings, not a {type(key).__name__}")
        _require_storable({key: value}, f"the state update of {key[:100]!r}")
        if value is None:
            if key in state:
                delta[key] = None
        else:
            encoded = _encoded(value)  # refuses NaN, infinity and what is not JSON
            if key not in state or _encoded(state[key]) != encoded:
                # compared as JSON, not with ==: 1 == 1.0 == True, yet the state must keep what
                # the handler returned, byte for byte
                delta[key] = value
    return delta


def _encoded(value: Any) -> bytes:
    try:
        return canonical(value)
    except (TypeError, ValueError) as error:
        raise InvalidTransition(f"a state value cannot be stored: {error}") from error


def _require_storable(value: Any, what: str) -> None:
    """An outcome the log cannot hold fails the decision, so the task fails at once saying why,
    rather than reaching the append, which cannot store it."""
    problem = unstorable(value)
    if problem is not None:
        raise InvalidTransition(f"{what} cannot be stored: {problem}")


def _require_sendable(value: Any, what: str, limit: int | None) -> None:
    """A value a message carries (a result, a call's input) fits in one: a larger one could
    never be sent, whatever retries did."""
    if limit is None:
        return
    try:
        size = len(dumps(value))
    except (TypeError, ValueError):
        return  # not JSON at all: _require_storable says so
    if size > limit:
        raise MessageTooLarge(
            f"{what} is {size} bytes of JSON, more than the {limit} a message may carry "
            "(WAYSTATION_MAX_MESSAGE_BYTES); keep large outputs outside the messages and pass "
            "a pointer to them"
        )


@dataclass(frozen=True)
class TaskState:
    """What the log says about one task."""

    task_id: str
    version: int = 0
    last_hash: bytes = bytes(32)
    status: Status = "new"
    agent: str | None = None
    input: Any = None
    reply_to: str | None = None
    correlation_id: str | None = None
    pause: int = 0
    """The number of the latest pause (0 before the first)."""
    state: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    calls: tuple[PendingCall, ...] = ()
    """The calls of the latest pause, in call order."""
    claims: Mapping[str, str | None] = field(default_factory=lambda: MappingProxyType({}))
    """Every claimed sub-task of every pause, with the id of the reply message that claimed it."""
    results: Mapping[str, CallResult] = field(default_factory=lambda: MappingProxyType({}))
    known_calls: frozenset[str] = frozenset()
    result: Any = None
    error: Any = None
    trace_id: str | None = None
    root_id: str | None = None
    """The root task of the call tree this task belongs to."""
    resumed_at: float | None = None
    """When the latest TaskResumed was decided (its metadata's ``occurred_at``), if any."""
    unreadable: tuple[str, ...] = ()
    """Events this code cannot read (an unknown type, or a schema version newer than it knows,
    as in a rolling upgrade), described. A state with any is incomplete: decide nothing on it."""
    ignored_replies: int = 0
    """How many ``ReplyIgnored`` the stream holds (at most :data:`MAX_IGNORED_REPLIES`)."""
    call_agents: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({}), compare=False, repr=False
    )
    """The agent of every call of every pause (its keys are ``known_calls``): what a fold that
    goes on from this state (``fold(..., start=)``) needs to name the agent of a later result."""
    until: int | None = None
    """The latest pause's ``FirstK``, if it has one."""
    agent_version: str | None = None
    """The agent version the latest pause recorded."""
    abandoned: frozenset[str] = frozenset()
    """Every wait a ``FirstK`` pause gave up when it resumed."""
    signals: Mapping[str, SignalReceived] = field(default_factory=lambda: MappingProxyType({}))
    """Every signal the stream recorded, by id (what deduplicates a signal sent twice)."""
    kept: tuple[str, ...] = ()
    """The ids of the signals no wait has taken yet, oldest first."""

    @property
    def exists(self) -> bool:
        return self.version > 0

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed", "cancelled")

    @property
    def outstanding(self) -> tuple[PendingCall, ...]:
        """Waits of the latest pause that have no claim yet, and that a ``FirstK`` resume did
        not give up."""
        if self.abandoned:
            return tuple(
                call
                for call in self.calls
                if call.subtask_id not in self.claims and call.subtask_id not in self.abandoned
            )
        return tuple(call for call in self.calls if call.subtask_id not in self.claims)

    def results_of_pause(self) -> list[CallResult]:
        """The latest pause's results, in wait order (complete once the task has resumed); a
        wait a ``FirstK`` pause gave up has a ``cancelled`` result."""
        results = self.results
        if not self.abandoned:
            return [results[c.subtask_id] for c in self.calls if c.subtask_id in results]
        return [
            results.get(c.subtask_id)
            or CallResult(
                subtask_id=c.subtask_id,
                agent=c.agent,
                outcome="cancelled",
                kind=c.kind,
                name=c.name,
            )
            for c in self.calls
            if c.subtask_id in results or c.subtask_id in self.abandoned
        ]

    def open_signal_wait(self, name: str) -> PendingCall | None:
        """The first unclaimed wait of the latest pause for a signal named ``name``."""
        if self.status != "paused":
            return None
        for wait in self.calls:
            if wait.kind == "signal" and wait.name == name and wait.subtask_id not in self.claims:
                return wait
        return None


def fold(
    task_id: str, events: Iterable[RecordedEvent], *, start: TaskState | None = None
) -> TaskState:
    """Fold a task's recorded events, in stream order, into its state.

    ``start``: the state of the events before these (what ``fold`` gave for them); the fold
    goes on from it, so that a decision's own events are applied to the state it was made on
    instead of folding the whole stream again. ``fold(t, later, start=fold(t, earlier))`` is
    ``fold(t, [*earlier, *later])``."""
    if start is None:
        version = 0
        last_hash = bytes(32)
        status: Status = "new"
        agent: str | None = None
        input_: Any = None
        reply_to: str | None = None
        correlation_id: str | None = None
        trace_id: Any = None
        root_id: Any = None
        pause = 0
        state: Mapping[str, Any] = MappingProxyType({})
        calls: tuple[PendingCall, ...] = ()
        agents: dict[str, str] = {}
        claims: dict[str, str | None] = {}
        results: dict[str, CallResult] = {}
        result: Any = None
        error: Any = None
        resumed_at: float | None = None
        unreadable: list[str] = []
        ignored = 0
        until: int | None = None
        agent_version: str | None = None
        abandoned: set[str] | frozenset[str] = frozenset()
        signals: dict[str, SignalReceived] | Mapping[str, SignalReceived] = MappingProxyType({})
        kept: list[str] | tuple[str, ...] = ()
    else:
        version, last_hash, status = start.version, start.last_hash, start.status
        agent, input_, reply_to = start.agent, start.input, start.reply_to
        correlation_id, trace_id, root_id = start.correlation_id, start.trace_id, start.root_id
        pause, state, calls = start.pause, start.state, start.calls
        agents = dict(start.call_agents)
        claims = dict(start.claims)
        results = dict(start.results)
        result, error, resumed_at = start.result, start.error, start.resumed_at
        unreadable = list(start.unreadable)
        ignored = start.ignored_replies
        until, agent_version = start.until, start.agent_version
        abandoned, signals, kept = start.abandoned, start.signals, start.kept
    for recorded in events:
        version = recorded.stream_version
        last_hash = recorded.hash
        event = parse(recorded)
        if isinstance(event, UnknownEvent):
            unreadable.append(
                f"v{recorded.stream_version} {event.type_name} ({event.reason}, schema version "
                f"{recorded.schema_version})"
            )
        elif isinstance(event, TaskStarted):
            agent, input_ = event.agent, event.input
            reply_to, correlation_id = event.reply_to, event.correlation_id
            trace_id = recorded.metadata.get("trace_id")
            root_id = recorded.metadata.get("correlation_id")
        elif isinstance(event, TaskPaused):
            status, pause, calls = "paused", event.pause, event.calls
            until, agent_version = event.until, event.agent_version
            state = MappingProxyType(apply_delta(state, event.state_delta))
            agents.update((c.subtask_id, c.agent) for c in event.calls)
        elif isinstance(event, SubtaskClaimed):
            claims[event.subtask_id] = event.message_id
            if kept and event.message_id in kept and _is_signal_wait(calls, event.subtask_id):
                # a signal's wait took it (a reply's message id may be the same string)
                kept = tuple(k for k in kept if k != event.message_id)
        elif isinstance(event, ReplyIgnored):
            ignored += 1
        elif isinstance(event, ResultRecorded):
            results[event.subtask_id] = _result_of(event, agents, calls, claims, signals)
        elif isinstance(event, TaskResumed):
            status = "resumed"
            if event.abandoned:
                abandoned = frozenset(abandoned).union(c.subtask_id for c in event.abandoned)
            occurred = recorded.metadata.get("occurred_at")
            resumed_at = float(occurred) if isinstance(occurred, (int, float)) else None
        elif isinstance(event, TaskCompleted):
            status, result = "completed", event.result
        elif isinstance(event, TaskFailed):
            status, error = "failed", event.error
        elif isinstance(event, TaskCancelled):
            status, error = "cancelled", {"type": "cancelled", "message": event.reason}
        elif isinstance(event, SignalReceived):
            signals = {**signals, event.signal_id: event}
            kept = (*kept, event.signal_id)
        elif isinstance(event, SignalRefused):
            ignored += 1
        elif isinstance(event, DeadlineExtended):
            calls = tuple(
                call.model_copy(update={"deadline_at": event.deadline_at})
                if call.subtask_id == event.subtask_id
                else call
                for call in calls
            )
    return TaskState(
        task_id=task_id,
        version=version,
        last_hash=last_hash,
        status=status,
        agent=agent,
        input=input_,
        reply_to=reply_to,
        correlation_id=correlation_id,
        pause=pause,
        state=state,
        calls=calls,
        claims=MappingProxyType(claims),
        results=MappingProxyType(results),
        known_calls=frozenset(agents),
        result=result,
        error=error,
        trace_id=trace_id,
        root_id=root_id,
        resumed_at=resumed_at,
        unreadable=tuple(unreadable),
        ignored_replies=ignored,
        call_agents=MappingProxyType(agents),
        until=until,
        agent_version=agent_version,
        abandoned=frozenset(abandoned),
        signals=signals if isinstance(signals, MappingProxyType) else MappingProxyType(signals),
        kept=tuple(kept),
    )


def _is_signal_wait(calls: Sequence[PendingCall], wait_id: str) -> bool:
    return any(c.subtask_id == wait_id and c.kind == "signal" for c in calls)


def _result_of(
    event: ResultRecorded,
    agents: Mapping[str, str],
    calls: Sequence[PendingCall],
    claims: Mapping[str, str | None],
    signals: Mapping[str, SignalReceived],
) -> CallResult:
    agent = agents.get(event.subtask_id, "")
    if agent:  # a peer call: most results, told apart without looking the wait up
        return CallResult(
            subtask_id=event.subtask_id,
            agent=agent,
            outcome=event.outcome,
            value=event.value,
            error=event.error,
        )
    wait = next((c for c in calls if c.subtask_id == event.subtask_id), None)
    signal = signals.get(claims.get(event.subtask_id) or "")
    return CallResult(
        subtask_id=event.subtask_id,
        agent="",
        outcome=event.outcome,
        value=event.value,
        error=event.error,
        kind=wait.kind if wait is not None else "call",
        name=wait.name if wait is not None else None,
        sender=signal.sender if signal is not None else None,
    )


# ---- decisions -----------------------------------------------------------------------------------


def decide_outcome(
    state: TaskState,
    outcome: Outcome,
    *,
    now: float,
    default_timeout: float,
    start: TaskStarted | None = None,
    record_completion: bool = False,
    max_timeout: float | None = None,
    max_state_bytes: int | None = None,
    max_value_bytes: int | None = None,
    agent_version: str | None = None,
) -> list[DomainEvent]:
    """The events that record a handler's outcome.

    For a new task ``start`` describes it; a completion of a new task writes nothing unless
    ``record_completion`` (auditing of all tasks) is on. A resumed task records its next pause or
    its completion. Deadlines are measured from ``now``, the moment of dispatch. A pause whose
    state, once its update is applied, is larger than ``max_state_bytes`` (as canonical JSON) is
    refused with :class:`StateTooLarge`; a result or a call input larger than
    ``max_value_bytes`` (as JSON) with :class:`MessageTooLarge`, and a pause whose sub-task ids
    would be longer than :data:`MAX_TASK_ID_BYTES` with :class:`InvalidTransition`.

    A pause records ``agent_version``. Its signal waits take the signals the task keeps (sent
    before a wait asked for them), oldest first, in the same append, which may resume it at
    once.
    """
    if isinstance(outcome, Complete):
        _require_storable(outcome.result, "the result")
        _require_sendable(outcome.result, "the result", max_value_bytes)
    if state.status == "new":
        if start is None:
            raise InvalidTransition("a new task needs its TaskStarted")
        if isinstance(outcome, Complete) and not record_completion:
            return []
        first: list[DomainEvent] = [start]
    elif state.status == "resumed":
        first = []
    else:
        raise InvalidTransition(f"task {state.task_id} is {state.status}, not running")
    if isinstance(outcome, Complete):
        return [*first, TaskCompleted(result=outcome.result)]
    pause = _pause(
        state,
        outcome,
        now=now,
        default_timeout=default_timeout,
        max_timeout=max_timeout,
        max_state_bytes=max_state_bytes,
        max_value_bytes=max_value_bytes,
        agent_version=agent_version,
    )
    if not state.kept or not any(w.kind == "signal" for w in pause.calls):
        return [*first, pause]
    return [*first, pause, *_take_kept_signals(state, pause)]


def _pause(
    state: TaskState,
    outcome: Pause,
    *,
    now: float,
    default_timeout: float,
    max_timeout: float | None = None,
    max_state_bytes: int | None = None,
    max_value_bytes: int | None = None,
    agent_version: str | None = None,
) -> TaskPaused:
    if not outcome.calls:
        raise InvalidTransition("a pause needs at least one call")
    until = outcome.until
    if until is not None and not (
        isinstance(until, FirstK)
        and isinstance(until.k, int)
        and not isinstance(until.k, bool)
        and 1 <= until.k <= len(outcome.calls)
    ):
        raise InvalidTransition(
            f"until={until!r}: a pause of {len(outcome.calls)} wait(s) resumes on FirstK(k) "
            f"with 1 <= k <= {len(outcome.calls)}"
        )
    number = state.pause + 1
    longest = subtask_id(state.task_id, number, len(outcome.calls) - 1)
    if len(longest.encode()) > MAX_TASK_ID_BYTES:
        raise InvalidTransition(
            f"its calls' sub-task ids (such as {longest[-60:]!r}) would be "
            f"{len(longest.encode())} bytes, more than the {MAX_TASK_ID_BYTES} a task id may "
            "have: the call tree is too deep, or the task id too long, to call peers"
        )
    calls = []
    for index, call in enumerate(outcome.calls):
        if isinstance(call, (Signal, Sleep)):
            calls.append(_other_wait(subtask_id(state.task_id, number, index), index, call, now))
            continue
        if not isinstance(call, Call) or not isinstance(call.agent, str) or not call.agent:
            raise InvalidTransition(
                f"wait {index} is not a Call with an agent name, a Signal or a Sleep"
            )
        if len(call.agent) > MAX_AGENT_NAME or "\x00" in call.agent:
            raise InvalidTransition(f"call {index} names no agent a queue can have")
        _require_storable(call.input, f"the input of call {index}")
        _require_sendable(call.input, f"the input of call {index}", max_value_bytes)
        timeout = call.timeout if call.timeout is not None else default_timeout
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise InvalidTransition(
                f"call {index} has a timeout of {timeout!r}s; it must be a positive number"
            )
        calls.append(
            PendingCall(
                subtask_id=subtask_id(state.task_id, number, index),
                agent=call.agent,
                input=call.input,
                deadline_at=now + (min(timeout, max_timeout) if max_timeout else timeout),
                dispatched_at=now,
            )
        )
    delta = _minimal_delta(state.state, outcome.update)
    if max_state_bytes is not None and delta:
        _require_state_fits(apply_delta(state.state, delta), max_state_bytes)
    return TaskPaused(
        pause=number,
        state_delta=delta,
        calls=tuple(calls),
        until=until.k if until is not None else None,
        agent_version=agent_version,
    )


def _other_wait(wait_id: str, index: int, wait: Signal | Sleep, now: float) -> PendingCall:
    """The pending wait of a ``Signal`` or a ``Sleep`` dispatched at ``now``."""
    if isinstance(wait, Signal):
        name = wait.name
        if not isinstance(name, str) or not name or len(name) > MAX_SIGNAL_NAME or "\x00" in name:
            raise InvalidTransition(
                f"wait {index}: a signal's name is a non-empty string of at most "
                f"{MAX_SIGNAL_NAME} characters, not {name!r}"
            )
        timeout = DEFAULT_SIGNAL_TIMEOUT if wait.timeout is None else wait.timeout
        if not _positive(timeout) or timeout > MAX_WAIT_SECONDS:
            raise InvalidTransition(
                f"wait {index} (signal {name!r}) has a timeout of {timeout!r}s; it must be a "
                f"positive number of at most {MAX_WAIT_SECONDS:.0f}"
            )
        schema = wait.schema
        if schema is not None and not isinstance(schema, dict):
            raise InvalidTransition(f"wait {index} (signal {name!r}): schema must be a JSON Schema")
        if schema is not None:
            _require_storable(schema, f"the schema of signal {name!r}")
        return PendingCall(
            subtask_id=wait_id,
            agent="",
            input=None,
            deadline_at=now + timeout,
            dispatched_at=now,
            kind="signal",
            name=name,
            signal_schema=schema,
        )
    if not isinstance(wait, Sleep) or (wait.seconds is None) == (wait.until is None):
        raise InvalidTransition(f"wait {index}: a Sleep takes seconds or until=, one of the two")
    if wait.until is not None:
        until = wait.until
        if isinstance(until, datetime):
            if until.tzinfo is None:
                raise InvalidTransition(
                    f"wait {index}: Sleep(until=) takes an aware datetime (one with a time zone)"
                )
            until = until.timestamp()
        if isinstance(until, bool) or not isinstance(until, (int, float)):
            raise InvalidTransition(
                f"wait {index}: Sleep(until=) takes a datetime or seconds since the epoch"
            )
        fire_at = max(float(until), now)
    else:
        seconds = wait.seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise InvalidTransition(f"wait {index}: Sleep({seconds!r}): seconds must be >= 0")
        fire_at = now + seconds
    if not math.isfinite(fire_at) or fire_at - now > MAX_WAIT_SECONDS:
        raise InvalidTransition(
            f"wait {index}: a Sleep lasts at most {MAX_WAIT_SECONDS:.0f}s (366 days)"
        )
    return PendingCall(
        subtask_id=wait_id,
        agent="",
        input=None,
        deadline_at=fire_at,
        dispatched_at=now,
        kind="timer",
    )


def _positive(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _take_kept_signals(state: TaskState, pause: TaskPaused) -> list[DomainEvent]:
    """Claims of ``pause``'s signal waits by the signals ``state`` keeps, oldest first; the last
    claim the pause needs resumes it."""
    events: list[DomainEvent] = []
    taken: set[str] = set()
    paused = replace(
        state, status="paused", pause=pause.pause, calls=pause.calls, until=pause.until
    )
    for wait in pause.calls:
        if wait.kind != "signal":
            continue
        signal_id = next(
            (k for k in state.kept if k not in taken and state.signals[k].name == wait.name), None
        )
        if signal_id is None:
            continue
        taken.add(signal_id)
        claim = _claim(paused, wait.subtask_id, "ok", state.signals[signal_id].payload, signal_id)
        events.extend(claim)
        if isinstance(claim[-1], TaskResumed):
            break
        paused = _after_claim(paused, wait.subtask_id, signal_id, "ok")
    return events


def _after_claim(state: TaskState, wait_id: str, message_id: str | None, outcome: str) -> TaskState:
    """``state`` once ``wait_id`` is claimed with ``outcome`` (what deciding one more claim in
    the same append needs to know)."""
    wait = next(w for w in state.calls if w.subtask_id == wait_id)
    result = CallResult(subtask_id=wait_id, agent=wait.agent, outcome=outcome)  # type: ignore[arg-type]
    return replace(
        state,
        claims=MappingProxyType({**state.claims, wait_id: message_id}),
        results=MappingProxyType({**state.results, wait_id: result}),
    )


def _claim(
    state: TaskState,
    wait_id: str,
    outcome: Literal["ok", "error", "timeout"],
    value: Any = None,
    message_id: str | None = None,
    error: Any = None,
) -> list[DomainEvent]:
    """Claim the open wait ``wait_id`` of the paused task with its result; resume the task when
    that is the result its pause waited for (G2, G3)."""
    events: list[DomainEvent] = [
        SubtaskClaimed(subtask_id=wait_id, pause=state.pause, message_id=message_id),
        ResultRecorded(
            subtask_id=wait_id, pause=state.pause, outcome=outcome, value=value, error=error
        ),
    ]
    abandoned = _resumes(state, wait_id, outcome)
    if abandoned is not None:
        events.append(TaskResumed(pause=state.pause, abandoned=abandoned))
    return events


def _resumes(state: TaskState, wait_id: str, outcome: str) -> tuple[CancelledCall, ...] | None:
    """Whether claiming ``wait_id`` with ``outcome`` resumes the pause, and if so the waits it
    gives up (none unless its ``FirstK`` is met, or can no longer be, before they end); None
    when the pause still waits."""
    if state.until is None:
        return () if len(state.outstanding) == 1 else None
    remaining = [w for w in state.outstanding if w.subtask_id != wait_id]
    succeeded = (outcome == "ok") + sum(
        1
        for w in state.calls
        if w.subtask_id in state.claims
        and (r := state.results.get(w.subtask_id)) is not None
        and r.outcome == "ok"
    )
    if remaining and state.until > succeeded and state.until <= succeeded + len(remaining):
        return None
    return tuple(CancelledCall(subtask_id=w.subtask_id, agent=w.agent) for w in remaining)


def _require_state_fits(state: Mapping[str, Any], limit: int) -> None:
    """The state a pause leaves is at most ``limit`` bytes as canonical JSON (what the log would
    keep folding on every later decision): a larger one fails the task, it never grows the log."""
    size = len(canonical(dict(state)))
    if size > limit:
        raise StateTooLarge(
            f"the task's state would be {size} bytes, more than the {limit} allowed "
            "(WAYSTATION_MAX_STATE_BYTES); keep large outputs outside the log and store a "
            "pointer to them in the state"
        )


def decide_reply(
    state: TaskState,
    subtask: str,
    *,
    outcome: Literal["ok", "error", "timeout"],
    value: Any = None,
    error: Any = None,
    message_id: str | None = None,
) -> list[DomainEvent]:
    """The events that record a reply for ``subtask``.

    The first reply for an outstanding call claims it and records its result, and the reply that
    completes the pause also resumes the task. Anything else changes nothing and is kept for audit
    only: a duplicate, a late reply (after the task finished, or after its call's deadline claimed
    it), a reply for a call the task never made. The redelivery of the very message that made a
    claim returns no events at all, and so does a reply that would be ignored once the stream
    holds :data:`MAX_IGNORED_REPLIES` of them (:func:`over_ignored_limit` tells the two apart).
    """
    events = _decide_reply(state, subtask, outcome, value, error, message_id)
    ignored = bool(events) and isinstance(events[0], ReplyIgnored)
    if ignored and state.ignored_replies >= MAX_IGNORED_REPLIES:
        return []
    return events


def over_ignored_limit(state: TaskState, subtask: str, message_id: str | None) -> bool:
    """Whether a reply for ``subtask`` that :func:`decide_reply` gave no events for was refused
    because the stream holds as many ignored replies as it may (not a redelivery of the claim)."""
    claimed_by_it = message_id is not None and state.claims.get(subtask) == message_id
    return state.ignored_replies >= MAX_IGNORED_REPLIES and not claimed_by_it


def _decide_reply(
    state: TaskState,
    subtask: str,
    outcome: Literal["ok", "error", "timeout"],
    value: Any,
    error: Any,
    message_id: str | None,
) -> list[DomainEvent]:
    if subtask in state.claims:
        if message_id is not None and state.claims[subtask] == message_id:
            return []
        recorded = state.results.get(subtask)
        if state.claims[subtask] is None and recorded is not None and recorded.outcome == "timeout":
            # the call's deadline claimed it: this is its first reply, arriving too late
            return [_ignored(subtask, "late", message_id, outcome)]
        return [_ignored(subtask, "duplicate", message_id, outcome)]
    if state.finished:
        return [_ignored(subtask, "late", message_id, outcome)]
    if subtask in state.abandoned:
        return [_ignored(subtask, "late", message_id, outcome)]
    if state.status != "paused" or not any(
        call.subtask_id == subtask and call.kind == "call" for call in state.calls
    ):
        return [_ignored(subtask, "unknown-call", message_id, outcome)]
    return _claim(state, subtask, outcome, value, message_id, error)


def _ignored(
    subtask: str,
    reason: Literal["duplicate", "late", "unknown-call"],
    message_id: str | None,
    outcome: str,
) -> ReplyIgnored:
    return ReplyIgnored(subtask_id=subtask, reason=reason, message_id=message_id, outcome=outcome)


def decide_timeout(state: TaskState, subtask: str, *, now: float) -> list[DomainEvent]:
    """The events that record that ``subtask``'s deadline passed without a reply (G6).

    A timeout claims the call like a reply does, so whichever of the two is appended first wins
    and the other changes nothing. A call already claimed, a task already finished, or a call
    whose deadline (perhaps just extended) is still ahead of ``now`` gives [].

    The deadline of a signal's wait is its timeout, decided the same way; the deadline of a
    timer is the moment it fires: its result is ok.
    """
    if subtask in state.claims or state.finished or state.status != "paused":
        return []
    call = next((c for c in state.calls if c.subtask_id == subtask), None)
    if call is None or call.deadline_at > now:
        return []
    if call.kind == "timer":
        return _claim(state, subtask, "ok")
    message = (
        "no reply before the call's deadline"
        if call.kind == "call"
        else f"no signal {call.name!r} before the wait's deadline"
    )
    return _claim(state, subtask, "timeout", error={"type": "timeout", "message": message})


def decide_signal(
    state: TaskState,
    name: str,
    payload: Any,
    *,
    signal_id: str,
    sender: str | None = None,
    invalid: str | None = None,
) -> list[DomainEvent]:
    """The events that record a signal named ``name`` sent to the task (message ``signal_id``).

    The first open wait of the current pause on ``name`` takes it: the signal is recorded, the
    wait claimed with its payload (the claim names ``signal_id``), and the pause resumed when
    that was its last result. With no such wait, the signal is kept in the stream for the next
    wait on ``name`` (at most :data:`MAX_KEPT_SIGNALS` of them). A signal already recorded gives
    [] (a duplicate: each signal is applied once). A signal for a finished task, one whose
    payload did not fit the wait's schema (``invalid`` says why), or one past the limit is
    recorded as refused, audit only, while the stream holds fewer than
    :data:`MAX_IGNORED_REPLIES` refusals and ignored replies; past that, [].

    A task with no stream gives []: it has not paused yet, finished without the log (G10), or
    never was; the caller answers the sender that the signal could not be delivered.
    """
    if not state.exists or signal_id in state.signals:
        return []
    reason: Literal["finished", "invalid", "too-many"] | None = None
    if state.finished:
        reason = "finished"
    elif invalid is not None:
        reason = "invalid"
    wait = None if reason else state.open_signal_wait(name)
    if reason is None and wait is None and len(state.kept) >= MAX_KEPT_SIGNALS:
        reason = "too-many"
    if reason is not None:
        if state.ignored_replies >= MAX_IGNORED_REPLIES:
            return []
        return [
            SignalRefused(
                signal_id=signal_id, name=name, reason=reason, detail=invalid, sender=sender
            )
        ]
    received = SignalReceived(signal_id=signal_id, name=name, payload=payload, sender=sender)
    if wait is None:
        return [received]
    return [received, *_claim(state, wait.subtask_id, "ok", payload, signal_id)]


def decide_extension(
    state: TaskState, subtask: str, *, extend_by: float, now: float, max_duration: float
) -> list[DomainEvent]:
    """Move an outstanding call's deadline to ``now + extend_by``, never past its dispatch time
    plus ``max_duration``, and never earlier than it already is. Anything else gives []."""
    if state.status != "paused" or subtask in state.claims or extend_by <= 0:
        return []
    call = next((c for c in state.calls if c.subtask_id == subtask), None)
    if call is None or call.kind != "call":
        return []
    dispatched = call.dispatched_at if call.dispatched_at is not None else now
    deadline = min(now + extend_by, dispatched + max_duration)
    if deadline <= call.deadline_at:
        return []
    return [DeadlineExtended(subtask_id=subtask, pause=state.pause, deadline_at=deadline)]


def decide_cancel(state: TaskState, reason: str | None = None) -> list[DomainEvent]:
    """Cancel the task (G7): every call it still waits for is named so each gets a cancel
    (its signals and timers just end with it).

    A finished task cannot be cancelled ([]). A task with no stream yet gets one holding only
    the cancellation, so its first run, if it is still going, finds the stream taken.
    """
    if state.finished:
        return []
    pending = tuple(
        CancelledCall(subtask_id=c.subtask_id, agent=c.agent)
        for c in state.outstanding
        if c.kind == "call"
    )
    return [TaskCancelled(reason=reason, pending=pending if state.status == "paused" else ())]


def decide_failure(
    state: TaskState, error: Any, *, start: TaskStarted | None = None
) -> list[DomainEvent]:
    """Record that the handler failed for good. A new task needs its ``start``."""
    if state.finished:
        return []
    if state.status == "new":
        if start is None:
            raise InvalidTransition("a new task needs its TaskStarted")
        return [start, TaskFailed(error=error)]
    return [TaskFailed(error=error)]
