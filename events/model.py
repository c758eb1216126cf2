"""The task's events, and the envelopes the log stores them in.

Every event of a task's stream is a frozen pydantic model below. The log stores an event as a
:class:`NewEvent` (what a writer appends) and hands it back as a :class:`RecordedEvent` (with its
stream version, global position, transaction id and hash). Data and metadata travel as plain
JSON-compatible dicts inside the envelopes; :func:`parse` turns a recorded event back into its
model, upcast first when it was stored under an older schema version
(:mod:`waystation.events.upcasting`). An event this code cannot read (an unknown type, a schema
version newer than it knows) is kept as it is and parses to :class:`UnknownEvent`, never dropped.

Over 400 lines on purpose: the events are one vocabulary (the log's schema), read together by
``fold``, the projections and the auditors, and their envelopes and ``parse`` are how each is
stored and read back; split, a reader would chase the schema across modules.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from .upcasting import BUILTIN, UpcastError, Upcasters

__all__ = [
    "OPERATIONS_STREAM",
    "CancelledCall",
    "DeadLettersReplayed",
    "DeadlineExtended",
    "DomainEvent",
    "EventMetadata",
    "NewEvent",
    "PendingCall",
    "RecordedEvent",
    "ReplyIgnored",
    "ResultRecorded",
    "SignalReceived",
    "SignalRefused",
    "SubtaskClaimed",
    "TaskCancelled",
    "TaskCompleted",
    "TaskFailed",
    "TaskPaused",
    "TaskResumed",
    "TaskStarted",
    "UnknownEvent",
    "WaitKind",
    "event_types",
    "parse",
]

JSON = Any


class DomainEvent(BaseModel):
    """Base of every event of a task's stream. ``event_type`` is the name stored in the log."""

    # NaN and infinity are kept as floats when dumped, so the hash chain's canonical encoding
    # rejects them; pydantic's default turns them into null, which silently deletes a state key
    # (a None in a delta) or replaces a result with null.
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")
    event_type: ClassVar[str]
    schema_version: ClassVar[int] = 1
    """The current version of the event's schema; what :meth:`storage_version` gives unless an
    event can be stored in an older one that older code still reads."""
    audit_only: ClassVar[bool] = False
    """Audit events record what was seen but change nothing; they may follow a terminal event."""
    terminal: ClassVar[bool] = False

    def stored_data(self) -> dict[str, JSON]:
        """The event's data as the log stores it."""
        return self.model_dump(mode="json")

    def storage_version(self) -> int:
        """The schema version the event is stored under."""
        return self.schema_version


WaitKind = Literal["call", "signal", "timer"]


class PendingCall(BaseModel):
    """One wait of a paused task: its id, its kind and its deadline.

    A ``call`` waits for a peer's reply (``agent``, ``input``); a ``signal`` for a message named
    ``name`` sent to the task from outside (``agent`` is empty, ``input`` is None,
    ``signal_schema`` the JSON Schema its payload must fit, when typed); a ``timer`` for its
    deadline itself. Whatever its kind, the wait is claimed once (``SubtaskClaimed``) by what
    ends it: a reply, a signal, the sweeper at its deadline. The fields a call does not use are
    left out of the stored event, so a pause of calls alone is stored as before they existed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")
    subtask_id: str
    agent: str
    input: JSON
    deadline_at: float
    """Seconds since the epoch by which the result must be recorded (measured from dispatch);
    a timer's moment to fire."""
    dispatched_at: float | None = None
    """When the call was dispatched; extensions of the deadline are bounded from here."""
    kind: WaitKind = "call"
    name: str | None = None
    """A signal's name."""
    signal_schema: dict[str, JSON] | None = None
    """The JSON Schema of a typed signal's payload (what a form asking for it shows)."""


