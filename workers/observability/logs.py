"""Logs: JSON lines for machines, readable lines in a terminal, with the task's context.

Every record a worker writes while it handles a message carries that message's task id, sub-task
id and trace id (where they apply) and the worker's id, without each call site passing them:
``log_context`` sets them in context variables, and aio-pika runs each delivery in its own
asyncio task, so one message's context never leaks into another's.

The trace id printed is the W3C one, as the task's spans have it (32 hex digits,
``waystation.observability.tracing.ids.trace_hex``), so that a search of the logs by a span's trace
id finds its lines. When the task's trace id as Waystation carries it is something else (a
publisher's ``x-waystation-trace-id``, or the task's own id), that is printed too, as
``waystation_trace_id``.

A line may add fields of its own, as ``extra={"fields": {"agent": ..., "attempt": 2}}``: a JSON
line has them beside the context's (a handler's failure has its agent and attempt so).

No line carries a password: every line, its traceback included, is written with the password of
any URL in it replaced by ``***`` (:func:`redact`; aio-pika's reconnection lines and the drivers'
exceptions quote the URL they were given).

``WAYSTATION_LOG_FORMAT`` chooses: ``json`` (one object per line), ``text``, or ``auto`` (text
when stderr is a terminal, JSON otherwise, e.g. in a container).
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys
import traceback
from collections.abc import Mapping
from datetime import UTC, datetime
from types import MappingProxyType, TracebackType
from typing import Any, Literal, TextIO

import orjson

from waystation.observability.tracing.ids import trace_hex

__all__ = [
    "CONTEXT_FIELDS",
    "configure_logging",
    "current_context",
    "log_context",
    "redact",
    "redact_url",
    "redacting_excepthook",
]

CONTEXT_FIELDS = ("task_id", "subtask_id", "trace_id", "waystation_trace_id")
"""Per-message fields, in the order a text line shows them."""

_context: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "waystation_log_context", default=MappingProxyType({})
)


_CREDENTIALS = re.compile(r"(^|[/\s'\"(=<,\[])([^\s:/@'\"<>]+):([^\s@/'\"<>]+)@")
"""``user:password@`` where it starts a URL's authority, or follows a space or a quote (a URL
written without its ``//``, as in the malformed ``amqps//user:password@host``)."""


def redact(text: str) -> str:
    """``text`` with the password of every ``user:password@`` in it replaced by ``***``."""
    if "@" not in text:
        return text
    return _CREDENTIALS.sub(r"\1\2:***@", text)


def redact_url(url: str) -> str:
    """``url`` as it may be shown: ``amqp://guest:***@host/``."""
    return redact(url)


def redacting_excepthook(
    kind: type[BaseException], error: BaseException, trace: TracebackType | None
) -> None:
    """``sys.excepthook`` that prints an uncaught exception's traceback redacted (a bug's
    traceback, written by Python rather than by a log handler, may quote a URL too)."""
    sys.stderr.write(redact("".join(traceback.format_exception(kind, error, trace))))


class log_context:  # (named as the function it replaced: ``with log_context(task_id=...)``)
    """Add ``fields`` (those not None) to every record logged inside the block. A class, not a
    generator: it wraps every delivery, and contextlib's generator machinery cost ~1% of a
    worker's CPU there."""

    __slots__ = ("_fields", "_token")

    def __init__(self, **fields: str | None) -> None:
        self._fields = fields

    def __enter__(self) -> None:
        current = _context.get()
        added = {k: v for k, v in self._fields.items() if v}
        self._token = _context.set({**current, **added} if current else added)

    def __exit__(self, *_: object) -> None:
        _context.reset(self._token)


def add_to_context(**fields: str | None) -> None:
    """Add ``fields`` to the current context until the enclosing ``log_context`` ends (e.g. the
    trace id of a reply, known only once its task's stream is read)."""
    current = _context.get()
    missing = {k: v for k, v in fields.items() if v and k not in current}
    if missing:
        _context.set({**current, **missing})


def current_context() -> dict[str, str]:
    return dict(_context.get())


class _ContextFilter(logging.Filter):
    """Puts the worker id, the current message's context and the record's own ``fields`` (its
    ``extra``) on every record."""

    def __init__(self, worker_id: str | None) -> None:
        super().__init__()
        self.worker_id = worker_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.waystation = {
            **({"worker_id": self.worker_id} if self.worker_id else {}),
            **_printed(_context.get()),
            **getattr(record, "fields", {}),
        }
        return True


def _printed(context: Mapping[str, str]) -> Mapping[str, str]:
    """``context`` as a line prints it: the trace id as the spans have it (here, not where the
    context is set: a line is logged far less often than a message is handled)."""
    trace = context.get("trace_id")
    if trace is None:
        return context
    w3c = trace_hex(trace)
    if w3c == trace:
        return context
    return {**context, "trace_id": w3c, "waystation_trace_id": trace}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, context, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "waystation", {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        return redact(orjson.dumps(entry, default=str).decode())


class TextFormatter(logging.Formatter):
    """``time LEVEL logger message [task=… subtask=… trace=… waystation_trace=…]``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = redact(super().format(record))
        fields: dict[str, str] = getattr(record, "waystation", {})
        shown = [f"{n.removesuffix('_id')}={fields[n]}" for n in CONTEXT_FIELDS if n in fields]
        if not shown:
            return line
        head, newline, rest = line.partition("\n")  # keep a traceback below the context
        return f"{head} [{' '.join(shown)}]{newline}{rest}"


def _not_transport_errors(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("error when creating transport")


def configure_logging(
    level: str = "INFO",
    log_format: Literal["auto", "json", "text"] = "auto",
    *,
    worker_id: str | None = None,
    stream: TextIO | None = None,
) -> None:
    """Set up the root logger once, for a process (the CLI's composition root calls this)."""
    stream = stream or sys.stderr
    if log_format == "auto":
        log_format = "text" if stream.isatty() else "json"
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(_ContextFilter(worker_id))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("aio_pika").setLevel(logging.WARNING)
    logging.getLogger("aiormq").setLevel(logging.WARNING)
    # a connection that cannot be made is told once, by whoever tries it (the command's one
    # line, or aio-pika's reconnection); aiormq's own line says it again but at debug level
    transport = logging.getLogger("aiormq.connection")
    if root.level > logging.DEBUG:
        transport.addFilter(_not_transport_errors)
    else:
        transport.removeFilter(_not_transport_errors)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
