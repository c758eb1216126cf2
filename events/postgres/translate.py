"""Errors of the driver and of SQLAlchemy as the log's own.

Every driver or SQLAlchemy error leaves the store through ``translate_error``. What may succeed
when tried again (the pool or the server out of connections, a cancelled statement, a deadlock, a
serialization failure, a lost connection, a server shutting down) becomes ``StoreUnavailable``;
the rest ``IntegrityError``. The full classification is drawn in ``waystation.events.errors``.
"""

from __future__ import annotations

import asyncpg
import sqlalchemy.exc

from ..errors import EventStoreError, IntegrityError, StoreUnavailable

__all__ = ["translate_error"]

_TRANSIENT_SQLSTATES = ("08", "53", "57P", "57014", "40001", "40P01", "55P03")
"""SQLSTATEs (or their classes) that say "not now" rather than "never": connection exceptions,
insufficient resources (53300 too many connections, out of memory, disk full), the server
shutting down or not accepting connections yet, a cancelled statement (statement_timeout,
pg_cancel_backend), a serialization failure, a deadlock, a lock timeout. The statement rolled
back; running it again may succeed."""


def _sqlstate(error: BaseException) -> str | None:
    """The SQLSTATE the server sent, wherever the layers put it: on the driver's exception
    (asyncpg, raised bare at connect time) or on the one SQLAlchemy wraps (``orig``)."""
    layer: BaseException | None = error
    for _ in range(4):  # error -> orig / cause -> the driver's own exception
        if layer is None:
            return None
        for candidate in (layer, getattr(layer, "orig", None)):
            code = getattr(candidate, "sqlstate", None)
            if isinstance(code, str) and code:
                return code
        layer = getattr(layer, "orig", None) or layer.__cause__
    return None


def translate_error(error: Exception) -> EventStoreError:
    """Map a driver or SQLAlchemy error to the log's own hierarchy (see
    ``waystation.events.errors``); for other tables of the same database too
    (``waystation.contrib.penguiflow.artifacts``)."""
    if isinstance(
        error, (asyncpg.exceptions._base.DataError, asyncpg.exceptions.ClientConfigurationError)
    ):
        # an argument the driver cannot encode, a bad setting: InterfaceErrors too, but never
        # transient (retrying would loop)
        return IntegrityError(str(error))
    if isinstance(error, sqlalchemy.exc.DBAPIError) and error.connection_invalidated:
        return StoreUnavailable(str(error.orig or error))
    if isinstance(
        error,
        (
            # the driver's own, when used directly (the hot path): the connection closed under
            # it, or was left mid-statement by a cancelled caller
            asyncpg.exceptions.InterfaceError,
            asyncpg.exceptions.InternalClientError,
            OSError,  # connection refused, reset, unreachable
            TimeoutError,  # the builtin one: a connect or command timeout of the driver
            sqlalchemy.exc.TimeoutError,  # no pooled connection free within pool_timeout
            sqlalchemy.exc.InterfaceError,
            sqlalchemy.exc.OperationalError,
        ),
    ):
        return StoreUnavailable(str(getattr(error, "orig", None) or error))
    sqlstate = _sqlstate(error)
    if sqlstate is not None and sqlstate.startswith(_TRANSIENT_SQLSTATES):
        return StoreUnavailable(f"{sqlstate}: {getattr(error, 'orig', None) or error}")
    return IntegrityError(str(error))
