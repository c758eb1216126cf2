"""The event log's exceptions.

Driver errors never leak out of a backend: each backend translates them at its boundary
(``raise ... from``) into this small hierarchy, so callers can act on meaning, not on driver types::

    EventStoreError
    ├── VersionConflict        another writer appended to the stream first; re-read and re-decide
    ├── StoreUnavailable       the database cannot do it right now; retry later (appends are
    │                          idempotent, so a retry after an unknown outcome is safe)
    └── IntegrityError         the log breaks one of its own rules (a bad append, a broken chain),
                               or refuses what it was given; retrying cannot help

What PostgreSQL (``waystation.events.postgres``) reports as ``StoreUnavailable``, because the same
statement may well succeed a moment later:

* the connection: refused, reset or lost (``OSError``, an invalidated connection, SQLSTATE
  class 08), a driver timeout (``TimeoutError``);
* the pool: no connection free within ``pool_timeout`` (``sqlalchemy.exc.TimeoutError``, which is
  not the builtin ``TimeoutError``);
* insufficient resources, SQLSTATE class 53: 53300 too many connections (server-wide, per role
  or per database), 53200 out of memory, 53100 disk full, 53400 a configuration limit;
* operator intervention: 57014 statement cancelled (``statement_timeout``,
  ``pg_cancel_backend``), 57P01..57P05 the server shutting down, starting up or not accepting
  connections now;
* concurrency: 40001 serialization failure, 40P01 deadlock detected, 55P03 lock not available
  (``lock_timeout``).

These count whether the driver raises them itself (asyncpg at connect time:
``TooManyConnectionsError``, ``CannotConnectNowError``, ``ConnectionRefusedError``) or wrapped by
SQLAlchemy. Everything else is an ``IntegrityError``: a constraint or the append-only guard (class
23), data jsonb cannot hold (22P05 ``\\u0000``), an index row too large (54000), and so on.
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
