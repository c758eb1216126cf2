"""Dead letters: what the workers (or the broker) set aside, why, and replaying them.

The dead-letter queue is read from the broker, not the log: a letter that never ran (bad
input) is in no stream. Reading it takes each letter and puts it back
(:func:`waystation.brokers.amqp.deadletters.browse`), so a page reads at most :data:`BOUND`
letters and says how many more wait (the broker's count). A letter's body is a publisher's
bytes: shown decoded and redacted as ``waystation export`` redacts (the ``pretty`` filter) when
it is JSON, else as text, each cut at :data:`BODY_CHARS` characters.

A replay is two steps, so that no single click (or forged link) sends anything anywhere: the
replay form goes to a confirmation page saying what will be replayed, whose form sends
``confirmed=yes``. A replay acks a letter only once the broker confirmed its republish
(:func:`~waystation.brokers.amqp.deadletters.replay`): one whose queue is gone stays here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import orjson
from aiohttp import web

from waystation.console.app import actor_of, pretty, render, sources_of
from waystation.events import parse_subtask_id

if TYPE_CHECKING:
    from waystation.brokers.amqp.deadletters import DeadLetter
    from waystation.console.app import Sources

__all__ = ["BODY_CHARS", "BOUND", "Row", "concerns", "routes", "task_of"]

routes = web.RouteTableDef()

BOUND = 500
"""Letters a page reads (and a replay looks at) at most."""
BODY_CHARS = 4096
"""Characters of a letter's body a page shows at most."""


def task_of(letter: DeadLetter, body: Any) -> str | None:
    """The task a letter is about, read defensively: its decoded body's ``task_id`` (a cancel,
    a resume, a signal, a result), else its correlation id (a task's, or a reply's sub-task,
    which is the called task's id), else its message id (a task's id)."""
    if isinstance(body, dict) and isinstance(body.get("task_id"), str) and body["task_id"]:
        return str(body["task_id"])
    return letter.correlation_id or letter.message_id or None


def concerns(letter: DeadLetter, task: str | None, wanted: str) -> bool:
    """Whether the letter concerns task ``wanted``: it is the task it names, its message or
    correlation id, or the task that made the call a reply answers."""
    if wanted in (task, letter.message_id, letter.correlation_id):
        return True
    try:
        caller, _, _ = parse_subtask_id(letter.correlation_id or "")
    except ValueError:
        return False
    return caller == wanted


@dataclass(frozen=True, slots=True)
class Row:
    """One letter as the page shows it."""

    letter: DeadLetter
    agent: str | None
    task_id: str | None
    body: str
    """Pretty, redacted JSON, or the text (decoded with replacements); cut."""
    body_is_json: bool
    cut: int
    """Characters of ``body`` left out."""

    @property
    def message_id(self) -> str | None:
        return self.letter.message_id


def _row(letter: DeadLetter, sources: Sources) -> Row:
    decoded: Any = None
    try:
        decoded = orjson.loads(letter.body)
        text, is_json = pretty(decoded), True
    except (TypeError, ValueError, RecursionError):  # not JSON, or JSON too deep to show
        text, is_json = letter.body.decode("utf-8", errors="replace"), False
    return Row(
        letter=letter,
        agent=sources.names.agent_of(letter.queue) if letter.queue else None,
        task_id=task_of(letter, decoded),
        body=text[:BODY_CHARS],
        body_is_json=is_json,
        cut=max(0, len(text) - BODY_CHARS),
    )


async def _read(sources: Sources) -> tuple[list[Row], int]:
    """The first :data:`BOUND` letters and how many wait in all (the broker's count; 0 when no
    worker has declared the queue yet)."""
    from waystation.brokers.amqp.deadletters import browse, count

    total = await count(sources.settings.amqp_url, sources.names)
    if total == 0:
        return [], 0
    letters = await browse(sources.settings.amqp_url, sources.names, BOUND)
    return [_row(letter, sources) for letter in letters], max(total, len(letters))


