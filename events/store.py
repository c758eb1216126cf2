"""The event log's port: the contract every backend implements.

A backend (``waystation.events.postgres.PostgresEventStore``,
``waystation.events.memory.InMemoryEventStore``) keeps one stream of events per task and a
transactional outbox of messages those events imply.

Contract (the shared suite in ``tests/contract/test_event_store.py`` runs it against every backend):

* ``append(stream, expected_version, events, prev_hash=…, outbox=…)`` writes all of ``events`` at
  versions ``expected_version + 1 …`` and all of ``outbox`` atomically, or nothing.
  - If the stream is not at ``expected_version`` it raises
    :class:`~waystation.events.errors.VersionConflict`.
  - If the first event's id is already in the stream, nothing is written and the result says
    ``duplicate=True``: the same decision was recorded before (a redelivery, a re-run).
    If a later event's id is in the log but the first's is not (decisions appended together,
    one of which was recorded before), nothing is written and it raises ``VersionConflict``:
    read again and decide again.
  - Each event's hash chains to the one before it: ``prev_hash`` must be the hash of the event
    at ``expected_version`` (:data:`~waystation.events.codec.GENESIS_HASH` for a new stream).
* ``read_stream`` returns a stream's events in version order; ``last_event`` its newest event
  alone (None for a stream with none), the head a writer appends after.
* ``read_all(after)`` returns events in commit order, never skipping one that commits later
  with a smaller position (the snapshot-horizon cursor, docs/internals.md).
* Pending calls (an inline projection kept by the append itself): a ``TaskPaused`` adds its
  calls with their deadlines, a ``SubtaskClaimed`` removes one, a ``DeadlineExtended`` moves
  one, a terminal event removes the task's rest. ``claim_expired_calls`` leases expired ones
  for ``lease`` seconds, skipping those another sweeper holds.
* The outbox: rows become visible to ``claim_outbox`` after ``outbox_delay`` seconds, or their
  message's own ``delay`` when that is longer (the writer publishes them itself first, and a
  claimed message's delay is spent); a claim leases rows for ``lease`` seconds so two relays
  do not publish the same row at once; ``retry_outbox`` gives leases back early, counting the
  broker's refusals of each row; ``replace_outbox`` puts another message in a row's place;
  ``delete_outbox`` forgets published rows.
  Each row belongs to the deployment (queue prefix) named by its events' metadata
  ``deployment``, as a pending call does: ``claim_outbox(deployment=d)`` and
  ``outbox_size(deployment=d)`` see only the rows of ``d`` and those of no deployment (written
  without one, or before the outbox knew deployments); without ``deployment`` they see every row.
  Two deployments sharing one database thus never relay each other's messages.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .model import NewEvent, RecordedEvent

__all__ = [
    "AppendResult",
    "EventStore",
    "ExpiredCall",
    "OutboxEntry",
    "OutboxMessage",
    "Position",
]


@dataclass(frozen=True, slots=True, order=True)
class Position:
    """A reader's place in the global order: (transaction id, global position)."""

    tx_id: int = 0
    global_position: int = 0

    @classmethod
    def of(cls, event: RecordedEvent) -> Position:
        return cls(event.tx_id, event.global_position)


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    """A message implied by appended events, published after they commit."""

    message_id: str
    routing_key: str
    body: bytes
    properties: dict[str, Any] = field(default_factory=dict)
    """AMQP properties: ``type``, ``correlation_id``, ``reply_to``, ``headers``, …"""
    exchange: str = ""
    delay: float = 0.0
    """Seconds after the commit before it may reach its queue (a retry's backoff): its writer
    publishes it to wait that long in the broker, and the relay takes its row no sooner."""


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    id: int
    message: OutboxMessage
    refusals: int = 0
    """Times the broker refused it so far (``retry_outbox(..., refused=...)``)."""
    age: float = 0.0
    """Seconds since it was written, by the store's clock."""


