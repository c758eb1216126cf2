"""What readers of the projections ask: where each projection stands (its checkpoint, how far
behind the log it is, whether a runner is active, and the transaction holding the log's horizon,
if any), and the rows of the read models.

The console's overview reads here too: each agent's recent activity (``agent_activity``, from
the ``agent_minutes`` projection), the calls waiting for each agent's answer
(``calls_outstanding``, from the inline ``pending_calls``) and the slots of the pool's limits in
use (``slots_in_use``, from ``pool_slots``). None of them reads ``events``: each is a small
read of a small table, whichever worker serves it.

The paused tasks come as ``waystation tasks`` lists them, and by keyset pages with more
filters for the console (``paused_tasks_page``).

Over 400 lines on purpose: the reads of the projections are one module, and the two reads of
the paused tasks share their filters and their SQL.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from waystation.events.codec import dumps, loads
from waystation.events.postgres import HorizonHolder, horizon_holder
from waystation.events.store import Position

from ..activity import KEEP, add_histograms, latency_quantile
from ..model import AgentCounts
from .runner import _LOCK_NAMESPACE
from .tables import _COUNTERS, PROJECTIONS

__all__ = [
    "COUNT_UP_TO",
    "PAGE_ORDERS",
    "WHOLE_UP_TO",
    "AgentActivity",
    "PausedTasksPage",
    "ProjectionStatus",
    "SlotUse",
    "agent_activity",
    "agent_stats",
    "calls_outstanding",
    "paused_tasks",
    "paused_tasks_page",
    "projection_status",
    "slots_in_use",
]


@dataclass(frozen=True, slots=True)
class ProjectionStatus:
    """Where a projection stands: its checkpoint and how far behind the log it is."""

    name: str
    position: Position
    events: int
    updated_at: datetime | None
    behind: int
    """Events in the log after the checkpoint."""
    lag_seconds: float
    """Age of the oldest event not yet applied (0 when up to date)."""
    active: bool
    """Whether a runner holds the projection's lock right now."""
    horizon: HorizonHolder | None = None
    """The transaction that holds back what a runner can read (None when none does)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tx_id": self.position.tx_id,
            "global_position": self.position.global_position,
            "events": self.events,
            "updated_at": self.updated_at.isoformat() if self.updated_at else None,
            "behind": self.behind,
            "lag_seconds": self.lag_seconds,
            "active_runner": self.active,
            "horizon": self.horizon.to_json() if self.horizon else None,
        }


_STATUS = text(
    """
    SELECT c.tx_id::text, c.global_position, c.events, c.updated_at,
           (SELECT count(*) FROM events e
            WHERE (e.tx_id, e.global_position) > (c.tx_id, c.global_position)),
           coalesce(extract(epoch FROM now() - (
               SELECT min(e.recorded_at) FROM events e
               WHERE (e.tx_id, e.global_position) > (c.tx_id, c.global_position))), 0),
           EXISTS (SELECT 1 FROM pg_locks l
                   WHERE l.locktype = 'advisory' AND l.granted
                     AND l.classid = CAST(:namespace AS oid)
                     AND l.objid = CAST(CAST(hashtext(c.name) AS bigint) & 4294967295 AS oid)
                     AND l.objsubid = 2)
    FROM (SELECT :name AS name) n
    LEFT JOIN projection_checkpoints c ON c.name = n.name
    """
)


async def projection_status(
    engine: AsyncEngine, names: Sequence[str] | None = None
) -> list[ProjectionStatus]:
    """The status of every projection, or of those ``names`` (a projection never run is at
    position zero, ``updated_at`` None), with what holds the log's horizon back."""
    holder = await horizon_holder(engine)
    statuses = []
    async with engine.connect() as connection:
        for name in PROJECTIONS if names is None else names:
            row = (
                await connection.execute(_STATUS, {"name": name, "namespace": _LOCK_NAMESPACE})
            ).one()
            if row[0] is None:  # never run: everything is behind
                behind = await connection.scalar(text("SELECT count(*) FROM events"))
                age = await connection.scalar(
                    text(
                        "SELECT coalesce(extract(epoch FROM now() - min(recorded_at)), 0) "
                        "FROM events"
                    )
                )
                statuses.append(
                    ProjectionStatus(
                        name, Position(), 0, None, int(behind or 0), float(age or 0), False, holder
                    )
                )
                continue
            statuses.append(
                ProjectionStatus(
                    name=name,
                    position=Position(int(row[0]), row[1]),
                    events=row[2],
                    updated_at=row[3],
                    behind=row[4],
                    lag_seconds=float(row[5]) if row[4] else 0.0,
                    active=bool(row[6]),
                    horizon=holder,
                )
            )
    return statuses


