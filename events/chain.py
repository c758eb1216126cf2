"""Building the hash chain of an append (shared by every backend)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from .codec import as_stored, chain_hash
from .model import NewEvent, RecordedEvent, hash_body

__all__ = ["chain", "recorded_events"]


def chain(
    stream_id: str, expected_version: int, events: Sequence[NewEvent], prev_hash: bytes
) -> list[tuple[int, bytes, bytes]]:
    """``(version, prev_hash, hash)`` for each event of an append, in order."""
    links = []
    previous = prev_hash
    for offset, event in enumerate(events, start=1):
        version = expected_version + offset
        digest = chain_hash(
            previous,
            hash_body(
                stream_id,
                version,
                event.event_id,
                event.event_type,
                event.schema_version,
                event.data,
                event.metadata,
            ),
        )
        links.append((version, previous, digest))
        previous = digest
    return links


def recorded_events(
    stream_id: str,
    expected_version: int,
    events: Sequence[NewEvent],
    prev_hash: bytes,
    *,
    tx_id: int = 0,
    first_position: int = 0,
    recorded_at: datetime | None = None,
) -> list[RecordedEvent]:
    """The events of an append as the log holds them once it commits: chained, versioned,
    numbered from ``first_position`` (0: positions not known, as for a writer's own copy), and
    with data and metadata in the form the log gives back (``events.codec.as_stored``), so that
    a writer's own copy decides exactly as a read of the stream would."""
    return [
        RecordedEvent(
            stream_id=stream_id,
            stream_version=version,
            event_id=event.event_id,
            event_type=event.event_type,
            data=as_stored(event.data),
            metadata=as_stored(event.metadata),
            schema_version=event.schema_version,
            prev_hash=previous,
            hash=digest,
            global_position=first_position + offset if first_position else 0,
            tx_id=tx_id,
            recorded_at=recorded_at,
        )
        for offset, (event, (version, previous, digest)) in enumerate(
            zip(events, chain(stream_id, expected_version, events, prev_hash), strict=True)
        )
    ]
