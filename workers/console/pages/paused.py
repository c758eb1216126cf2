"""Paused tasks: the paused-tasks projection, filtered and paged."""

from __future__ import annotations

from datetime import UTC, datetime

from aiohttp import web

from waystation.console.app import render, sources_of

__all__ = ["routes"]

routes = web.RouteTableDef()


@routes.get("/paused")
async def paused(request: web.Request) -> web.Response:
    from waystation.projections.postgres import paused_tasks

    sources = sources_of(request)
    rows = await paused_tasks(sources.engine, limit=50)
    return render(request, "paused.html", rows=rows, now=datetime.now(UTC))
