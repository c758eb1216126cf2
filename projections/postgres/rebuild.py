"""Rebuild a projection from position zero and compare it with the live one.

The log is replayed into shadow tables (committing batch by batch, so the horizon is not held
back); then, in one transaction, the live tables and the shadow are brought to the same position,
compared row for row, and (unless only checking) the live rows replaced with the shadow's. The
live runner waits on the checkpoint row meanwhile.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from waystation.events.store import Position

from .feed import _ENSURE_CHECKPOINT, _MOVE_CHECKPOINT, _apply_batches, _lock_checkpoint, catch_up
from .tables import Projection

__all__ = ["RebuildReport", "TableDifference", "rebuild"]


@dataclass(frozen=True, slots=True)
class TableDifference:
    """Rows of a live table that a rebuild from zero does not reproduce, and the reverse."""

    table: str
    only_live: int
    only_rebuilt: int
    sample_keys: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "only_live": self.only_live,
            "only_rebuilt": self.only_rebuilt,
            "sample_keys": list(self.sample_keys),
        }


@dataclass(frozen=True, slots=True)
class RebuildReport:
    projection: str
    position: Position
    events: int
    """Events the rebuild applied from position zero."""
    seconds: float
    differences: list[TableDifference] = field(default_factory=list)
    swapped: bool = False

    @property
    def identical(self) -> bool:
        return not self.differences

    def to_json(self) -> dict[str, Any]:
        return {
            "projection": self.projection,
            "tx_id": self.position.tx_id,
            "global_position": self.position.global_position,
            "events": self.events,
            "seconds": self.seconds,
            "identical": self.identical,
            "differences": [d.to_json() for d in self.differences],
            "swapped": self.swapped,
        }


async def _difference(
    connection: AsyncConnection, live: str, shadow: str, table: str, key: str
) -> TableDifference | None:
    only_live = [
        row[0]
        for row in await connection.execute(
            text(f"SELECT {key} FROM (SELECT * FROM {live} EXCEPT ALL SELECT * FROM {shadow}) d")
        )
    ]
    only_rebuilt = [
        row[0]
        for row in await connection.execute(
            text(f"SELECT {key} FROM (SELECT * FROM {shadow} EXCEPT ALL SELECT * FROM {live}) d")
        )
    ]
    if not only_live and not only_rebuilt:
        return None
    sample = tuple(sorted({str(k) for k in [*only_live, *only_rebuilt]})[:10])
    return TableDifference(table, len(only_live), len(only_rebuilt), sample)


async def rebuild(
    engine: AsyncEngine,
    projection: Projection,
    *,
    check_only: bool = False,
    batch_size: int = 10_000,
) -> RebuildReport:
    """Rebuild ``projection`` from position zero into shadow tables, compare them with the live
    ones at the same position and, unless ``check_only``, put the rebuilt rows in place."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    shadows = {t: f"{t}__rebuild" for t in projection.tables}
    checkpoint = f"{projection.name}:rebuild"
    async with engine.connect() as connection:
        for table, shadow in shadows.items():
            await connection.execute(text(f"DROP TABLE IF EXISTS {shadow}"))
            await connection.execute(text(f"CREATE TABLE {shadow} (LIKE {table} INCLUDING ALL)"))
        await connection.execute(
            text("DELETE FROM projection_checkpoints WHERE name = :name"), {"name": checkpoint}
        )
        await connection.commit()
        try:
            await catch_up(
                connection,
                projection,
                checkpoint=checkpoint,
                tables=shadows,
                batch_size=batch_size,
            )
            await connection.execute(_ENSURE_CHECKPOINT, {"name": projection.name})
            await connection.commit()
            async with connection.begin():
                # the live runner waits on this row until we commit
                live_position, _ = await _lock_checkpoint(connection, projection.name)
                rebuilt_position, _ = await _lock_checkpoint(connection, checkpoint)
                target = max(live_position, rebuilt_position)
                live_tables = {t: t for t in projection.tables}
                for name, tables in ((checkpoint, shadows), (projection.name, live_tables)):
                    await _apply_batches(
                        connection, projection, name, tables, batch_size=batch_size, upto=target
                    )
                _, events = await _lock_checkpoint(connection, checkpoint)
                differences = [
                    d
                    for table, shadow in shadows.items()
                    if (d := await _difference(connection, table, shadow, table, projection.key))
                ]
                swapped = not check_only and bool(differences)
                if swapped:
                    for table, shadow in shadows.items():
                        await connection.execute(
                            text(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
                        )
                        await connection.execute(text(f"DELETE FROM {table}"))
                        await connection.execute(
                            text(f"INSERT INTO {table} SELECT * FROM {shadow}")
                        )
                    await connection.execute(
                        _MOVE_CHECKPOINT,
                        {
                            "name": projection.name,
                            "tx_id": str(target.tx_id),
                            "position": target.global_position,
                            "events": events,
                        },
                    )
        finally:
            if connection.in_transaction():
                await connection.rollback()
            for shadow in shadows.values():
                await connection.execute(text(f"DROP TABLE IF EXISTS {shadow}"))
            await connection.execute(
                text("DELETE FROM projection_checkpoints WHERE name = :name"),
                {"name": checkpoint},
            )
            await connection.commit()
    return RebuildReport(
        projection=projection.name,
        position=target,
        events=events,
        seconds=loop.time() - started,
        differences=differences,
        swapped=swapped,
    )
