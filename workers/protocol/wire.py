"""The wire format: queue names, message types, properties and JSON bodies.

Everything a publisher or peer in another language needs is here (and in docs/wire-format.md).
All messages go through the default exchange (``""``) with the queue name as routing key, are
persistent (delivery mode 2), and carry ``content_type: application/json``.

Queues (``P`` is the queue prefix, ``waystation.`` by default):

* ``P<agent>``          quorum queue of an agent's tasks and resumes (the consumer group)
* ``P<agent>.replies``  quorum queue of the replies to that agent's peer calls
* ``P<agent>.replies.<n>``  its reply shards (``waystation.runtime.routing``): a peer request's
``reply_to``
  names one, so that the replies come back to the worker that paused the task
* ``P dead-letter``     quorum queue behind the dead-letter exchange ``Pdlx`` (fanout)

Message ``type`` property: on ``P<agent>``: ``task`` (default when absent), ``cancel``,
``resume`` (internal), ``query`` (what the log records about a task;
``waystation.runtime.flows.query``); on ``P<agent>.replies``: ``result`` (default when absent),
``progress``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from waystation.events import (
    DomainEvent,
    OutboxMessage,
    ResultRecorded,
    TaskCancelled,
    TaskCompleted,
    TaskFailed,
    TaskPaused,
    TaskResumed,
    TaskState,
)
from waystation.events.codec import dumps
from waystation.observability import tracing

__all__ = [
    "CONTENT_TYPE",
    "HEADER_ACTOR",
    "HEADER_ATTEMPTS",
    "HEADER_DEAD_LETTERED_AT",
    "HEADER_DETAIL",
    "HEADER_QUEUE",
    "HEADER_REASON",
    "HEADER_ROOT",
    "HEADER_TRACE",
    "HEADER_USER",
    "HEADER_WAITS",
    "MAX_ID_BYTES",
    "Names",
    "ResultEnvelope",
    "cancel_message",
    "derived_id",
    "implied_messages",
    "result_message",
    "trace_id_of",
    "with_attempts",
]

CONTENT_TYPE = "application/json"
HEADER_TRACE = "x-waystation-trace-id"
HEADER_TRACEPARENT = tracing.HEADER_TRACEPARENT
"""W3C Trace Context: a publisher that sends it (and no HEADER_TRACE) has its trace id used, and
its span is the parent of the task's first run. Every message a worker publishes carries one
(``waystation.observability.tracing``), naming the step that sent it: a request its call, a result
its task's outcome, a resume the resume."""
HEADER_ROOT = "x-waystation-root-task"
"""The root task of a call tree; a peer request carries it so every event names its root."""

HEADER_ATTEMPTS = "x-waystation-attempts"
"""Runs of this message's handler that already failed: set by a worker on the copy it sends back
to the queue to retry a failed run, and on a resume message after a run in place failed.
Waystation counts attempts itself with it, whatever the broker's own counters mean (RabbitMQ 4.3
stopped counting a requeue in ``x-delivery-count``)."""

HEADER_WAITS = "x-waystation-waits"
"""How often this message waited in the broker for a free slot of its agent's ``concurrency`` or
``rate`` (``waystation.runtime.limits``): set by a worker on the copy it sends back instead of
running it. Waiting is not an attempt; ``HEADER_ATTEMPTS`` goes on unchanged."""

HEADER_USER = "x-waystation-user"
"""On a copy a worker sends back (a retry, a wait for a slot) or dead-letters: the AMQP user
that published the original (its ``user_id``), which the copy cannot carry as its own property
(RabbitMQ checks that against the connection's user). A worker trusts it only on a message whose
``user_id`` is the workers' own user (``waystation.runtime.settle.Settler.received``)."""

HEADER_ACTOR = "x-waystation-actor"
"""On a ``cancel`` or ``signal``: who acted (``console:alice``), free text recorded as the
``actor`` of the events it causes (``waystation.protocol.actors``)."""

