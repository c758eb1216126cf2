"""The handler API: an :class:`App` registers agents, each an async handler of one task.

A handler receives a :class:`TaskContext` and returns :class:`~events.Complete` or
:class:`~events.Pause`::

    app = App()

    @app.agent("orchestrator")
    async def orchestrator(task: TaskContext) -> Outcome:
        if not task.resumed:                     # first run
            calls = [Call("researcher", {"x": x}) for x in task.input["xs"]]
            return Pause(calls, update={"started": True})
        return Complete(sum(r.value["answer"] for r in task.results))

A plain ``def`` handler (blocking code: a synchronous SDK, ``requests``, file work) is run in the
worker's thread pool, so that it stalls neither the event loop nor the broker's heartbeats.

An agent may declare pydantic models for its input and its result
(``@app.agent("quote", input=QuoteRequest, result=Quote)``): the input is validated before the
handler runs (an invalid one is dead-lettered as ``invalid-input`` and its publisher told which
field is wrong), ``task.input`` is then an instance of the input model, and a returned result is
validated against the result model and sent as ``model_dump(mode="json")``.

On a resume the handler gets its state back exactly as it was saved and the results of the pause
it is resuming from, in call order. A handler may pause any number of times; ``task.pause`` says
which pause it is resuming from (0 on the first run). Handlers never ack or publish anything
themselves: the runtime records the outcome first and settles the message after.

An :class:`Interceptor` wraps every run of every handler of an app (``App(interceptors=[...])``):
what it returns or raises is what the run returned or raised. It sees the task, never the
message, the log or the settlement.

A :class:`TaskObserver` is told of every failed run of a handler (``App(observers=[...])``):
its ``on_failure`` gets a :class:`HandlerFailure` (the task, the agent, the attempt, whether it
will be retried, and the exception with its traceback), to send on to Sentry or the like.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from waystation.events import CallResult, Outcome
from waystation.policies import (
    Backoff,
    PolicyError,
    Rate,
    as_rate,
    check_concurrency,
    check_keep_results,
    check_retries,
    check_time_limit,
)

__all__ = [
    "AgentSpec",
    "App",
    "BlockingHandler",
    "CallNext",
    "Handler",
    "HandlerFailure",
    "Interceptor",
    "TaskContext",
    "TaskObserver",
]

AGENT_NAME = re.compile(r"[A-Za-z0-9_.:@#,/+-]+")
"""What an agent's name may hold: what AMQP allows in the name of its queue (pamqp's check),
without the space, caught where the agent is declared rather than when its queue is."""


@dataclass(frozen=True, slots=True)
class TaskContext:
    """What a handler knows about the task it runs."""

    task_id: str
    agent: str
    input: Any
    """The task's JSON input; an instance of the agent's input model when it declares one."""
    state: Mapping[str, Any] = field(default_factory=dict)
    """The state saved by earlier pauses. Read-only: change it with ``Pause(update=…)``."""
    pause: int = 0
    """The pause this run resumes from; 0 on the first run."""
    results: Sequence[CallResult] = ()
    """The results of that pause's calls, in call order."""
    trace_id: str | None = None
    root_task_id: str | None = None

    @property
    def resumed(self) -> bool:
        return self.pause > 0


Handler = Callable[[TaskContext], Awaitable[Outcome]]
BlockingHandler = Callable[[TaskContext], Outcome]
"""A plain ``def`` handler: run in the worker's thread pool."""
AnyHandler = TypeVar("AnyHandler", bound=Callable[[TaskContext], Any])
CallNext = Callable[[TaskContext], Awaitable[Outcome]]
"""The rest of the chain: the interceptors after this one, then the handler."""


