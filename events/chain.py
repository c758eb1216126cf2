"""Building the hash chain of an append (shared by every backend)."""

from __future__ import annotations

from collections.abc import Sequence

from .codec import chain_hash
from .model import NewEvent, hash_body

__all__ = ["chain"]


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
