"""The worker's steps, one per message kind (docs/internals.md): decide, append, publish, settle.

Each flow takes a delivery and returns what should become of it
(``waystation.runtime.verdicts.Verdict``); the worker settles it afterwards, so that no flow acks
before its effect is durable (G1).

What each queue takes (``waystation.protocol.wire``):

* ``P<agent>``: ``task`` (:mod:`.task`), ``resume`` (:mod:`.resume`), ``cancel`` (:mod:`.cancel`),
  ``query`` (:mod:`.query`), ``signal`` (:mod:`.signal`);
* ``P<agent>.replies``: ``result`` (:mod:`.reply`), ``progress`` (:mod:`.progress`).
"""

from __future__ import annotations

from typing import Any

from waystation.agent import AgentSpec
from waystation.brokers.port import Delivery
from waystation.protocol.wire import (
    TYPE_CANCEL,
    TYPE_PROGRESS,
    TYPE_QUERY,
    TYPE_RESULT,
    TYPE_RESUME,
    TYPE_SIGNAL,
    TYPE_TASK,
)
from waystation.runtime.flows.base import Steps
from waystation.runtime.flows.cancel import handle_cancel
from waystation.runtime.flows.progress import handle_progress
from waystation.runtime.flows.query import handle_query
from waystation.runtime.flows.reply import handle_reply
from waystation.runtime.flows.resume import handle_resume
from waystation.runtime.flows.signal import handle_signal
from waystation.runtime.flows.task import handle_task
from waystation.runtime.verdicts import Verdict, dead

__all__ = ["KINDS", "Steps", "dispatch", "kind_label"]

KINDS = {
    "tasks": frozenset({TYPE_TASK, TYPE_RESUME, TYPE_CANCEL, TYPE_QUERY, TYPE_SIGNAL}),
    "replies": frozenset({TYPE_RESULT, TYPE_PROGRESS}),
}


def kind_label(delivery: Delivery, kind: str) -> str:
    """The delivery's type as a metric label (``other`` for types nobody sends, so a stray
    publisher cannot grow the label set without bound)."""
    given = delivery.type or (TYPE_TASK if kind == "tasks" else TYPE_RESULT)
    return given if given in KINDS[kind] else "other"


async def dispatch(
    steps: Steps, delivery: Delivery, spec: AgentSpec, kind: str, body: Any
) -> Verdict:
    """Run the flow of ``delivery``'s type (``kind`` is the queue it came from)."""
    if kind == "replies":
        message_type = delivery.type or TYPE_RESULT
        if message_type == TYPE_RESULT:
            return await handle_reply(steps, delivery, body)
        if message_type == TYPE_PROGRESS:
            return await handle_progress(steps, delivery, body)
    else:
        message_type = delivery.type or TYPE_TASK
        if message_type == TYPE_TASK:
            return await handle_task(steps, delivery, spec, body)
        if message_type == TYPE_RESUME:
            return await handle_resume(steps, delivery, spec, body)
        if message_type == TYPE_CANCEL:
            return await handle_cancel(steps, delivery, spec, body)
        if message_type == TYPE_QUERY:
            return await handle_query(steps, delivery, spec, body)
        if message_type == TYPE_SIGNAL:
            return await handle_signal(steps, delivery, spec, body)
    # a publisher that set reply_to on the task queue asked for an answer (G9)
    return dead(
        "unknown-message-type",
        f"type {message_type!r} on {kind} queue",
        tell_publisher=kind == "tasks",
    )