class Interceptor(Protocol):
    """Wraps every run of a handler: a first run, a retry, a resumed run (by message or in place).

    ``run`` gets the task and ``call_next``, the rest of the chain (the next interceptor, finally
    the handler); it may observe, time, add log context or a span, change the context it passes
    on, translate an exception, or return an outcome without calling ``call_next`` (the handler
    then does not run). What it returns or raises is taken as the handler's own: a raise is a
    failed attempt under the agent's ``retries`` and ``backoff`` (``Permanent``: no retry), a
    returned value must be a ``Complete`` or ``Pause`` that fits the agent's result model, and
    the agent's ``time_limit`` bounds the whole chain. It runs on the event loop, also around a
    plain ``def`` handler's thread, inside the run's span and after its pool slots are taken.
    It never sees the message, the log or the settlement: the outcome is recorded, then the
    message settled, after the chain returns (G1).

    Declared on the app, ``App(interceptors=[...])`` (a ``Worker`` may add its own after them);
    the first listed is the outermost. Subclassing is optional: any object with such a ``run``
    coroutine method is one."""

    async def run(self, task: TaskContext, call_next: CallNext) -> Outcome:
        return await call_next(task)


@dataclass(frozen=True, slots=True)
class HandlerFailure:
    """A run of a handler that raised (or that an interceptor, or its time limit, made fail)."""

    task_id: str
    agent: str
    attempt: int
    """Which run of the handler this was, from 1 (a resumed task counts its resumed runs anew)."""
    attempts: int
    """The most runs the agent's policy allows: the first and its ``retries``."""
    will_retry: bool
    """Whether the task is tried again; False when it fails with this error: the last attempt,
    a ``Permanent`` error, or an outcome that can never be recorded."""
    error: BaseException
    """What was raised, with its ``__traceback__``."""
    pause: int = 0
    """The pause the run resumed from; 0 on the first run."""
    retry_in: float | None = None
    """Seconds the next attempt waits (the agent's backoff), when there is one."""


class TaskObserver(Protocol):
    """Told what happens to tasks, beside the worker's own logs and metrics.

    ``on_failure`` is called once per failed run of a handler: a first run, a retry, a resumed
    run (by message or in place), before the task is retried or failed. It is a plain method,
    called on the event loop: keep it quick and hand slow work to a thread or a task of your
    own (Sentry's ``capture_exception`` only queues the event). What it raises is logged and
    ignored: an observer never changes what becomes of the task. Declared on the app,
    ``App(observers=[...])`` (a ``Worker`` may add its own after them). Subclassing is optional:
    any object with such an ``on_failure`` is one."""

    def on_failure(self, failure: HandlerFailure) -> None:
        return None


@dataclass(frozen=True, slots=True)
class AgentSpec:
    name: str
    handler: Handler | BlockingHandler
    default_timeout: float | None = None
    """Deadline of this agent's calls when a call sets none (else the global default)."""
    blocking: bool = False
    """The handler is a plain function, run in the worker's thread pool."""
    input_model: type[BaseModel] | None = None
    """What the input must be; the handler gets an instance of it as ``task.input``."""
    result_model: type[BaseModel] | None = None
    """What the result must be; it is sent as the model's JSON form."""
    retries: int | None = None
    """Runs after the first when the handler raises (None: ``WAYSTATION_DELIVERY_LIMIT`` - 1)."""
    backoff: Backoff = field(default_factory=Backoff)
    """The wait before each retry, spent in the broker (``waystation.policies``)."""
    time_limit: float | None = None
    """Seconds one run may take; a longer run is cancelled and counts as a failed attempt."""
    concurrency: int | None = None
    """Most runs of the handler at once across the pool (None: no limit;
    ``waystation.runtime.limits``)."""
    rate: Rate | None = None
    """Most starts of a run per period across the pool (None: no limit;
    ``waystation.runtime.limits``)."""
    keep_results: bool = False
    """Record every outcome in the log, also of a task that calls no peers (G10's exception, as
    ``WAYSTATION_AUDIT_ALL_TASKS`` for this agent alone), so that it can be asked for later."""
    signals: Mapping[str, type[BaseModel]] = field(default_factory=dict)
    """The model of each signal the agent's tasks wait for, by name: a signal whose payload
    does not fit is refused (the field named) and the wait goes on."""
    version: str | None = None
    """The version of the agent's code, recorded on each pause (the agent's own, else the
    app's)."""

    @property
    def limited(self) -> bool:
        """Whether a run must take a slot of the pool first (``concurrency`` or ``rate``)."""
        return self.concurrency is not None or self.rate is not None

    def attempts(self, delivery_limit: int) -> int:
        """Runs of the handler in all: the first and its retries."""
        return (delivery_limit - 1 if self.retries is None else self.retries) + 1

    def policy(self, delivery_limit: int) -> dict[str, Any]:
        """The agent's policies as ``waystation agents --json`` shows them."""
        return {
            "agent": self.name,
            "retries": self.attempts(delivery_limit) - 1,
            "backoff": self.backoff.to_json(),
            "time_limit": self.time_limit,
            "concurrency": self.concurrency,
            "rate": self.rate.to_json() if self.rate is not None else None,
            "default_call_timeout": self.default_timeout,
            "keep_results": self.keep_results,
            "signals": sorted(self.signals),
            "version": self.version,
        }


