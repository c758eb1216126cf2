"""A committed message the broker will not take: it costs that message alone (G4, G9).

The outbox publishes what committed events imply (``waystation.runtime.outbox``). When the broker
says no for good to one of them (no queue takes it: ``unroutable``; it can never be sent as it is:
``too-large``, ``unencodable``; or it kept refusing it for ``WAYSTATION_REFUSED_RETRY_SECONDS``:
``refused``), the message is kept as a dead letter with that reason, and its task gets a
terminal answer where one can still be given:

* a peer request: its call fails at once with that error, as a timeout would, without waiting
  for its deadline (the task goes on with an error result for that call);
* a resume: the task fails (its resumed run could never start);
* a task's result: its publisher gets an error result instead, when that one can be sent (not
  when its queue is gone, or full). A result whose publisher's queue is gone is no dead letter:
  its publisher did not wait, which is normal; it is counted as undelivered
  (``Settler.undelivered``), and the log, which wrote it, still holds it;
* anything else (a cancel for a peer, an answer): the dead letter alone.

The outbox forgets the row only once this is done (:func:`handle_undeliverable` returned); a
result's error answer takes its place in the row instead, and is tried like any other message
(its publisher's queue may refuse it for a while too).
"""

from __future__ import annotations

import logging
from typing import Any

from waystation.brokers.port import BrokerError, PublishRefused, Unroutable, Unsendable
from waystation.events import OutboxMessage, decide_failure, decide_reply, parse_subtask_id
from waystation.events.codec import loads
from waystation.protocol.wire import TYPE_RESUME, TYPE_TASK
from waystation.runtime.flows.base import Steps
from waystation.runtime.recorder import Cause
from waystation.runtime.settle import to_gone_publisher, unsendable_answer

__all__ = ["handle_undeliverable"]

log = logging.getLogger(__name__)


def _error_of(error: BrokerError) -> dict[str, str]:
    if isinstance(error, Unroutable):
        return {"type": "unroutable", "message": f"no queue {error.routing_key!r} for this call"}
    reason = error.reason if isinstance(error, PublishRefused) else "unavailable"
    return {"type": reason, "message": f"the request could not be sent: {error}"[:2000]}


async def handle_undeliverable(
    steps: Steps, message: OutboxMessage, error: BrokerError
) -> OutboxMessage | None:
    """Keep ``message`` as a dead letter and give its task its answer (see the module); the
    message to send in its place, if any (a result's error answer)."""
    if to_gone_publisher(message, error):
        steps.settler.undelivered(message, await _agent_of(steps, message))
        return None
    properties = message.properties
    kind = properties.get("type")
    subtask = properties.get("correlation_id")
    if kind == TYPE_TASK and subtask and subtask == message.message_id:
        await _fail_call(steps, subtask, _error_of(error))
    elif kind == TYPE_RESUME:
        await _fail_resumed(steps, message, error)
    await steps.settler.keep(message, error)
    if isinstance(error, Unsendable):
        return unsendable_answer(message, error)
    return None


async def _agent_of(steps: Steps, result: OutboxMessage) -> str | None:
    """The agent of the task whose ``result`` this is, as its log says."""
    try:
        task_id = loads(result.body)["task_id"]
    except (ValueError, TypeError, KeyError):
        return None
    return (await steps.recorder.load(str(task_id))).agent


async def _fail_call(steps: Steps, subtask: str, error: dict[str, str]) -> None:
    """The call ``subtask`` fails now, as if its peer had answered with ``error``."""
    task_id, _, _ = parse_subtask_id(subtask)
    log.warning("call %s of task %s failed: %s", subtask, task_id, error["message"])
    await steps.recorder.append_decision(
        task_id,
        lambda state: decide_reply(state, subtask, outcome="error", error=error),
        key=lambda _: f"reply:{subtask}",
        cause=Cause(message_id=f"undeliverable:{subtask}"),
        step="reply",
    )


async def _fail_resumed(steps: Steps, message: OutboxMessage, error: BrokerError) -> None:
    """The resume ``message`` will never run: its task fails, if it is still waiting for it."""
    try:
        body: Any = loads(message.body)
        task_id, pause = str(body["task_id"]), int(body["pause"])
    except (ValueError, TypeError, KeyError):
        return
    failure = {"type": "undeliverable-resume", "message": f"the resume could not be sent: {error}"}

    def decide(state: Any) -> list[Any]:
        if state.status != "resumed" or state.pause != pause:
            return []
        return decide_failure(state, failure)

    log.error("task %s failed: its resume from pause %d could not be sent", task_id, pause)
    await steps.recorder.append_decision(
        task_id,
        decide,
        key=lambda _: "failed",
        cause=Cause(message_id=message.message_id),
        step="failure",
    )
