"""Building the hash chain of an append (shared by every backend)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import orjson

from .codec import as_stored, chain_hash
from .model import NewEvent, RecordedEvent, hash_body

__all__ = ["chain", "recorded_events"]


def chain(
    stream_id: str, expected_version: int, events: Sequence[NewEvent], prev_hash: bytes
) -> list[tuple[int, bytes, bytes]]:
    """``(version, prev_hash, hash)`` for each event of an append, in order."""
    return [
        (e.stream_version, e.prev_hash, e.hash)
        for e in recorded_events(stream_id, expected_version, events, prev_hash)
    ]


def _stored_hash(prev_hash: bytes, body: dict[str, Any], original: dict[str, Any]) -> bytes:
    """``chain_hash(prev_hash, original)`` computed from ``body``, the same body with its data
    and metadata already in stored form (``as_stored``): their encoding is already canonical, so
    it is not folded a second time. A number written with an exponent (a float of 1e16 or more
    that came back as a float beyond 64 bits, which the fold writes as digits), or a value orjson
    cannot encode again, takes the long way."""
    try:
        encoded = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        return chain_hash(prev_hash, original)
    if _EXPONENT.search(encoded):
        return chain_hash(prev_hash, original)
    digest = hashlib.sha256(prev_hash)
    digest.update(encoded)
    return digest.digest()


_EXPONENT = re.compile(rb"[:\[,]-?\d+(?:\.\d+)?[eE]")
"""A JSON number written with an exponent (inside a string it only costs the long way)."""


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
    recorded = []
    previous = prev_hash
    for offset, event in enumerate(events, start=1):
        version = expected_version + offset
        data, metadata = as_stored(event.data), as_stored(event.metadata)
        identity = (stream_id, version, event.event_id, event.event_type, event.schema_version)
        digest = _stored_hash(
            previous,
            hash_body(*identity, data, metadata),
            hash_body(*identity, event.data, event.metadata),
        )
        recorded.append(
            RecordedEvent(
                stream_id=stream_id,
                stream_version=version,
                event_id=event.event_id,
                event_type=event.event_type,
                data=data,
                metadata=metadata,
                schema_version=event.schema_version,
                prev_hash=previous,
                hash=digest,
                global_position=first_position + offset - 1 if first_position else 0,
                tx_id=tx_id,
                recorded_at=recorded_at,
            )
        )
        previous = digest
    return recorded