class App:
    """A registry of agents; a worker serves every agent of its app."""

    def __init__(
        self,
        *,
        interceptors: Sequence[Interceptor] = (),
        observers: Sequence[TaskObserver] = (),
        version: str | None = None,
    ) -> None:
        """``version``: the version of the app's code, recorded on each pause of an agent that
        declares none of its own (its release, a git commit): see docs/agents.md#versions."""
        self._version = _checked_version(version, "the app")
        self._agents: dict[str, AgentSpec] = {}
        self._interceptors = checked_interceptors(interceptors)
        self._observers = checked_observers(observers)

    def agent(
        self,
        name: str,
        *,
        default_timeout: float | None = None,
        input: type[BaseModel] | None = None,
        result: type[BaseModel] | None = None,
        retries: int | None = None,
        backoff: Backoff | None = None,
        time_limit: float | None = None,
        concurrency: int | None = None,
        rate: Rate | str | None = None,
        keep_results: bool = False,
        signals: Mapping[str, type[BaseModel]] | None = None,
        version: str | None = None,
    ) -> Callable[[AnyHandler], AnyHandler]:
        """Register the decorated function as the handler of agent ``name``: a coroutine
        function, or a plain function (run in the worker's thread pool). ``input`` and
        ``result`` are the pydantic models of its input and result, if it declares them. Its
        policies (``waystation.policies``): ``retries`` after a raising run (default: the delivery
        limit's), the ``backoff`` between them, a ``time_limit`` per run, and across the pool the
        most runs at once (``concurrency``) and starts per period (``rate``: a
        :class:`~waystation.policies.Rate` or ``"10/s"``); none by default. ``keep_results``
        records every outcome in the log, so that it can be asked for later (by default a task
        that calls no peers records nothing, G10). A policy that cannot work raises
        :class:`~waystation.policies.PolicyError` here, at import time.

        ``signals`` maps the name of each signal its tasks wait for (``Signal(name)``) to the
        pydantic model its payload must fit: every worker checks a signal against it before a
        wait takes it. ``version``: the version of this agent's code, recorded on each pause
        (the app's when None)."""
        if not AGENT_NAME.fullmatch(name):
            raise ValueError(
                f"agent names are letters, digits and -_.:@#,/+ (no spaces; AMQP allows no more "
                f"in the name of the agent's queue): {name!r}"
            )
        for role, model in (("input", input), ("result", result)):
            if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise TypeError(f"agent {name!r}: {role}= takes a pydantic model, not {model!r}")
        check_retries(retries)
        check_time_limit(time_limit)
        check_concurrency(concurrency)
        check_keep_results(keep_results)
        signal_models = _checked_signals(name, signals)
        agent_version = _checked_version(version, f"agent {name!r}") or self._version
        pool_rate = as_rate(rate)
        if backoff is not None and not isinstance(backoff, Backoff):
            raise PolicyError(f"backoff must be a workers.Backoff, not {backoff!r}")

        def register(handler: AnyHandler) -> AnyHandler:
            if name in self._agents:
                raise ValueError(f"agent {name!r} is already registered")
            self._agents[name] = AgentSpec(
                name,
                handler,
                default_timeout,
                blocking=not _is_async(handler),
                input_model=input,
                result_model=result,
                retries=retries,
                backoff=backoff or Backoff(),
                time_limit=time_limit,
                concurrency=concurrency,
                rate=pool_rate,
                keep_results=keep_results,
                signals=signal_models,
                version=agent_version,
            )
            return handler

        return register

    @property
    def agents(self) -> Mapping[str, AgentSpec]:
        return dict(self._agents)

    def __getitem__(self, name: str) -> AgentSpec:
        return self._agents[name]

    @property
    def interceptors(self) -> tuple[Interceptor, ...]:
        """What wraps every run of the app's handlers, outermost first."""
        return self._interceptors

    @property
    def observers(self) -> tuple[TaskObserver, ...]:
        """What is told of every failed run of the app's handlers, in order."""
        return self._observers