HEADER_REASON = "x-waystation-reason"
"""On a dead letter: why, as a machine-readable code (docs/failures.md)."""
HEADER_DETAIL = "x-waystation-detail"
HEADER_QUEUE = "x-waystation-queue"
"""On a dead letter: the queue it came from (where a replay sends it back)."""
HEADER_DEAD_LETTERED_AT = "x-waystation-dead-lettered-at"
"""On a dead letter: when the worker dead-lettered it (ISO 8601, UTC, in milliseconds)."""

MAX_ID_BYTES = 255
"""Bytes of an AMQP short string: a message id, a correlation id, a queue name."""

TYPE_TASK = "task"
TYPE_RESUME = "resume"
TYPE_CANCEL = "cancel"
TYPE_QUERY = "query"
TYPE_SIGNAL = "signal"
TYPE_RESULT = "result"
TYPE_PROGRESS = "progress"


_REPLY_SUFFIX = re.compile(r"\.replies(\.[0-9]+)?\Z")
_WAIT_QUEUE = re.compile(r"retry-wait\.[0-9]+ms")  # (what Names.wait makes after the prefix)


@dataclass(frozen=True, slots=True)
class Names:
    """The broker names of one deployment (one queue prefix), with its reply shards
    (``waystation.runtime.routing``; 0: none)."""

    prefix: str = "waystation."
    reply_shards: int = 0

    def tasks(self, agent: str) -> str:
        return f"{self.prefix}{agent}"

    def replies(self, agent: str) -> str:
        return f"{self.prefix}{agent}.replies"

    def reply_shard(self, agent: str, shard: int) -> str:
        """One of the agent's reply shards, where the replies to one worker's pauses go."""
        return f"{self.prefix}{agent}.replies.{shard}"

    def reply_queues(self, agent: str) -> list[str]:
        """Every queue a reply to ``agent`` may come on: the shared one, then the shards."""
        return [
            self.replies(agent),
            *(self.reply_shard(agent, n) for n in range(self.reply_shards)),
        ]

    def agent_of(self, queue: str) -> str | None:
        """The agent whose task queue, reply queue or reply shard ``queue`` is (the inverse of
        :meth:`tasks` and :meth:`replies`); None for a queue of another prefix or of the
        deployment itself (the dead-letter queue, a wait queue)."""
        if not queue.startswith(self.prefix) or queue == self.dead_letter_queue:
            return None
        rest = _REPLY_SUFFIX.sub("", queue[len(self.prefix) :])
        return rest if rest and not _WAIT_QUEUE.fullmatch(rest) else None

    @property
    def dead_letter_exchange(self) -> str:
        return f"{self.prefix}dlx"

    @property
    def dead_letter_queue(self) -> str:
        return f"{self.prefix}dead-letter"

    @property
    def policy_name(self) -> str:
        return f"{self.prefix}defaults"

    def wait(self, milliseconds: int) -> str:
        """The wait queue (and its exchange) where a retry spends ``milliseconds`` before it
        returns to its queue (``waystation.policies``)."""
        return f"{self.prefix}retry-wait.{milliseconds}ms"


STATUSES = ("ok", "error", "cancelled")


@dataclass(frozen=True, slots=True)
class ResultEnvelope:
    """The body of a ``result`` message: a task's outcome, or a peer's reply to a call.

    ``{"status": "ok", "result": <any JSON>}``,
    ``{"status": "error", "error": {"type": "...", "message": "..."}}`` or
    ``{"status": "cancelled", "error": {"type": "cancelled", "message": <reason>}}``.
    """

    status: Literal["ok", "error", "cancelled"]
    result: Any = None
    error: Any = None
    task_id: str | None = None

    def to_json(self) -> bytes:
        body: dict[str, Any] = {"status": self.status}
        if self.status == "ok":
            body["result"] = self.result
        else:
            body["error"] = self.error
        if self.task_id is not None:
            body["task_id"] = self.task_id
        return dumps(body)

    @classmethod
    def from_json(cls, payload: Any) -> ResultEnvelope:
        if not isinstance(payload, dict) or payload.get("status") not in STATUSES:
            raise ValueError(
                'a result body is an object with "status": "ok", "error" or "cancelled"'
            )
        return cls(
            status=payload["status"],
            result=payload.get("result"),
            error=payload.get("error"),
            task_id=payload.get("task_id"),
        )


