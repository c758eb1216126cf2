"""What every flow uses: the worker's parts, running an agent's handler, and giving up on it."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ValidationError

from waystation.agent import AgentSpec, App, CallNext, HandlerFailure, Interceptor, TaskContext
from waystation.brokers.port import Broker, Delivery
from waystation.events import (
    Call,
    Complete,
    DomainEvent,
    InvalidTransition,
    Outcome,
    Pause,
    Signal,
    TaskStarted,
    TaskState,
    decide_failure,
    decide_outcome,
)
from waystation.events.codec import dumps, loads
from waystation.observability import tracing
from waystation.observability.observer import Observer
from waystation.policies import Backoff, Permanent, TimeLimitExceeded
from waystation.protocol.wire import Names, ResultEnvelope, result_message
from waystation.runtime.faults import FaultPlan
from waystation.runtime.limits import UNLIMITED, Admission, PoolLimits
from waystation.runtime.publishing import PublishStep
from waystation.runtime.recorder import Cause, Recorder
from waystation.runtime.settle import Settler
from waystation.runtime.verdicts import (
    Verdict,
    attempt_of,
    crash_limit,
    dead,
    retry,
    wait,
    waits_of,
)
from waystation.settings import Settings

__all__ = [
    "DeliveryLimitReached",
    "Steps",
    "copy_json",
    "error_of",
    "invalid_fields",
    "resume_context",
    "typed_input",
]

log = logging.getLogger(__name__)

ENVELOPE_ROOM = 1024
"""Bytes of a message that a result or call input leaves to the rest of its body."""


def copy_json(value: Any) -> Any:
    return loads(dumps(value))


class DeliveryLimitReached(Exception):
    """The message was delivered more times than the delivery limit allows without being
    settled: its runs failed, or its workers died holding it (a poison message)."""


def error_of(error: BaseException) -> dict[str, str]:
    # what an exception says is not ours to trust: a NUL would make the failure unstorable too
    message = str(error)[:2000].replace("\x00", "\\u0000")
    return {"type": type(error).__name__, "message": message}


def invalid_fields(error: ValidationError) -> str:
    """What pydantic found wrong, one ``field: why`` per problem (the field as a dotted path)."""
    problems = []
    for problem in error.errors(include_url=False):
        where = ".".join(str(part) for part in problem["loc"]) or "(the whole value)"
        problems.append(f"{where}: {problem['msg']}")
    return "; ".join(problems)


def typed_input(spec: AgentSpec, raw: Any) -> Any:
    """The input as the handler sees it: an instance of the agent's input model when it declares
    one (raises pydantic's ``ValidationError`` when the input does not fit), else the JSON."""
    if spec.input_model is None:
        return raw
    return spec.input_model.model_validate(raw)


def _as_json(spec: AgentSpec, outcome: Outcome) -> Outcome:
    """``outcome`` with its models in their JSON form: a result checked against the agent's
    result model, call inputs given as models. A result that does not fit can never become
    valid by retrying: an ``InvalidTransition``."""
    if isinstance(outcome, Pause):
        if not any(
            isinstance(call, Signal) or isinstance(getattr(call, "input", None), BaseModel)
            for call in outcome.calls
        ):
            return outcome
        calls = [
            _signal_with_schema(spec, call)
            if isinstance(call, Signal)
            else replace(call, input=call.input.model_dump(mode="json"))
            if isinstance(call, Call) and isinstance(call.input, BaseModel)
            else call
            for call in outcome.calls
        ]
        return replace(outcome, calls=calls)
    value = outcome.result
    model = spec.result_model
    if model is not None and not isinstance(value, model):
        try:
            value = model.model_validate(value)
        except ValidationError as error:
            raise InvalidTransition(
                f"handler {spec.name!r} returned a result that is not a valid "
                f"{model.__name__}: {invalid_fields(error)}"
            ) from error
    if isinstance(value, BaseModel):
        return Complete(value.model_dump(mode="json"))
    return outcome


def _signal_with_schema(spec: AgentSpec, signal: Signal) -> Signal:
    """``signal`` with the JSON Schema of the model its agent declares for it (``signals=``),
    which every worker checks a signal against. A model given on the ``Signal`` alone could only
    be checked by the worker that paused, so it must be the declared one."""
    declared = spec.signals.get(signal.name) if isinstance(signal.name, str) else None
    given = signal.schema
    if isinstance(given, type) and issubclass(given, BaseModel) and given is not declared:
        raise InvalidTransition(
            f"Signal({signal.name!r}, schema={given.__name__}): declare it on the agent, "
            f"@app.agent({spec.name!r}, signals={{{signal.name!r}: {given.__name__}}}), so "
            "that every worker can check the signals sent to it"
        )
    if declared is None:
        return signal
    return replace(signal, schema=declared.model_json_schema())


def _through(interceptor: Interceptor, call_next: CallNext, task: TaskContext) -> Any:
    """One link of the interceptors' chain (``Steps._intercepted``)."""
    return interceptor.run(task, call_next)


def resume_context(spec: AgentSpec, state: TaskState) -> TaskContext:
    """What the handler of a resumed task sees: its input, saved state and the pause's results.

    A task that paused under another version of its agent's code than this worker's is logged,
    with both (docs/agents.md#versions): its state and results must still read right."""
    if state.agent_version != spec.version:
        log.warning(
            "task %s paused under version %s of agent %r resumes under version %s",
            state.task_id,
            state.agent_version or "(none declared)",
            spec.name,
            spec.version or "(none declared)",
            extra={"paused_version": state.agent_version, "version": spec.version},
        )
    return TaskContext(
        task_id=state.task_id,
        agent=spec.name,
        input=typed_input(spec, copy_json(state.input)),
        # a private copy: mutating it persists nothing and cannot disturb the delta
        state=MappingProxyType(copy_json(dict(state.state))),
        pause=state.pause,
        results=tuple(state.results_of_pause()),
        trace_id=state.trace_id,
        root_task_id=state.root_id,
    )


@dataclass(frozen=True, slots=True)
class Steps:
    """The steps every flow is made of, with the parts of the worker they use: admitting a run
    (``admit``), running the handler (``run_handler``), deciding its outcome
    (``decide_outcome``), recording through the ``recorder``, answering and failing a task
    (``handler_failed``); what becomes of the delivery is the flow's :class:`Verdict`."""

    app: App
    settings: Settings
    names: Names
    broker: Broker
    recorder: Recorder
    observer: Observer
    clock: Callable[[], float]
    faults: FaultPlan
    settler: Settler
    publishing: PublishStep
    """Sends what an append committed (the delivery loop, the relay's undeliverable rows)."""
    threads: Executor | None = None
    """Where plain ``def`` handlers run (None: the event loop's default executor)."""
    limits: PoolLimits | None = None
    """The pool's limits, when an agent of the app declares one (``waystation.runtime.limits``)."""
    interceptors: tuple[Interceptor, ...] = ()
    """What wraps every handler run, outermost first (the app's, then the worker's own)."""

    def default_timeout(self, spec: AgentSpec) -> float:
        return spec.default_timeout or self.settings.default_call_timeout

    def decide_outcome(
        self, state: TaskState, outcome: Outcome, spec: AgentSpec, **options: Any
    ) -> list[DomainEvent]:
        """``waystation.events.task.decide_outcome`` within this pool's settings and ``spec``'s
        default timeout (``options``: the rest of its arguments)."""
        return decide_outcome(
            state,
            outcome,
            now=self.clock(),
            default_timeout=self.default_timeout(spec),
            max_timeout=self.settings.max_call_duration,
            max_state_bytes=self.settings.max_state_bytes,
            max_value_bytes=self.max_value_bytes,
            agent_version=spec.version,
            **options,
        )

    @property
    def max_value_bytes(self) -> int:
        """The largest result or call input (as JSON) a message can carry: the message limit
        less room for the envelope and the properties around it."""
        return max(1, self.settings.max_message_bytes - ENVELOPE_ROOM)

    async def _invoke(self, spec: AgentSpec, context: TaskContext) -> Any:
        """One run of the handler: a plain one in the thread pool (a time limit frees the
        worker from waiting for it, but its thread runs on to its end), an async one here."""
        if spec.blocking:
            return await self._run_in_thread(spec, context)
        return await spec.handler(context)  # type: ignore[misc]

    async def _intercepted(self, spec: AgentSpec, context: TaskContext) -> Any:
        """One run of the handler through the interceptors, the first outermost: each gets the
        rest of the chain as its ``call_next``, and the last one's is ``_invoke``."""

        async def handler(task: TaskContext) -> Any:
            return await self._invoke(spec, task)

        call: CallNext = handler
        for interceptor in reversed(self.interceptors):
            call = functools.partial(_through, interceptor, call)
        return await call(context)

    async def admit(self, spec: AgentSpec, delivery: Delivery, task_id: str) -> Admission | Verdict:
        """The slots of a run of ``task_id`` when its agent has pool limits
        (``waystation.runtime.limits``); when one is full, what becomes of ``delivery`` instead: it
        waits in the broker, its attempts untouched. An agent without limits is admitted at once,
        and so is a delivery out of attempts (it fails without running)."""
        if self.limits is None or not spec.limited or self.out_of_attempts(delivery):
            return UNLIMITED
        found = await self.limits.admit(spec, task_id, waits_of(delivery))
        if isinstance(found, Admission):
            return found
        log.info(
            "task %s waits %.2fs in the broker: %s's %s is full",
            task_id,
            found.seconds,
            spec.name,
            found.limit,
        )
        self.observer.waited(spec.name, found.limit)
        return wait(attempt_of(delivery) - 1, found.seconds)

    async def run_handler(
        self, spec: AgentSpec, context: TaskContext, admission: Admission = UNLIMITED
    ) -> Outcome:
        """One run of ``spec``'s handler within its time limit; the slots of ``admission`` are
        given back when it ends, however it ends. The interceptors, if any, wrap the run inside
        its span and its time limit; what they return or raise is the run's."""
        # without interceptors the handler is called as it is, nothing added to the run
        invoke = self._intercepted if self.interceptors else self._invoke
        try:
            with tracing.run(context.task_id, spec.name, context.pause, context.trace_id):
                if spec.time_limit is None:
                    outcome = await invoke(spec, context)
                else:
                    try:
                        async with asyncio.timeout(spec.time_limit) as limit:
                            outcome = await invoke(spec, context)
                    except TimeoutError:
                        if not limit.expired():
                            raise  # the handler's own timeout, not its time limit
                        raise TimeLimitExceeded(
                            f"the run took longer than {spec.name!r}'s time_limit of "
                            f"{spec.time_limit:g}s"
                        ) from None
        finally:
            if admission.runs and self.limits is not None:
                await self.limits.release(admission)
        if not isinstance(outcome, (Complete, Pause)):
            raise InvalidTransition(
                f"handler {spec.name!r} returned {type(outcome).__name__}, not Complete or Pause"
            )
        return _as_json(spec, outcome)

    async def _run_in_thread(self, spec: AgentSpec, context: TaskContext) -> Any:
        """Run a plain ``def`` handler in the thread pool, with this task's log context. A thread
        cannot be cancelled: a run given up on (at shutdown) finishes in its thread, unheard."""
        run = functools.partial(contextvars.copy_context().run, spec.handler, context)
        outcome = await asyncio.get_running_loop().run_in_executor(self.threads, run)
        if inspect.isawaitable(outcome):
            # a plain function that returns a coroutine (a lambda around one) is async after all
            outcome = await outcome
        return outcome

    def out_of_attempts(self, delivery: Delivery) -> DeliveryLimitReached | None:
        """Why ``delivery`` must not be handled again, if it must not: its workers kept dying
        while they held it (a poison message). A death is weaker evidence against a message
        than its handler raising, and a task that calls no peers may have answered before its
        worker died, so deaths get twice the delivery limit (``crash_limit``)."""
        returns = delivery.broker_count
        limit = crash_limit(self.settings.delivery_limit)
        if returns <= limit:
            return None
        return DeliveryLimitReached(
            f"taken back unsettled {returns} times (its workers died holding it), "
            f"more than the {limit} allowed"
        )

    async def handler_failed(
        self,
        delivery: Delivery,
        state: TaskState,
        error: Exception,
        *,
        start: TaskStarted | None = None,
        spec: AgentSpec | None = None,
    ) -> Verdict:
        """Retry (a copy counting this failed run goes back to the queue, after the agent's
        backoff, waiting in the broker), or, on the last attempt (or for an error that trying
        again cannot help: ``Permanent``, an outcome that can never be recorded), record the
        failure, answer the publisher with an error (through the outbox) and dead-letter. Either
        way the failed run is told to the observer once (logged with its traceback)."""
        attempt = attempt_of(delivery)
        if spec is None and state.agent is not None:
            spec = self.app.agents.get(state.agent)
        limit = (
            spec.attempts(self.settings.delivery_limit)
            if spec is not None
            else self.settings.delivery_limit
        )
        permanent = isinstance(error, (InvalidTransition, DeliveryLimitReached, Permanent))
        again = not permanent and attempt < limit
        delay = (spec.backoff if spec is not None else Backoff()).delay(attempt) if again else None
        self.observer.on_failure(
            HandlerFailure(
                task_id=state.task_id,
                agent=state.agent or (spec.name if spec is not None else "?"),
                attempt=attempt,
                attempts=limit,
                will_retry=again,
                error=error,
                pause=state.pause,
                retry_in=delay,
            )
        )
        if delay is not None:
            self.observer.count("handler_retries")
            return retry(attempt, delay)
        failure = error_of(error)
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
        if not applied.events:
            # finished before (a retry of a failure already recorded, or a cancel): what the
            # log holds is the answer, and its outbox already carried it
            await self.answer_cancelled_before_start(delivery, applied.state)
        return dead("handler-failed", detail)

    async def answer_cancelled_before_start(self, delivery: Delivery, state: TaskState) -> None:
        """A task cancelled before its first run was recorded has a stream holding only the
        cancellation, which knows nothing of its publisher: only its own message does. Tell it."""
        if state.status == "cancelled" and state.agent is None and delivery.reply_to:
            envelope = ResultEnvelope("cancelled", error=state.error, task_id=state.task_id)
            await self.settler.answer_or_keep(
                result_message(state.task_id, delivery.reply_to, delivery.correlation_id, envelope)
            )
