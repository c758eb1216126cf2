"""Audit of the event log: verify a stream. A pure function, but for ``read_streams``, which
reads the log through the store's port.

``verify_stream`` checks one task's stream as the log holds it: contiguous versions from 1, the
hash chain (each ``prev_hash`` links to the event before, each ``hash`` matches the content), and
the invariants of the task's state machine (docs/guarantees.md): a wait of any kind is claimed at
most once (G2), a pause is resumed at most once and only when its rule is met, every result
follows its claim, and nothing but audit-only events follows a terminal event.

The waits beyond peer calls (issue 31) add their own: a signal is recorded once
(``SignalReceived`` per ``signal_id``) and taken by one wait at most; a signal wait is claimed by a
signal of its name recorded before the claim (or, with no signal, by its timeout); a timer fires
ok and a signal wait's result is its signal (ok) or its timeout; a pause resumes once every wait
has a result, or, with ``FirstK(k)``, once k succeeded or k can no longer be reached, and its
``TaskResumed.abandoned`` names exactly the waits still open then, which nothing claims later.

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

from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass
from typing import Any

from waystation.events.codec import GENESIS_HASH, chain_hash
from waystation.events.model import (
    DomainEvent,
    PendingCall,
    RecordedEvent,
    ResultRecorded,
    SignalReceived,
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
    ``wrong-abandoned``, ``claim-after-abandon``, ``double-signal``, ``signal-reused``,
    ``claim-without-signal``, ``wrong-outcome``, ``after-terminal``, ``foreign-event``,
    ``unsupported-version`` (a schema version this code cannot read, see
    ``waystation.events.upcasting``: its invariants could not be checked), or, in an export only,
    ``bad-redaction`` (see ``waystation.projections.exported``)."""
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
    waits = _Waits()
    claimed: set[str] = set()
    results: set[str] = set()
    resumed: set[int] = set()
    terminal: RecordedEvent | None = None

    def seen(pause: int) -> bool:
        """Whether every event of ``pause`` from its TaskPaused on is among ``events``."""
        return not partial or pause in waits.pauses

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
            waits.paused(parsed)
        elif isinstance(parsed, SignalReceived):
            if parsed.signal_id in waits.signals:
                problem("double-signal", f"signal {parsed.signal_id} recorded a second time")
            else:
                waits.signals[parsed.signal_id] = parsed
        elif isinstance(parsed, SubtaskClaimed):
            if parsed.subtask_id in claimed:
                problem("double-claim", f"{parsed.subtask_id} claimed a second time")
            claimed.add(parsed.subtask_id)
            for kind, message in waits.claim(parsed, partial):
                problem(kind, message)
        elif isinstance(parsed, ResultRecorded):
            if parsed.subtask_id not in claimed and seen(parsed.pause):
                problem(
                    "result-without-claim",
                    f"result for {parsed.subtask_id} with no SubtaskClaimed before it",
                )
            if parsed.subtask_id in results:
                problem("double-result", f"a second result for {parsed.subtask_id}")
            results.add(parsed.subtask_id)
            for kind, message in waits.result(parsed):
                problem(kind, message)
        elif isinstance(parsed, TaskResumed):
            if parsed.pause in resumed:
                problem("double-resume", f"pause #{parsed.pause} resumed a second time")
            resumed.add(parsed.pause)
            if parsed.pause not in waits.pauses:
                if seen(parsed.pause):
                    problem("early-resume", f"resumed pause #{parsed.pause}, which never paused")
            else:
                for kind, message in waits.resume(parsed):
                    problem(kind, message)
    return problems


