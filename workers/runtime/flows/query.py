"""A query message: answer what the log records about a task, on the query's ``reply_to``.

A publisher that did not submit a task (or lost its result) has no database: it asks a worker,
through any agent's queue of the deployment (every worker reads the same log), with
``{"task_id": str}``. The answer is a ``result`` message correlated with the query::

    {"status": "ok", "result": {"task_id": ..., "status": <status>, "outcome": <outcome>}}

``status`` is what the log says: ``completed``, ``failed``, ``cancelled`` (finished: ``outcome``
is the result body its publisher got), ``paused`` or ``resumed`` (not finished yet), or
``unknown``: the log does not hold the task. That is so for a task not run yet, and also for a
task that completed without calling peers, which writes nothing (G10) unless
``WAYSTATION_AUDIT_ALL_TASKS`` is on. A query writes nothing and runs no handler.
"""

from __future__ import annotations

import logging
from typing import Any

from waystation.agent import AgentSpec
from waystation.brokers.port import Delivery
from waystation.events import TaskState
from waystation.events.codec import loads
from waystation.protocol.wire import ResultEnvelope, derived_id, result_message
from waystation.runtime.flows.base import Steps
from waystation.runtime.flows.cancel import MAX_TASK_ID
from waystation.runtime.flows.task import recorded_outcome
from waystation.runtime.verdicts import Verdict, ack, dead

__all__ = ["handle_query", "query_answer"]

log = logging.getLogger(__name__)


async def handle_query(steps: Steps, delivery: Delivery, spec: AgentSpec, body: Any) -> Verdict:
    if not isinstance(body, dict) or not isinstance(body.get("task_id"), str):
        return dead("wrong-shape", 'a query body is {"task_id": str}', tell_publisher=True)
    task_id = body["task_id"]
    if len(task_id) > MAX_TASK_ID or not task_id:
        return dead(
            "wrong-shape",
            f"a query's task_id is 1 to {MAX_TASK_ID} characters",
            tell_publisher=True,
        )
    if not delivery.reply_to:
        return dead("missing-property", "a query needs a reply_to to answer to")
    state = await steps.recorder.load(task_id)
    answer = query_answer(state)
    steps.observer.count("queries_answered")
    await steps.settler.answer_or_keep(
        result_message(
            derived_id(task_id, ":query"),
            delivery.reply_to,
            delivery.correlation_id or delivery.message_id,
            ResultEnvelope("ok", result=answer),
        )
    )
    log.info("query of %s: %s", task_id, answer["status"])
    return ack()


def query_answer(state: TaskState) -> dict[str, Any]:
    """The ``result`` of a query's answer: the task's status and, once finished, its outcome."""
    outcome = loads(recorded_outcome(state).to_json()) if state.finished else None
    status = state.status if state.exists else "unknown"
    return {"task_id": state.task_id, "status": status, "outcome": outcome}
