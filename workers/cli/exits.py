"""The ``waystation`` command's exit codes, and the failures a user can cause, told in one line.

A broker or database that cannot be reached, refuses the login or does not exist, a setting
that is invalid or unknown, a task sent to an agent no worker serves: each ends a command with
one line on stderr that names the setting (or argument) to check, shows its URL with the
password redacted, and says what to do; and with a code of its own (:data:`EXIT_CODES`). The
traceback is logged at ``--log-level debug``. Anything else is a bug, and keeps its traceback.

:func:`explain` reads such a failure out of an exception however the libraries wrapped it
(aio-pika, aiormq, SQLAlchemy, asyncpg, the log's and the broker port's own errors), and says
whether it may pass by itself (``transient``: a worker starting retries it) or cannot
(a wrong password, a missing database or virtual host: a worker stops at once).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

import click

if TYPE_CHECKING:
    from waystation.settings import Settings

__all__ = [
    "EXIT_BROKER",
    "EXIT_CODES",
    "EXIT_CONFIG",
    "EXIT_NO_ROUTE",
    "EXIT_STORE",
    "Failure",
    "explain",
]

log = logging.getLogger("waystation")

EXIT_STORE = 4
"""The event log cannot be used: its database is down, refuses us, or does not exist."""
EXIT_BROKER = 5
"""The broker cannot be used: unreachable, refused the login, or no such virtual host."""
EXIT_CONFIG = 6
"""A ``WAYSTATION_*`` variable (or the option that stands for it) is invalid or unknown."""
EXIT_NO_ROUTE = 7
"""A message for an agent no queue takes: no worker serving it has declared its queue."""

EXIT_CODES = {
    0: "done (a worker: stopped by SIGTERM or SIGINT, in any phase)",
    1: "an error: a task failed, a problem found, a metrics port taken (see each --help)",
    2: "usage: a bad option or argument",
    3: "no answer within --timeout (submit, cancel, signal)",
    EXIT_STORE: "the event log's database cannot be used (down, login refused, missing)",
    EXIT_BROKER: "the broker cannot be used (unreachable, login refused, no such vhost)",
    EXIT_CONFIG: "a WAYSTATION_* variable is invalid or unknown",
    EXIT_NO_ROUTE: "no queue for the agent named (no worker serving it has started)",
}
"""Every code a command exits with; the group's ``--help`` and docs/troubleshooting.md list
them (a unit test keeps both in step)."""


class Failure(click.ClickException):
    """A failure a user can cause: one line, an exit code, and whether it may pass by itself."""

    def __init__(self, line: str, code: int, *, transient: bool = False) -> None:
        from waystation.observability.logs import redact

        super().__init__(redact(line))  # (a driver's words may quote the URL)
        self.exit_code = code
        self.transient = transient

    def show(self, file: object = None) -> None:
        click.echo(f"waystation: {self.message}", err=True)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception behind it: causes, contexts, a group's members,
    SQLAlchemy's wrapped driver error."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend(getattr(current, "exceptions", ()))
        for behind in (current.__cause__, current.__context__, getattr(current, "orig", None)):
            if isinstance(behind, BaseException):
                todo.append(behind)


def _modules(error: BaseException) -> set[str]:
    """The top-level packages of the code each exception of the chain passed through."""
    found = set()
    for each in _chain(error):
        found.add(type(each).__module__.partition(".")[0])
        trace = each.__traceback__
        while trace is not None:
            found.add(str(trace.tb_frame.f_globals.get("__name__", "")).partition(".")[0])
            trace = trace.tb_next
    return found


def _names(error: BaseException) -> set[str]:
    return {type(each).__name__ for each in _chain(error)}


def _first_line(error: BaseException) -> str:
    """The innermost error's own words (a driver's), without the wrappers' repetitions."""
    words = ""
    for each in _chain(error):
        text = str(each).strip().splitlines()[0] if str(each).strip() else ""
        if text and not isinstance(each, click.ClickException):
            words = f"{type(each).__name__}: {text}"
    return words or type(error).__name__


def explain(error: BaseException, settings: Settings | None) -> Failure | None:
    """The failure ``error`` is, told for a user, or None when it is none a user can cause."""
    if isinstance(error, Failure):
        return error
    names = _names(error)
    if names & {"PublishError", "NoQueue"} and (failure := _no_route(error, settings)):
        return failure
    from waystation.brokers.amqp.topology import PolicyNotApplied

    for each in _chain(error):
        if isinstance(each, PolicyNotApplied):
            return Failure(
                f"the broker's queue policy cannot be applied: {each} ({each.setting}; "
                "WAYSTATION_BROKER_POLICY=none leaves it to the broker's definitions)",
                EXIT_BROKER,
                transient=each.transient,
            )
    modules = _modules(error)
    if names & {"BrokerError", "BrokerUnavailable"} or modules & {"aiormq", "aio_pika", "pamqp"}:
        return _broker(error, names, settings)
    from waystation.events.errors import EventStoreError

    database = {"asyncpg", "sqlalchemy", "alembic"}
    if isinstance(error, EventStoreError) or modules & database:
        return _database(error, names, settings)
    return None


