"""The projections' tables, and how a batch of the log changes them: set-based, one load, one
upsert and one delete per table, the rows folded by the pure functions of
:mod:`waystation.projections.model`."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from waystation.events.codec import dumps, loads

from ..activity import fold_agent_minutes
from ..model import FeedEvent, OpenWait, PausedTask, fold_agent_stats, fold_paused_tasks

__all__ = [
    "PROJECTIONS",
    "AgentMinutesProjection",
    "AgentStatsProjection",
    "PausedTasksProjection",
    "Projection",
]


class Projection(abc.ABC):
    """A read model kept by a runner: its tables, and how a batch of the log changes them.

    ``tables`` maps each logical table to the name to write (the live table, or a shadow during
    a rebuild); ``apply`` runs inside the runner's transaction.
    """

    name: str
    tables: tuple[str, ...]
    key: str
    """The primary key column of its tables (for reporting differences)."""

    @abc.abstractmethod
    async def apply(
        self, connection: AsyncConnection, events: Sequence[FeedEvent], tables: Mapping[str, str]
    ) -> None: ...


class PausedTasksProjection(Projection):
    name = "paused_tasks"
    tables = ("paused_tasks",)
    key = "task_id"

    async def apply(
        self, connection: AsyncConnection, events: Sequence[FeedEvent], tables: Mapping[str, str]
    ) -> None:
        table = tables["paused_tasks"]
        # a task whose first event in the batch is its first pause has no row to load
        touched = {e.stream_id for e in events if e.event_type != "TaskStarted"}
        rows: dict[str, PausedTask] = {}
        if touched:
            result = await connection.execute(
                text(
                    f"SELECT task_id, agent, pause, waits_expected, waits_recorded, "
                    f"paused_since, status, waits::text, first_k, agent_version FROM {table} "
                    f"WHERE task_id = ANY(CAST(:ids AS text[]))"
                ),
                {"ids": list(touched)},
            )
            for row in result:
                rows[row[0]] = PausedTask(
                    task_id=row[0],
                    agent=row[1],
                    pause=row[2],
                    waits_expected=row[3],
                    waits_recorded=row[4],
                    paused_since=row[5],
                    status=row[6],
                    waits=tuple(OpenWait.from_json(w) for w in loads(row[7])),
                    first_k=row[8],
                    agent_version=row[9],
                )
        changes = fold_paused_tasks(rows, events)
        if changes.deletes:
            await connection.execute(
                text(f"DELETE FROM {table} WHERE task_id = ANY(CAST(:ids AS text[]))"),
                {"ids": list(changes.deletes)},
            )
        if changes.upserts:
            await _upsert_paused(connection, table, list(changes.upserts.values()))


async def _upsert_paused(connection: AsyncConnection, table: str, rows: list[PausedTask]) -> None:
    await connection.execute(
        text(
            f"""
            INSERT INTO {table} (task_id, agent, pause, waits_expected, waits_recorded,
                                 earliest_deadline, paused_since, status, waits, first_k,
                                 agent_version)
            SELECT t, a, p, we, wr, to_timestamp(ed), ps, st, CAST(w AS jsonb), k, v
            FROM unnest(CAST(:task_ids AS text[]), CAST(:agents AS text[]),
                        CAST(:pauses AS integer[]), CAST(:expected AS integer[]),
                        CAST(:recorded AS integer[]), CAST(:earliest AS float8[]),
                        CAST(:since AS timestamptz[]), CAST(:status AS text[]),
                        CAST(:waits AS text[]), CAST(:first_k AS integer[]),
                        CAST(:versions AS text[]))
                 AS u(t, a, p, we, wr, ed, ps, st, w, k, v)
            ON CONFLICT (task_id) DO UPDATE SET
                agent = excluded.agent, pause = excluded.pause,
                waits_expected = excluded.waits_expected,
                waits_recorded = excluded.waits_recorded,
                earliest_deadline = excluded.earliest_deadline,
                paused_since = excluded.paused_since, status = excluded.status,
                waits = excluded.waits, first_k = excluded.first_k,
                agent_version = excluded.agent_version
            """
        ),
        {
            "task_ids": [r.task_id for r in rows],
            "agents": [r.agent for r in rows],
            "pauses": [r.pause for r in rows],
            "expected": [r.waits_expected for r in rows],
            "recorded": [r.waits_recorded for r in rows],
            "earliest": [r.earliest_deadline for r in rows],
            "since": [r.paused_since for r in rows],
            "status": [r.status for r in rows],
            "waits": [dumps([w.to_json() for w in r.waits]).decode() for r in rows],
            "first_k": [r.first_k for r in rows],
            "versions": [r.agent_version for r in rows],
        },
    )


_COUNTERS = (
    "completed",
    "failed",
    "cancelled",
    "paused_now",
    "timeouts",
    "pauses_resumed",
    "pause_microseconds",
)


class AgentStatsProjection(Projection):
    name = "agent_stats"
    tables = ("agent_stats",)
    key = "agent"

    async def apply(
        self, connection: AsyncConnection, events: Sequence[FeedEvent], tables: Mapping[str, str]
    ) -> None:
        increments = fold_agent_stats(events)
        if not increments:
            return
        table = tables["agent_stats"]
        columns = ", ".join(_COUNTERS)
        arrays = ", ".join(f"CAST(:{c} AS bigint[])" for c in _COUNTERS)
        updates = ", ".join(f"{c} = s.{c} + excluded.{c}" for c in _COUNTERS)
        agents = sorted(increments)  # a fixed order: two writers never deadlock on rows
        params: dict[str, Any] = {"agents": agents}
        for column in _COUNTERS:
            params[column] = [getattr(increments[a], column) for a in agents]
        await connection.execute(
            text(
                f"""
                INSERT INTO {table} AS s (agent, {columns})
                SELECT * FROM unnest(CAST(:agents AS text[]), {arrays})
                ON CONFLICT (agent) DO UPDATE SET {updates}
                """
            ),
            params,
        )


_MINUTE_COUNTS = ("started", "completed", "failed", "cancelled")


class AgentMinutesProjection(Projection):
    """Per agent and minute: tasks started, completed, failed, cancelled, and a latency
    histogram (:mod:`waystation.projections.activity` says what each counts and why rows older
    than a day behind the newest go)."""

    name = "agent_minutes"
    tables = ("agent_minutes",)
    key = "agent || ' ' || minute"

    async def apply(
        self, connection: AsyncConnection, events: Sequence[FeedEvent], tables: Mapping[str, str]
    ) -> None:
        table = tables["agent_minutes"]
        # the newest minute counted before this batch: the table's latest row (never deleted)
        newest = await connection.scalar(text(f"SELECT max(minute) FROM {table}"))
        changes = fold_agent_minutes(events, newest=newest)
        if changes.increments:
            rows = [changes.increments[k] for k in sorted(changes.increments)]
            counts = ", ".join(_MINUTE_COUNTS)
            params: dict[str, Any] = {
                "minutes": [r.minute for r in rows],
                "agents": [r.agent for r in rows],
                # one array literal a row: unnest cannot take a two-dimensional array apart
                "latency": ["{" + ",".join(map(str, r.latency)) + "}" for r in rows],
            }
            for column in _MINUTE_COUNTS:
                params[column] = [getattr(r, column) for r in rows]
            await connection.execute(
                text(
                    f"""
                    INSERT INTO {table} AS s (minute, agent, {counts}, latency)
                    SELECT m, a, {counts}, CAST(l AS integer[])
                    FROM unnest(CAST(:minutes AS timestamptz[]), CAST(:agents AS text[]),
                                {", ".join(f"CAST(:{c} AS bigint[])" for c in _MINUTE_COUNTS)},
                                CAST(:latency AS text[]))
                         AS u(m, a, {counts}, l)
                    ON CONFLICT (minute, agent) DO UPDATE SET
                        {", ".join(f"{c} = s.{c} + excluded.{c}" for c in _MINUTE_COUNTS)},
                        latency = ARRAY(
                            SELECT x + y
                            FROM unnest(s.latency, excluded.latency) WITH ORDINALITY AS b(x, y, n)
                            ORDER BY n)
                    """
                ),
                params,
            )
        if changes.cutoff is not None:
            # as merge_agent_minutes does; nothing to find unless the newest minute moved
            await connection.execute(
                text(f"DELETE FROM {table} WHERE minute < :cutoff"), {"cutoff": changes.cutoff}
            )


PROJECTIONS: dict[str, Projection] = {
    p.name: p for p in (PausedTasksProjection(), AgentStatsProjection(), AgentMinutesProjection())
}