@dataclass(frozen=True, slots=True)
class ExpiredCall:
    """A pending wait whose deadline has passed, leased to one sweeper: a call or a signal that
    timed out, or a timer due to fire (``kind``; ``agent`` is empty for the last two)."""

    subtask_id: str
    task_id: str
    agent: str
    now: float = 0.0
    """The database's clock when it found the call expired (seconds since the epoch): the
    timeout is decided on it, not on the sweeping worker's own clock, which may be behind."""
    kind: str = "call"


@dataclass(frozen=True, slots=True)
class AppendResult:
    version: int
    """The stream's version after the append (for a duplicate: of the last matching event)."""
    last_hash: bytes
    duplicate: bool = False
    outbox_ids: tuple[int, ...] = ()
    recorded: tuple[RecordedEvent, ...] = ()
    """The appended events as the log now holds them (``waystation.events.chain.recorded_events``;
    global positions and tx ids unknown to a database writer): a writer's own copy, already chained.
    Empty for a duplicate."""


class EventStore(abc.ABC):
    """An append-only, hash-chained log of task streams with a transactional outbox."""

    @abc.abstractmethod
    async def append(
        self,
        stream_id: str,
        expected_version: int,
        events: Sequence[NewEvent],
        *,
        prev_hash: bytes,
        outbox: Sequence[OutboxMessage] = (),
        outbox_delay: float = 5.0,
    ) -> AppendResult: ...

    @abc.abstractmethod
    async def read_stream(self, stream_id: str, *, after: int = 0) -> list[RecordedEvent]:
        """The stream's events in order; with ``after``, only those of a later version (a
        reader that holds the stream up to ``after`` catches up)."""

    async def last_event(self, stream_id: str) -> RecordedEvent | None:
        """The stream's newest event, or None when it has none. Backends answer from their index
        on ``(stream_id, stream_version)``; this default reads the whole stream."""
        events = await self.read_stream(stream_id)
        return events[-1] if events else None

    @abc.abstractmethod
    async def read_all(
        self, after: Position = Position(), limit: int = 1000
    ) -> list[RecordedEvent]: ...

    @abc.abstractmethod
    async def claim_outbox(
        self, limit: int = 100, lease: float = 30.0, *, deployment: str | None = None
    ) -> list[OutboxEntry]:
        """Lease up to ``limit`` rows due for publishing, oldest first; only those of
        ``deployment`` (and of none) when it is given."""

    @abc.abstractmethod
    async def retry_outbox(
        self, ids: Sequence[int], delay: float, *, refused: str | None = None
    ) -> None:
        """Give the rows' leases back early: they are claimable again after ``delay`` seconds.
        With ``refused`` (why the broker refused them), each counts one more refusal."""

    @abc.abstractmethod
    async def replace_outbox(self, outbox_id: int, message: OutboxMessage) -> None:
        """Put ``message`` in the row's place (its refusals and age stay the row's): what a
        message that can never be sent is answered with instead, tried like any other row."""

    @abc.abstractmethod
    async def delete_outbox(self, ids: Sequence[int]) -> None: ...

    @abc.abstractmethod
    async def outbox_size(self, *, deployment: str | None = None) -> int:
        """Rows not yet deleted; only those ``claim_outbox(deployment=…)`` could take when
        ``deployment`` is given."""

    @abc.abstractmethod
    async def outbox_oldest(self, *, deployment: str | None = None) -> float | None:
        """Seconds since the oldest row not yet deleted was written (None: there is none); of
        the rows ``outbox_size`` counts."""

    @abc.abstractmethod
    async def claim_expired_calls(
        self, limit: int = 100, lease: float = 30.0, *, deployment: str | None = None
    ) -> list[ExpiredCall]:
        """Lease up to ``limit`` pending calls whose deadline has passed; only those appended
        with metadata ``deployment`` equal to ``deployment`` when it is given."""

    @abc.abstractmethod
    async def pending_call_deadlines(self, task_id: str) -> dict[str, float]:
        """The pending calls of one task and their deadlines (seconds since the epoch)."""

    async def close(self) -> None:  # noqa: B027 - optional for backends holding nothing
        """Release connections."""
