"""Export of the event log as JSONL, with secrets redacted.

One line per event, a JSON object holding every column the log keeps for it: ``stream_id``,
``stream_version``, ``event_id``, ``event_type``, ``schema_version``, ``data``, ``metadata``,
``prev_hash`` and ``hash`` (hex), ``global_position``, ``tx_id``, ``recorded_at`` (ISO-8601),
plus ``redacted``, the paths whose values were replaced. Keys are sorted, so equal events give
equal lines. Reading an export back and verifying it without the database is
:mod:`waystation.projections.exported`.

Redaction: the value of every object key named in ``redact_keys`` (``security_context`` by
default), at any depth of ``data`` or ``metadata``, becomes ``{"redacted": "sha256:<hex>"}``, the
SHA-256 of the value's canonical JSON: whoever holds the secret can check it was that one, and
equal secrets show as equal. A low-entropy secret can be guessed from its hash; export with care.
Paths read ``data.state_delta.security_context``, ``data.calls[0].input.security_context``, and
``data["odd.key"]`` for keys that are not plain names.

Reading the whole log pages through ``EventStore.read_all`` in commit order and writes as it
reads. Commit order is ``(tx_id, global_position)``, in which positions are not monotonic
(appends running at the same moment interleave), so the export does not stop at the first event
past ``to_position``: it stops once ``STOP_MARGIN`` transactions in a row lie wholly past it. An
append can only sort after the transactions whose ids were handed out while it took its first
position, at most one per concurrent writer.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from waystation.events.codec import canonical
from waystation.events.model import RecordedEvent
from waystation.events.store import EventStore, Position

__all__ = [
    "DEFAULT_REDACT_KEYS",
    "STOP_MARGIN",
    "ExportSummary",
    "Selection",
    "export_log",
    "redact",
    "to_line",
    "to_record",
]

DEFAULT_REDACT_KEYS = frozenset({"security_context"})
"""The keys whose values an export redacts unless told otherwise: the checkpoint's secrets."""

STOP_MARGIN = 1000
"""Transactions wholly past ``to_position`` read in a row before a range export stops."""

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")
_MARKER = re.compile(r"sha256:[0-9a-f]{64}\Z")


# ---- selection and redaction ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Selection:
    """Which events to export: ``since <= recorded_at <= until`` and ``after_position <
    global_position <= to_position``, each bound only when given (naive times are UTC)."""

    since: datetime | None = None
    until: datetime | None = None
    after_position: int | None = None
    to_position: int | None = None

    def __post_init__(self) -> None:
        for name in ("since", "until"):
            moment = getattr(self, name)
            if moment is not None and moment.tzinfo is None:
                object.__setattr__(self, name, moment.replace(tzinfo=UTC))

    def includes(self, event: RecordedEvent) -> bool:
        position = event.global_position
        if self.after_position is not None and position <= self.after_position:
            return False
        if self.to_position is not None and position > self.to_position:
            return False
        if self.since is None and self.until is None:
            return True
        moment = event.recorded_at
        if moment is None:
            return False
        return (self.since is None or moment >= self.since) and (
            self.until is None or moment <= self.until
        )


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if _PLAIN_KEY.match(key):
        return f"{path}.{key}"
    return f"{path}[{canonical(key).decode()}]"


def _marker(value: Any) -> dict[str, str]:
    return {"redacted": "sha256:" + hashlib.sha256(canonical(value)).hexdigest()}


def _is_marker(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and len(value) == 1
        and isinstance(value.get("redacted"), str)
        and bool(_MARKER.match(value["redacted"]))
    )


def redact(value: Any, keys: Collection[str], path: str) -> tuple[Any, list[str]]:
    """``value`` with the value of every key in ``keys`` replaced by a marker, and their paths."""
    if not keys:
        return value, []
    redacted: list[str] = []

    def walk(item: Any, at: str) -> Any:
        if isinstance(item, dict):
            out = {}
            for key, child in sorted(item.items()):  # paths in the line's (sorted) key order
                if key in keys:
                    out[key] = _marker(child)
                    redacted.append(_child(at, key))
                else:
                    out[key] = walk(child, _child(at, key))
            return out
        if isinstance(item, list):
            return [walk(child, _child(at, index)) for index, child in enumerate(item)]
        return item

    return walk(value, path), redacted