def _choice(source: Any) -> dict[str, str]:
    """The letters a form or a query names: ``message_id``, ``reason`` (each when given)."""
    return {
        name: str(source.get(name))
        for name in ("message_id", "reason")
        if isinstance(source.get(name), str) and source.get(name)
    }


def _confirmation(choice: dict[str, str]) -> str:
    return "/dead-letters/confirm?" + urlencode(choice)


def _chosen(rows: list[Row], choice: dict[str, str]) -> list[Row]:
    return [
        row
        for row in rows
        if row.letter.queue is not None
        and choice.get("message_id", row.letter.message_id) == row.letter.message_id
        and choice.get("reason", row.letter.reason) == row.letter.reason
    ]


def _count(request: web.Request, name: str) -> int:
    try:
        return max(0, int(request.query.get(name, "0")))
    except ValueError:
        return 0


@routes.get("/dead-letters")
async def dead_letters(request: web.Request) -> web.Response:
    rows, total = await _read(sources_of(request))
    filters = {
        name: request.query[name] for name in ("reason", "agent", "task") if request.query.get(name)
    }
    shown = [
        row
        for row in rows
        if filters.get("reason", row.letter.reason) == row.letter.reason
        and ("agent" not in filters or filters["agent"] == row.agent)
        and ("task" not in filters or concerns(row.letter, row.task_id, filters["task"]))
    ]
    return render(
        request,
        "dead_letters.html",
        rows=shown,
        read=len(rows),
        total=total,
        filters=filters,
        by_reason=Counter(row.letter.reason for row in rows).most_common(),
        by_agent=Counter(row.agent for row in rows).most_common(),
        replayed=_count(request, "replayed") if request.query.get("done") == "replayed" else None,
        not_replayed=_count(request, "not_replayed"),
        now=datetime.now(UTC),
    )


@routes.get("/dead-letters/confirm")
async def confirm(request: web.Request) -> web.Response:
    choice = _choice(request.query)
    if not choice:
        return _unsaid(request)
    rows, total = await _read(sources_of(request))
    return render(
        request,
        "dead_letters_confirm.html",
        rows=_chosen(rows, choice),
        choice=choice,
        here=_confirmation(choice),
        read=len(rows),
        total=total,
        now=datetime.now(UTC),
    )


@routes.post("/dead-letters/replay")
async def replay(request: web.Request) -> web.StreamResponse:
    from waystation.brokers.amqp.deadletters import ReplayNotRecorded, replay

    form = await request.post()
    choice = _choice(form)
    if not choice:
        return _unsaid(request)
    if form.get("confirmed") != "yes":
        raise web.HTTPSeeOther(_confirmation(choice))
    sources = sources_of(request)
    rows, _ = await _read(sources)
    wanted = len(_chosen(rows, choice))
    try:
        replayed = await replay(
            sources.settings.amqp_url,
            sources.names,
            reason=choice.get("reason"),
            message_id=choice.get("message_id"),
            limit=BOUND,
            store=sources.store,
            actor=actor_of(request),
        )
    except ReplayNotRecorded as error:
        return render(
            request,
            "message.html",
            status=500,
            title="Replayed, but not recorded",
            message=f"{len(error.replayed)} dead letter(s) went back to their queues, but the "
            f"event log could not record the replay ({error.cause!r}). The console's log names "
            "their message ids: record them by hand.",
        )
    done = {
        "done": "replayed",
        "replayed": len(replayed),
        "not_replayed": max(0, wanted - len(replayed)),
        **({"reason": choice["reason"]} if "reason" in choice else {}),
    }
    raise web.HTTPSeeOther("/dead-letters?" + urlencode(done))


def _unsaid(request: web.Request) -> web.Response:
    return render(
        request,
        "message.html",
        status=400,
        title="Which dead letters?",
        message="Say which dead letters to replay: a message id, or a reason.",
    )