def _broker(error: BaseException, names: set[str], settings: Settings | None) -> Failure | None:
    from waystation.observability.logs import redact_url

    url = redact_url(settings.amqp_url) if settings else "the broker"
    where = f"{url} (WAYSTATION_AMQP_URL)"
    words = _first_line(error)
    if "ProbableAuthenticationError" in names or "ACCESS_REFUSED" in words:
        return Failure(
            f"the broker cannot be used: it refused the login at {where}; check the user and "
            "password in the URL",
            EXIT_BROKER,
        )
    if ("InvalidFrameError" in names and "Connection.Close" in words) or "vhost" in words:
        vhost = (unquote(urlsplit(settings.amqp_url).path[1:]) or "/") if settings else "?"
        return Failure(
            f"the broker cannot be used: it closed the connection to {where} as it opened; does "
            f"its virtual host {vhost!r} exist, and may the user use it? (rabbitmqctl "
            "list_vhosts)",
            EXIT_BROKER,
        )
    if not any(isinstance(each, OSError | TimeoutError) for each in _chain(error)):
        if "BrokerUnavailable" not in names and "AMQPConnectionError" not in names:
            return None
    if any(isinstance(each, TimeoutError) for each in _chain(error)):
        from waystation.brokers.amqp.transport import CONNECT_TIMEOUT

        words = f"no answer within {CONNECT_TIMEOUT:g} s"
    return Failure(
        f"the broker cannot be used: cannot reach it at {where} ({words}); is RabbitMQ "
        "running there, on that port?",
        EXIT_BROKER,
        transient=True,
    )


# asyncpg's names for what a retry cannot mend: the login, the database, the right to create it
_DATABASE_REFUSED = {"InvalidPasswordError", "InvalidAuthorizationSpecificationError"}
_DATABASE_MISSING = "InvalidCatalogNameError"
_DATABASE_FORBIDDEN = "InsufficientPrivilegeError"
# and for what may pass: a server starting up or shutting down, its connections all taken
_DATABASE_BUSY = {
    "CannotConnectNowError",
    "TooManyConnectionsError",
    "AdminShutdownError",
    "CrashShutdownError",
    "ConnectionDoesNotExistError",
    "ConnectionFailureError",
}


def _database(error: BaseException, names: set[str], settings: Settings | None) -> Failure | None:
    from waystation.observability.logs import redact_url

    url = redact_url(settings.database_url) if settings else "the database"
    where = f"{url} (WAYSTATION_DATABASE_URL)"
    words = _first_line(error)
    if names & _DATABASE_REFUSED:
        return Failure(
            f"the event log cannot be used: PostgreSQL at {where} refused the login ({words}); "
            "check the user and password in the URL",
            EXIT_STORE,
        )
    if _DATABASE_MISSING in names:
        return Failure(
            f"the event log cannot be used: the database of {where} does not exist; "
            "`waystation db upgrade` creates it (a worker creates it as it starts)",
            EXIT_STORE,
        )
    if "UndefinedTableError" in names:
        return Failure(
            f"the event log cannot be used: the database of {where} has no event log (it was "
            "never migrated); `waystation db upgrade` migrates it",
            EXIT_STORE,
        )
    if _DATABASE_FORBIDDEN in names:
        return Failure(
            f"the event log cannot be used: PostgreSQL at {where} does not allow it ({words}); "
            "the role needs the right to create the database, or create it beforehand",
            EXIT_STORE,
        )
    from waystation.events.errors import EventStoreError, StoreUnavailable

    unreachable = any(isinstance(each, OSError | TimeoutError) for each in _chain(error))
    unreachable = unreachable or bool(names & _DATABASE_BUSY)
    if unreachable or any(isinstance(each, StoreUnavailable) for each in _chain(error)):
        return Failure(
            f"the event log cannot be used: cannot reach PostgreSQL at {where} ({words}); "
            "is it running there, on that port?",
            EXIT_STORE,
            transient=True,
        )
    if isinstance(error, EventStoreError):
        return Failure(f"the event log at {where} cannot be used ({words})", EXIT_STORE)
    return None


def _no_route(error: BaseException, settings: Settings | None) -> Failure | None:
    from waystation.client import NoQueue

    prefix = settings.queue_prefix if settings else ""
    for each in _chain(error):
        if isinstance(each, NoQueue):  # a delayed submit's
            return _no_queue(each.queue, prefix)
    frame = next(
        (getattr(e.message, "delivery", None) for e in _chain(error) if hasattr(e, "message")),
        None,
    )
    if getattr(frame, "reply_text", None) != "NO_ROUTE":
        return None  # (a message returned for another reason is none a user caused)
    return _no_queue(str(getattr(frame, "routing_key", "") or "?"), prefix)


def _no_queue(queue: str, prefix: str) -> Failure:
    agent = queue.removeprefix(prefix) if prefix else queue
    return Failure(
        f"no queue {queue!r} for agent {agent!r} (WAYSTATION_QUEUE_PREFIX={prefix!r}); no "
        "worker serving that agent has started on this broker under this prefix; "
        "`waystation agents --app module:attribute` lists an app's agents",
        EXIT_NO_ROUTE,
    )
