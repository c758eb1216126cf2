"""The overview: each agent's figures, the projections' lag and what holds the horizon back,
and how many dead letters wait.

Every figure comes from the log's projections (``agent_minutes`` for the rates and latencies,
``agent_stats`` for the totals, ``pending_calls`` and ``pool_slots`` for what is held now) or
from the broker's own count of dead letters, so any console process shows the same, whichever
worker did the work. The log holds the tasks that paused (every task with
``WAYSTATION_AUDIT_ALL_TASKS``): a task that never pauses writes nothing (G10), so the rates
count the logged tasks; the workers' ``/metrics`` count every one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from waystation.console.app import render, sources_of

__all__ = ["routes"]

routes = web.RouteTableDef()

WINDOW_MINUTES = 15


@dataclass
class AgentRow:
    """What the overview shows of one agent."""

    agent: str
    activity: Any = None
    """Its ``AgentActivity`` over the window; None when it logged nothing in it."""
    counts: Any = None
    """Its ``AgentCounts`` since the log began."""
    calls_outstanding: int = 0
    slots: list[Any] = field(default_factory=list)
    bars: list[tuple[float, float, float, str]] = field(default_factory=list)
    """The chart of its completed (and failed) tasks per minute: x, height, failed height, label."""


async def _dead_letters(request: web.Request) -> int | None:
    """The dead letters waiting; None when the broker cannot be asked (the page still shows)."""
    from waystation.brokers.amqp.deadletters import count

    sources = sources_of(request)
    try:
        return await asyncio.wait_for(count(sources.settings.amqp_url, sources.names), 5.0)
    except Exception:  # the broker is down or refuses: say so on the page, show the rest
        return None


CHART_HEIGHT = 28.0
BAR_WIDTH = 6.0


def _bars(series: list[tuple[datetime, int, int]]) -> list[tuple[float, float, float, str]]:
    """An inline chart's bars (drawn by the template as SVG rectangles: no script, no style)."""
    peak = max((completed + failed for _, completed, failed in series), default=0) or 1
    bars = []
    for index, (minute, completed, failed) in enumerate(series):
        scale = CHART_HEIGHT / peak
        label = f"{minute:%H:%M} UTC: {completed} completed, {failed} failed"
        bars.append((index * (BAR_WIDTH + 1), (completed + failed) * scale, failed * scale, label))
    return bars


@routes.get("/")
async def overview(request: web.Request) -> web.Response:
    from waystation.cli.tasks import lag_warning
    from waystation.projections.postgres import (
        agent_activity,
        agent_stats,
        calls_outstanding,
        projection_status,
        slots_in_use,
    )

    sources = sources_of(request)
    engine = sources.engine
    stats, activity, outstanding, slots, statuses, dead = await asyncio.gather(
        agent_stats(engine),
        agent_activity(engine, minutes=WINDOW_MINUTES),
        calls_outstanding(engine),
        slots_in_use(engine),
        projection_status(engine),
        _dead_letters(request),
    )
    agents: dict[str, AgentRow] = {}

    def row(agent: str) -> AgentRow:
        return agents.setdefault(agent, AgentRow(agent))

    for agent, counts in stats.items():
        row(agent).counts = counts
    for agent, figures in activity.items():
        row(agent).activity = figures
        row(agent).bars = _bars(figures.series)
    for agent, calls in outstanding.items():
        row(agent).calls_outstanding = calls
    for use in slots:
        if use.deployment == sources.settings.queue_prefix:
            row(use.agent).slots.append(use)
    now = datetime.now(UTC)
    paused = next((s for s in statuses if s.name == "paused_tasks"), None)
    context: dict[str, Any] = {
        "agents": [agents[name] for name in sorted(agents)],
        "window": WINDOW_MINUTES,
        "chart_height": CHART_HEIGHT,
        "bar_width": BAR_WIDTH,
        "projections": statuses,
        "horizon": statuses[0].horizon if statuses else None,
        "lag_warning": lag_warning(paused, now) if paused is not None else None,
        "dead_letters": dead,
        "now": now,
    }
    return render(request, "overview.html", **context)
