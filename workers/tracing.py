"""OpenTelemetry spans of a task's life (the optional ``waystation[otel]`` extra).

Every hook of the worker into OpenTelemetry is here. With the extra missing, or tracing not turned
on (``OTEL_TRACES_EXPORTER`` unset or ``none``, or ``OTEL_SDK_DISABLED=true``), each hook is a
no-op that costs one check of a module flag, and the worker never imports OpenTelemetry.

The spans of one task (docs/observability.md, "OpenTelemetry spans"):

* ``run <agent>``: each run of the handler (first run, resumed run, retry);
* ``pause <agent>``: a recorded pause, child of the run that returned it, with one
  ``call <peer>`` child span per call (the peer's request carries the call span as its parent);
* ``reply <outcome>``: a result recorded for a call, child of the span the reply names as its
  parent (the peer's ``complete`` span), linked to its call span;
* ``resume <agent>``: the pause's last result resumed the task, child of that ``reply`` span,
  linked to the pause; the resumed ``run`` is its child, wherever it runs;
* ``complete``/``fail``/``cancel <agent>``: the outcome recorded (or, for a task that completed
  without calls, answered), child of the run that produced it.

One trace: the trace id is the task's trace id as Waystation carries it (``x-waystation-trace-id``,
``TaskContext.trace_id``, ``EventMetadata.trace_id``), used as the W3C trace id when it is one (32
hex digits, as taken from a publisher's ``traceparent``) and hashed into one otherwise (a task id,
when the publisher sent no trace): a root task and everything it calls share it. The span ids of
what the log records (pause, call, reply, resume, outcome) are derived from the task and the event,
so the messages an append implies can name their parent span in ``traceparent`` before the append
commits, and any worker names the same span the same way: every message the worker publishes
carries ``traceparent`` (computed whether or not this worker exports spans), and every message it
consumes is read for it.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import functools
import hashlib
import importlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from waystation.events import (
    DomainEvent,
    ResultRecorded,
    TaskCancelled,
    TaskCompleted,
    TaskFailed,
    TaskPaused,
    TaskResumed,
    TaskState,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "HEADER_TRACEPARENT",
    "TEST_SPANS_FILE",
    "active",
    "call_key",
    "configure",
    "consuming",
    "end_key",
    "finished_unrecorded",
    "recorded",
    "reply_key",
    "resume_key",
    "run",
    "shutdown",
    "traceparent",
]

log = logging.getLogger(__name__)

HEADER_TRACEPARENT = "traceparent"
TEST_SPANS_FILE = "WAYSTATION_TEST_SPANS_FILE"
"""With ``OTEL_TRACES_EXPORTER=waystation-test``: where the worker writes its finished spans
(JSON) when it stops. For tests only."""

_HEX32 = re.compile(r"[0-9a-f]{32}")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


# ---- ids: pure functions, used by waystation.protocol.wire whether or not tracing is on
# --------------------


@functools.lru_cache(maxsize=4096)
def trace_hex(trace_id: str) -> str:
    """The W3C trace id (32 hex digits) of a Waystation trace id (cached: every message of a
    call tree asks for the same one)."""
    lowered = trace_id.strip().lower()
    if _HEX32.fullmatch(lowered) and lowered != "0" * 32:
        return lowered
    return hashlib.sha256(trace_id.encode()).hexdigest()[:32]


def span_hex(trace_id: str, key: str) -> str:
    """The span id (16 hex digits) of the recorded step ``key`` of trace ``trace_id``."""
    digest = hashlib.sha256(f"{trace_id}\x00{key}".encode()).hexdigest()[:16]
    return digest if digest != "0" * 16 else "0" * 15 + "1"


def call_key(subtask_id: str) -> str:
    return f"call:{subtask_id}"


def pause_key(task_id: str, pause: int) -> str:
    return f"pause:{task_id}:{pause}"


def reply_key(subtask_id: str) -> str:
    return f"reply:{subtask_id}"


def resume_key(task_id: str, pause: int) -> str:
    return f"resume:{task_id}:{pause}"


def end_key(task_id: str) -> str:
    return f"end:{task_id}"


def traceparent(trace_id: str, key: str) -> str:
    """The ``traceparent`` header of a message whose parent is the step ``key``."""
    return f"00-{trace_hex(trace_id)}-{span_hex(trace_id, key)}-01"


def parse_traceparent(headers: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """(trace id, parent span id) of a message's ``traceparent`` header, if it has a valid one."""
    value = (headers or {}).get(HEADER_TRACEPARENT)
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not isinstance(value, str):
        return None
    match = _TRACEPARENT.match(value.strip().lower())
    if match is None or match.group(1) == "0" * 32 or match.group(2) == "0" * 16:
        return None
    return match.group(1), match.group(2)


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
_next_ids: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "waystation_next_ids", default=None
)
"""(trace id, span id) the next span started gets (0: the SDK's own choice)."""

