"""What a recorded decision is made of, shared by the recorder (a decision alone) and the
combiner (decisions together): its cause, what it applied, the run step of a decision that
resumes its task, and a decision made ready to append."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from waystation.brokers.port import Delivery
from waystation.events import (
    DomainEvent,
    NewEvent,
    OutboxMessage,
    TaskResumed,
    TaskState,
)

__all__ = [
    "MAX_CONFLICT_RETRIES",
    "Applied",
    "Cause",
    "Decide",
    "Extension",
    "Key",
    "Part",
    "RunResumed",
    "UnreadableStream",
    "resumes",
]

MAX_CONFLICT_RETRIES = 50


class UnreadableStream(Exception):
    """A task's stream holds events this worker cannot read (a newer version wrote them)."""


@dataclass(frozen=True, slots=True)
class Cause:
    """What made the worker append: recorded as the events' causation and actor."""

    message_id: str | None = None
    amqp_user: str | None = None
    actor: str | None = None
    """Who acted, as a cancel or a signal names them (``waystation.protocol.actors.actor_of``);
    None for everything else, whose metadata has no actor."""

    @classmethod
    def of(cls, delivery: Delivery, *, actor: str | None = None) -> Cause:
        return cls(delivery.message_id or delivery.correlation_id, delivery.user_id, actor)


@dataclass(frozen=True, slots=True)
class Applied:
    state: TaskState
    """The state the decision was taken on."""
    events: list[DomainEvent]
    """What was appended; [] when there was nothing to do."""
    checkpoint_started: float | None = None
    """perf_counter() when a handler run in place returned a pause."""


@dataclass(frozen=True, slots=True)
class Extension:
    """What the run step of a decision that resumes its task (:data:`RunResumed`) appends instead
    of the decision's events, with when the handler that produced them returned a pause and when
    the resume was decided."""

    events: list[DomainEvent]
    checkpoint_started: float | None
    resumed_at: float | None
    """None when the run in place failed (the decision goes on by resume message)."""
    failed_runs: int = 0
    retry_delay: float = 0.0
    """With ``failed_runs``: the agent's backoff, which the resume message waits in the broker."""


RunResumed = Callable[
    [TaskState, list[DomainEvent], list[NewEvent]], Coroutine[Any, Any, Extension | None]
]
"""The run step of a decision that resumes its task, between deciding and appending, under the
stream's lock: ``run(state, events, made)`` gets the state decided on, the decision's events, and
the same events made ready to append (their ids and metadata, so that the run folds exactly what
will be recorded); it returns what to append instead (the resumed run's outcome joined to the
decision), or None (the decision as it is: a resume message, which any instance takes). It runs
again with every re-decision (a conflict)."""
Decide = Callable[[TaskState], list[DomainEvent]]
Key = Callable[[list[DomainEvent]], str]


@dataclass(frozen=True, slots=True)
class Part:
    """One decision ready to append (``Recorder.part``)."""

    state: TaskState
    """The state it was decided on."""
    events: list[DomainEvent]
    new_events: list[NewEvent]
    messages: list[OutboxMessage]
    context: contextvars.Context | None = None
    """The context of the delivery it answers, when another one's task records it: its spans
    are recorded there (their parent is that delivery's, not the recording one's)."""


def resumes(events: Sequence[DomainEvent]) -> bool:
    """Whether a decision resumes its task (so a handler may run on it)."""
    return bool(events) and isinstance(events[-1], TaskResumed)
