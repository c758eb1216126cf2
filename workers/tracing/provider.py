"""Where Waystation's spans go: the tracer provider ``OTEL_TRACES_EXPORTER`` asks for, and the
tracer that starts spans on it with the ids a step's span must have (``waystation.tracing.ids``).

Everything OpenTelemetry is imported inside the functions: with tracing off, the worker never
imports it.
"""

from __future__ import annotations

import atexit
import contextvars
import importlib
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .ids import span_hex, trace_hex

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = ["TEST_SPANS_FILE", "Tracing", "active", "configure", "current", "shutdown"]

log = logging.getLogger(__name__)

TEST_SPANS_FILE = "WAYSTATION_TEST_SPANS_FILE"
"""With ``OTEL_TRACES_EXPORTER=waystation-test``: where the worker writes its finished spans
(JSON) when it stops. For tests only."""

_next_ids: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "waystation_next_ids", default=None
)
"""(trace id, span id) the next span started gets (0: the SDK's own choice)."""


class Tracing:
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


current: Tracing | None = None
"""Where spans go; None while tracing is off (every hook checks it first)."""
_configured = False


def active() -> bool:
    return current is not None


def configure() -> bool:
    """Turn tracing on when the environment asks for it (``OTEL_TRACES_EXPORTER``) and the
    ``otel`` extra is installed; once per process. True when spans are produced."""
    global current, _configured
    if _configured:
        return current is not None
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
        current = _build(wanted)
    except ImportError as missing:
        log.warning(
            "OTEL_TRACES_EXPORTER=%s but %s: tracing is off; install waystation[otel] (and, "
            "for otlp, opentelemetry-exporter-otlp)",
            ",".join(wanted),
            missing,
        )
        return False
    if current is not None:
        atexit.register(shutdown)
        log.info("tracing on: exporting spans to %s", ",".join(wanted))
    return current is not None


def _build(wanted: list[str], *, install: bool = True) -> Tracing | None:
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
    return Tracing(tracer, provider, memory, os.environ.get(TEST_SPANS_FILE))


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
    if current is not None:
        try:
            current.shutdown()
        except Exception:
            log.exception("tracing: shutting down the exporters failed")