_NULL = contextlib.nullcontext()


class _Tracing:
    """The live implementation: an SDK tracer provider and how to dump a test's spans."""

    def __init__(self, tracer: Tracer, provider: Any, memory: Any, dump_to: str | None) -> None:
        self.tracer = tracer
        self.provider = provider
        self.memory = memory
        self.dump_to = dump_to
        self.closed = False
        self.lock = threading.Lock()

    def start(
        self,
        name: str,
        trace_id: str,
        parent: tuple[str, str] | None,
        *,
        key: str | None = None,
        start_ns: int | None = None,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[str] = (),
    ) -> Span:
        from opentelemetry import context as otel_context
        from opentelemetry import trace

        trace_x = trace_hex(trace_id)
        if parent is not None and parent[0] == trace_x:
            parent_context = trace.set_span_in_context(
                trace.NonRecordingSpan(_span_context(trace_x, parent[1]))
            )
        else:
            parent_context = otel_context.Context()
        token = _next_ids.set(
            (int(trace_x, 16), int(span_hex(trace_id, key), 16) if key is not None else 0)
        )
        try:
            return self.tracer.start_span(
                name,
                context=parent_context,
                attributes=dict(attributes or {}),
                links=[trace.Link(_span_context(trace_x, link)) for link in links],
                start_time=start_ns,
            )
        finally:
            _next_ids.reset(token)

    def step(
        self,
        name: str,
        trace_id: str,
        parent: tuple[str, str] | None,
        key: str,
        start_ns: int,
        attributes: Mapping[str, Any],
        links: Sequence[str] = (),
        error: bool = False,
    ) -> str:
        """A finished span of a recorded step; returns its span id."""
        from opentelemetry.trace import Status, StatusCode

        span = self.start(
            name,
            trace_id,
            parent,
            key=key,
            start_ns=start_ns,
            attributes=attributes,
            links=links,
        )
        if error:
            span.set_status(Status(StatusCode.ERROR))
        span.end()
        return span_hex(trace_id, key)

    def shutdown(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.provider.shutdown()
        if self.memory is not None and self.dump_to:
            spans = [_span_json(span) for span in self.memory.get_finished_spans()]
            with open(self.dump_to, "w") as file:
                json.dump(spans, file)


def _span_context(trace_x: str, span_x: str) -> Any:
    from opentelemetry.trace import SpanContext, TraceFlags

    return SpanContext(int(trace_x, 16), int(span_x, 16), True, TraceFlags(TraceFlags.SAMPLED))


def _span_json(span: Any) -> dict[str, Any]:
    context = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "links": [f"{link.context.span_id:016x}" for link in span.links],
        "attributes": dict(span.attributes or {}),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "service": span.resource.attributes.get("service.name"),
        "pid": os.getpid(),
    }


_impl: _Tracing | None = None
_configured = False


def active() -> bool:
    return _impl is not None


def configure() -> bool:
    """Turn tracing on when the environment asks for it (``OTEL_TRACES_EXPORTER``) and the
    ``otel`` extra is installed; once per process. True when spans are produced."""
    global _impl, _configured
    if _configured:
        return _impl is not None
    _configured = True
    wanted = [
        name.strip().lower()
        for name in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")
        if name.strip() and name.strip().lower() != "none"
    ]
    disabled = os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    if not wanted or disabled:
        return False
    try:
        _impl = _build(wanted)
    except ImportError as missing:
        log.warning(
            "OTEL_TRACES_EXPORTER=%s but %s: tracing is off; install waystation[otel] (and, "
            "for otlp, opentelemetry-exporter-otlp)",
            ",".join(wanted),
            missing,
        )
        return False
    if _impl is not None:
        atexit.register(shutdown)
        log.info("tracing on: exporting spans to %s", ",".join(wanted))
    return _impl is not None


