"""Building the hash chain of an append (shared by every backend)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime

import orjson

from .codec import canonical
from .model import NewEvent, RecordedEvent

__all__ = ["chain", "recorded_events"]


def chain(
    stream_id: str, expected_version: int, events: Sequence[NewEvent], prev_hash: bytes
) -> list[tuple[int, bytes, bytes]]:
    """``(version, prev_hash, hash)`` for each event of an append, in order."""
    return [
        (e.stream_version, e.prev_hash, e.hash)
        for e in recorded_events(stream_id, expected_version, events, prev_hash)
    ]


def _event_hash(
    prev_hash: bytes,
    stream: bytes,
    version: int,
    event_id: str,
    event_type: str,
    schema_version: int,
    data: bytes,
    metadata: bytes,
) -> bytes:
    """``chain_hash(prev_hash, hash_body(...))`` from parts already encoded: ``stream`` the stream
    id as JSON, ``data`` and ``metadata`` canonical JSON (``waystation.events.codec.canonical``).
    The body's keys are fixed and every value is encoded on its own, so the canonical encoding of
    the whole body is theirs put together in sorted key order; nothing is encoded twice (a property
    test holds it equal to ``chain_hash``)."""
    digest = hashlib.sha256(prev_hash)
    digest.update(
        b"".join(
            (
                b'{"data":',
                data,
                b',"event_id":"',
                event_id.encode(),
                b'","event_type":',
                orjson.dumps(event_type),
                b',"metadata":',
                metadata,
                b',"schema_version":',
                str(schema_version).encode(),
                b',"stream_id":',
                stream,
                b',"stream_version":',
                str(version).encode(),
                b"}",
            )
        )
    )
    return digest.digest()


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
    with data and metadata in the form the log gives back (``waystation.events.codec.as_stored``),
    so that a writer's own copy decides exactly as a read of the stream would.

    An event made again from the same inputs (its ``NewEvent`` chained at the same place of the
    same stream, after the same hash) is the one made before (``NewEvent._recorded``)."""
    recorded = []
    previous = prev_hash
    stream = orjson.dumps(stream_id)
    for offset, event in enumerate(events, start=1):
        version = expected_version + offset
        position = first_position + offset - 1 if first_position else 0
        made = event._recorded
        if (
            made is not None
            and made.prev_hash == previous
            and made.stream_version == version
            and made.stream_id == stream_id
            and made.global_position == position
            and made.tx_id == tx_id
            and made.recorded_at == recorded_at
        ):
            recorded.append(made)
            previous = made.hash
            continue
        data, metadata = canonical(event.data), canonical(event.metadata)
        digest = _event_hash(
            previous,
            stream,
            version,
            str(event.event_id),
            event.event_type,
            event.schema_version,
            data,
            metadata,
        )
        made = RecordedEvent(
            stream_id=stream_id,
            stream_version=version,
            event_id=event.event_id,
            event_type=event.event_type,
            # as the log gives them back (``waystation.events.codec.as_stored``)
            data=orjson.loads(data),
            metadata=orjson.loads(metadata),
            schema_version=event.schema_version,
            prev_hash=previous,
            hash=digest,
            global_position=position,
            tx_id=tx_id,
            recorded_at=recorded_at,
        )
        object.__setattr__(event, "_recorded", made)
        recorded.append(made)
        previous = digest
    return recorded