_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


def trace_id_of(headers: Mapping[str, Any] | None, default: str) -> str:
    """The trace a message belongs to: its ``x-waystation-trace-id`` header, else the trace id of
    a W3C ``traceparent`` header, else ``default`` (a new task starts its own trace)."""
    headers = headers or {}
    given = headers.get(HEADER_TRACE)
    if isinstance(given, bytes):
        given = given.decode(errors="replace")
    if isinstance(given, str) and given.strip():
        return given.strip()[:200]
    parent = headers.get(HEADER_TRACEPARENT)
    if isinstance(parent, bytes):
        parent = parent.decode(errors="replace")
    if isinstance(parent, str):
        match = _TRACEPARENT.match(parent.strip().lower())
        if match and match.group(1) != "0" * 32:
            return match.group(1)
    return default


def _headers(state: TaskState, step: str) -> dict[str, Any]:
    """The headers of a message sent by the step ``step`` (a ``waystation.observability.tracing``
    key) of the task ``state``: its root, its trace and, as ``traceparent``, that step's span."""
    headers: dict[str, Any] = {HEADER_ROOT: state.root_id or state.task_id}
    if state.trace_id:
        headers[HEADER_TRACE] = state.trace_id
        headers[HEADER_TRACEPARENT] = tracing.traceparent(state.trace_id, step)
    return headers


def derived_id(base: str, suffix: str) -> str:
    """The message id ``base + suffix`` (``:result`` of a task id), or, when that would be over
    :data:`MAX_ID_BYTES`, the same made of the base's digest: as deterministic, and sendable."""
    derived = base + suffix
    if len(derived.encode()) <= MAX_ID_BYTES:
        return derived
    return hashlib.sha256(base.encode()).hexdigest() + suffix


def result_message(
    task_id: str,
    reply_to: str,
    correlation_id: str | None,
    envelope: ResultEnvelope,
    headers: dict[str, Any] | None = None,
) -> OutboxMessage:
    """A task's result; with its trace in ``headers``, its ``traceparent`` is the outcome's span."""
    headers = dict(headers or {})
    trace_id = headers.get(HEADER_TRACE)
    if isinstance(trace_id, str) and trace_id and HEADER_TRACEPARENT not in headers:
        headers[HEADER_TRACEPARENT] = tracing.traceparent(trace_id, tracing.end_key(task_id))
    return OutboxMessage(
        message_id=derived_id(task_id, ":result"),
        routing_key=reply_to,
        body=envelope.to_json(),
        properties={
            "type": TYPE_RESULT,
            "correlation_id": correlation_id or task_id,
            "content_type": CONTENT_TYPE,
            "headers": headers,
        },
    )


def cancel_message(
    names: Names, subtask_id: str, agent: str, reason: str, headers: dict[str, Any]
) -> OutboxMessage:
    """Tell peer ``agent`` that the call ``subtask_id`` is no longer wanted."""
    return OutboxMessage(
        message_id=f"{subtask_id}:cancel",
        routing_key=names.tasks(agent),
        body=dumps({"task_id": subtask_id, "reason": reason}),
        properties={"type": TYPE_CANCEL, "content_type": CONTENT_TYPE, "headers": headers},
    )


def with_attempts(message: OutboxMessage, attempts: int, *, delay: float = 0.0) -> OutboxMessage:
    """``message`` carrying how many runs of its handler already failed (``HEADER_ATTEMPTS``),
    to reach its queue ``delay`` seconds after it is published (the backoff before the next)."""
    headers = {**(message.properties.get("headers") or {}), HEADER_ATTEMPTS: attempts}
    return replace(message, properties={**message.properties, "headers": headers}, delay=delay)


