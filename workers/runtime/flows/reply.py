"""A peer's reply: claim the call and record its result; the last one resumes the task (G2, G3).

``SubtaskClaimed`` + ``ResultRecorded`` (+ ``TaskResumed`` for the last outstanding call) go in
one append. A duplicate, a late reply or one for an unknown call is acked and recorded for audit
(``ReplyIgnored``), never applied; the redelivery of the very message that claimed is recognised
and acked without appending anything.

Replies to one task that wait for its stream's lock on one worker (they arrive together, and
reply routing brings them to one worker) are recorded in one append
(``Recorder.append_decision``, ``combine``); the first ones wait up to
``WAYSTATION_REPLY_GATHER_MS`` for the rest of the replies the pause still waits for
(``gather``, :func:`replies_awaited`): its open peer calls, since a signal or a timer never gets
a reply message, and under ``FirstK(k)`` no more than the successes it still lacks, since the
pause resumes on the k-th and gives up the rest.

The worker that records the last reply runs the resumed handler at once, in place, and appends
its outcome in the same statement (:mod:`.in_place`, the decision's run step): no resume message,
no second read. The reply stays unacked until that append commits, so a crash redelivers it and
the whole step runs again.
"""

from __future__ import annotations

import functools
import logging
import uuid
from typing import Any, Literal

from waystation.brokers.port import Delivery
from waystation.events import (
    DomainEvent,
    ReplyIgnored,
    SubtaskClaimed,
    TaskState,
    decide_reply,
    parse_subtask_id,
)
from waystation.events.task import MAX_IGNORED_REPLIES, over_ignored_limit
from waystation.protocol.intake import Rejection
from waystation.protocol.wire import ResultEnvelope
from waystation.runtime.flows.base import Steps
from waystation.runtime.flows.in_place import run_in_place
from waystation.runtime.recorder import Applied, Cause
from waystation.runtime.verdicts import Verdict, ack, dead

__all__ = ["handle_reply", "handle_unstorable_reply", "replies_awaited", "subtask_of"]

log = logging.getLogger(__name__)


def subtask_of(delivery: Delivery) -> tuple[str, str] | Verdict:
    """``(task_id, subtask_id)`` a reply or progress report is about, or why it is dead."""
    subtask = delivery.correlation_id
    if not subtask:
        return dead("missing-property", "a reply needs the correlation_id of its request")
    try:
        task_id, _, _ = parse_subtask_id(subtask)
    except ValueError:
        return dead("malformed-correlation-id", f"{subtask!r} names no sub-task")
    return task_id, subtask


async def handle_reply(steps: Steps, delivery: Delivery, body: Any) -> Verdict:
    found = subtask_of(delivery)
    if isinstance(found, Verdict):
        return found
    task_id, subtask = found
    try:
        envelope = ResultEnvelope.from_json(body)
    except ValueError as problem:
        return dead("wrong-shape", str(problem))
    outcome: Literal["ok", "error"] = "ok" if envelope.status == "ok" else "error"
    value = envelope.result if outcome == "ok" else None
    error = envelope.error if outcome == "ok" else envelope.error or {"type": envelope.status}
    applied = await _record(steps, delivery, task_id, subtask, outcome, value, error)
    if not applied.state.exists:
        return dead("unknown-task", f"no task {task_id!r} in the log")
    if not applied.events:
        if over_ignored_limit(applied.state, subtask, delivery.message_id):
            return dead(
                "ignored-replies-limit",
                f"task {task_id!r} already records {MAX_IGNORED_REPLIES} ignored replies",
            )
        steps.observer.count("redelivered_recognised")
    return ack(applied.checkpoint_started)


async def handle_unstorable_reply(steps: Steps, delivery: Delivery, why: Rejection) -> Verdict:
    """A reply whose body the log cannot store fails its call now, as an error saying why,
    rather than at its deadline; the reply itself is dead-lettered for whoever sent it."""
    found = subtask_of(delivery)
    if isinstance(found, Verdict):
        return found
    task_id, subtask = found
    error = {"type": "unstorable-reply", "message": why.detail}
    applied = await _record(steps, delivery, task_id, subtask, "error", None, error)
    if not applied.state.exists:
        return dead("unknown-task", f"no task {task_id!r} in the log")
    return dead(why.reason, why.detail)


async def _record(
    steps: Steps,
    delivery: Delivery,
    task_id: str,
    subtask: str,
    outcome: Literal["ok", "error"],
    value: Any,
    error: Any,
) -> Applied:
    """Claim ``subtask`` with this result (resuming in place when it is the last), or record the
    reply for audit when it cannot be applied."""

    def decide(state: TaskState) -> list[DomainEvent]:
        if not state.exists:
            return []
        return decide_reply(
            state,
            subtask,
            outcome=outcome,
            value=value,
            error=error,
            message_id=delivery.message_id,
        )

    def key(events: list[DomainEvent]) -> str:
        if isinstance(events[0], SubtaskClaimed):
            return f"reply:{subtask}"
        return f"ignored:{subtask}:{delivery.message_id or uuid.uuid4()}"

    applied = await steps.recorder.append_decision(
        task_id,
        decide,
        key=key,
        cause=Cause.of(delivery),
        step="reply",
        run_resumed=functools.partial(run_in_place, steps),
        combine=True,
        gather=replies_awaited,
    )
    if applied.events and isinstance(applied.events[0], ReplyIgnored):
        log.info("reply for %s not applied: %s", subtask, applied.events[0].reason)
        steps.observer.count("replies_ignored")
    return applied


def replies_awaited(state: TaskState) -> int:
    """How many replies ``state``'s pause may still take before it resumes: its open peer calls
    (a signal's or a timer's wait never gets a reply message), and under ``FirstK(k)`` at most
    the successes it still lacks. 0 once it is no longer paused: a reply to a wait a ``FirstK``
    pause gave up is late, and nothing comes with it."""
    if state.status != "paused":
        return 0
    open_calls = sum(1 for wait in state.outstanding if wait.kind == "call")
    if state.until is None:
        return open_calls
    succeeded = sum(
        1
        for wait in state.calls
        if (result := state.results.get(wait.subtask_id)) is not None and result.ok
    )
    return max(0, min(open_calls, state.until - succeeded))
