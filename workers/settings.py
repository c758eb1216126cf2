"""Typed settings, read from ``WAYSTATION_*`` environment variables by the composition root.

Nothing reads the environment at import time: ``Settings()`` is built once, in the CLI (or a
test), and passed down.
"""

from __future__ import annotations

import difflib
import os
import socket
from collections.abc import Iterable, Mapping
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "HARNESS_PREFIX",
    "HARNESS_VARIABLES",
    "PREFIX",
    "Settings",
    "amqp_url",
    "asyncpg_url",
    "unknown_variables",
    "variable_of",
]

PREFIX = "WAYSTATION_"
HARNESS_PREFIX = "WAYSTATION_TEST_"
"""Variables of the test harness (``WAYSTATION_TEST_DATABASE_URL``, ...): never settings."""
HARNESS_VARIABLES = frozenset({"WAYSTATION_SIM_SEEDS"})
"""Other variables the project's scripts read (the simulation's seeds)."""

_DRIVER = "postgresql+asyncpg"
_PLAIN_SCHEMES = ("postgresql", "postgres")


def asyncpg_url(url: str) -> str:
    """``url`` as SQLAlchemy's asyncpg driver takes it: ``postgresql://`` and ``postgres://``
    (the forms psql, libpq and most tools use) get the driver named; a URL naming another
    driver is refused, since the log speaks to PostgreSQL through asyncpg alone."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError("is not a database URL; write postgresql://user:password@host:port/name")
    if scheme in _PLAIN_SCHEMES:
        return f"{_DRIVER}://{rest}"
    if scheme == _DRIVER:
        return url
    if scheme.startswith(("postgresql+", "postgres+")):
        raise ValueError(
            f"names the driver {scheme.partition('+')[2]!r}; Waystation uses asyncpg: "
            f"write postgresql://... (or {_DRIVER}://...)"
        )
    raise ValueError(f"is not a PostgreSQL URL (scheme {scheme!r}); write postgresql://...")


def amqp_url(url: str) -> str:
    """``url`` if it is an AMQP URL with a host; refused otherwise, saying what to write (a
    malformed one would have the broker's client retry it forever)."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in ("amqp", "amqps"):
        raise ValueError(
            "is not an AMQP URL; write amqp://user:password@host:5672/vhost (or amqps://)"
        )
    try:
        host = urlsplit(url).hostname
    except ValueError as error:  # a port that is not a number
        raise ValueError(f"is not a valid URL ({error})") from None
    if not host:
        raise ValueError("names no host; write amqp://user:password@host:5672/vhost")
    return url


def variable_of(field: str) -> str:
    """The environment variable of the setting ``field``: ``WAYSTATION_CONCURRENCY``."""
    return PREFIX + field.upper()


def unknown_variables(
    environ: Mapping[str, str], known: Iterable[str] = ()
) -> list[tuple[str, str | None]]:
    """Each ``WAYSTATION_*`` variable of ``environ`` that is neither a setting, nor in
    ``known`` (those the command line reads), nor the test harness's, with the known name it
    most resembles (None when none does): a misspelled setting is not silently ignored."""
    names = {variable_of(field) for field in Settings.model_fields} | set(known)
    names |= HARNESS_VARIABLES
    unknown = []
    for name in sorted(environ):
        upper = name.upper()  # (the settings are read whatever their case)
        if not upper.startswith(PREFIX) or upper.startswith(HARNESS_PREFIX) or upper in names:
            continue
        # compared without the prefix they all share, which would make any two look alike
        close = difflib.get_close_matches(
            upper.removeprefix(PREFIX), sorted(n.removeprefix(PREFIX) for n in names), n=1
        )
        unknown.append((name, PREFIX + close[0] if close else None))
    return unknown


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Settings(BaseSettings):
    """Every setting, its environment variable (``WAYSTATION_`` + upper-case name) and default."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX,
        extra="ignore",
        # a URL with its password must not be printed back in a validation error
        hide_input_in_errors=True,
    )

    database_url: str = "postgresql+asyncpg://postgres@127.0.0.1:5432/waystation"
    """URL of the event log's database, ``postgresql://`` (or ``postgres://``, or SQLAlchemy's
    ``postgresql+asyncpg://``; the driver is always asyncpg). Created if missing."""
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    """URL of the broker, ``amqp://`` or ``amqps://`` with a host; anything else is refused."""
    queue_prefix: str = "waystation."
    """Prepended to every queue and exchange name; one prefix is one isolated deployment."""
    concurrency: int = Field(default=32, ge=1)
    """Messages a worker handles at once per queue (the consumer prefetch)."""
    default_call_timeout: float = Field(default=300.0, gt=0)
    """Deadline of a peer call when neither the call nor the agent sets one, in seconds."""
    max_call_duration: float = Field(default=3600.0, gt=0)
    """Upper bound of a call's deadline, from its dispatch, however often a peer extends it (s)."""
    sweep_interval: float = Field(default=1.0, gt=0)
    """How often each worker looks for calls past their deadline, in seconds."""
    max_message_bytes: int = Field(default=1024 * 1024, ge=1)
    """Bodies larger than this are dead-lettered as ``too-large``."""
    max_header_bytes: int = Field(default=64 * 1024, ge=1)
    """Headers larger than this (as JSON) are dead-lettered as ``headers-too-large``."""
    max_state_bytes: int = Field(default=1024 * 1024, ge=1)
    """Largest agent state (canonical JSON) a pause may leave: a ``Pause(update=...)`` past it
    fails the task (``StateTooLarge``), without retries."""
    reply_shards: int = Field(default=4, ge=0, le=64)
    """Reply shards per agent (``waystation.runtime.routing``): a pause's replies come back to the
    worker that recorded it, which then decides from its own copy of the stream, without conflicts.
    Use at least as many as workers serving an agent; 0 turns routing off. Lower it only when
    no task is paused: replies waiting in a shard past the new count are not consumed."""
    fast_frames: bool = True
    """The worker's own AMQP connection encodes and decodes its hot path's frames with
    Waystation's codec (``waystation.brokers.amqp.frames``: the same bytes as pamqp's, in a fraction
    of the time); no other connection of the process does. Off: pamqp's own codec."""
    resume_in_place: bool = True
    """The worker that records a pause's last reply runs the resumed handler at once and appends
    its outcome with that reply (no resume message; docs/performance.md). Off: every resume
    travels as a message on the agent's queue. A resumed handler that raises always goes by
    message."""
    audit_all_tasks: bool = False
    """Record tasks that complete without calling peers too (off: they write nothing)."""
    delivery_limit: int = Field(default=5, ge=1)
    """Attempts of a task whose handler raises: after this many the task is recorded as failed,
    its publisher gets an error and the message is dead-lettered. Also the broker's policy
    ``delivery-limit``, which dead-letters a message that keeps killing its workers."""
    slot_lease_seconds: float = Field(default=30.0, gt=0, le=3600)
    """How long a run's concurrency slot stays taken without its worker renewing it (every third
    of this): a worker that dies gives its slots back within this time
    (``waystation.runtime.limits``)."""
    limit_wait_max: float = Field(default=2.0, ge=0.1, le=3600)
    """Longest wait in the broker between two tries of a task whose agent's concurrency is full
    (its waits start at 0.1 s and double), in seconds."""
    broker_policy: Literal["auto", "rabbitmqctl", "management", "none"] = "auto"
    """How the worker applies the queue policy: ``rabbitmqctl`` on this host, ``management``
    through RabbitMQ's management API (compose), or ``none`` when the broker's definitions set
    it. ``auto`` uses rabbitmqctl when it is installed."""
    management_url: str | None = None
    """RabbitMQ's management API, for ``broker_policy=management``. Unset: the AMQP URL's host
    on port 15672, with the AMQP URL's user and password."""
    outbox_delay: float = Field(default=5.0, gt=0)
    """Seconds before the outbox relay republishes a message its writer has not published."""
    outbox_poll_interval: float = Field(default=1.0, gt=0)
    refused_retry_seconds: float = Field(default=600.0, ge=0)
    """How long a message the broker keeps refusing (a full queue with ``x-overflow:
    reject-publish``, a nack) is tried again, with backoff, before it is dead-lettered as
    ``refused`` and its task answered (s; counted from its first refusal, as the sum of its
    backoff waits). A message that can never pass (too large, not
    encodable, no queue) is dead-lettered at once."""
    projection_batch_size: int = Field(default=1000, ge=1)
    """Events a projection runner applies per transaction."""
    projection_poll_interval: float = Field(default=1.0, gt=0)
    """How often an active projection runner looks at the log without a notification (s)."""
    projection_standby_interval: float = Field(default=1.0, gt=0)
    """How often a standby runner tries to take over a projection; bounds the failover time (s)."""
    stream_cache_bytes: int = Field(default=32 * 1024 * 1024, ge=0)
    """Memory a worker may use for its copies of the streams it wrote last (they spare a read
    of the log for the next decision on them); 0 keeps none."""
    stream_cache_seconds: float = Field(default=60.0, ge=0)
    """How long a worker keeps its copy of a stream it wrote last (s): a copy older than this is
    dropped, and the next decision on the stream reads it; 0 keeps none."""
    reply_gather_ms: float = Field(default=20.0, ge=0, le=10_000)
    """How long the first replies to a pause wait for the rest of them (ms), so that they are
    recorded in one append instead of one each; the last reply never waits, nor does any for
    a pause of more calls than ``concurrency`` (they could not all be held at once). 0: none
    wait."""
    db_pool_size: int = Field(default=16, ge=1)
    """Database connections per worker, at most (all but two serve the hot path's statements on
    asyncpg connections of their own, two the rest on SQLAlchemy's;
    ``waystation.events.postgres.split_pool``); handlers wait for one when all are busy."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the worker's (and the projection runner's) ``/metrics`` and ``/healthz``; 0 turns
    the endpoint off. Unset: the first free port from 9464 to 9563, so that several processes
    on one host each get one (the port taken is logged); set, that port or an error."""
    metrics_host: str = "0.0.0.0"
    """Address the metrics endpoint listens on (``127.0.0.1`` keeps it local)."""
    console_host: str = "127.0.0.1"
    """Address ``waystation console`` listens on: this host only, unless told otherwise (any
    other address also needs ``console_token`` for actions, sent in clear over plain HTTP: put
    TLS in front)."""
    console_port: int = Field(default=8470, ge=0, le=65535)
    """Port of ``waystation console`` (0: any free port, logged)."""
    console_token: SecretStr | None = None
    """The secret a person types into ``waystation console`` to act (cancel, signal, replay);
    unset, the console is read-only. Keep it out of shells' history: set it in the
    environment of the console's process only."""
    worker_id: str = Field(default_factory=_default_worker_id)
    shutdown_grace: float = Field(default=10.0, ge=0)
    """Seconds in-flight messages get to reach their next commit on SIGTERM."""
    stats_file: str | None = None
    """Where a worker writes its checkpoint latencies and counters when it stops (benchmarks)."""
    fault_point: str | None = None
    """Test hook: SIGKILL the worker at this named step (see workers/runtime/faults.py)."""
    fault_after: int = Field(default=1, ge=1)
    """Test hook: kill on this hit of ``fault_point``."""

    @field_validator("database_url")
    @classmethod
    def _asyncpg(cls, url: str) -> str:
        return asyncpg_url(url)

    @field_validator("amqp_url")
    @classmethod
    def _amqp(cls, url: str) -> str:
        return amqp_url(url)