def _resumed_here(following: Sequence[DomainEvent]) -> bool:
    """True when the resumed run's outcome is in the same append (resumed in place): then no
    resume message is needed, its work is done."""
    return any(isinstance(e, (TaskPaused, TaskCompleted, TaskFailed)) for e in following)


def implied_messages(
    names: Names,
    state: TaskState,
    events: Sequence[DomainEvent],
    reply_to: str | None = None,
) -> list[OutboxMessage]:
    """The messages that appending ``events`` to a task in ``state`` implies (G4).

    ``state`` must describe the task (its agent, origin, trace) as of these events: for a new
    task, the state folded from the ``TaskStarted`` among them. ``reply_to``: where a pause's
    requests ask for their replies (the recording worker's reply shard,
    ``waystation.runtime.routing``); by default the agent's shared reply queue.
    """
    agent = state.agent or ""
    messages: list[OutboxMessage] = []
    for position, event in enumerate(events):
        if isinstance(event, TaskPaused):
            for call in event.calls:
                if call.kind != "call":
                    continue  # a signal comes from outside, a timer from the sweeper
                messages.append(
                    OutboxMessage(
                        message_id=call.subtask_id,
                        routing_key=names.tasks(call.agent),
                        body=dumps(call.input),
                        properties={
                            "type": TYPE_TASK,
                            "correlation_id": call.subtask_id,
                            "reply_to": reply_to or names.replies(agent),
                            "content_type": CONTENT_TYPE,
                            "headers": _headers(state, tracing.call_key(call.subtask_id)),
                        },
                    )
                )
        elif isinstance(event, TaskResumed):
            for given_up in event.abandoned:
                if given_up.agent:  # a peer call; a signal's or a timer's wait just ends
                    messages.append(
                        cancel_message(
                            names,
                            given_up.subtask_id,
                            given_up.agent,
                            "not needed: the caller resumed with the first results",
                            _headers(state, tracing.reply_key(given_up.subtask_id)),
                        )
                    )
            if _resumed_here(events[position + 1 :]):
                continue
            messages.append(
                OutboxMessage(
                    message_id=f"{state.task_id}:resume:{event.pause}",
                    routing_key=names.tasks(agent),
                    body=dumps({"task_id": state.task_id, "pause": event.pause}),
                    properties={
                        "type": TYPE_RESUME,
                        "content_type": CONTENT_TYPE,
                        "headers": _headers(state, tracing.resume_key(state.task_id, event.pause)),
                    },
                )
            )
        elif isinstance(event, ResultRecorded) and event.outcome == "timeout":
            agent_of = {call.subtask_id: call.agent for call in state.calls}
            if agent_of.get(event.subtask_id):
                messages.append(
                    cancel_message(
                        names,
                        event.subtask_id,
                        agent_of[event.subtask_id],
                        "timeout",
                        _headers(state, tracing.reply_key(event.subtask_id)),
                    )
                )
        elif isinstance(event, TaskCancelled):
            for pending in event.pending:
                messages.append(
                    cancel_message(
                        names,
                        pending.subtask_id,
                        pending.agent,
                        event.reason or "cancelled",
                        _headers(state, tracing.end_key(state.task_id)),
                    )
                )
            if state.reply_to:
                envelope = ResultEnvelope(
                    "cancelled",
                    error={"type": "cancelled", "message": event.reason},
                    task_id=state.task_id,
                )
                messages.append(
                    result_message(
                        state.task_id,
                        state.reply_to,
                        state.correlation_id,
                        envelope,
                        _headers(state, tracing.end_key(state.task_id)),
                    )
                )
        elif isinstance(event, (TaskCompleted, TaskFailed)) and state.reply_to:
            envelope = (
                ResultEnvelope("ok", result=event.result, task_id=state.task_id)
                if isinstance(event, TaskCompleted)
                else ResultEnvelope("error", error=event.error, task_id=state.task_id)
            )
            messages.append(
                result_message(
                    state.task_id,
                    state.reply_to,
                    state.correlation_id,
                    envelope,
                    _headers(state, tracing.end_key(state.task_id)),
                )
            )
    return messages
