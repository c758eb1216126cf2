"""A cancel message: record ``TaskCancelled``, cancel the peers it waits for, answer (G7).

A cancel racing a resume is settled by the log: whichever commits first wins, and the other is
refused by the version check and decided again on what is there.

Who cancelled, when the publisher named them (the ``x-waystation-actor`` header, cleaned), is
the ``actor`` of the ``TaskCancelled`` metadata, and goes on the cancels sent to its peers.
"""

from __future__ import annotations

import logging
from typing import Any

from waystation.agent import AgentSpec
from waystation.brokers.port import Delivery
from waystation.events import OPERATIONS_STREAM, TaskState, decide_cancel
from waystation.protocol.actors import actor_of
from waystation.protocol.wire import ResultEnvelope, derived_id, result_message
from waystation.runtime.flows.base import Steps
from waystation.runtime.recorder import Cause
from waystation.runtime.verdicts import Verdict, ack, dead

__all__ = ["MAX_TASK_ID", "NOT_A_TASK", "handle_cancel"]

MAX_TASK_ID = 255
NOT_A_TASK = (
    f"{OPERATIONS_STREAM!r} is the log's stream of operations (dead-letter replays), not a task"
)

log = logging.getLogger(__name__)


async def handle_cancel(steps: Steps, delivery: Delivery, spec: AgentSpec, body: Any) -> Verdict:
    if not isinstance(body, dict) or not isinstance(body.get("task_id"), str):
        return dead(
            "wrong-shape",
            'a cancel body is {"task_id": str, "reason": str?}',
            tell_publisher=True,
        )
    task_id = body["task_id"]
    if len(task_id) > MAX_TASK_ID or not task_id:
        # a task id is a message id (at most 255 bytes in AMQP): a longer one names no task,
        # and no index row could hold it
        return dead(
            "wrong-shape",
            f"a cancel's task_id is 1 to {MAX_TASK_ID} characters",
            tell_publisher=True,
        )
    if task_id == OPERATIONS_STREAM:
        return dead("wrong-shape", NOT_A_TASK, tell_publisher=True)
    reason = body.get("reason") if isinstance(body.get("reason"), str) else None
    applied = await steps.recorder.append_decision(
        task_id,
        lambda current: decide_cancel(current, reason),
        key=lambda _: "cancel",
        cause=Cause.of(delivery, actor=actor_of(delivery.headers)),
        step="cancel",
        describe_new=lambda current: TaskState(task_id=task_id, agent=spec.name),
    )
    status = "cancelled" if applied.events else applied.state.status
    log.info("cancel of %s: %s", task_id, "cancelled" if applied.events else status)
    steps.observer.count("cancels_applied" if applied.events else "cancels_ignored")
    if delivery.reply_to:
        envelope = ResultEnvelope("ok", result={"task_id": task_id, "status": status})
        await steps.settler.answer_or_keep(
            result_message(
                derived_id(task_id, ":cancel"), delivery.reply_to, delivery.correlation_id, envelope
            )
        )
    return ack()
