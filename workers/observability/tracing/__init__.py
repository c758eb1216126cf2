"""OpenTelemetry spans of a task's life (the optional ``waystation[otel]`` extra).

Every hook of the worker into OpenTelemetry is here, in three parts:

* ``ids``: trace and span ids and ``traceparent`` headers, pure functions that
  ``waystation.protocol.wire`` and ``waystation.observability.logs`` use whether or not tracing is
  on;
* ``provider``: which tracer provider the spans go to (one given to the worker, the
  application's own, or Waystation's from ``OTEL_TRACES_EXPORTER``), and the tracer on it;
* ``spans``: the hooks the worker calls, and the spans they start.

With the extra missing, or tracing not turned on (no provider given or set by the application,
and ``OTEL_TRACES_EXPORTER`` unset or ``none``; or ``OTEL_SDK_DISABLED=true``), each hook is a
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
when the publisher sent no trace): a root task and everything it calls share it, and its log
lines print it. The span ids of what the log records (pause, call, reply, resume, outcome) are
derived from the task and the event, so the messages an append implies can name their parent
span in ``traceparent`` before the append commits, and any worker names the same span the same
way: every message the worker publishes carries ``traceparent`` (computed whether or not this
worker exports spans), and every message it consumes is read for it.
"""

from __future__ import annotations

from waystation.observability.tracing.ids import (
    HEADER_TRACEPARENT,
    call_key,
    end_key,
    parse_traceparent,
    pause_key,
    reply_key,
    resume_key,
    span_hex,
    trace_hex,
    traceparent,
)
from waystation.observability.tracing.provider import TEST_SPANS_FILE, active, configure, shutdown
from waystation.observability.tracing.spans import consuming, finished_unrecorded, recorded, run

__all__ = [
    "HEADER_TRACEPARENT",
    "TEST_SPANS_FILE",
    "active",
    "call_key",
    "configure",
    "consuming",
    "end_key",
    "finished_unrecorded",
    "parse_traceparent",
    "pause_key",
    "recorded",
    "reply_key",
    "resume_key",
    "run",
    "shutdown",
    "span_hex",
    "trace_hex",
    "traceparent",
]
