"""A resume message: run the handler of a task whose pause has every result, record what it does.

Any instance serving the agent takes it. The state is restored exactly as saved, with the pause's
results in call order; the handler's next pause or completion is appended at the version read,
and a conflict (a cancel, an audit event, another instance) means read again and re-check.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from waystation.agent import AgentSpec
from waystation.brokers.port import Delivery
from waystation.events import InvalidTransition, Pause, VersionConflict, decide_outcome
from waystation.runtime.flows.base import Flows, resume_context
from waystation.runtime.recorder import MAX_CONFLICT_RETRIES, Cause
from waystation.runtime.settle import Settled, ack, dead

__all__ = ["handle_resume"]

log = logging.getLogger(__name__)


async def handle_resume(flows: Flows, delivery: Delivery, spec: AgentSpec, body: Any) -> Settled:
    try:
        task_id, pause = str(body["task_id"]), int(body["pause"])
    except (TypeError, KeyError, ValueError):
        return dead("wrong-shape", 'a resume body is {"task_id": str, "pause": int}')
    recorder = flows.recorder
    state = await recorder.load(task_id)
    if state.status != "resumed" or state.pause != pause:
        log.info("resume of %s from pause %d: nothing to do (%s)", task_id, pause, state.status)
        flows.observer.duplicate("duplicate_resumes")
        return ack()
    admission = await flows.admit(spec, delivery, task_id)
    if isinstance(admission, Settled):
        return admission  # a limit of the pool is full: the resume waits in the broker
    try:
        spent = flows.out_of_attempts(delivery)
        if spent is not None:
            raise spent
        outcome = await flows.run_handler(spec, resume_context(spec, state), admission)
    except Exception as error:
        return await flows.handler_failed(delivery, state, error, spec=spec)
    returned_at = time.perf_counter()
    async with recorder.locks.hold(task_id):
        for _ in range(MAX_CONFLICT_RETRIES):
            try:
                events = decide_outcome(
                    state,
                    outcome,
                    now=flows.clock(),
                    default_timeout=flows.default_timeout(spec),
                    max_timeout=flows.settings.max_call_duration,
                    max_state_bytes=flows.settings.max_state_bytes,
                    max_value_bytes=flows.max_value_bytes,
                )
            except InvalidTransition as error:
                break_error: Exception = error
                break
            try:
                await recorder.commit(
                    state, events, f"resume:{pause}", Cause.of(delivery), step="resume"
                )
            except VersionConflict:
                # an audit event or a cancel landed meanwhile, or another instance ran it
                flows.observer.version_conflict()
                state = await recorder.load(task_id)
                if state.status != "resumed" or state.pause != pause:
                    return ack()
                continue
            if state.resumed_at is not None:
                flows.observer.resumed(max(0.0, flows.clock() - state.resumed_at))
            return ack(returned_at if isinstance(outcome, Pause) else None)
        else:
            raise RuntimeError(f"resume of {task_id}: {MAX_CONFLICT_RETRIES} conflicts")
    return await flows.handler_failed(delivery, state, break_error, spec=spec)