class _Waits:
    """What the checks of waits need to know of a stream so far: each pause's waits, the
    signals recorded, who claimed what, the results and the waits given up."""

    def __init__(self) -> None:
        self.pauses: dict[int, TaskPaused] = {}
        self.wait: dict[str, PendingCall] = {}
        self.signals: dict[str, SignalReceived] = {}
        self.consumed: dict[str, str] = {}
        """Signal id to the wait that took it."""
        self.claims: dict[str, str | None] = {}
        """Wait to the message id its claim names."""
        self.outcomes: dict[str, str] = {}
        self.abandoned: dict[str, int] = {}
        """Wait given up to the pause whose resume gave it up."""

    def paused(self, pause: TaskPaused) -> None:
        self.pauses[pause.pause] = pause
        self.wait.update((w.subtask_id, w) for w in pause.calls)

    def claim(self, claim: SubtaskClaimed, partial: bool) -> Iterator[tuple[str, str]]:
        """The problems of a claim: of a wait given up, or of a signal wait by no signal of its
        name recorded before it, or by a signal another wait took."""
        wait_id, signal_id = claim.subtask_id, claim.message_id
        self.claims[wait_id] = signal_id
        if wait_id in self.abandoned:
            yield (
                "claim-after-abandon",
                f"{wait_id} claimed after the resume of pause #{self.abandoned[wait_id]} gave "
                "it up",
            )
        wait = self.wait.get(wait_id)
        by_signal = signal_id is not None and (
            signal_id in self.signals or (wait is not None and wait.kind == "signal")
        )
        if not by_signal:
            return
        assert signal_id is not None
        if signal_id in self.consumed:
            yield (
                "signal-reused",
                f"signal {signal_id} claims {wait_id}, but {self.consumed[signal_id]} took it",
            )
        else:
            self.consumed[signal_id] = wait_id
        if wait is None or wait.kind != "signal":
            return
        signal = self.signals.get(signal_id)
        if signal is None and not partial:  # a partial stream may start after the signal
            yield (
                "claim-without-signal",
                f"{wait_id} claimed by signal {signal_id}, which no SignalReceived before it "
                "records",
            )
        elif signal is not None and signal.name != wait.name:
            yield (
                "claim-without-signal",
                f"{wait_id} waits for signal {wait.name!r} but was claimed by signal "
                f"{signal_id}, named {signal.name!r}",
            )

    def result(self, result: ResultRecorded) -> Iterator[tuple[str, str]]:
        """The problems of a result: a timer's that is not ok, a signal wait's that is not its
        signal (ok) or its timeout (no signal)."""
        wait_id = result.subtask_id
        self.outcomes[wait_id] = result.outcome
        wait = self.wait.get(wait_id)
        if wait is None or wait_id not in self.claims:
            return
        if wait.kind == "timer" and result.outcome != "ok":
            yield "wrong-outcome", f"timer {wait_id} fired with outcome {result.outcome}, not ok"
        elif wait.kind == "signal":
            want = "timeout" if self.claims[wait_id] is None else "ok"
            if result.outcome != want:
                how = "timed out" if want == "timeout" else "took a signal"
                yield (
                    "wrong-outcome",
                    f"signal wait {wait_id} {how} but records outcome {result.outcome}, not {want}",
                )

    def resume(self, resume: TaskResumed) -> Iterator[tuple[str, str]]:
        """The problems of a resume: its pause's rule not met yet (every wait ended, or its
        FirstK reached or out of reach), or ``abandoned`` not the waits still open."""
        pause = self.pauses[resume.pause]
        ids = [w.subtask_id for w in pause.calls]
        still_open = [i for i in ids if i not in self.outcomes]
        successes = sum(self.outcomes.get(i) == "ok" for i in ids)
        k = pause.until
        if k is None and still_open:
            yield (
                "early-resume",
                f"resumed pause #{resume.pause} before the results of {', '.join(still_open)}",
            )
        elif k is not None and successes < k <= successes + len(still_open):
            yield (
                "early-resume",
                f"resumed pause #{resume.pause} (first {k}) after {successes} success(es), "
                f"with {len(still_open)} wait(s) still open that could reach {k}",
            )
        given_up = [c.subtask_id for c in resume.abandoned]
        if set(given_up) != set(still_open) and not (k is None and not given_up):
            yield (
                "wrong-abandoned",
                f"resume of pause #{resume.pause} gives up [{', '.join(given_up)}] but "
                f"[{', '.join(still_open)}] were still open",
            )
        self.abandoned.update((i, resume.pause) for i in given_up)


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
