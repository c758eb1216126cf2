"""An export read back, and verified without the database.

:func:`read_export` reads the lines :mod:`waystation.projections.export` wrote back into the
:class:`~waystation.events.model.RecordedEvent` each came from (:func:`from_record` for one line),
and :func:`verify_export` checks them.

Verifying an export: lines are grouped by stream and each stream runs through
:func:`waystation.projections.audit.verify_stream`. The content hash of a redacted event cannot be
recomputed (it covers the secret), so only its links and invariants are checked, and the report
counts such events: a value altered elsewhere in a redacted event cannot be found from the file
alone. Every path a line lists as redacted must hold a redaction marker (``bad-redaction``
otherwise), so an event whose content check is skipped always shows a marker.

A stream whose first line is past version 1 (a position or time range starting mid-stream) is not
a tampering: it gets a ``partial-stream`` note, and its chain is checked from the stored
``prev_hash`` of its first exported event.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from waystation.events.codec import loads
from waystation.events.model import RecordedEvent

from .audit import Problem, verify_stream
from .export import _markers

__all__ = [
    "ExportFormatError",
    "ExportVerification",
    "ExportedEvent",
    "Note",
    "from_record",
    "read_export",
    "verify_export",
]


class ExportFormatError(ValueError):
    """A line of an export file is not an exported event."""

    def __init__(self, message: str, line: int | None = None) -> None:
        self.line = line
        self.message = message
        super().__init__(f"line {line}: {message}" if line is not None else message)


@dataclass(frozen=True, slots=True)
class ExportedEvent:
    """An event read back from an export, with the paths its export redacted."""

    event: RecordedEvent
    redacted: tuple[str, ...] = ()


def _field(record: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in record:
        raise ExportFormatError(f"no {name!r}")
    value = record[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ExportFormatError(f"{name!r} is {value!r}, not {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", str: "a string", dict: "an object", list: "a list"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _hash(record: dict[str, Any], name: str) -> bytes:
    text = _field(record, name, str)
    try:
        value = bytes.fromhex(text)
    except ValueError as error:
        raise ExportFormatError(f"{name!r} is not hex: {text!r}") from error
    if len(value) != 32:
        raise ExportFormatError(f"{name!r} is {len(value)} bytes, not 32")
    return value


def from_record(record: Any) -> ExportedEvent:
    """The event an export line (parsed JSON) holds; :class:`ExportFormatError` if it holds none."""
    if not isinstance(record, dict):
        raise ExportFormatError(f"not a JSON object but {type(record).__name__}")
    try:
        event_id = uuid.UUID(_field(record, "event_id", str))
    except ValueError as error:
        raise ExportFormatError(f"'event_id' is not a UUID: {record['event_id']!r}") from error
    moment = record.get("recorded_at")
    if moment is not None and not isinstance(moment, str):
        raise ExportFormatError(f"'recorded_at' is {moment!r}, not a string")
    try:
        recorded_at = datetime.fromisoformat(moment) if moment is not None else None
    except ValueError as error:
        raise ExportFormatError(f"'recorded_at' is not ISO-8601: {moment!r}") from error
    redacted = record.get("redacted", [])
    if not isinstance(redacted, list) or not all(isinstance(p, str) for p in redacted):
        raise ExportFormatError(f"'redacted' is {redacted!r}, not a list of paths")
    return ExportedEvent(
        RecordedEvent(
            stream_id=_field(record, "stream_id", str),
            stream_version=_field(record, "stream_version", int),
            event_id=event_id,
            event_type=_field(record, "event_type", str),
            data=_field(record, "data", dict),
            metadata=_field(record, "metadata", dict),
            schema_version=_field(record, "schema_version", int),
            prev_hash=_hash(record, "prev_hash"),
            hash=_hash(record, "hash"),
            global_position=_field(record, "global_position", int),
            tx_id=_field(record, "tx_id", int),
            recorded_at=recorded_at,
        ),
        tuple(redacted),
    )


def read_export(lines: Iterable[bytes | str]) -> Iterator[ExportedEvent]:
    """The events of an export file's lines, in file order; blank lines are skipped.

    Raises :class:`ExportFormatError` naming the first line that is not an exported event.
    """
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = loads(line)
        except ValueError as error:
            raise ExportFormatError(f"not JSON: {error}", number) from error
        try:
            yield from_record(record)
        except ExportFormatError as error:
            raise ExportFormatError(error.message, number) from error


# ---- verifying an export -------------------------------------------------------------------------


Note = Problem
"""Something an auditor should know about an export that is not a problem in itself; shaped
like a :class:`~waystation.projections.audit.Problem`. Kind ``partial-stream``: the file holds the
stream from ``stream_version`` on only."""


@dataclass(frozen=True, slots=True)
class ExportVerification:
    """The outcome of verifying an export file."""

    streams: int = 0
    events: int = 0
    redacted: int = 0
    """Events whose content hash could not be checked because values were redacted."""
    problems: list[Problem] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "streams": self.streams,
            "events": self.events,
            "redacted": self.redacted,
            "notes": [note.to_json() for note in self.notes],
            "problems": [problem.to_json() for problem in self.problems],
        }


def _check_redactions(item: ExportedEvent) -> list[Problem]:
    event = item.event
    present = set(_markers(event.data, "data")) | set(_markers(event.metadata, "metadata"))
    return [
        Problem(
            event.stream_id,
            event.stream_version,
            "bad-redaction",
            f"{path} is listed as redacted but holds no redaction marker",
        )
        for path in item.redacted
        if path not in present
    ]


def verify_export(exported: Iterable[ExportedEvent]) -> ExportVerification:
    """Verify the streams of an export (grouped by stream, each in version order)."""
    by_stream: dict[str, list[ExportedEvent]] = {}
    for item in exported:
        by_stream.setdefault(item.event.stream_id, []).append(item)
    problems: list[Problem] = []
    notes: list[Note] = []
    redacted = 0
    for stream_id, items in by_stream.items():
        items.sort(key=lambda item: item.event.stream_version)
        events = [item.event for item in items]
        redacted_versions = {item.event.stream_version for item in items if item.redacted}
        redacted += len(redacted_versions)
        first = events[0].stream_version
        partial = first > 1
        if partial:
            notes.append(
                Note(
                    stream_id,
                    first,
                    "partial-stream",
                    f"the file starts this stream at version {first} (versions 1-{first - 1} "
                    f"were not exported); its chain is checked from v{first}'s stored prev_hash "
                    f"{events[0].prev_hash.hex()[:16]}…",
                )
            )
        found = [problem for item in items for problem in _check_redactions(item)]
        found += verify_stream(events, partial=partial, redacted_versions=redacted_versions)
        problems += sorted(found, key=lambda problem: problem.stream_version)
    return ExportVerification(
        streams=len(by_stream),
        events=sum(len(items) for items in by_stream.values()),
        redacted=redacted,
        problems=problems,
        notes=notes,
    )