def _build(wanted: list[str], *, install: bool = True) -> _Tracing | None:
    """A tracer provider exporting to ``wanted``; ``install`` makes it the process's own (so
    that a handler's spans, through ``opentelemetry.trace.get_tracer``, nest in its run)."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class Ids(RandomIdGenerator):
        """The SDK's random ids, unless a step's derived ids are asked for."""

        def generate_trace_id(self) -> int:
            wanted = _next_ids.get()
            return wanted[0] if wanted else super().generate_trace_id()

        def generate_span_id(self) -> int:
            wanted = _next_ids.get()
            return wanted[1] if wanted and wanted[1] else super().generate_span_id()

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "waystation"}
    provider = TracerProvider(
        resource=Resource.create(attributes), id_generator=Ids(), shutdown_on_exit=False
    )
    memory = None
    for name in wanted:
        if name == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        elif name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
        elif name == "waystation-test":
            memory = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(memory))
        else:
            log.warning("OTEL_TRACES_EXPORTER: unknown exporter %r ignored", name)
    if install:
        trace.set_tracer_provider(provider)
    tracer = provider.get_tracer("waystation")
    return _Tracing(tracer, provider, memory, os.environ.get(TEST_SPANS_FILE))


def _otlp_exporter() -> Any:
    """The OTLP exporter of ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``opentelemetry-exporter-otlp``)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf").strip()
    transport = "grpc" if protocol == "grpc" else "http"
    module = importlib.import_module(
        f"opentelemetry.exporter.otlp.proto.{transport}.trace_exporter"
    )
    return module.OTLPSpanExporter()


def shutdown() -> None:
    """Flush and stop exporting (the worker stopping); a test exporter writes its file."""
    if _impl is not None:
        try:
            _impl.shutdown()
        except Exception:
            log.exception("tracing: shutting down the exporters failed")


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
    if _impl is None:
        return _NULL
    return _consuming(headers)


@contextlib.contextmanager
def _running(task_id: str, agent: str, pause: int, trace_id: str | None) -> Iterator[None]:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    assert _impl is not None
    trace_id = trace_id or task_id
    parent: tuple[str, str] | None
    if pause > 0:
        parent = (trace_hex(trace_id), span_hex(trace_id, resume_key(task_id, pause)))
    else:
        consumed = _consumed.get()
        parent = consumed.parent if consumed is not None else None
    span = _impl.start(
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
    if _impl is None:
        return _NULL
    return _running(task_id, agent, pause, trace_id)


def recorded(state: TaskState, events: Sequence[DomainEvent]) -> None:
    """The spans of what was just appended to ``state``'s task."""
    if _impl is None or not events:
        return
    try:
        _recorded(_impl, state, events, time.time_ns())
    except Exception:
        log.exception("tracing: could not record the spans of %s", state.task_id)


def finished_unrecorded(state: TaskState) -> None:
    """A task that completed without calls (nothing recorded, G10): its ``complete`` span."""
    if _impl is None:
        return
    try:
        _recorded(_impl, state, [TaskCompleted(result=None)], time.time_ns())
    except Exception:
        log.exception("tracing: could not record the completion of %s", state.task_id)


def _recorded(impl: _Tracing, state: TaskState, events: Sequence[DomainEvent], now: int) -> None:
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
    for event in events:
        if isinstance(event, TaskPaused):
            pause = impl.step(
                f"pause {agent}",
                trace_id,
                run_parent,
                pause_key(task_id, event.pause),
                after_run,
                {
                    **attributes,
                    "waystation.pause": event.pause,
                    "waystation.calls": len(event.calls),
                },
            )
            for call in event.calls:
                impl.step(
                    f"call {call.agent}",
                    trace_id,
                    (trace_x, pause),
                    call_key(call.subtask_id),
                    after_run,
                    {
                        **attributes,
                        "waystation.subtask_id": call.subtask_id,
                        "waystation.peer": call.agent,
                    },
                )
        elif isinstance(event, ResultRecorded):
            called = span_hex(trace_id, call_key(event.subtask_id))
            parent = delivered if event.outcome != "timeout" else None
            last_reply = impl.step(
                f"reply {event.outcome}",
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
                {**attributes, "waystation.pause": event.pause},
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
