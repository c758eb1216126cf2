"""A signal: a named message from outside that a paused task waits for (issue 31).

A ``signal`` message on the queue of the task's agent carries ``{"task_id", "name", "payload"}``;
its AMQP ``message_id`` is the signal's id, and its ``user_id`` (which RabbitMQ checks against
the connection's user) who sent it (docs/wire-format.md#signals). ``decide_signal`` records it in
the task's stream: the first open wait on that name takes it (and the last result the pause
waits for resumes the task, in place, as a reply does), or the stream keeps it for the next wait
on that name. A signal whose id the stream already holds changes nothing, so a redelivery, or a
sender that sends twice, is applied once.

The sender, when it gave ``reply_to``, is answered (``result`` message, its ``correlation_id``):
``taken`` by a wait, ``kept`` for a later one, ``duplicate``, or an error saying why it was not
applied: the task has finished, Waystation has no record of it (it has not paused yet, finished
without the log (G10), or never was), it belongs to another agent, or the payload does not fit
the agent's declared model for the signal (the wait goes on). A refusal is recorded for audit in
a stream that exists (``SignalRefused``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from pydantic import BaseModel, ValidationError

from waystation.agent import AgentSpec
from waystation.brokers.port import Delivery
from waystation.events import SignalReceived, SignalRefused, TaskState, decide_signal
from waystation.events.task import MAX_SIGNAL_NAME
from waystation.protocol.wire import ResultEnvelope, derived_id, result_message
from waystation.runtime.flows.base import Steps, invalid_fields
from waystation.runtime.flows.cancel import MAX_TASK_ID
from waystation.runtime.flows.in_place import run_in_place
from waystation.runtime.recorder import Cause
from waystation.runtime.verdicts import Verdict, ack, dead

__all__ = ["SIGNAL_SHAPE", "handle_signal"]

log = logging.getLogger(__name__)

SIGNAL_SHAPE = 'a signal body is {"task_id": str, "name": str, "payload": any JSON}'


async def handle_signal(steps: Steps, delivery: Delivery, spec: AgentSpec, body: Any) -> Verdict:
    problem = _shape_problem(delivery, body)
    if problem is not None:
        return dead("wrong-shape", problem, tell_publisher=True)
    task_id, name, payload = body["task_id"], body["name"], body.get("payload")
    signal_id = delivery.message_id
    assert signal_id is not None  # checked by _shape_problem
    invalid = _invalid(spec.signals.get(name), payload)

    def decide(state: TaskState) -> list[Any]:
        if _foreign(state, spec):
            return []
        return decide_signal(
            state, name, payload, signal_id=signal_id, sender=delivery.user_id, invalid=invalid
        )

    applied = await steps.recorder.append_decision(
        task_id,
        decide,
        key=lambda _: f"signal:{signal_id}",
        cause=Cause.of(delivery),
        step="signal",
        run_resumed=functools.partial(run_in_place, steps),
    )
    answer = _answer(applied.state, applied.events, spec, name, signal_id, invalid)
    log.info("signal %r (%s) for %s: %s", name, signal_id, task_id, answer.status_line)
    steps.observer.count(f"signals_{answer.status}")
    if delivery.reply_to:
        await steps.settler.answer_or_keep(
            result_message(
                derived_id(signal_id, ":signal"),
                delivery.reply_to,
                delivery.correlation_id,
                answer.envelope(task_id, signal_id),
            )
        )
    return ack(applied.checkpoint_started)


def _shape_problem(delivery: Delivery, body: Any) -> str | None:
    if not delivery.message_id:
        return "a signal needs a message_id: its id, which makes sending it twice harmless"
    if not isinstance(body, dict) or not isinstance(body.get("task_id"), str):
        return SIGNAL_SHAPE
    if not body["task_id"] or len(body["task_id"]) > MAX_TASK_ID:
        return f"a signal's task_id is 1 to {MAX_TASK_ID} characters"
    name = body.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_SIGNAL_NAME:
        return f"a signal's name is a string of 1 to {MAX_SIGNAL_NAME} characters"
    if set(body) - {"task_id", "name", "payload"}:
        return f"{SIGNAL_SHAPE}; unknown keys {sorted(set(body) - {'task_id', 'name', 'payload'})}"
    return None


def _foreign(state: TaskState, spec: AgentSpec) -> bool:
    """Whether the task is another agent's. A stream that holds only a cancel (the task was
    cancelled before its first run recorded anything) names no agent: it is nobody's, and a
    signal for it is refused as for any finished task."""
    return state.exists and state.agent is not None and state.agent != spec.name


def _invalid(model: type[BaseModel] | None, payload: Any) -> str | None:
    """Why ``payload`` does not fit the agent's model of the signal, or None."""
    if model is None:
        return None
    try:
        model.model_validate(payload)
    except ValidationError as error:
        return f"the payload is not a valid {model.__name__}: {invalid_fields(error)}"
    return None


class _Answer:
    def __init__(self, status: str, message: str | None = None) -> None:
        self.status = status
        self.message = message

    @property
    def ok(self) -> bool:
        return self.status in ("taken", "kept", "duplicate")

    @property
    def status_line(self) -> str:
        return self.status if self.message is None else f"{self.status}: {self.message}"

    def envelope(self, task_id: str, signal_id: str) -> ResultEnvelope:
        if self.ok:
            return ResultEnvelope(
                "ok", result={"task_id": task_id, "signal_id": signal_id, "status": self.status}
            )
        return ResultEnvelope(
            "error", error={"type": self.status, "message": self.message}, task_id=task_id
        )


def _answer(
    state: TaskState,
    events: list[Any],
    spec: AgentSpec,
    name: str,
    signal_id: str,
    invalid: str | None,
) -> _Answer:
    """What became of the signal, as its sender is told."""
    if not state.exists:
        return _Answer(
            "undeliverable",
            f"no task {state.task_id!r} in the log: it has not paused yet, finished without "
            "waiting (G10), or never was; a signal reaches a task that has paused",
        )
    if _foreign(state, spec):
        return _Answer(
            "wrong-agent",
            f"task {state.task_id!r} is a task of agent {state.agent!r}; send its signals to "
            "that agent's queue",
        )
    received = next((e for e in events if isinstance(e, (SignalReceived, SignalRefused))), None)
    if received is None:
        if signal_id in state.signals:
            return _Answer("duplicate")
        # refused and not recorded now: a copy of a signal whose refusal the stream holds (its
        # id made the same events, recognised), or a refusal past the number the stream may
        # hold; its sender hears the refusal, as the first copy's sender did
        return _refusal(
            state, "finished" if state.finished else "invalid" if invalid else "too-many", invalid
        )
    if isinstance(received, SignalRefused):
        return _refusal(state, received.reason, invalid)
    taken = len(events) > 1
    return _Answer("taken" if taken else "kept", None if taken else f"no wait on {name!r} yet")


def _refusal(state: TaskState, reason: str, invalid: str | None) -> _Answer:
    """The answer to a signal refused for ``reason`` (``SignalRefused.reason``)."""
    if reason == "invalid":
        return _Answer("invalid", invalid)
    if reason == "finished":
        return _Answer(
            "undeliverable", f"task {state.task_id!r} has {state.status}; nothing waits for it"
        )
    return _Answer(
        "undeliverable", f"task {state.task_id!r} keeps as many signals no wait took as it may"
    )
