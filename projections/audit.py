"""Audit of the event log: verify a stream. A pure function, but for ``read_streams``, which
reads the log through the store's port.

``verify_stream`` checks one task's stream as the log holds it: contiguous versions from 1, the
hash chain (each ``prev_hash`` links to the event before, each ``hash`` matches the content), and
the invariants of the task's state machine (docs/guarantees.md): a sub-task is claimed at most once
(G2), a pause is resumed at most once and only after every one of its calls has a result (G3),
every result follows its claim, and nothing but audit-only events follows a terminal event.

``verify_stream`` also checks part of a stream (``partial=True``, e.g. a position range of an
export): the chain is then anchored at the first event's stored ``prev_hash``, and an invariant is
checked only where the events it needs are there, that is for the pauses whose ``TaskPaused`` is
among them. Events whose values were redacted (``redacted_versions``) keep their links and
invariants checked, but their content hash cannot be recomputed: it covers the secret.

``read_streams`` gives the audit its input: one task's stream, or every stream of the log.
Reading a stream for people (its timeline, a task's state at a past point) is
:mod:`waystation.projections.history`.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import Any

from waystation.events.codec import GENESIS_HASH, chain_hash
from waystation.events.model import (
    DomainEvent,
    RecordedEvent,
    ResultRecorded,
    SubtaskClaimed,
    TaskPaused,
    TaskResumed,
    UnknownEvent,
    parse,
)
from waystation.events.store import EventStore, Position

__all__ = ["Problem", "read_streams", "verify_stream"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a stream, at the event where it shows."""

    stream_id: str
    stream_version: int
    kind: str
    """``version-gap``, ``broken-link``, ``hash-mismatch``, ``unreadable``, ``double-claim``,
    ``double-result``, ``result-without-claim``, ``double-resume``, ``early-resume``,
    ``after-terminal``, ``foreign-event``, ``unsupported-version`` (a schema version this code
    cannot read, see ``waystation.events.upcasting``: its invariants could not be checked), or, in
    an export only, ``bad-redaction`` (see ``waystation.projections.exported``)."""
    message: str

    def __str__(self) -> str:
        return f"{self.stream_id} v{self.stream_version}: {self.kind}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {
            "stream_id": self.stream_id,
            "stream_version": self.stream_version,
            "kind": self.kind,
            "message": self.message,
        }


def _parsed(event: RecordedEvent) -> DomainEvent | None:
    try:
        return parse(event)
    except Exception:  # tampered or malformed data: reported as unreadable
        return None


def verify_stream(
    events: Sequence[RecordedEvent],
    *,
    partial: bool = False,
    redacted_versions: Set[int] = frozenset(),
) -> list[Problem]:
    """Everything wrong with one stream's events (in version order); empty when it verifies.

    ``partial``: the events may start after version 1 (the module docstring says what is then
    checked). ``redacted_versions``: the versions whose content hash is not checked.
    """
    problems: list[Problem] = []
    if not events:
        return problems
    stream_id = events[0].stream_id
    expected_version = events[0].stream_version if partial else 1
    previous_hash = events[0].prev_hash if partial else GENESIS_HASH
    calls_of_pause: dict[int, tuple[str, ...]] = {}
    claimed: set[str] = set()
    results: set[str] = set()
    resumed: set[int] = set()
    terminal: RecordedEvent | None = None

    def seen(pause: int) -> bool:
        """Whether every event of ``pause`` from its TaskPaused on is among ``events``."""
        return not partial or pause in calls_of_pause

    for event in events:
        version = event.stream_version

        def problem(kind: str, message: str, version: int = version) -> None:
            problems.append(Problem(stream_id, version, kind, message))

        if event.stream_id != stream_id:
            problem("foreign-event", f"event of stream {event.stream_id!r} in {stream_id!r}")
        if version != expected_version:
            problem("version-gap", f"expected version {expected_version}, found {version}")
        expected_version = version + 1
        if event.prev_hash != previous_hash:
            problem(
                "broken-link",
                f"prev_hash {event.prev_hash.hex()[:16]}… does not link to the previous event's "
                f"hash {previous_hash.hex()[:16]}…",
            )
        previous_hash = event.hash
        if version not in redacted_versions:
            try:
                computed = chain_hash(event.prev_hash, event.hash_body())
            except (TypeError, ValueError) as error:
                problem("hash-mismatch", f"{event.event_type} cannot be hashed: {error}")
            else:
                if computed != event.hash:
                    problem(
                        "hash-mismatch",
                        f"{event.event_type}: stored hash {event.hash.hex()[:16]}… does not "
                        f"match its content (computed {computed.hex()[:16]}…)",
                    )

        parsed = _parsed(event)
        if parsed is None:
            if version not in redacted_versions:  # a redaction may replace a field it needs
                problem("unreadable", f"{event.event_type} data does not parse: {event.data!r}")
            continue
        if isinstance(parsed, UnknownEvent) and parsed.reason != "unknown-type":
            problem(
                "unsupported-version",
                f"{event.event_type} schema v{event.schema_version} cannot be read by this code "
                f"({parsed.reason}); its invariants were not checked",
            )
            continue
        if terminal is not None and not type(parsed).audit_only:
            problem(
                "after-terminal",
                f"{event.event_type} after the terminal {terminal.event_type} "
                f"at v{terminal.stream_version}",
            )
        if type(parsed).terminal and terminal is None:
            terminal = event

        if isinstance(parsed, TaskPaused):
            calls_of_pause[parsed.pause] = tuple(c.subtask_id for c in parsed.calls)
        elif isinstance(parsed, SubtaskClaimed):
            if parsed.subtask_id in claimed:
                problem("double-claim", f"{parsed.subtask_id} claimed a second time")
            claimed.add(parsed.subtask_id)
        elif isinstance(parsed, ResultRecorded):
            if parsed.subtask_id not in claimed and seen(parsed.pause):
                problem(
                    "result-without-claim",
                    f"result for {parsed.subtask_id} with no SubtaskClaimed before it",
                )
            if parsed.subtask_id in results:
                problem("double-result", f"a second result for {parsed.subtask_id}")
            results.add(parsed.subtask_id)
        elif isinstance(parsed, TaskResumed):
            if parsed.pause in resumed:
                problem("double-resume", f"pause #{parsed.pause} resumed a second time")
            resumed.add(parsed.pause)
            if parsed.pause not in calls_of_pause:
                if seen(parsed.pause):
                    problem("early-resume", f"resumed pause #{parsed.pause}, which never paused")
            else:
                missing = [s for s in calls_of_pause[parsed.pause] if s not in results]
                if missing:
                    problem(
                        "early-resume",
                        f"resumed pause #{parsed.pause} before the results of {', '.join(missing)}",
                    )
    return problems


# ---- reading the log -----------------------------------------------------------------------------


async def read_streams(
    store: EventStore, task_id: str | None = None, *, page_size: int = 1000
) -> dict[str, list[RecordedEvent]]:
    """The events of one task (an empty list when it is not in the log), or of the whole log,
    read page by page in commit order, by stream, each stream in version order."""
    if task_id is not None:
        return {task_id: await store.read_stream(task_id)}
    streams: dict[str, list[RecordedEvent]] = {}
    after = Position()
    while batch := await store.read_all(after, limit=page_size):
        for event in batch:
            streams.setdefault(event.stream_id, []).append(event)
        after = Position.of(batch[-1])
    for events in streams.values():
        events.sort(key=lambda e: e.stream_version)
    return streams
