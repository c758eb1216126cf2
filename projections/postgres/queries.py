"""What readers of the projections ask: where each projection stands (its checkpoint, how far
behind the log it is, whether a runner is active, and the transaction holding the log's horizon,
if any), and the rows of the read models."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from waystation.events.codec import dumps
from waystation.events.postgres import HorizonHolder, horizon_holder
from waystation.events.store import Position

from ..model import AgentCounts
from .runner import _LOCK_NAMESPACE
from .tables import _COUNTERS, PROJECTIONS

__all__ = ["ProjectionStatus", "agent_stats", "paused_tasks", "projection_status"]


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


async def paused_tasks(
    engine: AsyncEngine,
    *,
    agent: str | None = None,
    status: str | None = None,
    waiting_for: str | None = None,
    signal: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """Rows of the paused-tasks projection, oldest pause first.

    ``waiting_for``: only tasks with an open wait of that kind (``call``, ``signal``,
    ``timer``); ``signal``: only tasks with an open wait for the signal of that name. Both are
    answered by the index on ``waits`` (containment).
    """
    conditions = []
    params: dict[str, Any] = {"limit": limit}
    if agent is not None:
        conditions.append("agent = :agent")
        params["agent"] = agent
    if status is not None:
        conditions.append("status = :status")
        params["status"] = status
    wanted: dict[str, str] = {}
    if waiting_for is not None:
        wanted["kind"] = waiting_for
    if signal is not None:
        if waiting_for not in (None, "signal"):
            raise ValueError(f"a signal's wait is not a {waiting_for}'s")
        wanted |= {"kind": "signal", "name": signal}
    if wanted:
        # only the filters asked for, so that the planner sees a plain containment it can
        # answer with the GIN index, whatever plan it caches
        conditions.append("waits @> CAST(:wanted AS jsonb)")
        params["wanted"] = dumps([wanted]).decode()
    where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
    async with engine.connect() as connection:
        result = await connection.execute(
            text(
                f"""
                SELECT task_id, agent, pause, waits_expected, waits_recorded,
                       earliest_deadline, paused_since, status, waits, first_k, agent_version
                FROM paused_tasks
                {where}
                ORDER BY paused_since, task_id
                LIMIT :limit
                """
            ),
            params,
        )
        return [dict(row._mapping) for row in result]


async def agent_stats(engine: AsyncEngine) -> dict[str, AgentCounts]:
    """The per-agent statistics projection, by agent."""
    async with engine.connect() as connection:
        result = await connection.execute(
            text(f"SELECT agent, {', '.join(_COUNTERS)} FROM agent_stats ORDER BY agent")
        )
        return {row[0]: AgentCounts(*row[1:]) for row in result}
