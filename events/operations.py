"""Appending to the operations stream: what operators did to the deployment as a whole.

A dead-letter replay changes no task's stream (the replayed messages make their own events as
they are handled again), yet the log must say who replayed what: one audit-only event in
:data:`~waystation.events.model.OPERATIONS_STREAM`, never in a task's stream, whose worker
appends at the version it read and would conflict with it. Operators are few and slow, so the
stream is appended to at its end as read just before: a conflict (another replay at the same
moment) reads the end again and appends again, the event keeping its id. Any other failure is
the caller's to report: the operation happened, its record did not.
"""

from __future__ import annotations

import time
import uuid

from .codec import GENESIS_HASH
from .errors import VersionConflict
from .model import OPERATIONS_STREAM, DomainEvent, EventMetadata, NewEvent, RecordedEvent
from .store import EventStore

__all__ = ["MAX_ATTEMPTS", "append_operation"]

MAX_ATTEMPTS = 20
"""Conflicts an operation's append goes through before it gives up (``VersionConflict``)."""


async def append_operation(
    store: EventStore,
    event: DomainEvent,
    *,
    actor: str | None,
    amqp_user: str | None = None,
    deployment: str | None = None,
) -> RecordedEvent | None:
    """Append ``event`` to the operations stream at its end, with ``actor`` (and the AMQP user
    and queue prefix it acted through) in its metadata; returns it as recorded (None when the
    store found it there already). Raises what the store raises, or ``VersionConflict`` after
    :data:`MAX_ATTEMPTS` conflicts."""
    metadata = EventMetadata(
        actor=actor,
        amqp_user=amqp_user,
        deployment=deployment,
        occurred_at=time.time(),
        causation_id=f"operation:{uuid.uuid4()}",
    )
    new = NewEvent.of(uuid.uuid4(), event, metadata)
    for attempt in range(MAX_ATTEMPTS):
        last = await store.last_event(OPERATIONS_STREAM)
        version, prev_hash = (0, GENESIS_HASH) if last is None else (last.stream_version, last.hash)
        try:
            result = await store.append(OPERATIONS_STREAM, version, [new], prev_hash=prev_hash)
        except VersionConflict:
            if attempt == MAX_ATTEMPTS - 1:
                raise
            continue
        # (none recorded: a duplicate, this very event committed by an earlier attempt)
        return result.recorded[0] if result.recorded else None
    raise AssertionError("unreachable")  # pragma: no cover
