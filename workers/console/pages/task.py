"""A task: its timeline, its call tree, its state after each event, its result, its hash chain
verified when the page opens, its export, and what a signed-in person may do to it (cancel it,
answer its signals). What the page shows is read in :mod:`waystation.console.taskview`; the
chain is checked by what ``waystation verify`` runs, the export is ``waystation export``'s lines.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from aiohttp import web

from waystation.console.app import actor_of, render, sources_of, task_url
from waystation.console.taskview import (
    INLINE_STATES,
    MAX_CHILDREN,
    call_tree,
    cancel_reason,
    rows_of,
    signal_waits,
)

__all__ = ["routes"]

routes = web.RouteTableDef()

CANCEL_TIMEOUT = 20.0
"""Seconds a cancel waits for the agent's answer before the page says none came."""
MAX_REASON = 500

FLASHES = {
    "cancelled": ("ok", "Cancelled. Every call it still waited for is cancelled too."),
    "already-completed": ("note", "Not cancelled: the task had already completed."),
    "already-failed": ("note", "Not cancelled: the task had already failed."),
    "signal-taken": ("ok", "Signal sent: a wait of the task took it."),
    "signal-kept": ("ok", "Signal sent: the task keeps it for its next wait on that name."),
    "signal-duplicate": ("note", "That signal had been recorded already."),
}
"""What a ``?done=`` after an action says; any other value says nothing (nothing from the query
is shown)."""


def _not_found(request: web.Request, task_id: str) -> web.Response:
    return render(
        request,
        "message.html",
        status=404,
        title="No such task",
        message=f"The log has no task {task_id!r}. A task is logged from its first pause "
        "(or every task, with WAYSTATION_AUDIT_ALL_TASKS); one that completed without "
        "pausing left nothing to show.",
    )


@routes.get("/tasks")
async def find(request: web.Request) -> web.StreamResponse:
    """The header's find box: to the page of the task id given."""
    task_id = request.query.get("id", "").strip()
    if not task_id:
        return render(
            request, "message.html", status=400, title="Which task?", message="Give a task id."
        )
    raise web.HTTPSeeOther(task_url(task_id))


def _version(value: str | None) -> int | None:
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


@routes.get("/tasks/{task_id}")
async def task(request: web.Request) -> web.Response:
    from waystation.projections.audit import verify_stream

    task_id = request.match_info["task_id"]
    sources = sources_of(request)
    events = await sources.store.read_stream(task_id)
    if not events:
        return _not_found(request, task_id)
    now = datetime.now(UTC)
    rows, state = rows_of(task_id, events, _version(request.query.get("state_at")), now)
    tree = await call_tree(sources.engine, task_id, events, state)
    kind, message = FLASHES.get(request.query.get("done", ""), (None, None))
    return render(
        request,
        "task.html",
        task_id=task_id,
        state=state,
        rows=rows,
        whole_states=len(events) <= INLINE_STATES,
        tree=tree,
        problems=verify_stream(events),
        cancel_reason=cancel_reason(events),
        traces=sorted({row.entry.trace_id for row in rows if row.entry.trace_id}),
        signal_waits=signal_waits(state),
        values={},
        problem=None,
        flash=(kind, message) if kind else None,
        max_children=MAX_CHILDREN,
        max_reason=MAX_REASON,
        now=now,
    )


_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9._-]+")


def export_filename(task_id: str) -> str:
    """A download's name for the task's export: its id, every character but letters, digits and
    ``._-`` replaced (no quote, slash or newline can reach the header), at most 100 of them."""
    cleaned = _UNSAFE_FILENAME.sub("_", task_id).strip("._")[:100] or "task"
    return f"{cleaned}.jsonl"


@routes.get("/tasks/{task_id}/export")
async def export(request: web.Request) -> web.StreamResponse:
    """The task's events as ``waystation export --task`` writes them, redacted by default."""
    from waystation.projections.export import DEFAULT_REDACT_KEYS, to_line

    task_id = request.match_info["task_id"]
    events = await sources_of(request).store.read_stream(task_id)
    if not events:
        return _not_found(request, task_id)
    return web.Response(
        body=b"".join(to_line(event, redact_keys=DEFAULT_REDACT_KEYS) for event in events),
        content_type="application/x-ndjson",
        headers={
            "Content-Disposition": f'attachment; filename="{export_filename(task_id)}"',
            "Cache-Control": "no-store",
        },
    )


@routes.post("/tasks/{task_id}/cancel")
async def cancel(request: web.Request) -> web.StreamResponse:
    """Cancel the task through its agent (as ``waystation cancel`` does), then back to its
    page, saying what came of it."""
    from waystation.events.task import fold

    task_id = request.match_info["task_id"]
    sources = sources_of(request)
    form = await request.post()
    reason = str(form.get("reason", "")).strip()[:MAX_REASON] or None
    state = fold(task_id, await sources.store.read_stream(task_id))
    if not state.exists:
        return _not_found(request, task_id)
    if state.agent is None:
        return render(
            request,
            "message.html",
            status=409,
            title="Cannot cancel",
            message=f"The log does not say which agent runs task {task_id!r}.",
        )
    client = await sources.client()
    try:
        status = await client.cancel(
            state.agent, task_id, reason=reason, actor=actor_of(request), timeout=CANCEL_TIMEOUT
        )
    except TimeoutError:
        return render(
            request,
            "message.html",
            status=504,
            title="No answer in time",
            message=f"Agent {state.agent!r} did not answer the cancel within "
            f"{CANCEL_TIMEOUT:g} s. The cancel stays queued for it: reload the task's page.",
        )
    done = "cancelled" if status == "cancelled" else f"already-{status}"
    raise web.HTTPSeeOther(f"{task_url(task_id)}?done={done}")
