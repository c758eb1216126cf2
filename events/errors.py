"""The event log's exceptions.

Driver errors never leak out of a backend: each backend translates them at its boundary
(``raise ... from``) into this small hierarchy, so callers can act on meaning, not on driver types::

    EventStoreError
    ├── VersionConflict        another writer appended to the stream first; re-read and re-decide
    ├── StoreUnavailable       the database cannot be reached right now; retry later
    └── IntegrityError         the log breaks one of its own rules (a bad append, a broken chain)
"""

from __future__ import annotations

__all__ = ["EventStoreError", "IntegrityError", "StoreUnavailable", "VersionConflict"]


class EventStoreError(Exception):
    """Base class of every error the event log raises."""


class VersionConflict(EventStoreError):
    """The stream's version was not the one the writer expected.

    Optimistic concurrency: the caller re-reads the stream, decides again and retries.
    """

    def __init__(self, stream_id: str, expected_version: int) -> None:
        super().__init__(f"stream {stream_id!r} moved past version {expected_version}")
        self.stream_id = stream_id
        self.expected_version = expected_version


class StoreUnavailable(EventStoreError):
    """The backing database could not be reached or dropped the connection mid-statement.

    Whether the statement committed is unknown; appends are idempotent, so retrying is safe.
    """


class IntegrityError(EventStoreError):
    """The log was asked to do something that breaks its rules, or was found broken."""
