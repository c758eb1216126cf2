"""A resume message: run the handler of a task whose pause has every result, record what it does.

Any instance serving the agent takes it. The state is restored exactly as saved, with the pause's
results in call order; the handler's next pause or completion is recorded by the recorder's one
conflict loop (``Recorder.append_decision``): a conflict (a cancel, an audit event, another
instance) means read again and re-check, and a stream no longer resumed at that pause records
nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from waystation.agent import AgentSpec
from waystation.brokers.port import Delivery
from waystation.events import DomainEvent, InvalidTransition, Pause, TaskState
from waystation.runtime.flows.base import Steps, resume_context
from waystation.runtime.recorder import Cause
from waystation.runtime.verdicts import Verdict, ack, dead

__all__ = ["handle_resume"]

log = logging.getLogger(__name__)


async def handle_resume(steps: Steps, delivery: Delivery, spec: AgentSpec, body: Any) -> Verdict:
    try:
        task_id, pause = str(body["task_id"]), int(body["pause"])
    except (TypeError, KeyError, ValueError):
        return dead("wrong-shape", 'a resume body is {"task_id": str, "pause": int}')
    recorder = steps.recorder
    state = await recorder.load(task_id)
    if state.status != "resumed" or state.pause != pause:
        log.info("resume of %s from pause %d: nothing to do (%s)", task_id, pause, state.status)
        steps.observer.duplicate("duplicate_resumes")
        return ack()
    admission = await steps.admit(spec, delivery, task_id)
    if isinstance(admission, Verdict):
        return admission  # a limit of the pool is full: the resume waits in the broker
    try:
        spent = steps.out_of_attempts(delivery)
        if spent is not None:
            raise spent
        outcome = await steps.run_handler(spec, resume_context(spec, state), admission)
    except Exception as error:
        return await steps.handler_failed(delivery, state, error, spec=spec)
    returned_at = time.perf_counter()

    def decide(current: TaskState) -> list[DomainEvent]:
        if current.status != "resumed" or current.pause != pause:
            return []  # an audit event or a cancel landed meanwhile, or another instance ran it
        return steps.decide_outcome(current, outcome, spec)

    try:
        applied = await recorder.append_decision(
            task_id,
            decide,
            key=lambda _: f"resume:{pause}",
            cause=Cause.of(delivery),
            step="resume",
        )
    except InvalidTransition as error:
        return await steps.handler_failed(delivery, state, error, spec=spec)
    if not applied.events:
        return ack()
    if applied.state.resumed_at is not None:
        steps.observer.resumed(max(0.0, steps.clock() - applied.state.resumed_at))
    return ack(returned_at if isinstance(outcome, Pause) else None)
