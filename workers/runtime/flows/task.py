"""A task message: run the agent's handler, then record its outcome (docs/internals.md).

A task that completes without calling peers writes nothing (G10; auditing, or its agent's
``keep_results``, records it): its result is the only effect, unless the broker refuses that
answer for now (its queue is full): then the completion is recorded after all, and its outbox
row tried again with backoff, rather than the handler run again.
A pause appends ``TaskStarted`` and ``TaskPaused`` in one statement, whose outbox rows are the
peer requests (G5: published only after the checkpoint committed). A handler that raises is
retried by redelivery up to the delivery limit, then recorded as failed. An input that does not
fit the agent's input model is dead-lettered (``invalid-input``) before the handler runs, and its
publisher told which field is wrong; nothing is recorded.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import ValidationError

from waystation.agent import AgentSpec, TaskContext
from waystation.brokers.port import Delivery, PublishRefused
from waystation.events import (
    MAX_TASK_ID_BYTES,
    Complete,
    Pause,
    TaskCompleted,
    TaskStarted,
    TaskState,
    VersionConflict,
)
from waystation.protocol.wire import (
    HEADER_ROOT,
    HEADER_TRACE,
    ResultEnvelope,
    result_message,
    trace_id_of,
)
from waystation.runtime.flows.base import Steps, invalid_fields, typed_input
from waystation.runtime.recorder import Cause
from waystation.runtime.verdicts import Verdict, ack, dead, sent_again

__all__ = ["handle_task", "recorded_outcome"]

log = logging.getLogger(__name__)


async def handle_task(steps: Steps, delivery: Delivery, spec: AgentSpec, payload: Any) -> Verdict:
    task_id = delivery.message_id
    if not task_id:
        return dead(
            "missing-property", "a task needs a message_id (its task id)", tell_publisher=True
        )
    if len(task_id.encode()) > MAX_TASK_ID_BYTES:
        return dead(
            "id-too-long",
            f"a task id is at most {MAX_TASK_ID_BYTES} bytes (AMQP's limit of 255 less room for "
            f"the ids derived from it); this one is {len(task_id.encode())}",
            tell_publisher=True,
        )
    again = sent_again(delivery)
    root_id = str(delivery.headers.get(HEADER_ROOT) or task_id)
    if again or root_id == task_id:
        # it may have been recorded already: by its first holder, or by the run a retry (or a
        # wait for a slot) of its own came from (a worker that died between sending the copy
        # and acking leaves both). And a task a publisher submitted (a root) may be a resend of
        # one that already finished: it is answered from the log, not run again. (A call of
        # another task skips this read: its caller sends each call once, and records a
        # repeated answer as a duplicate.)
        recorded = await steps.recorder.load(task_id)
        if recorded.exists:
            return await _already_recorded(steps, delivery, recorded)
    try:
        handler_input = typed_input(spec, payload)
    except ValidationError as error:
        return dead(
            "invalid-input",
            f"the input of {spec.name!r} is not a valid {error.title}: {invalid_fields(error)}",
            tell_publisher=True,
        )
    trace_id = trace_id_of(delivery.headers, task_id)
    state = TaskState(
        task_id=task_id,
        agent=spec.name,
        input=payload,
        reply_to=delivery.reply_to,
        correlation_id=delivery.correlation_id,
        trace_id=trace_id,
        root_id=root_id,
    )
    start = TaskStarted(
        agent=spec.name,
        input=payload,
        reply_to=delivery.reply_to,
        correlation_id=delivery.correlation_id,
    )
    context = TaskContext(
        task_id=task_id,
        agent=spec.name,
        input=handler_input,
        trace_id=trace_id,
        root_task_id=root_id,
    )
    admission = await steps.admit(spec, delivery, task_id)
    if isinstance(admission, Verdict):
        return admission  # a limit of the pool is full: the task waits in the broker
    try:
        spent = steps.out_of_attempts(delivery)
        if spent is not None:
            raise spent
        outcome = await steps.run_handler(spec, context, admission)
        returned_at = time.perf_counter()
        events = steps.decide_outcome(
            state,
            outcome,
            spec,
            start=start,
            # a completion is recorded with auditing on, and when this delivery is a retry, a
            # wait's copy or a redelivery: another run of the same task (the copy a dying
            # worker left, or the run that died) may be failing or answering meanwhile, and
            # only the log can settle which answer stands; and for an agent that keeps its
            # results (``keep_results``), whose publishers may ask for them later
            record_completion=steps.settings.audit_all_tasks or spec.keep_results or again,
        )
    except Exception as error:
        return await steps.handler_failed(delivery, state, error, start=start, spec=spec)
    if not events:
        # completed without peers: nothing to record (G10); the answer is the only effect
        assert isinstance(outcome, Complete)
        if delivery.reply_to:
            if root_id == task_id:
                # ...unless a cancel was recorded meanwhile: then the answer is that (b). Read
                # right before answering, so only a cancel committed in between can cross it.
                # (A call of another task skips this: its caller, the only one that cancels it,
                # records a later answer as late and applies nothing.)
                recorded = await steps.recorder.load(task_id)
                if recorded.exists:
                    return await _already_recorded(steps, delivery, recorded)
            envelope = ResultEnvelope("ok", result=outcome.result, task_id=task_id)
            try:
                await steps.settler.answer(
                    result_message(
                        task_id,
                        delivery.reply_to,
                        delivery.correlation_id,
                        envelope,
                        {HEADER_ROOT: root_id, HEADER_TRACE: trace_id},
                    ),
                    agent=spec.name,
                )
            except PublishRefused as refused:
                # its queue refuses it for now (full): the completion is recorded after all, and
                # its outbox row is tried again with backoff; the handler does not run again
                log.warning(
                    "task %s: its answer was refused (%s); recording it for the outbox",
                    task_id,
                    refused.detail,
                )
                events = [start, TaskCompleted(result=outcome.result)]
        if not events:
            steps.observer.completed_unrecorded(state)
            return ack()
    try:
        await steps.recorder.commit(
            state, events, "run", Cause.of(delivery), step="pause", history=[]
        )
    except VersionConflict:
        return await _already_recorded(steps, delivery, await steps.recorder.load(task_id))
    return ack(returned_at if isinstance(outcome, Pause) else None)


async def _already_recorded(steps: Steps, delivery: Delivery, state: TaskState) -> Verdict:
    """The task's stream exists: another delivery recorded it first (its outbox answers the
    publisher), it was cancelled before its first run was recorded, or it is a resend of a
    task that finished; the last two are answered here, from the log."""
    if _answer_from_log(delivery, state):
        await steps.settler.answer_or_keep(
            result_message(
                state.task_id,
                delivery.reply_to or "",
                delivery.correlation_id,
                recorded_outcome(state),
                {
                    HEADER_ROOT: state.root_id or state.task_id,
                    HEADER_TRACE: state.trace_id or trace_id_of(delivery.headers, state.task_id),
                },
            ),
            agent=state.agent,
        )
        steps.observer.count("results_answered_from_log")
    log.info("task %s is already recorded (%s); acking", state.task_id, state.status)
    steps.observer.duplicate(
        "redelivered_recognised" if delivery.redelivered else "duplicate_tasks"
    )
    return ack()


def recorded_outcome(state: TaskState) -> ResultEnvelope:
    """The result message body a finished task's publisher got (``implied_messages``)."""
    if state.status == "completed":
        return ResultEnvelope("ok", result=state.result, task_id=state.task_id)
    if state.status == "cancelled":
        return ResultEnvelope("cancelled", error=state.error, task_id=state.task_id)
    return ResultEnvelope("error", error=state.error, task_id=state.task_id)


def _answer_from_log(delivery: Delivery, state: TaskState) -> bool:
    """Whether ``delivery`` of a task the log holds gets its recorded outcome from here.

    Only a finished task has one, and only a delivery with a ``reply_to`` asks. The log's own
    outbox already answered the ``reply_to`` and ``correlation_id`` its ``TaskStarted`` names: a
    redelivery or a retry of that message (or a repeated call of another task) is not answered
    twice. A publisher's resend is answered, even to the same queue: it asked again.
    """
    if not state.finished or not delivery.reply_to:
        return False
    same_publisher = state.reply_to == delivery.reply_to and (
        state.correlation_id or state.task_id
    ) == (delivery.correlation_id or state.task_id)
    if not same_publisher:
        return True
    again = sent_again(delivery)
    root = str(delivery.headers.get(HEADER_ROOT) or state.task_id) == state.task_id
    return root and not again