def _checked_signals(
    agent: str, signals: Mapping[str, type[BaseModel]] | None
) -> Mapping[str, type[BaseModel]]:
    if signals is None:
        return {}
    if not isinstance(signals, Mapping):
        raise TypeError(f"agent {agent!r}: signals= maps signal names to pydantic models")
    for name, model in signals.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"agent {agent!r}: a signal's name is a non-empty string: {name!r}")
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(
                f"agent {agent!r}: signals[{name!r}] takes a pydantic model, not {model!r}"
            )
    return MappingProxyType(dict(signals))


def _checked_version(version: str | None, whose: str) -> str | None:
    if version is not None and (not isinstance(version, str) or not version.strip()):
        raise TypeError(f"{whose}: version= takes a non-empty string, not {version!r}")
    return version


def checked_interceptors(interceptors: Sequence[Interceptor]) -> tuple[Interceptor, ...]:
    """``interceptors`` as a tuple, each checked to have an ``async def run`` (a ``TypeError``
    at import time, not at the first run)."""
    if isinstance(interceptors, (str, bytes)) or not isinstance(interceptors, Sequence):
        raise TypeError(f"interceptors= takes a list of interceptors, not {interceptors!r}")
    for interceptor in interceptors:
        if isinstance(interceptor, type):
            raise TypeError(f"interceptors= takes instances, not the class {interceptor.__name__}")
        if not inspect.iscoroutinefunction(getattr(interceptor, "run", None)):
            raise TypeError(
                f"an interceptor has a coroutine method run(task, call_next): {interceptor!r}"
            )
    return tuple(interceptors)


def checked_observers(observers: Sequence[TaskObserver]) -> tuple[TaskObserver, ...]:
    """``observers`` as a tuple, each checked to have a plain ``on_failure`` method (a
    ``TypeError`` at import time, not at the first failure)."""
    if isinstance(observers, (str, bytes)) or not isinstance(observers, Sequence):
        raise TypeError(f"observers= takes a list of observers, not {observers!r}")
    for observer in observers:
        if isinstance(observer, type):
            raise TypeError(f"observers= takes instances, not the class {observer.__name__}")
        on_failure = getattr(observer, "on_failure", None)
        if not callable(on_failure) or _is_async(on_failure):
            raise TypeError(
                "an observer has a plain (not async) method on_failure(failure); hand slow "
                f"work to a thread or a task of your own: {observer!r}"
            )
    return tuple(observers)


def _is_async(handler: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004
    )
