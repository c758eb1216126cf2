"""Sending a signal from the console: the answer to a task's signal wait, from its form.

``POST /tasks/{task_id}/signal`` (the form of templates/_signal_form.html, on the task's page
and on the approvals page) finds the open wait of that name in the task's stream, builds the
payload from the form by the wait's schema (forms.py), and sends it to the task's agent as any
publisher would (``Client.signal``); the worker that takes it records it, with its sender, and
resumes the task. What became of it decides the answer: ``taken``, ``kept`` or ``duplicate``
go back to the task's page (``?done=signal-taken``); a form that cannot be converted, or a
payload the worker refuses as not fitting the agent's model (naming the field), shows the form
again with the values and the problem, and nothing is applied.

Each rendering of the form carries a nonce, and the signal its id derived from it
(``forms.signal_id_of``): a double click, or a POST the browser sends again, is the same signal,
which the log applies once and the worker answers ``duplicate``.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from aiohttp import web

from waystation.console.app import actor_of, render, session_of, sources_of
from waystation.console.forms import PAYLOAD, FormProblem, payload, signal_id_of
from waystation.console.pages.approvals import approval

if TYPE_CHECKING:
    from waystation.events.model import RecordedEvent
    from waystation.events.task import TaskState

__all__ = ["routes"]

routes = web.RouteTableDef()

WHAT_IS_SHOWN = frozenset({PAYLOAD, "wait"})
"""The form's inputs besides its fields that it shows again after a problem."""

ANSWER_SECONDS = 30.0
"""How long the console waits for the worker's answer to a signal."""

_in_flight: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
"""A lock per signal being sent, by its id (gone with the last submission that holds it)."""


def _task_page(task_id: str, done: str) -> web.HTTPSeeOther:
    return web.HTTPSeeOther(f"/tasks/{quote(task_id, safe='')}?done=signal-{done}")


def _message(request: web.Request, status: int, title: str, message: str) -> web.Response:
    return render(request, "message.html", status=status, title=title, message=message)


@routes.post("/tasks/{task_id}/signal")
async def send_signal(request: web.Request) -> web.StreamResponse:
    from waystation.client import new_signal_id

    task_id = request.match_info["task_id"]
    form = await request.post()
    name, nonce = str(form.get("wait", "")), str(form.get("nonce", ""))
    assert session_of(request) is not None  # the guard let only a signed-in person's form in
    signal_id = signal_id_of(task_id, name, nonce) if nonce else new_signal_id()
    # One submission of a form at a time: the client matches a worker's answer by the signal's
    # id, so two in flight at once would both be told the first answer (both "taken"); the
    # second, after the first, finds the signal in the log: "duplicate".
    lock = _in_flight.setdefault(signal_id, asyncio.Lock())
    async with lock:
        return await _send(request, task_id, name, signal_id, form)


async def _send(
    request: web.Request,
    task_id: str,
    name: str,
    signal_id: str,
    form: Mapping[str, Any],
) -> web.StreamResponse:
    from waystation.client import SignalNotApplied
    from waystation.events import fold

    sources = sources_of(request)
    events = await sources.store.read_stream(task_id)
    state = fold(task_id, events)
    if not state.exists:
        return _message(
            request, 404, "No such task", f"The log has no task {task_id!r}: nothing to signal."
        )
    if signal_id in state.signals:  # this form was sent before, and the log holds its signal
        raise _task_page(task_id, "duplicate")
    wait = state.open_signal_wait(name)
    if wait is None:
        return _message(
            request,
            409,
            "Not waiting for this signal",
            f"Task {task_id} is {state.status} and waits for no signal {name!r}: it may have "
            "been answered, timed out or cancelled meanwhile. See the task's page.",
        )
    # what the form shows again if need be (never empty: it names the wait)
    posted = {k: str(v) for k, v in form.items() if k.startswith("field.") or k in WHAT_IS_SHOWN}
    try:
        value = payload(wait.signal_schema, posted)
    except FormProblem as problem:
        return _again(request, state, events, name, posted, f"Not sent: {problem}.")
    client = await sources.client()
    try:
        outcome = await client.signal(
            task_id,
            name,
            value,
            agent=str(state.agent),
            signal_id=signal_id,
            actor=actor_of(request),
            timeout=ANSWER_SECONDS,
        )
    except TimeoutError:
        return _message(
            request,
            504,
            "No answer yet",
            f"No worker of agent {state.agent!r} answered within {ANSWER_SECONDS:.0f} s; the "
            "signal may still be applied when one does. Sending this form again is harmless: it "
            "is the same signal, applied once.",
        )
    except SignalNotApplied as refused:
        if refused.status == "invalid":  # the payload does not fit the agent's model
            return _again(request, state, events, name, posted, f"Refused: {refused.message}.")
        return _message(request, 409, "Not applied", f"{refused.status}: {refused.message}")
    raise _task_page(task_id, outcome)


def _again(
    request: web.Request,
    state: TaskState,
    events: list[RecordedEvent],
    name: str,
    posted: dict[str, str],
    problem: str,
) -> web.Response:
    """The form shown again, with what was posted and why it was not applied (a new
    rendering: a new nonce, so that the mended form is a signal of its own)."""
    item = approval(state, events, signal=name, values={name: posted}, problems={name: problem})
    assert item is not None, "the task waits for this signal: its form was found above"
    return render(request, "signal.html", status=422, name=name, item=item)
