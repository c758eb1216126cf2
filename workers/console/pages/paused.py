"""Paused tasks: the paused-tasks projection, filtered and paged.

Filters: the agent, what a task waits for (a peer call, a signal by name, a timer), how long it
has been paused and how soon its earliest deadline falls. Pages are keyset-paged on the
projection's indexes (``paused_tasks_page``), so the hundredth page of 100,000 tasks costs what
the first does; "next" carries the cursor, and a filter change starts again from the first page.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from waystation.console.app import render, sources_of

__all__ = ["routes"]

routes = web.RouteTableDef()

SPANS = {"1m": 60, "10m": 600, "1h": 3600, "1d": 86_400, "7d": 7 * 86_400}
"""The choices of the age and deadline filters, in seconds."""
KINDS = ("call", "signal", "timer")
ORDERS = {
    "oldest": "oldest pause first",
    "newest": "newest pause first",
    "deadline": "soonest deadline first",
}
PAGE_SIZE = 50


def _filters(query: Any) -> dict[str, str]:
    """The filters a request asks for, kept only when they are valid choices (the rest of the
    page then shows what is asked, never an error for a hand-edited query)."""
    chosen = {
        "agent": query.get("agent", "").strip(),
        "waiting_for": query.get("waiting_for", ""),
        "signal": query.get("signal", "").strip(),
        "older_than": query.get("older_than", ""),
        "due_within": query.get("due_within", ""),
        "order": query.get("order", "oldest"),
    }
    if chosen["waiting_for"] not in KINDS:
        chosen["waiting_for"] = ""
    if chosen["signal"]:
        chosen["waiting_for"] = "signal"
    for span in ("older_than", "due_within"):
        if chosen[span] not in SPANS:
            chosen[span] = ""
    if chosen["order"] not in ORDERS:
        chosen["order"] = "oldest"
    return chosen


@routes.get("/paused")
async def paused(request: web.Request) -> web.Response:
    from waystation.cli.tasks import lag_warning
    from waystation.projections.postgres import paused_tasks_page, projection_status

    sources = sources_of(request)
    chosen = _filters(request.query)
    now = datetime.now(UTC)
    [projection] = await projection_status(sources.engine, ["paused_tasks"])
    try:
        page = await paused_tasks_page(
            sources.engine,
            agent=chosen["agent"] or None,
            waiting_for=chosen["waiting_for"] or None,
            signal=chosen["signal"] or None,
            paused_before=now - timedelta(seconds=SPANS[chosen["older_than"]])
            if chosen["older_than"]
            else None,
            deadline_before=now + timedelta(seconds=SPANS[chosen["due_within"]])
            if chosen["due_within"]
            else None,
            order=chosen["order"],
            after=request.query.get("after") or None,
            limit=PAGE_SIZE,
        )
    except ValueError as error:  # a cursor of another order, or not one at all
        return render(request, "message.html", status=400, title="Paused tasks", message=str(error))
    return render(
        request,
        "paused.html",
        page=page,
        rows=[dict(row, waiting=_waiting_for(row)) for row in page.rows],
        chosen=chosen,
        spans=SPANS,
        kinds=KINDS,
        orders=ORDERS,
        first_page=not request.query.get("after"),
        lag_warning=lag_warning(projection, now),
        now=now,
    )


def _waiting_for(row: dict[str, Any]) -> str:
    """What a row's task waits for, in a few words, as ``waystation tasks`` says it."""
    from waystation.projections.model import OpenWait
    from waystation.projections.waits import describe_waits

    return describe_waits((OpenWait.from_json(w).label for w in row["waits"]), row["first_k"])
