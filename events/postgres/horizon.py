"""The log's snapshot horizon: what readers in commit order stop below, and what holds it.

Global order: a reader that followed ``global_position`` alone would skip events whose
transaction commits after a later position's. ``read_all`` orders by ``(tx_id, global_position)``
and stops below the snapshot horizon (``SNAPSHOT_HORIZON``): the oldest transaction still running
that may yet commit events of this database, so nothing can later appear behind the cursor;
writers are never serialised.

The horizon is not ``pg_snapshot_xmin(pg_current_snapshot())``: that is the oldest transaction
running anywhere on the cluster, and one left open in another database (another application, an
idle session) would stall every reader here for as long as it lasts. Of the transactions the
statement's snapshot sees running (``pg_snapshot_xip``), the horizon ignores only those proven to
belong to another database: held right now by a session of another database
(``pg_stat_activity.backend_xid``), or prepared there (``pg_prepared_xacts``). A transaction id
belongs to one database for its whole life, so a proof read a moment after the snapshot still
holds; a transaction not found (it just ended, or is invisible to this role) keeps holding the
horizon, which only delays a reader, never makes it skip. ``horizon_holder`` names what holds it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["SNAPSHOT_HORIZON", "HorizonHolder", "horizon_holder"]

_RUNNING_HERE = """
    SELECT running.id FROM pg_snapshot_xip(pg_current_snapshot()) AS running(id)
    WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity elsewhere
                      WHERE elsewhere.backend_xid = xid(running.id)
                        AND elsewhere.datname <> current_database())
      AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts elsewhere
                      WHERE elsewhere.transaction = xid(running.id)
                        AND elsewhere.database <> current_database())
"""
"""Transactions the statement's snapshot sees running, but those of other databases."""

SNAPSHOT_HORIZON = f"""(
    SELECT coalesce(min(here.id), pg_snapshot_xmax(pg_current_snapshot()))
    FROM ({_RUNNING_HERE}) AS here
)"""
"""SQL for the oldest transaction id that may still commit events of this database (the
snapshot's ``xmax`` when none runs): a reader stops below it. Shared with the projections' feed."""

_HORIZON_HOLDER = text(
    f"""
    SELECT here.id::text, a.pid, coalesce(a.datname, p.database),
           CASE WHEN p.gid IS NOT NULL THEN 'prepared' ELSE a.state END,
           extract(epoch FROM clock_timestamp() - coalesce(a.xact_start, p.prepared)),
           a.application_name, p.gid
    FROM ({_RUNNING_HERE} ORDER BY running.id LIMIT 1) AS here
    LEFT JOIN pg_stat_activity a ON a.backend_xid = xid(here.id)
    LEFT JOIN pg_prepared_xacts p ON p.transaction = xid(here.id)
    ORDER BY a.backend_type = 'client backend' DESC NULLS LAST
    LIMIT 1
    """
)


@dataclass(frozen=True, slots=True)
class HorizonHolder:
    """The oldest running transaction that may yet commit events of this database. Readers of
    the log (``read_all``, the projections) do not move past its transaction id until it ends:
    one left open stalls them all. Fields PostgreSQL hides from this role are None (a role
    granted ``pg_read_all_stats`` sees every session's)."""

    xid: int
    pid: int | None
    """The session's backend process; None for a prepared transaction, which has none."""
    database: str | None
    state: str | None
    """``pg_stat_activity.state`` (``active``, ``idle in transaction``, …), or ``prepared``."""
    age_seconds: float | None
    """How long the transaction has been open (prepared: since it was prepared)."""
    application_name: str | None = None
    prepared: str | None = None
    """The global id of a prepared transaction (``ROLLBACK PREPARED`` takes it)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        who = f"prepared transaction {self.prepared!r}" if self.prepared else f"pid {self.pid}"
        age = f"{self.age_seconds:.1f}s" if self.age_seconds is not None else "unknown"
        return (
            f"{who} in database {self.database or '?'} ({self.state or 'state unknown'}, "
            f"transaction {self.xid} open for {age}, application {self.application_name or '-'!r})"
        )


async def horizon_holder(engine: AsyncEngine) -> HorizonHolder | None:
    """What holds the log's snapshot horizon now, or None when no transaction does."""
    async with engine.connect() as connection:
        row = (await connection.execute(_HORIZON_HOLDER)).one_or_none()
    if row is None:
        return None
    return HorizonHolder(
        xid=int(row[0]),
        pid=row[1],
        database=row[2],
        state=row[3],
        age_seconds=float(row[4]) if row[4] is not None else None,
        application_name=row[5] or None,
        prepared=row[6],
    )
