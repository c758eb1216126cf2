"""Which tracer provider Waystation's spans go to, and the tracer that starts them there.

:func:`configure` decides once per process (a worker calls it when it starts), first match wins:

1. the provider a worker was given (``Worker(..., tracer_provider=...)``);
2. the application's own: the global provider, when the application set one
   (``opentelemetry.trace.set_tracer_provider``) before the worker started;
3. when ``OTEL_TRACES_EXPORTER`` asks for spans, a provider of Waystation's own with those
   exporters, made the global one (so that a handler's own spans have a provider to go to).
   Only here is the global provider set, and only because no one had set it.

``OTEL_SDK_DISABLED=true`` turns every case off. Waystation flushes a provider it was given (or
found) when a worker stops and leaves closing it to the application; it shuts down its own.

A step's span gets ids derived from its task and step (``waystation.observability.tracing.ids``):
the tracer asks its provider's id generator for them, which Waystation wraps (on its own tracer
only, so the application's spans keep their generator's ids). With a provider that is not the SDK's
there is no generator to wrap: the spans get its ids, and a message may name a parent span that
was exported under another id.

Everything OpenTelemetry is imported inside the functions: with tracing off, the worker never
imports it.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import importlib
import json
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from waystation.observability.tracing.ids import span_hex, trace_hex

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

__all__ = ["TEST_SPANS_FILE", "Tracing", "active", "configure", "current", "shutdown"]

log = logging.getLogger(__name__)

TEST_SPANS_FILE = "WAYSTATION_TEST_SPANS_FILE"
"""With ``OTEL_TRACES_EXPORTER=waystation-test``: where the worker writes its finished spans
(JSON) when it stops. For tests only."""

_next_ids: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "waystation_next_ids", default=None
)
"""(trace id, span id) the next span started gets (0: the generator's own choice)."""


class Tracing:
    """The live implementation: a tracer on the chosen provider, and how to dump a test's
    spans. ``owned``: the provider is Waystation's own (it shuts it down)."""

    def __init__(
        self,
        tracer: Tracer,
        provider: Any,
        *,
        owned: bool,
        memory: Any = None,
        dump_to: str | None = None,
    ) -> None:
        self.tracer = tracer
        self.provider = provider
        self.owned = owned
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
        if not self.owned:
            # the application's provider: out with what is queued, the rest is the
            # application's to close (other workers of the process may still use it)
            flush = getattr(self.provider, "force_flush", None)
            if flush is not None:
                flush()
            return
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


def configure(provider: TracerProvider | None = None) -> bool:
    """Turn tracing on, on the provider chosen as the module says; True when spans are
    produced. Decided once per process, except that a ``provider`` given later still turns it
    on."""
    global current, _configured
    if current is not None:
        if provider is not None and provider is not current.provider:
            log.warning(
                "tracing: this process already sends its spans to another tracer provider; "
                "the one given to this worker is not used"
            )
        return True
    if _configured and provider is None:
        return False
    _configured = True
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    given = provider if provider is not None else _global_provider()
    if given is not None:
        current = _adopt(given)
        if current is not None:
            log.info("tracing on: spans go to the application's %s", type(given).__name__)
        return current is not None
    wanted = [
        name.strip().lower()
        for name in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")
        if name.strip() and name.strip().lower() != "none"
    ]
    if not wanted:
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
    atexit.register(shutdown)
    log.info("tracing on: exporting spans to %s", ",".join(wanted))
    return True


def _global_provider() -> Any:
    """The global tracer provider if the application set one, else None. Not imported to ask:
    an application that set one has imported ``opentelemetry.trace`` already."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    return None if isinstance(provider, trace.ProxyTracerProvider) else provider


def _adopt(provider: Any) -> Tracing | None:
    """Waystation's tracer on the application's ``provider``; None for a no-op provider (the
    application chose no spans)."""
    from opentelemetry import trace

    if isinstance(provider, trace.NoOpTracerProvider):
        return None
    tracer = provider.get_tracer("waystation")
    ids = getattr(tracer, "id_generator", None)
    if ids is None:
        log.warning(
            "tracing: the tracer provider %s is not OpenTelemetry's SDK: Waystation's spans get "
            "its ids, not the ids the messages name as their parents",
            type(provider).__name__,
        )
    elif not isinstance(ids, _derived_ids()):
        tracer.id_generator = _derived_ids()(ids)
    return Tracing(tracer, provider, owned=False)


@functools.cache
def _derived_ids() -> type[Any]:
    """The id generator of Waystation's tracer (a class made on first use: it subclasses the
    SDK's, which is imported only when tracing is on)."""
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    class DerivedIds(IdGenerator):
        """``inner``'s ids, unless a step's derived ids are asked for (``_next_ids``)."""

        def __init__(self, inner: IdGenerator) -> None:
            self.inner = inner

        def generate_trace_id(self) -> int:
            wanted = _next_ids.get()
            return wanted[0] if wanted else self.inner.generate_trace_id()

        def generate_span_id(self) -> int:
            wanted = _next_ids.get()
            return wanted[1] if wanted and wanted[1] else self.inner.generate_span_id()

        def is_trace_id_random(self) -> bool:
            return self.inner.is_trace_id_random()

    return DerivedIds


def _build(wanted: list[str], *, install: bool = True) -> Tracing:
    """A tracer provider of Waystation's own exporting to ``wanted``; ``install`` makes it the
    process's global one (configure calls this only when no one had set that)."""
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

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "waystation"}
    provider = TracerProvider(
        resource=Resource.create(attributes),
        id_generator=_derived_ids()(RandomIdGenerator()),
        shutdown_on_exit=False,
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
    return Tracing(
        tracer, provider, owned=True, memory=memory, dump_to=os.environ.get(TEST_SPANS_FILE)
    )


def _otlp_exporter() -> Any:
    """The OTLP exporter of ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``opentelemetry-exporter-otlp``)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf").strip()
    transport = "grpc" if protocol == "grpc" else "http"
    module = importlib.import_module(
        f"opentelemetry.exporter.otlp.proto.{transport}.trace_exporter"
    )
    return module.OTLPSpanExporter()


def shutdown() -> None:
    """Flush and stop exporting (the worker stopping); a test exporter writes its file. A
    provider that is the application's is only flushed."""
    if current is not None:
        try:
            current.shutdown()
        except Exception:
            log.exception("tracing: shutting down the exporters failed")