_PAUSED_COLUMNS = (
    "task_id, agent, pause, waits_expected, waits_recorded, earliest_deadline, paused_since, "
    "status, waits, first_k, agent_version"
)
_DEADLINE = "coalesce(earliest_deadline, 'infinity'::timestamptz)"
"""The deadline order's sort key, as revision 0011 indexes it: a row with no open wait last."""
_WAIT_KINDS = ("call", "signal", "timer")


def _kind_condition(kind: str) -> str:
    """Tasks with an open wait of ``kind`` (one of three, written out, not a parameter)."""
    return f"""waits @> '[{{"kind": "{kind}"}}]'::jsonb"""


def _paused_filters(
    *,
    agent: str | None = None,
    status: str | None = None,
    waiting_for: str | None = None,
    signal: str | None = None,
    paused_before: datetime | None = None,
    paused_after: datetime | None = None,
    deadline_before: datetime | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """The conditions of a read of the paused-tasks projection, and their parameters: only the
    filters asked for, so that the planner sees each as an index can answer it, whatever plan
    it caches for the statement."""
    conditions = []
    params: dict[str, Any] = {}
    if agent is not None:
        conditions.append("agent = :agent")
        params["agent"] = agent
    if status is not None:
        conditions.append("status = :status")
        params["status"] = status
    if waiting_for is not None and waiting_for not in _WAIT_KINDS:
        raise ValueError(f"a wait is a {', a '.join(_WAIT_KINDS)}, not {waiting_for!r}")
    if signal is not None and waiting_for not in (None, "signal"):
        raise ValueError(f"a signal's wait is not a {waiting_for}'s")
    kind = "signal" if signal is not None else waiting_for
    if kind is not None:
        # containments, which the GIN index on waits answers (revision 0009); the kind's is
        # written out (one of three) as the predicate of its partial indexes (revision 0011)
        conditions.append(_kind_condition(kind))
    if signal is not None:
        conditions.append("waits @> CAST(:wanted AS jsonb)")
        params["wanted"] = dumps([{"kind": "signal", "name": signal}]).decode()
    if paused_before is not None:
        conditions.append("paused_since < :paused_before")
        params["paused_before"] = paused_before
    if paused_after is not None:
        conditions.append("paused_since >= :paused_after")
        params["paused_after"] = paused_after
    if deadline_before is not None:
        conditions.append(f"{_DEADLINE} < :deadline_before")
        params["deadline_before"] = deadline_before
    return conditions, params


async def paused_tasks(
    engine: AsyncEngine,
    *,
    agent: str | None = None,
    status: str | None = None,
    waiting_for: str | None = None,
    signal: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """Rows of the paused-tasks projection, oldest pause first (``waystation tasks``).

    ``waiting_for``: only tasks with an open wait of that kind (``call``, ``signal``,
    ``timer``); ``signal``: only tasks with an open wait for the signal of that name. Both are
    answered by the index on ``waits`` (containment). :func:`paused_tasks_page` pages through
    them, with more filters.
    """
    page = await paused_tasks_page(
        engine,
        agent=agent,
        status=status,
        waiting_for=waiting_for,
        signal=signal,
        limit=limit,
    )
    return page.rows


@dataclass(frozen=True, slots=True)
class _Order:
    """A order of the paused tasks: its sort, the keyset condition that starts a page after a
    row, and that row's key as a cursor holds it (text, cast back in SQL)."""

    sort: str
    after: str
    key: Callable[[Mapping[str, Any]], list[str]]


def _deadline_key(row: Mapping[str, Any]) -> list[str]:
    deadline = row["earliest_deadline"]
    return ["infinity" if deadline is None else deadline.isoformat(), row["task_id"]]


_KEY_CAST = "(CAST(CAST(:key_0 AS text) AS timestamptz), CAST(:key_1 AS text))"
_ORDERS = {
    "oldest": _Order(
        sort="paused_since, task_id",
        after=f"(paused_since, task_id) > {_KEY_CAST}",
        key=lambda row: [row["paused_since"].isoformat(), row["task_id"]],
    ),
    "newest": _Order(
        sort="paused_since DESC, task_id DESC",
        after=f"(paused_since, task_id) < {_KEY_CAST}",
        key=lambda row: [row["paused_since"].isoformat(), row["task_id"]],
    ),
    "deadline": _Order(
        sort=f"{_DEADLINE}, task_id",
        after=f"({_DEADLINE}, task_id) > {_KEY_CAST}",
        key=_deadline_key,
    ),
}
PAGE_ORDERS = tuple(_ORDERS)
"""The orders :func:`paused_tasks_page` pages in."""

COUNT_UP_TO = 2000
"""A filter the planner expects to select at most this many rows is counted exactly."""
WHOLE_UP_TO = 1000
"""A filter that selects at most this many rows is read whole and sorted."""


@dataclass(frozen=True, slots=True)
class PausedTasksPage:
    """A page of paused tasks: its rows (as :func:`paused_tasks` gives them), the cursor of the
    next page (None on the last), and how many rows the filter selects in all."""

    rows: list[dict[str, Any]]
    next: str | None
    """Pass it as ``after`` for the next page, with the same order (and filters)."""
    total: int
    """Rows the filter selects: exact when ``total_exact``, else the planner's estimate."""
    total_exact: bool


def _cursor(order: str, row: Mapping[str, Any]) -> str:
    key = _ORDERS[order].key(row)
    return base64.urlsafe_b64encode(dumps({"order": order, "key": key})).decode().rstrip("=")


def _uncursor(order: str, cursor: str) -> list[str]:
    """The key a cursor holds; ValueError for a string that is not a cursor of this order."""
    try:
        decoded = loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        cursor_order, key = decoded["order"], decoded["key"]
        valid = (
            cursor_order in _ORDERS
            and isinstance(key, list)
            and len(key) == 2
            and all(isinstance(k, str) for k in key)
        )
        if valid and key[0] != "infinity":
            datetime.fromisoformat(key[0])
    except (ValueError, TypeError, KeyError, binascii.Error) as error:
        raise ValueError(f"not a cursor of the paused tasks' pages: {cursor!r}") from error
    if not valid:
        raise ValueError(f"not a cursor of the paused tasks' pages: {cursor!r}")
    if cursor_order != order:
        raise ValueError(
            f"this cursor pages in the order {cursor_order!r}, not {order!r}: start again "
            "from the first page of this order"
        )
    return key


async def paused_tasks_page(
    engine: AsyncEngine,
    *,
    agent: str | None = None,
    status: str | None = None,
    waiting_for: str | None = None,
    signal: str | None = None,
    paused_before: datetime | None = None,
    paused_after: datetime | None = None,
    deadline_before: datetime | None = None,
    order: str = "oldest",
    after: str | None = None,
    limit: int = 50,
) -> PausedTasksPage:
    """A page of the paused-tasks projection, by keyset: each page starts after the last row of
    the one before (``after``, its ``next`` cursor), never at an offset, so that every page
    costs what the first does, and paging to the end visits every row that stays in the table
    exactly once, however many come and go meanwhile.

    Filters (all optional, together): ``agent``; ``status`` (``paused`` or ``resumed``);
    ``waiting_for`` a kind of open wait (``call``, ``signal``, ``timer``) and ``signal`` a
    signal's name, answered by the GIN index on ``waits``; ``paused_before`` (strictly) and
    ``paused_after`` (at or after) on ``paused_since``; ``deadline_before`` on the earliest
    open deadline (a row with none never matches). Orders: ``oldest`` or ``newest`` pause first
    (ties by task id), or ``deadline``: the earliest deadline first, rows without an open wait
    last. Revision 0011 indexes each order with and without the agent.

    ``total``: the planner's estimate of the rows the filter selects (from the table's
    statistics: EXPLAIN, a fraction of a millisecond), and an exact count instead when that
    estimate is at most :data:`COUNT_UP_TO` (a count through the filter's indexes, a few
    milliseconds), so that a selective filter shows its true number and a table of 100,000 rows
    is never counted. The count also picks the page's plan: a filter that selects at most
    :data:`WHOLE_UP_TO` rows is read whole and sorted (cheap, and safe from a filter the
    order's index would walk far to satisfy: approvals, whose deadlines are days away, in
    deadline order behind every call's); any other is read along the order's index (revision
    0011 has one per order, per order and agent, and per order and kind of wait).

    A cursor is opaque (base64 of the order and the last row's key); one of another order, or
    a string that is none, is a ValueError, as an unknown order or wait kind is.
    """
    if order not in _ORDERS:
        raise ValueError(f"the order is one of {', '.join(_ORDERS)}, not {order!r}")
    if limit < 1:
        raise ValueError(f"a page holds at least one row, not {limit}")
    conditions, params = _paused_filters(
        agent=agent,
        status=status,
        waiting_for=waiting_for,
        signal=signal,
        paused_before=paused_before,
        paused_after=paused_after,
        deadline_before=deadline_before,
    )
    async with engine.connect() as connection:
        total, exact = await _total(connection, conditions, params)
        statement, page_params = _page_statement(
            order, conditions, params, after, limit, whole=exact and total <= WHOLE_UP_TO
        )
        result = await connection.execute(statement, page_params)
        rows = [dict(row._mapping) for row in result]
    more = len(rows) > limit
    rows = rows[:limit]
    return PausedTasksPage(
        rows=rows,
        next=_cursor(order, rows[-1]) if more else None,
        total=total,
        total_exact=exact,
    )


def _page_statement(
    order: str,
    conditions: list[str],
    params: dict[str, Any],
    after: str | None,
    limit: int,
    *,
    whole: bool = False,
) -> tuple[TextClause, dict[str, Any]]:
    """The page's statement and parameters: a row more than the page, to know whether a next
    page has any. ``whole``: read every row of the filter, then sort (see
    :func:`paused_tasks_page`)."""
    sorting = _ORDERS[order]
    conditions = list(conditions)
    params = {**params, "limit": limit + 1}
    if after is not None:
        params["key_0"], params["key_1"] = _uncursor(order, after)
        conditions.append(sorting.after)
    where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
    selected = f"SELECT {_PAUSED_COLUMNS} FROM paused_tasks {where}"
    if whole:
        selected = f"WITH m AS MATERIALIZED ({selected}) SELECT * FROM m"
    return text(f"{selected} ORDER BY {sorting.sort} LIMIT :limit"), params


async def _total(
    connection: AsyncConnection, conditions: list[str], params: dict[str, Any]
) -> tuple[int, bool]:
    """``(rows the filter selects, exact)``: see :func:`paused_tasks_page`."""
    where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
    # a signal's name implies its kind: estimated with both, the planner would multiply their
    # selectivities and expect a fraction of the rows
    implied = _kind_condition("signal") if "wanted" in params else None
    estimated = [c for c in conditions if c != implied]
    plan = await connection.scalar(
        text(
            "EXPLAIN (FORMAT JSON) SELECT 1 FROM paused_tasks"
            + (f" WHERE {' AND '.join(estimated)}" if estimated else "")
        ),
        params,
    )
    estimate = int(plan[0]["Plan"]["Plan Rows"])  # the json is decoded by the engine's driver
    if estimate > COUNT_UP_TO:
        return estimate, False
    # planned for every row it selects (no LIMIT, which would make the planner hope to stop
    # early along a scan that may have to go far), so through the indexes of its filters
    counted = await connection.scalar(text(f"SELECT count(*) FROM paused_tasks {where}"), params)
    return int(counted), True


async def agent_stats(engine: AsyncEngine) -> dict[str, AgentCounts]:
    """The per-agent statistics projection, by agent."""
    async with engine.connect() as connection:
        result = await connection.execute(
            text(f"SELECT agent, {', '.join(_COUNTERS)} FROM agent_stats ORDER BY agent")
        )
        return {row[0]: AgentCounts(*row[1:]) for row in result}


@dataclass(frozen=True, slots=True)
class AgentActivity:
    """One agent's tasks over the last minutes, from the ``agent_minutes`` projection.

    The window is the ``minutes`` whole minutes before the current one, and the current one so
    far; rates divide by its length (``window_minutes``). The counts cover the tasks the log
    records (``waystation.projections.activity`` says which, and what latency measures).
    """

    agent: str
    window_minutes: float
    started: int
    completed: int
    failed: int
    cancelled: int
    latency_samples: int
    """Completed and failed tasks in the window with a latency the log can tell."""
    p50_seconds: float | None
    """The median latency, None without samples: the geometric middle of its histogram bucket,
    within about 9% of the true value from 1 ms to 26 hours (shown as 1 ms below, 26.4 h above)."""
    p99_seconds: float | None
    series: list[tuple[datetime, int, int]] = field(default_factory=list)
    """(minute, completed, failed) for every minute of the window, oldest first, zeros
    included (the last is the current minute so far)."""

    def _per_minute(self, count: int) -> float:
        return count / self.window_minutes

    @property
    def started_per_minute(self) -> float:
        return self._per_minute(self.started)

    @property
    def completed_per_minute(self) -> float:
        return self._per_minute(self.completed)

    @property
    def failed_per_minute(self) -> float:
        return self._per_minute(self.failed)

    def to_json(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "window_minutes": self.window_minutes,
            "started": self.started,
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "started_per_minute": self.started_per_minute,
            "completed_per_minute": self.completed_per_minute,
            "failed_per_minute": self.failed_per_minute,
            "latency_samples": self.latency_samples,
            "p50_seconds": self.p50_seconds,
            "p99_seconds": self.p99_seconds,
            "series": [
                {"minute": minute.isoformat(), "completed": completed, "failed": failed}
                for minute, completed, failed in self.series
            ],
        }


_WINDOW = text(
    """
    SELECT agent, minute, started, completed, failed, cancelled, latency
    FROM agent_minutes
    WHERE minute >= date_trunc('minute', now()) - make_interval(mins => :minutes)
    ORDER BY agent, minute
    """
)


async def agent_activity(engine: AsyncEngine, *, minutes: int = 15) -> dict[str, AgentActivity]:
    """Each agent's activity over the last ``minutes`` whole minutes and the current one so
    far, by agent; an agent without a row in the window is left out. The database's clock says
    what "now" is (the one that stamps the log's ``recorded_at``)."""
    if not 1 <= minutes <= KEEP // timedelta(minutes=1):
        raise ValueError(f"minutes is from 1 to {KEEP // timedelta(minutes=1)} (what is kept)")
    async with engine.connect() as connection:
        # one transaction: now() is the same for both
        now, current = (
            await connection.execute(text("SELECT now(), date_trunc('minute', now())"))
        ).one()
        rows = (await connection.execute(_WINDOW, {"minutes": minutes})).all()
    window = (now - current) / timedelta(minutes=1) + minutes
    span = [current - timedelta(minutes=m) for m in range(minutes, -1, -1)]
    by_agent: dict[str, list[Any]] = {}
    for row in rows:
        by_agent.setdefault(row.agent, []).append(row)
    activity = {}
    for agent, own in by_agent.items():
        histogram = add_histograms(r.latency for r in own)
        per_minute = {r.minute: (r.completed, r.failed) for r in own}
        activity[agent] = AgentActivity(
            agent=agent,
            window_minutes=window,
            started=sum(r.started for r in own),
            completed=sum(r.completed for r in own),
            failed=sum(r.failed for r in own),
            cancelled=sum(r.cancelled for r in own),
            latency_samples=sum(histogram),
            p50_seconds=latency_quantile(histogram, 0.5),
            p99_seconds=latency_quantile(histogram, 0.99),
            series=[(m, *per_minute.get(m, (0, 0))) for m in span],
        )
    return activity


async def calls_outstanding(engine: AsyncEngine) -> dict[str, int]:
    """Peer calls waiting for an answer, by the agent called (signals and timers left out):
    the rows of ``pending_calls``, which the log's own trigger keeps in step with every append,
    so the count is exact at the moment of reading. Agents with none are left out."""
    async with engine.connect() as connection:
        result = await connection.execute(
            text(
                "SELECT agent, count(*) FROM pending_calls WHERE kind = 'call' "
                "GROUP BY agent ORDER BY agent"
            )
        )
        return {row[0]: row[1] for row in result}


_LIMITS = {"runs": "concurrency", "starts": "rate"}


@dataclass(frozen=True, slots=True)
class SlotUse:
    """The slots of one limit of an agent in one deployment (``pool_slots``), and how many are
    held now.

    ``kind`` is the table's: ``runs`` for the agent's ``concurrency``, ``starts`` for its
    ``rate`` (a start holds its slot for the rate's whole period). ``slots`` counts the rows
    the table has, which is the largest limit declared so far: a limit lowered later leaves its
    higher slots in the table, unused.
    """

    deployment: str
    agent: str
    kind: str
    held: int
    """Slots taken and not yet given back nor run out (the database's clock)."""
    slots: int

    @property
    def limit(self) -> str:
        """The agent's setting the slots are for: ``concurrency`` or ``rate``."""
        return _LIMITS.get(self.kind, self.kind)

    def to_json(self) -> dict[str, Any]:
        return {
            "deployment": self.deployment,
            "agent": self.agent,
            "kind": self.kind,
            "limit": self.limit,
            "held": self.held,
            "slots": self.slots,
        }


async def slots_in_use(engine: AsyncEngine) -> list[SlotUse]:
    """Every prepared limit of every agent, by deployment, agent and kind: its slots held now
    against the slots it has.

    The table also holds the claims of reply shards (``<agent>.replies.<n>``: which worker
    calls a shard its home, ``waystation.runtime.routing.home_key``); they are no agent's limit
    and are left out."""
    async with engine.connect() as connection:
        result = await connection.execute(
            text(
                r"""
                SELECT deployment, agent, kind,
                       count(*) FILTER (WHERE lease IS NOT NULL AND expires_at > now()),
                       count(*)
                FROM pool_slots
                WHERE agent !~ '\.replies\.[0-9]+$'
                GROUP BY deployment, agent, kind
                ORDER BY deployment, agent, kind
                """
            )
        )
        return [SlotUse(*row) for row in result]