class CancelledCall(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    subtask_id: str
    agent: str


class TaskStarted(DomainEvent):
    """The first event of a task that needs the log: who asked for what, and where to answer."""

    event_type: ClassVar[str] = "TaskStarted"
    agent: str
    input: JSON
    reply_to: str | None = None
    correlation_id: str | None = None


class TaskPaused(DomainEvent):
    """A checkpoint: the handler returned a pause at invocation ``pause`` (1 for the first run)."""

    event_type: ClassVar[str] = "TaskPaused"
    schema_version: ClassVar[int] = 2
    pause: int
    state_delta: dict[str, JSON]
    """Minimal change to the agent's state; a ``None`` value deletes the key."""
    calls: tuple[PendingCall, ...]
    """The pause's waits, in the order the handler gave them (peer calls, signals, timers)."""
    until: int | None = None
    """Resume once this many waits succeeded (``FirstK``), or once that cannot happen any more;
    None: once every wait has its result."""
    agent_version: str | None = None
    """The version of the agent's code that paused (declared on the agent or the app)."""

    def stored_data(self) -> dict[str, JSON]:
        # the new fields are left out at their defaults, so that a pause of calls alone is
        # stored (and hashed) byte for byte as before, and read by older code
        return self.model_dump(mode="json", exclude_defaults=True)

    def storage_version(self) -> int:
        plain = self.until is None and self.agent_version is None
        if plain and all(call.kind == "call" for call in self.calls):
            return 1
        return self.schema_version


class SubtaskClaimed(DomainEvent):
    """A reply for ``subtask_id`` was taken; no other reply for it will ever be applied."""

    event_type: ClassVar[str] = "SubtaskClaimed"
    subtask_id: str
    pause: int
    message_id: str | None = None
    """The AMQP message id of the claiming reply, to recognise its own redelivery."""


class ResultRecorded(DomainEvent):
    """The result of a claimed sub-task: ok with a value, an error, or a timeout."""

    event_type: ClassVar[str] = "ResultRecorded"
    subtask_id: str
    pause: int
    outcome: Literal["ok", "error", "timeout"]
    value: JSON = None
    error: JSON = None


class TaskResumed(DomainEvent):
    """Pause ``pause`` has the results it waits for; the task runs again (once per pause).

    ``abandoned``: the waits still open when a ``FirstK`` pause resumed early. Each is given
    up: a call is cancelled at its peer, and a reply or a deadline that comes later changes
    nothing."""

    event_type: ClassVar[str] = "TaskResumed"
    schema_version: ClassVar[int] = 2
    pause: int
    abandoned: tuple[CancelledCall, ...] = ()

    def stored_data(self) -> dict[str, JSON]:
        if self.abandoned:
            return self.model_dump(mode="json")
        return {"pause": self.pause}

    def storage_version(self) -> int:
        # v1 without abandoned waits, as before; with them, a version older code reads as an
        # unknown event (as it reads the FirstK pause before it) rather than failing to parse
        return self.schema_version if self.abandoned else 1


class TaskCompleted(DomainEvent):
    event_type: ClassVar[str] = "TaskCompleted"
    terminal: ClassVar[bool] = True
    result: JSON


class TaskFailed(DomainEvent):
    """The handler failed for good (its retries are spent, or its outcome was invalid)."""

    event_type: ClassVar[str] = "TaskFailed"
    terminal: ClassVar[bool] = True
    error: JSON


class TaskCancelled(DomainEvent):
    """The task was cancelled; ``pending`` are the calls it still waited for (each is cancelled)."""

    event_type: ClassVar[str] = "TaskCancelled"
    terminal: ClassVar[bool] = True
    reason: str | None = None
    pending: tuple[CancelledCall, ...] = ()


class DeadlineExtended(DomainEvent):
    """A peer reported progress on ``subtask_id``; its deadline moves to ``deadline_at``."""

    event_type: ClassVar[str] = "DeadlineExtended"
    subtask_id: str
    pause: int
    deadline_at: float


class ReplyIgnored(DomainEvent):
    """Audit only: a reply acked but not applied (duplicate, late, or for no known call)."""

    event_type: ClassVar[str] = "ReplyIgnored"
    audit_only: ClassVar[bool] = True
    subtask_id: str
    reason: Literal["duplicate", "late", "unknown-call"]
    message_id: str | None = None
    outcome: str | None = None


class SignalReceived(DomainEvent):
    """A signal came for the task: its id (the AMQP message id, once per signal), its name, its
    payload and who sent it (the AMQP ``user_id``, which RabbitMQ checks).

    When a wait of the current pause takes it, a ``SubtaskClaimed`` naming ``signal_id`` as its
    ``message_id`` follows in the same append; otherwise the signal is kept, and the next wait on
    that name takes it when its pause is recorded."""

    event_type: ClassVar[str] = "SignalReceived"
    signal_id: str
    name: str
    payload: JSON = None
    sender: str | None = None


class SignalRefused(DomainEvent):
    """Audit only: a signal acked but not applied, and why (the task had finished, its payload
    did not fit the wait's schema, or the task keeps as many unclaimed signals as it may)."""

    event_type: ClassVar[str] = "SignalRefused"
    audit_only: ClassVar[bool] = True
    signal_id: str
    name: str
    reason: Literal["finished", "invalid", "too-many"]
    detail: str | None = None
    sender: str | None = None


OPERATIONS_STREAM = "waystation-operations"
"""The stream of what operators did to the deployment as a whole (not to one task): dead-letter
replays. A stream of its own, not a task's: appending to a task's stream would race its worker's
optimistic concurrency. Its events are audit-only and change no task; a task with this id would
share it, so no publisher should give a task this id."""


class DeadLettersReplayed(DomainEvent):
    """Audit only, in :data:`OPERATIONS_STREAM`: ``actor`` sent ``count`` dead letters back to
    the queues they came from (``waystation dead-letters replay``), those of ``reason`` when it
    was given; ``message_ids`` and ``queues`` name them (a letter without a message id as
    ``None``). One event per replay, for the letters actually republished."""

    event_type: ClassVar[str] = "DeadLettersReplayed"
    audit_only: ClassVar[bool] = True
    actor: str | None = None
    reason: str | None = None
    """The reason filter given, None: every reason."""
    count: int
    message_ids: tuple[str | None, ...]
    queues: tuple[str, ...]
    """The distinct queues the letters went back to, sorted."""


class UnknownEvent(DomainEvent):
    """An event this code cannot read; kept verbatim so nothing is lost on read.

    Either its type is unknown, or its type is known but its stored schema version cannot be
    brought to the current one (see :mod:`waystation.events.upcasting`): then ``reason`` says why
    and ``stored_version`` is the version it was written with.
    """

    event_type: ClassVar[str] = "?"
    audit_only: ClassVar[bool] = True
    type_name: str
    data: dict[str, JSON]
    reason: Literal["unknown-type", "newer-version", "missing-upcaster"] = "unknown-type"
    stored_version: int | None = None


_EVENT_TYPES: dict[str, type[DomainEvent]] = {
    cls.event_type: cls
    for cls in (
        TaskStarted,
        TaskPaused,
        SubtaskClaimed,
        ResultRecorded,
        TaskResumed,
        TaskCompleted,
        TaskFailed,
        TaskCancelled,
        DeadlineExtended,
        ReplyIgnored,
        SignalReceived,
        SignalRefused,
        DeadLettersReplayed,
    )
}


def event_types() -> dict[str, type[DomainEvent]]:
    """The event types this code knows, by stored name."""
    return dict(_EVENT_TYPES)


class EventMetadata(BaseModel):
    """Who caused an event and in which context; stored with every event and hashed with it."""

    model_config = ConfigDict(frozen=True, extra="allow", ser_json_inf_nan="constants")
    worker_id: str | None = None
    amqp_user: str | None = None
    causation_id: str | None = None
    """The id of the message whose handling produced the event."""
    correlation_id: str | None = None
    """The root task of the whole call tree."""
    trace_id: str | None = None
    occurred_at: float | None = None
    deployment: str | None = None
    """The queue prefix of the writer; the deadline sweeper of a deployment takes only its own."""
    actor: str | None = None
    """Who acted, as the publisher of a cancel or a signal named them (its ``x-waystation-actor``
    header, e.g. ``console:alice``; ``waystation.protocol.actors``), or the operator
    of a dead-letter replay; absent on every other event, and on events older than it."""


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event as a writer appends it."""

    event_id: uuid.UUID
    event_type: str
    data: dict[str, JSON]
    metadata: dict[str, JSON] = field(default_factory=dict)
    schema_version: int = 1
    _recorded: RecordedEvent | None = field(default=None, init=False, repr=False, compare=False)
    """What ``waystation.events.chain.recorded_events`` last made of it, kept: a worker chains a
    combined append's parts one by one to decide each on the state the ones before leave, then the
    store chains the whole append; the second time the same inputs give this back."""

    @classmethod
    def of(
        cls,
        event_id: uuid.UUID,
        event: DomainEvent,
        metadata: EventMetadata | Mapping[str, JSON],
    ) -> NewEvent:
        """``event`` to append; ``metadata`` as a model, or already as the log stores it
        (JSON, no None values: what ``EventMetadata.model_dump(mode="json",
        exclude_none=True)`` gives), which is copied."""
        return cls(
            event_id=event_id,
            event_type=event.event_type,
            data=event.stored_data(),
            metadata=(
                metadata.model_dump(mode="json", exclude_none=True)
                if isinstance(metadata, EventMetadata)
                else dict(metadata)
            ),
            schema_version=event.storage_version(),
        )


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    """An event as the log holds it."""

    stream_id: str
    stream_version: int
    event_id: uuid.UUID
    event_type: str
    data: dict[str, JSON]
    metadata: dict[str, JSON]
    schema_version: int
    prev_hash: bytes
    hash: bytes
    global_position: int = 0
    tx_id: int = 0
    recorded_at: datetime | None = None
    _parsed: DomainEvent | None = field(default=None, init=False, repr=False, compare=False)
    """What :func:`parse` made of it with the built-in types and upcasters, kept: a worker folds
    the same recorded events again and again (its cached copy of a stream, each decision of a
    combined append), and validating them each time was a few per cent of its CPU."""

    def hash_body(self) -> dict[str, JSON]:
        return hash_body(
            self.stream_id,
            self.stream_version,
            self.event_id,
            self.event_type,
            self.schema_version,
            self.data,
            self.metadata,
        )


def hash_body(
    stream_id: str,
    stream_version: int,
    event_id: uuid.UUID,
    event_type: str,
    schema_version: int,
    data: dict[str, JSON],
    metadata: dict[str, JSON],
) -> dict[str, JSON]:
    """What the hash chain covers for one event."""
    return {
        "stream_id": stream_id,
        "stream_version": stream_version,
        "event_id": str(event_id),
        "event_type": event_type,
        "schema_version": schema_version,
        "data": data,
        "metadata": metadata,
    }


def parse(
    event: RecordedEvent,
    *,
    types: Mapping[str, type[DomainEvent]] | None = None,
    upcasters: Upcasters | None = None,
) -> DomainEvent:
    """The domain event inside a recorded one, upcast from its stored schema version.

    ``types`` and ``upcasters`` default to the built-in event types and their upcasters. An
    unknown type, or a stored version the upcasters cannot bring to the current one, comes back
    as :class:`UnknownEvent` with its data; invalid data raises pydantic's ``ValidationError``.
    With the built-in types and upcasters, the result is kept on ``event`` (both are frozen) and
    given again the next time.
    """
    if types is None and upcasters is None:
        if event._parsed is None:
            object.__setattr__(event, "_parsed", _parse(event, _EVENT_TYPES, BUILTIN))
        assert event._parsed is not None
        return event._parsed
    return _parse(
        event,
        _EVENT_TYPES if types is None else types,
        BUILTIN if upcasters is None else upcasters,
    )


def _parse(
    event: RecordedEvent, types: Mapping[str, type[DomainEvent]], upcasters: Upcasters
) -> DomainEvent:
    cls = types.get(event.event_type)
    if cls is None:
        return UnknownEvent(type_name=event.event_type, data=event.data)
    try:
        data = upcasters.upcast(
            event.event_type, event.data, stored=event.schema_version, current=cls.schema_version
        )
    except UpcastError as error:
        return UnknownEvent(
            type_name=event.event_type,
            data=event.data,
            reason=error.reason,
            stored_version=event.schema_version,
        )
    return cls.model_validate(data)
