"""How the PostgreSQL store classifies the SQLSTATEs it can meet (``waystation.events.errors`` has
the tree).

``tests/integration/test_store_errors.py`` provokes one real error of each transient class on the
real server; this table covers the codes of those classes that cannot be provoked on a shared
server (out of memory, disk full), and the neighbours that must stay permanent (40002 is in the
same class as a deadlock, yet an integrity breach).
"""

from __future__ import annotations

import asyncpg
import pytest

from waystation.events import IntegrityError, StoreUnavailable
from waystation.events.postgres import translate_error

TRANSIENT = {
    "08000": "connection exception",
    "08006": "connection failure",
    "53000": "insufficient resources",
    "53100": "disk full",
    "53200": "out of memory",
    "53300": "too many connections",
    "53400": "configuration limit exceeded",
    "57014": "query cancelled",
    "57P01": "admin shutdown",
    "57P02": "crash shutdown",
    "57P03": "cannot connect now",
    "40001": "serialization failure",
    "40P01": "deadlock detected",
    "55P03": "lock not available",
}

PERMANENT = {
    "23505": "unique violation",
    "23001": "restrict violation (the append-only guard)",
    "23514": "check violation",
    "22P05": "untranslatable character (\\u0000 in jsonb)",
    "54000": "program limit exceeded (index row too large)",
    "40002": "transaction integrity constraint violation",
    "42P01": "undefined table",
    "P0001": "raise exception",
}


def server_error(sqlstate: str) -> asyncpg.PostgresError:
    """The exception asyncpg raises for an error message carrying ``sqlstate``."""
    error = asyncpg.PostgresError.new({"C": sqlstate, "M": "from the server", "S": "ERROR"})
    assert error.sqlstate == sqlstate
    return error


@pytest.mark.parametrize("sqlstate", sorted(TRANSIENT))
def test_a_transient_sqlstate_is_store_unavailable(sqlstate: str) -> None:
    translated = translate_error(server_error(sqlstate))
    assert isinstance(translated, StoreUnavailable), TRANSIENT[sqlstate]


@pytest.mark.parametrize("sqlstate", sorted(PERMANENT))
def test_any_other_sqlstate_is_an_integrity_error(sqlstate: str) -> None:
    assert isinstance(translate_error(server_error(sqlstate)), IntegrityError), PERMANENT[sqlstate]


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.exceptions.InterfaceError("connection is closed"),
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle"),
        asyncpg.exceptions.InternalClientError("cannot switch to state 12; another operation"),
    ],
    ids=repr,
)
def test_the_drivers_own_errors_of_a_broken_connection_are_store_unavailable(
    error: Exception,
) -> None:
    # the hot path uses the asyncpg connection directly: these reach the store unwrapped
    assert isinstance(translate_error(error), StoreUnavailable)


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.exceptions._base.DataError("invalid input for query argument $1"),
        asyncpg.exceptions.ClientConfigurationError("a bad setting"),
    ],
    ids=repr,
)
def test_what_the_driver_cannot_send_is_an_integrity_error(error: Exception) -> None:
    assert isinstance(translate_error(error), IntegrityError)
