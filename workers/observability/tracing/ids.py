"""Trace and span ids, and W3C ``traceparent`` headers: pure functions, no OpenTelemetry.

``waystation.protocol.wire`` puts a ``traceparent`` on every message a worker publishes, and
the logs print :func:`trace_hex` of the task's trace id (``waystation.observability.logs``),
whether or not this worker exports spans; the spans (``waystation.observability.tracing.spans``) use
the same ids, so the three join.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "HEADER_TRACEPARENT",
    "call_key",
    "end_key",
    "parse_traceparent",
    "pause_key",
    "reply_key",
    "resume_key",
    "span_hex",
    "trace_hex",
    "traceparent",
]

HEADER_TRACEPARENT = "traceparent"

_HEX32 = re.compile(r"[0-9a-f]{32}")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


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


# the keys of the steps the log records, one per span a message can name as its parent


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
