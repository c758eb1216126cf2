"""What every flow uses: the worker's parts, running an agent's handler, and giving up on it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from events import (
    Complete,
    InvalidTransition,
    Outcome,
    Pause,
    TaskStarted,
    TaskState,
    decide_failure,
)
from events.codec import dumps, loads

from ..agent import AgentSpec, App, TaskContext
from ..broker import Broker, Delivery
from ..faults import FaultPlan
from ..observer import Observer
from ..recorder import Cause, Recorder
from ..settings import Settings
from ..settle import Settled, attempt_of, dead, requeue
from ..wire import Names

__all__ = ["Flows", "copy_json", "error_of", "resume_context"]

log = logging.getLogger(__name__)


def copy_json(value: Any) -> Any:
    return loads(dumps(value))


def error_of(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error)[:2000]}


def resume_context(spec: AgentSpec, state: TaskState) -> TaskContext:
    """What the handler of a resumed task sees: its input, saved state and the pause's results."""
    return TaskContext(
        task_id=state.task_id,
        agent=spec.name,
        input=copy_json(state.input),
        # a private copy: mutating it persists nothing and cannot disturb the delta
        state=MappingProxyType(copy_json(dict(state.state))),
        pause=state.pause,
        results=tuple(state.results_of_pause()),
        trace_id=state.trace_id,
        root_task_id=state.root_id,
    )


@dataclass(frozen=True, slots=True)
class Flows:
    """The parts of one worker its flows work with."""

    app: App
    settings: Settings
    names: Names
    broker: Broker
    recorder: Recorder
    observer: Observer
    clock: Callable[[], float]
    faults: FaultPlan

    def default_timeout(self, spec: AgentSpec) -> float:
        return spec.default_timeout or self.settings.default_call_timeout

    async def run_handler(self, spec: AgentSpec, context: TaskContext) -> Outcome:
        outcome = await spec.handler(context)
        if not isinstance(outcome, (Complete, Pause)):
            raise InvalidTransition(
                f"handler {spec.name!r} returned {type(outcome).__name__}, not Complete or Pause"
            )
        return outcome

    async def handler_failed(
        self,
        delivery: Delivery,
        state: TaskState,
        error: Exception,
        *,
        start: TaskStarted | None = None,
    ) -> Settled:
        """Retry by redelivery, or, on the last attempt (or for an invalid outcome), record the
        failure, answer the publisher with an error (through the outbox) and dead-letter."""
        attempt = attempt_of(delivery)
        limit = self.settings.delivery_limit
        permanent = isinstance(error, InvalidTransition)
        if not permanent and attempt < limit:
            log.warning(
                "task %s: handler raised %s (attempt %d of %d); retrying",
                state.task_id,
                error_of(error),
                attempt,
                limit,
            )
            self.observer.count("handler_retries")
            await asyncio.sleep(min(0.2 * 2 ** (attempt - 1), 5.0))
            return requeue()
        failure = error_of(error)
        log.error(
            "task %s failed for good after %d attempt(s): %s", state.task_id, attempt, failure
        )
        self.observer.count("tasks_failed")
        applied = await self.recorder.append_decision(
            state.task_id,
            lambda current: decide_failure(current, failure, start=start),
            key=lambda _: "failed",
            cause=Cause.of(delivery),
            step="failure",
            describe_new=lambda _: state,
        )
        detail = f"{failure['type']}: {failure['message']}"
        # the error result goes out through the outbox with TaskFailed; tell directly otherwise
        return dead("handler-failed", detail, tell_publisher=not applied.events)
