"""The spans of a task's life, from the worker's hooks: a delivery consumed, a handler run,
events appended (docs/observability.md, "OpenTelemetry spans").

Each hook is a no-op that costs one check while tracing is off (``provider.current`` is None).
The step spans (pause, call, reply, resume, outcome) get the ids derived from their task and step
(``waystation.observability.tracing.ids``): the messages an append implies name them in
``traceparent`` before the append commits.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from waystation.events import (
    DomainEvent,
    PendingCall,
    ResultRecorded,
    TaskCancelled,
    TaskCompleted,
    TaskFailed,
    TaskPaused,
    TaskResumed,
    TaskState,
)
from waystation.observability.tracing import provider
from waystation.observability.tracing.ids import (
    call_key,
    end_key,
    parse_traceparent,
    pause_key,
    reply_key,
    resume_key,
    span_hex,
    trace_hex,
)
from waystation.observability.tracing.provider import Tracing

__all__ = ["consuming", "finished_unrecorded", "recorded", "run"]

log = logging.getLogger(__name__)

# ---- what the current delivery and run are (set only when tracing is on) ----------------------


@dataclass(frozen=True, slots=True)
class _Consumed:
    parent: tuple[str, str] | None
    started_ns: int


@dataclass(frozen=True, slots=True)
class _Run:
    task_id: str
    span_id: str
    ended_ns: int


_consumed: contextvars.ContextVar[_Consumed | None] = contextvars.ContextVar(
    "waystation_consumed", default=None
)
_run: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("waystation_run", default=None)

_NULL = contextlib.nullcontext()


# ---- hooks ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _consuming(headers: Mapping[str, Any] | None) -> Iterator[None]:
    consumed = _consumed.set(_Consumed(parse_traceparent(headers), time.time_ns()))
    ran = _run.set(None)
    try:
        yield
    finally:
        _run.reset(ran)
        _consumed.reset(consumed)


def consuming(headers: Mapping[str, Any] | None) -> contextlib.AbstractContextManager[None]:
    """Around the handling of one delivery: its ``traceparent`` is the parent of what it runs."""
    if provider.current is None:
        return _NULL
    return _consuming(headers)


@contextlib.contextmanager
def _running(task_id: str, agent: str, pause: int, trace_id: str | None) -> Iterator[None]:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    impl = provider.current
    assert impl is not None
    trace_id = trace_id or task_id
    parent: tuple[str, str] | None
    if pause > 0:
        parent = (trace_hex(trace_id), span_hex(trace_id, resume_key(task_id, pause)))
    else:
        consumed = _consumed.get()
        parent = consumed.parent if consumed is not None else None
    span = impl.start(
        f"run {agent}",
        trace_id,
        parent,
        attributes={
            "waystation.task_id": task_id,
            "waystation.agent": agent,
            "waystation.pause": pause,
        },
    )
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    except BaseException as error:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        raise
    finally:
        otel_context.detach(token)
        span.end()
        _run.set(_Run(task_id, f"{span.get_span_context().span_id:016x}", time.time_ns()))


def run(
    task_id: str, agent: str, pause: int, trace_id: str | None
) -> contextlib.AbstractContextManager[None]:
    """Around one run of a handler: the ``run`` span, current while the handler runs (so that
    the handler's own spans are its children)."""
    if provider.current is None:
        return _NULL
    return _running(task_id, agent, pause, trace_id)


def recorded(state: TaskState, events: Sequence[DomainEvent]) -> None:
    """The spans of what was just appended to ``state``'s task."""
    impl = provider.current
    if impl is None or not events:
        return
    try:
        _recorded(impl, state, events, time.time_ns())
    except Exception:
        log.exception("tracing: could not record the spans of %s", state.task_id)


def finished_unrecorded(state: TaskState) -> None:
    """A task that completed without calls (nothing recorded, G10): its ``complete`` span."""
    impl = provider.current
    if impl is None:
        return
    try:
        _recorded(impl, state, [TaskCompleted(result=None)], time.time_ns())
    except Exception:
        log.exception("tracing: could not record the completion of %s", state.task_id)


def _recorded(impl: Tracing, state: TaskState, events: Sequence[DomainEvent], now: int) -> None:
    task_id, agent = state.task_id, state.agent or "?"
    trace_id = state.trace_id or task_id
    trace_x = trace_hex(trace_id)
    consumed = _consumed.get()
    started = consumed.started_ns if consumed is not None else now
    delivered = consumed.parent if consumed is not None else None
    ran = _run.get()
    run_parent = (trace_x, ran.span_id) if ran is not None and ran.task_id == task_id else None
    after_run = ran.ended_ns if run_parent is not None and ran is not None else started
    last_reply: str | None = None
    attributes = {"waystation.task_id": task_id, "waystation.agent": agent}
    waits = {wait.subtask_id: wait for wait in state.calls}
    for event in events:
        if isinstance(event, TaskPaused):
            waits.update((wait.subtask_id, wait) for wait in event.calls)
            pause = impl.step(
                f"pause {agent}",
                trace_id,
                run_parent,
                pause_key(task_id, event.pause),
                after_run,
                {**attributes, **_pause_attributes(event)},
            )
            for wait in event.calls:
                name, wait_attributes = _wait_span(wait)
                impl.step(
                    name,
                    trace_id,
                    (trace_x, pause),
                    call_key(wait.subtask_id),
                    after_run,
                    {**attributes, "waystation.subtask_id": wait.subtask_id, **wait_attributes},
                )
        elif isinstance(event, ResultRecorded):
            called = span_hex(trace_id, call_key(event.subtask_id))
            wait = waits.get(event.subtask_id)
            kind = wait.kind if wait is not None else "call"
            # a reply or a signal names its sender's span; a deadline or a timer has no sender
            parent = delivered if event.outcome != "timeout" and kind != "timer" else None
            last_reply = impl.step(
                _result_span(kind, event.outcome),
                trace_id,
                parent if parent is not None and parent[0] == trace_x else (trace_x, called),
                reply_key(event.subtask_id),
                started,
                {
                    **attributes,
                    "waystation.subtask_id": event.subtask_id,
                    "waystation.outcome": event.outcome,
                },
                links=[called],
                error=event.outcome != "ok",
            )
        elif isinstance(event, TaskResumed):
            paused = span_hex(trace_id, pause_key(task_id, event.pause))
            impl.step(
                f"resume {agent}",
                trace_id,
                (trace_x, last_reply or paused),
                resume_key(task_id, event.pause),
                started,
                {
                    **attributes,
                    "waystation.pause": event.pause,
                    **({"waystation.abandoned": len(event.abandoned)} if event.abandoned else {}),
                },
                links=[paused],
            )
        elif isinstance(event, (TaskCompleted, TaskFailed, TaskCancelled)):
            name = {TaskCompleted: "complete", TaskFailed: "fail", TaskCancelled: "cancel"}[
                type(event)
            ]
            impl.step(
                f"{name} {agent}",
                trace_id,
                run_parent or delivered,
                end_key(task_id),
                after_run if run_parent is not None else started,
                attributes,
                error=not isinstance(event, TaskCompleted),
            )


def _pause_attributes(event: TaskPaused) -> dict[str, Any]:
    """A pause's span attributes: its number, its peer calls and, when it has others or a
    ``FirstK``, its waits and how many of them resume it."""
    calls = sum(1 for wait in event.calls if wait.kind == "call")
    found: dict[str, Any] = {"waystation.pause": event.pause, "waystation.calls": calls}
    if calls != len(event.calls):
        found["waystation.waits"] = len(event.calls)
    if event.until is not None:
        found["waystation.first_k"] = event.until
    return found


def _wait_span(wait: PendingCall) -> tuple[str, dict[str, Any]]:
    """The name and attributes of a wait's span: a peer call is ``call <peer>``; a timer or a
    signal waits for no peer, and says what it waits for instead."""
    if wait.kind == "call":
        return f"call {wait.agent}", {"waystation.peer": wait.agent}
    if wait.kind == "timer":
        return "wait timer", {"waystation.wait": "timer"}
    return f"wait signal {wait.name}", {"waystation.wait": "signal", "waystation.signal": wait.name}


def _result_span(kind: str, outcome: str) -> str:
    """The name of the span of a wait's result: ``reply <outcome>`` for a call's,
    ``timer fired`` when a timer is due, ``signal <ok|timeout>`` for a signal's."""
    if kind == "timer":
        return "timer fired"
    if kind == "signal":
        return f"signal {outcome}"
    return f"reply {outcome}"
