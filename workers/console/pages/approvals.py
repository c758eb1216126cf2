"""Approvals: every task waiting for a signal, with what a person needs to answer it.

The paused-tasks projection finds the tasks (by the kind and name of their open waits, which
its index answers); each task's own stream then gives what it asks for and why: its input, the
state its latest pause checkpointed, and each open signal wait with its deadline and schema,
answered with the signal's form (templates/_signal_form.html). The stream is the truth: a task
the projection still lists but whose wait the log shows answered is left out, so a person is
not asked twice.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from aiohttp import web

from waystation.console.app import render, sources_of

if TYPE_CHECKING:
    from waystation.console.app import Sources
    from waystation.events.model import RecordedEvent
    from waystation.events.task import TaskState

__all__ = ["LIMIT", "approval", "routes"]

routes = web.RouteTableDef()

LIMIT = 100
"""Tasks the page shows at most (a filter narrows a longer list)."""


def approval(
    state: TaskState,
    events: list[RecordedEvent],
    *,
    signal: str | None = None,
    values: dict[str, dict[str, str]] | None = None,
    problems: dict[str, str] | None = None,
) -> dict[str, Any] | None:
    """What the page shows of one task: its open signal waits (those named ``signal`` only,
    when given), each with the form's previous ``values`` and ``problems`` by signal name;
    None when the log shows it waiting for no such signal (any more)."""
    now = time.time()
    waits = [
        {
            "name": wait.name,
            "signal_schema": wait.signal_schema,
            "subtask_id": wait.subtask_id,
            "deadline_at": wait.deadline_at,
            "deadline_in": wait.deadline_at - now,
            "form_values": (values or {}).get(str(wait.name), {}),
            "problem": (problems or {}).get(str(wait.name)),
        }
        for wait in state.outstanding
        if wait.kind == "signal" and (signal is None or wait.name == signal)
    ]
    if state.status != "paused" or not waits:
        return None
    paused = next((e for e in reversed(events) if e.event_type == "TaskPaused"), None)
    return {
        "task_id": state.task_id,
        "agent": state.agent,
        "paused_since": paused.recorded_at if paused is not None else None,
        "input": state.input,
        "state": dict(state.state),
        "waits": waits,
    }


async def _approval_of(sources: Sources, task_id: str, signal: str | None) -> dict[str, Any] | None:
    from waystation.events import fold

    events = await sources.store.read_stream(task_id)
    return approval(fold(task_id, events), events, signal=signal)


@routes.get("/approvals")
async def approvals(request: web.Request) -> web.Response:
    from waystation.cli.tasks import lag_warning
    from waystation.projections.postgres import paused_tasks, projection_status

    sources = sources_of(request)
    signal = request.query.get("signal") or None
    agent = request.query.get("agent") or None
    rows, statuses = await asyncio.gather(
        paused_tasks(
            sources.engine, waiting_for="signal", signal=signal, agent=agent, limit=LIMIT + 1
        ),
        projection_status(sources.engine),
    )
    found = await asyncio.gather(
        *(_approval_of(sources, row["task_id"], signal) for row in rows[:LIMIT])
    )
    projection = next((s for s in statuses if s.name == "paused_tasks"), None)
    return render(
        request,
        "approvals.html",
        items=[item for item in found if item is not None],
        more=len(rows) > LIMIT,
        limit=LIMIT,
        signal=signal or "",
        agent=agent or "",
        lag_warning=lag_warning(projection, datetime.now(UTC)) if projection else None,
    )
