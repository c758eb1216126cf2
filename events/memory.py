"""An in-memory event log: a real implementation of the port, for fast tests and simulation.

It keeps the same contract as PostgreSQL (the shared contract suite runs against both), with one
writer at a time: every method completes without awaiting, so an append is atomic on the loop.
Its global order is simply the order of appends (there are no concurrent transactions here).
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from .chain import recorded_events
from .codec import GENESIS_HASH, dumps, loads, unstorable
from .errors import IntegrityError, VersionConflict
from .model import NewEvent, RecordedEvent
from .store import (
    AppendResult,
    EventStore,
    ExpiredCall,
    OutboxEntry,
    OutboxMessage,
    Position,
)

__all__ = ["MAX_STREAM_ID_BYTES", "InMemoryEventStore"]

MAX_STREAM_ID_BYTES = 2000
"""Below what PostgreSQL's btree index on ``(stream_id, stream_version)`` takes (~2,700 bytes)."""


def _copy(event: RecordedEvent) -> RecordedEvent:
    """A reader's own copy, as a database hands out: mutating it cannot alter the log."""
    return dataclasses.replace(
        event, data=loads(dumps(event.data)), metadata=loads(dumps(event.metadata))
    )


def _require_storable(stream_id: str, events: Sequence[NewEvent]) -> None:
    """Refuse what PostgreSQL would refuse, as it would (``IntegrityError``): a NUL character in
    text or ``jsonb``, or a stream id too long for its index."""
    if "\x00" in stream_id or len(stream_id.encode()) > MAX_STREAM_ID_BYTES:
        raise IntegrityError(f"a stream id of {len(stream_id)} characters cannot be stored")
    for event in events:
        problem = unstorable(event.data) or unstorable(event.metadata)
        if problem is not None:
            raise IntegrityError(f"event {event.event_id} cannot be stored: {problem}")


