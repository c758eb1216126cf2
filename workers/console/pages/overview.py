"""The overview: each agent's figures, the projections' lag and what holds the horizon back,
and how many dead letters wait. Every figure comes from the log's projections (or the broker's
own count of dead letters), so any console process shows the same, whichever worker did the
work."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from waystation.console.app import render, sources_of

__all__ = ["routes"]

routes = web.RouteTableDef()


async def _dead_letters(request: web.Request) -> int | None:
    """The dead letters waiting; None when the broker cannot be asked (the page still shows)."""
    from waystation.brokers.amqp.deadletters import count

    sources = sources_of(request)
    try:
        return await asyncio.wait_for(count(sources.settings.amqp_url, sources.names), 5.0)
    except Exception:  # the broker is down or refuses: say so on the page, show the rest
        return None


@routes.get("/")
async def overview(request: web.Request) -> web.Response:
    from waystation.cli.tasks import lag_warning
    from waystation.projections.postgres import agent_stats, projection_status

    sources = sources_of(request)
    stats, statuses, dead = await asyncio.gather(
        agent_stats(sources.engine), projection_status(sources.engine), _dead_letters(request)
    )
    now = datetime.now(UTC)
    paused = next((s for s in statuses if s.name == "paused_tasks"), None)
    context: dict[str, Any] = {
        "stats": stats,
        "projections": statuses,
        "horizon": statuses[0].horizon if statuses else None,
        "lag_warning": lag_warning(paused, now) if paused is not None else None,
        "dead_letters": dead,
        "now": now,
    }
    return render(request, "overview.html", **context)
