"""The pool's slots in PostgreSQL: table ``pool_slots`` (migration 0006), one row a slot.

Every statement is one round trip in autocommit mode, on the event log's engine:

* ``take`` picks, for each limit, the slot free longest (``expires_at <= now()``) with
  ``FOR UPDATE SKIP LOCKED``, and updates them all only when every limit found one. Two workers
  taking at once lock different rows or skip each other's; a row another transaction took
  meanwhile is re-checked by PostgreSQL after its commit and no longer free. So a slot is never
  held by two leases, and no ``take`` waits for another.
* ``renew`` and ``give_back`` touch only rows whose ``lease`` is still theirs: a lease that ran
  out and was taken by another is not renewed (nor freed) by its old holder.

The database's clock decides when a slot's time is up, so workers need not agree on the time.
Errors leave as the event log's (``waystation.events.postgres.translate_error``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import TIMESTAMP
from sqlalchemy.ext.asyncio import AsyncEngine

from waystation.events.postgres import translate_error
from waystation.slots import Limit, Refusal, SlotLeases

__all__ = ["PostgresSlotLeases", "pool_slots_table"]

pool_slots_table = sa.Table(
    "pool_slots",
    sa.MetaData(),
    sa.Column("deployment", sa.Text, primary_key=True),
    sa.Column("agent", sa.Text, primary_key=True),
    sa.Column("kind", sa.Text, primary_key=True),
    sa.Column("slot", sa.Integer, primary_key=True),
    sa.Column("lease", sa.Text),
    sa.Column("holder", sa.Text),
    sa.Column("task_id", sa.Text),
    sa.Column("taken_at", TIMESTAMP(timezone=True)),
    sa.Column("expires_at", TIMESTAMP(timezone=True), nullable=False),
)
"""The table of migration 0006 (``migrations/versions/0006_pool_slots.py``)."""

_PREPARE = sa.text(
    """
    INSERT INTO pool_slots (deployment, agent, kind, slot)
    SELECT :deployment, :agent, w.kind, n
    FROM unnest(CAST(:kinds AS text[]), CAST(:sizes AS integer[])) AS w(kind, size),
         generate_series(0, w.size - 1) AS n
    ON CONFLICT DO NOTHING
    """
)

_TAKE = sa.text(
    """
    WITH wanted AS (
        SELECT * FROM unnest(CAST(:kinds AS text[]), CAST(:sizes AS integer[]),
                             CAST(:holds AS double precision[])) AS w(kind, size, hold)
    ), free AS (
        SELECT w.kind, w.hold, f.slot
        FROM wanted w
        LEFT JOIN LATERAL (
            SELECT s.slot FROM pool_slots s
            WHERE s.deployment = :deployment AND s.agent = :agent AND s.kind = w.kind
              AND s.slot < w.size AND s.expires_at <= now()
            ORDER BY s.expires_at, s.slot LIMIT 1
            FOR UPDATE SKIP LOCKED
        ) f ON true
    ), taken AS (
        UPDATE pool_slots s
        SET lease = :lease, holder = :holder, task_id = :task_id, taken_at = now(),
            expires_at = now() + make_interval(secs => free.hold)
        FROM free
        WHERE NOT EXISTS (SELECT 1 FROM free WHERE free.slot IS NULL)
          AND s.deployment = :deployment AND s.agent = :agent
          AND s.kind = free.kind AND s.slot = free.slot
        RETURNING s.kind
    )
    SELECT (SELECT count(*) FROM taken) AS taken,
           ARRAY(SELECT kind FROM free WHERE slot IS NULL ORDER BY kind) AS full,
           (SELECT extract(epoch FROM min(s.expires_at) - now())::float8
            FROM pool_slots s
            JOIN free ON free.kind = s.kind AND free.slot IS NULL
            JOIN wanted w ON w.kind = s.kind AND s.slot < w.size
            WHERE s.deployment = :deployment AND s.agent = :agent AND s.kind = 'starts'
              AND s.expires_at > now()) AS free_in
    """
)

_RENEW = sa.text(
    """
    UPDATE pool_slots SET expires_at = now() + make_interval(secs => CAST(:hold AS float8))
    WHERE lease = ANY(CAST(:leases AS text[])) AND kind = 'runs'
    RETURNING lease
    """
)

_GIVE_BACK = sa.text(
    """
    UPDATE pool_slots
    SET lease = NULL, holder = NULL, task_id = NULL, taken_at = NULL, expires_at = '-infinity'
    WHERE lease = ANY(CAST(:leases AS text[])) AND kind = 'runs'
    """
)


class PostgresSlotLeases(SlotLeases):
    """The slots of every worker using this database (the event log's engine will do)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def _run(self, statement: sa.TextClause, params: dict[str, Any]) -> list[sa.Row[Any]]:
        """The rows of one statement, committed (a no-op on the log's autocommit engine)."""
        try:
            async with self.engine.connect() as connection:
                result = await connection.execute(statement, params)
                rows = list(result) if result.returns_rows else []
                await connection.commit()
                return rows
        except Exception as error:
            raise translate_error(error) from error

    async def prepare(self, deployment: str, agent: str, limits: Sequence[Limit]) -> None:
        params = {
            "deployment": deployment,
            "agent": agent,
            "kinds": [limit.kind for limit in limits],
            "sizes": [limit.size for limit in limits],
        }
        await self._run(_PREPARE, params)

    async def take(
        self,
        deployment: str,
        agent: str,
        limits: Sequence[Limit],
        *,
        lease: str,
        holder: str,
        task_id: str,
    ) -> Refusal | None:
        params = {
            "deployment": deployment,
            "agent": agent,
            "kinds": [limit.kind for limit in limits],
            "sizes": [limit.size for limit in limits],
            "holds": [float(limit.hold) for limit in limits],
            "lease": lease,
            "holder": holder,
            "task_id": task_id,
        }
        [row] = await self._run(_TAKE, params)
        if row.taken:
            return None
        return Refusal(tuple(row.full), None if row.free_in is None else max(0.0, row.free_in))

    async def renew(self, leases: Collection[str], hold: float) -> set[str]:
        if not leases:
            return set()
        rows = await self._run(_RENEW, {"leases": list(leases), "hold": hold})
        return {row.lease for row in rows}

    async def give_back(self, leases: Collection[str]) -> None:
        if leases:
            await self._run(_GIVE_BACK, {"leases": list(leases)})