class InMemoryEventStore(EventStore):
    def __init__(
        self,
        clock: Callable[[], float] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._streams: dict[str, list[RecordedEvent]] = {}
        self._all: list[RecordedEvent] = []
        self._event_ids: dict[object, RecordedEvent] = {}
        self._outbox: dict[int, _OutboxRow] = {}
        self._next_outbox_id = 1
        self._clock = clock or time.monotonic
        self._wall_clock = wall_clock
        # subtask id -> [task id, agent, deadline (epoch s), leased until (epoch s), deployment]
        self._pending: dict[str, list[Any]] = {}
        self.transactions = 0

    async def append(
        self,
        stream_id: str,
        expected_version: int,
        events: Sequence[NewEvent],
        *,
        prev_hash: bytes,
        outbox: Sequence[OutboxMessage] = (),
        outbox_delay: float = 5.0,
    ) -> AppendResult:
        if not events:
            raise IntegrityError("an append needs at least one event")
        _require_storable(stream_id, events)
        stream = self._streams.get(stream_id, [])
        first = self._event_ids.get(events[0].event_id)
        if first is not None:
            if first.stream_id != stream_id:
                raise IntegrityError(f"event {events[0].event_id} belongs to {first.stream_id!r}")
            matched = [self._event_ids[e.event_id] for e in events if e.event_id in self._event_ids]
            last = max(matched, key=lambda e: e.stream_version)
            return AppendResult(version=last.stream_version, last_hash=last.hash, duplicate=True)
        if len(stream) != expected_version:
            raise VersionConflict(stream_id, expected_version)
        head = stream[-1].hash if stream else GENESIS_HASH
        if head != prev_hash:
            raise IntegrityError(f"prev_hash does not match the head of {stream_id!r}")
        if any(e.event_id in self._event_ids for e in events):
            # as PostgreSQL's unique index answers it: read again and decide again
            raise VersionConflict(stream_id, expected_version)
        self.transactions += 1
        tx_id = self.transactions
        # data and metadata come back as new objects, in stored form: no aliasing with the caller
        recorded = recorded_events(
            stream_id,
            expected_version,
            events,
            prev_hash,
            tx_id=tx_id,
            first_position=len(self._all) + 1,
            recorded_at=datetime.fromtimestamp(self._wall_clock(), UTC),
        )
        self._streams[stream_id] = stream + recorded
        self._all.extend(recorded)
        self._event_ids.update((e.event_id, e) for e in recorded)
        self._follow_pending_calls(recorded)
        ids = []
        deployment = recorded[0].metadata.get("deployment")  # as PostgreSQL's append takes it
        now = self._clock()
        for message in outbox:
            ids.append(self._next_outbox_id)
            available_at = now + max(outbox_delay, message.delay)
            self._outbox[self._next_outbox_id] = _OutboxRow(message, available_at, deployment, now)
            self._next_outbox_id += 1
        return AppendResult(
            version=recorded[-1].stream_version,
            last_hash=recorded[-1].hash,
            outbox_ids=tuple(ids),
            recorded=tuple(recorded),
        )

    def _follow_pending_calls(self, recorded: list[RecordedEvent]) -> None:
        """The same rules as the PostgreSQL trigger (migrations/versions/0008), in one pass in
        append order: a ``FirstK`` resume that gives up its pause's waits, then the next pause
        of a run in place, in one append, leave that pause's waits."""
        for event in recorded:
            data = event.data
            if event.event_type == "TaskPaused":
                for call in data["calls"]:
                    self._pending.setdefault(
                        call["subtask_id"],
                        [
                            event.stream_id,
                            call["agent"],
                            float(call["deadline_at"]),
                            0.0,
                            event.metadata.get("deployment") or "",
                            call.get("kind", "call"),
                        ],
                    )
            elif event.event_type == "SubtaskClaimed":
                self._pending.pop(event.data["subtask_id"], None)
            elif event.event_type == "DeadlineExtended":
                entry = self._pending.get(event.data["subtask_id"])
                if entry is not None:
                    entry[2], entry[3] = float(event.data["deadline_at"]), 0.0
            elif event.event_type in ("TaskCompleted", "TaskFailed", "TaskCancelled") or (
                event.event_type == "TaskResumed" and "abandoned" in data
            ):
                for subtask in [k for k, v in self._pending.items() if v[0] == event.stream_id]:
                    del self._pending[subtask]

    async def claim_expired_calls(
        self, limit: int = 100, lease: float = 30.0, *, deployment: str | None = None
    ) -> list[ExpiredCall]:
        now = self._wall_clock()
        expired = sorted(
            (entry[2], subtask)
            for subtask, entry in self._pending.items()
            if entry[2] <= now
            and entry[3] <= now
            and (deployment is None or entry[4] == deployment)
        )[:limit]
        claimed = []
        for _, subtask in expired:
            entry = self._pending[subtask]
            entry[3] = now + lease
            claimed.append(
                ExpiredCall(
                    subtask_id=subtask, task_id=entry[0], agent=entry[1], now=now, kind=entry[5]
                )
            )
        return claimed

    async def pending_call_deadlines(self, task_id: str) -> dict[str, float]:
        return {k: v[2] for k, v in self._pending.items() if v[0] == task_id}

    async def read_stream(self, stream_id: str, *, after: int = 0) -> list[RecordedEvent]:
        return [_copy(e) for e in self._streams.get(stream_id, ()) if e.stream_version > after]

    async def last_event(self, stream_id: str) -> RecordedEvent | None:
        stream = self._streams.get(stream_id)
        return _copy(stream[-1]) if stream else None

    async def read_all(
        self, after: Position = Position(), limit: int = 1000
    ) -> list[RecordedEvent]:
        # positions are the order of appends here: the first one past ``after`` by bisection
        start = bisect.bisect_right(self._all, after, key=Position.of)
        return [_copy(e) for e in self._all[start : start + limit]]

    async def claim_outbox(
        self, limit: int = 100, lease: float = 30.0, *, deployment: str | None = None
    ) -> list[OutboxEntry]:
        now = self._clock()
        claimed: list[OutboxEntry] = []
        for outbox_id, row in sorted(self._outbox.items()):
            if len(claimed) >= limit:
                break
            if row.available_at <= now and _relays(deployment, row.deployment):
                row.available_at = now + lease
                # its delay is spent once it can be claimed, as PostgreSQL's row knows no delay
                message = dataclasses.replace(copy.deepcopy(row.message), delay=0.0)
                claimed.append(
                    OutboxEntry(outbox_id, message, row.refusals, max(0.0, now - row.created_at))
                )
        return claimed

    async def retry_outbox(
        self, ids: Sequence[int], delay: float, *, refused: str | None = None
    ) -> None:
        now = self._clock()
        for outbox_id in ids:
            row = self._outbox.get(outbox_id)
            if row is not None:
                row.available_at = now + delay
                if refused is not None:
                    row.refusals += 1
                    row.last_refusal = refused

    async def replace_outbox(self, outbox_id: int, message: OutboxMessage) -> None:
        row = self._outbox.get(outbox_id)
        if row is not None:
            row.message = copy.deepcopy(message)

    async def delete_outbox(self, ids: Sequence[int]) -> None:
        for outbox_id in ids:
            self._outbox.pop(outbox_id, None)

    async def outbox_size(self, *, deployment: str | None = None) -> int:
        return sum(1 for row in self._outbox.values() if _relays(deployment, row.deployment))

    async def outbox_oldest(self, *, deployment: str | None = None) -> float | None:
        now = self._clock()
        created = [r.created_at for r in self._outbox.values() if _relays(deployment, r.deployment)]
        return max(0.0, now - min(created)) if created else None


@dataclasses.dataclass(slots=True, eq=False)
class _OutboxRow:
    message: OutboxMessage
    available_at: float
    deployment: str | None
    """The deployment of the events that implied it."""
    created_at: float
    refusals: int = 0
    last_refusal: str | None = None


def _relays(relay: str | None, row: str | None) -> bool:
    """Whether a relay of deployment ``relay`` (None: every one) takes a row of ``row``."""
    return relay is None or row is None or row == relay