def _markers(value: Any, path: str) -> Iterator[str]:
    """The paths of every redaction marker inside ``value``."""
    if _is_marker(value):
        yield path
    elif isinstance(value, dict):
        for key, child in value.items():
            yield from _markers(child, _child(path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _markers(child, _child(path, index))


# ---- records -------------------------------------------------------------------------------------


def to_record(
    event: RecordedEvent, *, redact_keys: Collection[str] = DEFAULT_REDACT_KEYS
) -> dict[str, Any]:
    """The export line of ``event`` as a JSON-able dict, its secrets redacted."""
    data, in_data = redact(event.data, redact_keys, "data")
    metadata, in_metadata = redact(event.metadata, redact_keys, "metadata")
    return {
        "stream_id": event.stream_id,
        "stream_version": event.stream_version,
        "event_id": str(event.event_id),
        "event_type": event.event_type,
        "schema_version": event.schema_version,
        "data": data,
        "metadata": metadata,
        "prev_hash": event.prev_hash.hex(),
        "hash": event.hash.hex(),
        "global_position": event.global_position,
        "tx_id": event.tx_id,
        "recorded_at": event.recorded_at.isoformat() if event.recorded_at is not None else None,
        "redacted": in_data + in_metadata,
    }


def to_line(event: RecordedEvent, *, redact_keys: Collection[str] = DEFAULT_REDACT_KEYS) -> bytes:
    """One line of the export file, newline included."""
    return canonical(to_record(event, redact_keys=redact_keys)) + b"\n"


# ---- writing an export ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExportSummary:
    """What an export wrote; ``missing_tasks`` are asked-for tasks not in the log (then nothing
    was written)."""

    events: int = 0
    streams: int = 0
    redacted: int = 0
    """Events with at least one redacted value."""
    missing_tasks: tuple[str, ...] = ()


async def export_log(
    store: EventStore,
    write: Callable[[bytes], object],
    *,
    tasks: Sequence[str] = (),
    selection: Selection = Selection(),
    redact_keys: Collection[str] = DEFAULT_REDACT_KEYS,
    page_size: int = 1000,
    stop_margin: int = STOP_MARGIN,
) -> ExportSummary:
    """Write the selected events, one line each, through ``write`` as they are read.

    With ``tasks``, those streams in turn (each read whole: a stream is one task); otherwise the
    whole log in commit order, page by page.
    """
    events = 0
    streams: set[str] = set()
    redacted = 0

    def emit(event: RecordedEvent) -> None:
        nonlocal events, redacted
        record = to_record(event, redact_keys=redact_keys)
        write(canonical(record) + b"\n")
        events += 1
        redacted += bool(record["redacted"])
        streams.add(event.stream_id)

    if tasks:
        found = {task: await store.read_stream(task) for task in dict.fromkeys(tasks)}
        missing = tuple(task for task, stream in found.items() if not stream)
        if missing:
            return ExportSummary(missing_tasks=missing)
        for stream in found.values():
            for event in stream:
                if selection.includes(event):
                    emit(event)
        return ExportSummary(events, len(streams), redacted)

    bound = selection.to_position
    after = Position()
    beyond = 0  # transactions in a row read wholly past the bound
    last_tx: int | None = None
    while batch := await store.read_all(after, limit=page_size):
        for event in batch:
            if bound is not None:
                if event.global_position <= bound:
                    beyond = 0
                elif event.tx_id != last_tx:
                    beyond += 1
                    if beyond > stop_margin:
                        return ExportSummary(events, len(streams), redacted)
                last_tx = event.tx_id
            if selection.includes(event):
                emit(event)
        after = Position.of(batch[-1])
    return ExportSummary(events, len(streams), redacted)
