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

Who sent it, when the publisher named them (the ``x-waystation-actor`` header, cleaned: a person
behind the AMQP user, ``console:alice``), is the ``actor`` of the metadata of every event the
signal appends (with a resumed run in place, its events too: the signal caused them).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from pydantic import BaseModel, ValidationError

from waystation.agent import AgentSpec
from waystation.brokers.port import Delivery
from waystation.events import (
    OPERATIONS_STREAM,
    SignalReceived,
    SignalRefused,
    TaskState,
    decide_signal,
)
from waystation.events.task import MAX_KEPT_SIGNALS, MAX_SIGNAL_NAME
from waystation.protocol.actors import actor_of
from waystation.protocol.wire import ResultEnvelope, derived_id, result_message
from waystation.runtime.flows.base import Steps, invalid_fields
from waystation.runtime.flows.cancel import MAX_TASK_ID, NOT_A_TASK
from waystation.runtime.flows.in_place import run_in_place
from waystation.runtime.recorder import Applied, Cause
from waystation.runtime.verdicts import Verdict, ack, dead

__all__ = ["SIGNAL_SHAPE", "handle_signal"]

log = logging.getLogger(__name__)

SIGNAL_SHAPE = 'a signal body is {"task_id": str, "name": str, "payload": any JSON}'


async def handle_signal(steps: Steps, delivery: Delivery, spec: AgentSpec, body: Any) -> Verdict:
    signal_id = delivery.message_id
    if not signal_id:
        return dead(
            "missing-property",
            "a signal needs a message_id: its id, which makes sending it twice harmless",
            tell_publisher=True,
        )
    problem = _shape_problem(body)
    if problem is not None:
        return dead("wrong-shape", problem, tell_publisher=True)
    task_id, name = body["task_id"], body["name"]
    payload, invalid = _checked(spec.signals.get(name), body.get("payload"))

    decided: list[Any] = []
    """What the last decision gave: when the recorder appends none of it, the log holds a
    decision under this signal's id already."""

    def decide(state: TaskState) -> list[Any]:
        if _foreign(state, spec):
            return []
        decided[:] = decide_signal(
            state, name, payload, signal_id=signal_id, sender=delivery.user_id, invalid=invalid
        )
        return decided

    applied = await steps.recorder.append_decision(
        task_id,
        decide,
        key=lambda _: f"signal:{signal_id}",
        cause=Cause.of(delivery, actor=actor_of(delivery.headers)),
        step="signal",
        run_resumed=functools.partial(run_in_place, steps),
    )
    answer = _answer(applied, decided, spec, name, signal_id, invalid)
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


def _shape_problem(body: Any) -> str | None:
    if not isinstance(body, dict) or not isinstance(body.get("task_id"), str):
        return SIGNAL_SHAPE
    if not body["task_id"] or len(body["task_id"]) > MAX_TASK_ID:
        return f"a signal's task_id is 1 to {MAX_TASK_ID} characters"
    if body["task_id"] == OPERATIONS_STREAM:
        return NOT_A_TASK
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


def _checked(model: type[BaseModel] | None, payload: Any) -> tuple[Any, str | None]:
    """The payload to record and why it does not fit the agent's model of the signal (None
    when it does): a payload that fits is recorded in the model's JSON form (``1`` given for a
    ``bool`` field is recorded as ``true``), as the resumed handler reads it."""
    if model is None:
        return payload, None
    try:
        return model.model_validate(payload).model_dump(mode="json"), None
    except ValidationError as error:
        return payload, f"the payload is not a valid {model.__name__}: {invalid_fields(error)}"


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
    applied: Applied,
    decided: list[Any],
    spec: AgentSpec,
    name: str,
    signal_id: str,
    invalid: str | None,
) -> _Answer:
    """What became of the signal, as its sender is told: ``applied`` is what the recorder
    appended, ``decided`` what the last decision gave."""
    state = applied.state
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
    events = applied.events
    received = next((e for e in events if isinstance(e, (SignalReceived, SignalRefused))), None)
    if received is None:
        if signal_id in state.signals:
            return _Answer("duplicate")
        if not decided:  # refused, but the stream holds as many refusals as it may
            return _refusal(state, _reason(state, invalid), invalid, NOT_RECORDED)
        return _refused_before(state, decided, signal_id, invalid)
    if isinstance(received, SignalRefused):
        return _refusal(state, received.reason, invalid)
    taken = len(events) > 1
    return _Answer("taken" if taken else "kept", None if taken else f"no wait on {name!r} yet")


NOT_RECORDED = " (not recorded: the task's log holds as many refusals as it may)"


def _reason(state: TaskState, invalid: str | None) -> str:
    """Why ``decide_signal`` refused a signal it did not record (as it tells them apart)."""
    if state.finished:
        return "finished"
    return "invalid" if invalid is not None else "too-many"


def _refused_before(
    state: TaskState, decided: list[Any], signal_id: str, invalid: str | None
) -> _Answer:
    """A signal sent again under an id whose refusal the log holds: a decision is recorded
    once per id, so nothing new is (a corrected payload needs an id of its own)."""
    before = f"a signal with id {signal_id!r} was refused before, and an id is applied once"
    refusal = next((e for e in decided if isinstance(e, SignalRefused)), None)
    if refusal is None:  # it would be taken or kept now
        return _Answer("undeliverable", f"{before}: send it again under a new id")
    return _refusal(state, refusal.reason, invalid, f" ({before})")


def _refusal(state: TaskState, reason: str, invalid: str | None, note: str = "") -> _Answer:
    """A refused signal's answer: ``invalid`` (the wait goes on) or ``undeliverable``."""
    messages = {
        "finished": f"task {state.task_id!r} has {state.status}; nothing waits for it",
        "invalid": f"{invalid}; the wait goes on",
        "too-many": f"task {state.task_id!r} keeps {MAX_KEPT_SIGNALS} signals no wait took, "
        "as many as it may",
    }
    return _Answer("invalid" if reason == "invalid" else "undeliverable", messages[reason] + note)
