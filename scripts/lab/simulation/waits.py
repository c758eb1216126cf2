"""What must hold of the waits beyond peer calls: signals, timers and ``FirstK`` pauses (issue 31).

The log's own consistency (``verify_stream``) cannot tell a signal taken by two waits from two
signals, a resumed handler given other results than the log holds, or a sender told ``taken`` of
a signal the log never recorded. These invariants read the raw events (not ``fold`` or the
``decide_*`` functions they judge) and hold them against what the world saw: the answers each
sender of a signal received and what each resumed run of the orchestrator was given
(``Observed.seen``). :func:`problems` requires:

1. each signal id is recorded at most once (``SignalReceived`` or ``SignalRefused``) and claims
   at most one wait; a claim of a signal's wait names a signal received before it (or in the same
   append) under the wait's name, and records its payload;
2. every wait, whatever its kind, is claimed at most once; a claim by a deadline (no message)
   comes at or after that deadline on the database's clock, and is ``ok`` for a timer and a
   ``timeout`` for a call or a signal's wait;
3. a pause resumes once, as soon as its rule is met and never before: every wait claimed, or,
   with ``FirstK(k)``, ``k`` successes or ``k`` out of reach; no wait of it is claimed after
   that; its ``abandoned`` are exactly the waits open then (each of them that is a peer call gets
   its cancel: ``.reality``);
4. the run resumed from a pause whose outcome the log holds was given exactly the results the
   log holds, in wait order: the payload of a signal, ``ok`` of a timer, ``cancelled`` for a
   wait given up (each run records a digest of what it was given with its outcome: a run in
   place whose append found the stream moved on, and was run again, is not held to it); and
   every run, that one too, was given each result the log held when it began (a run on a
   stale copy of its stream is not);
5. a signal whose sender was told ``taken``, ``kept`` or ``duplicate`` is in the log (``taken``:
   with its claim); one whose sender heard only refusals (``undeliverable``, ``invalid``) is not
   and claimed nothing; only a payload that does not fit is ``invalid``, and such a payload is
   never recorded as received; every signal sent is answered (unless its delivery, or its
   answer, was dead-lettered);
6. nothing is left: no pending wait (``pending_calls``) of a task that has finished, and the
   signals a stream keeps for a later wait are exactly those it received and no wait took.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from waystation.events import RecordedEvent, fold
from waystation.events.codec import canonical
from waystation.protocol.wire import derived_id

from .scenario import SignalSpec
from .world import Logged, Observed, Seen, fingerprint

__all__ = ["problems"]

_TERMINAL = ("TaskCompleted", "TaskFailed", "TaskCancelled")
_AUDIT_ONLY = ("ReplyIgnored", "SignalRefused")
_SLACK = 1e-6
"""Seconds of rounding a timestamp may lose (``recorded_at`` is a datetime)."""


def problems(observed: Observed, streams: dict[str, list[RecordedEvent]]) -> list[str]:
    found: list[str] = []
    for task_id, events in streams.items():
        pauses = _pauses(events)
        found.extend(f"{task_id}: {p}" for p in _signals_recorded_once(events, pauses))
        found.extend(f"{task_id}: {p}" for p in _claims(events, pauses))
        found.extend(f"{task_id}: {p}" for p in _resumes(events, pauses))
        found.extend(f"{task_id}: {p}" for p in _kept(task_id, events, pauses))
        for (seen_task, pause), runs in observed.seen.items():
            if seen_task == task_id:
                given = _given(events, pauses.get(pause), pause, runs)
                found.extend(f"{task_id}: {p}" for p in given)
                stale = _stale(pause, runs, observed.logged.get((task_id, pause), []))
                found.extend(f"{task_id}: {p}" for p in stale)
    found.extend(_answers(observed, streams))
    found.extend(_nothing_left(observed, streams))
    return found


# ---- the stream, read raw --------------------------------------------------------------------


@dataclass
class _Wait:
    wait_id: str
    kind: str
    agent: str
    name: str | None
    deadline: float


@dataclass
class _Pause:
    number: int
    waits: list[_Wait]
    until: int | None
    claims: dict[str, list[tuple[RecordedEvent, RecordedEvent | None]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    """Each claimed wait, to its claims (``SubtaskClaimed`` with the ``ResultRecorded`` after)."""
    resumes: list[RecordedEvent] = field(default_factory=list)

    def wait(self, wait_id: str) -> _Wait | None:
        return next((w for w in self.waits if w.wait_id == wait_id), None)


def _pauses(events: list[RecordedEvent]) -> dict[int, _Pause]:
    pauses: dict[int, _Pause] = {}
    deadlines: dict[str, float] = {}
    for position, event in enumerate(events):
        data = event.data
        if event.event_type == "TaskPaused":
            waits = [
                _Wait(
                    c["subtask_id"],
                    c.get("kind", "call"),
                    c["agent"],
                    c.get("name"),
                    float(c["deadline_at"]),
                )
                for c in data["calls"]
            ]
            pauses.setdefault(data["pause"], _Pause(data["pause"], waits, data.get("until")))
        elif event.event_type == "DeadlineExtended":
            deadlines[data["subtask_id"]] = float(data["deadline_at"])
        elif event.event_type == "SubtaskClaimed" and data["pause"] in pauses:
            result = next(
                (
                    e
                    for e in events[position + 1 :]
                    if e.event_type == "ResultRecorded"
                    and e.data["subtask_id"] == data["subtask_id"]
                ),
                None,
            )
            pauses[data["pause"]].claims[data["subtask_id"]].append((event, result))
        elif event.event_type == "TaskResumed" and data["pause"] in pauses:
            pauses[data["pause"]].resumes.append(event)
    for pause in pauses.values():
        for wait in pause.waits:
            wait.deadline = deadlines.get(wait.wait_id, wait.deadline)
    return pauses


def _received(events: list[RecordedEvent]) -> dict[str, RecordedEvent]:
    return {e.data["signal_id"]: e for e in events if e.event_type == "SignalReceived"}


def _at(event: RecordedEvent) -> float:
    assert event.recorded_at is not None
    return event.recorded_at.timestamp()


# ---- 1. a signal is recorded once and taken by one wait ----------------------------------------


def _signals_recorded_once(events: list[RecordedEvent], pauses: dict[int, _Pause]) -> list[str]:
    found = []
    records: dict[str, int] = defaultdict(int)
    for event in events:
        if event.event_type in ("SignalReceived", "SignalRefused"):
            records[event.data["signal_id"]] += 1
    for signal_id, count in records.items():
        if count > 1:
            found.append(f"signal {signal_id} recorded {count} times")
    taken_by: dict[str, list[str]] = defaultdict(list)
    for pause in pauses.values():
        for wait_id, claims in pause.claims.items():
            wait = pause.wait(wait_id)
            for claim, _ in claims:
                if wait is not None and wait.kind == "signal" and claim.data.get("message_id"):
                    taken_by[claim.data["message_id"]].append(wait_id)
    for signal_id, waits in taken_by.items():
        if len(waits) > 1:
            found.append(f"signal {signal_id} taken by {len(waits)} waits: {', '.join(waits)}")
    return found


# ---- 2. every wait is claimed once, by what ends it --------------------------------------------


def _claims(events: list[RecordedEvent], pauses: dict[int, _Pause]) -> list[str]:
    found = []
    received = _received(events)
    for pause in pauses.values():
        for wait_id, claims in pause.claims.items():
            wait = pause.wait(wait_id)
            if wait is None:
                found.append(f"{wait_id} claimed, and pause #{pause.number} has no such wait")
                continue
            if len(claims) > 1:
                found.append(f"{wait.kind} wait {wait_id} claimed {len(claims)} times")
            for claim, result in claims:
                if result is None:
                    found.append(f"{wait_id} claimed with no result recorded")
                    continue
                found.extend(_claim_problems(wait, claim, result, received))
    return found


def _claim_problems(
    wait: _Wait, claim: RecordedEvent, result: RecordedEvent, received: dict[str, RecordedEvent]
) -> list[str]:
    message_id = claim.data.get("message_id")
    outcome = result.data["outcome"]
    if message_id is None:  # its deadline claimed it
        expected = "ok" if wait.kind == "timer" else "timeout"
        found = []
        if outcome != expected:
            found.append(f"{wait.kind} wait {wait.wait_id} claimed by its deadline as {outcome}")
        if _at(claim) < wait.deadline - _SLACK:
            found.append(
                f"{wait.kind} wait {wait.wait_id} claimed by its deadline "
                f"{wait.deadline - _at(claim):.3f}s before it"
            )
        return found
    if wait.kind == "timer":
        return [f"timer {wait.wait_id} claimed by message {message_id}"]
    if wait.kind != "signal":
        return []  # a peer's reply (.reality)
    signal = received.get(message_id)
    if signal is None or signal.stream_version > claim.stream_version:
        return [f"signal wait {wait.wait_id} claimed by {message_id}, not a signal received before"]
    if signal.data["name"] != wait.name:
        return [
            f"signal wait {wait.wait_id} on {wait.name!r} taken by {message_id}, "
            f"a signal {signal.data['name']!r}"
        ]
    payload = signal.data.get("payload")
    if outcome != "ok" or canonical(result.data.get("value")) != canonical(payload):
        return [
            f"signal wait {wait.wait_id} records {outcome} {result.data.get('value')!r}, "
            f"and its signal {message_id} carried {payload!r}"
        ]
    return []


# ---- 3. one resume per pause, by its rule ------------------------------------------------------


def _resumes(events: list[RecordedEvent], pauses: dict[int, _Pause]) -> list[str]:
    found = []
    for pause in pauses.values():
        if len(pause.resumes) > 1:
            found.append(f"pause #{pause.number} resumed {len(pause.resumes)} times")
        found.extend(_by_its_rule(events, pause))
    return found


def _by_its_rule(events: list[RecordedEvent], pause: _Pause) -> list[str]:
    """Walk ``pause``'s claims in stream order: its rule is met at most at the last of them,
    its resume follows that claim, and gives up exactly the waits open then."""
    found = []
    claimed: dict[str, str] = {}
    met_at: int | None = None
    resume = pause.resumes[0] if pause.resumes else None
    for event in events:
        data = event.data
        if event.event_type == "ResultRecorded" and data.get("pause") == pause.number:
            if data["subtask_id"] in claimed:
                continue  # a second claim: reported with the claims
            if met_at is not None or (
                resume is not None and event.stream_version > resume.stream_version
            ):
                found.append(
                    f"{data['subtask_id']} claimed after pause #{pause.number} had what it "
                    "waited for"
                )
            claimed[data["subtask_id"]] = data["outcome"]
            if _rule_met(pause, claimed):
                met_at = event.stream_version
        elif event is resume:
            if met_at is None:
                found.append(
                    f"pause #{pause.number} resumed before its rule was met "
                    f"({_rule(pause)}; claimed {sorted(claimed)})"
                )
            given_up = {c["subtask_id"] for c in data.get("abandoned", ())}
            still_open = {w.wait_id for w in pause.waits} - set(claimed)
            if given_up != still_open:
                found.append(
                    f"pause #{pause.number} resumed giving up {sorted(given_up)}, while "
                    f"{sorted(still_open)} were open"
                )
            met_at = None if met_at is None else -1  # resumed: no further claim may come
        elif met_at is not None and met_at >= 0 and event.event_type not in _AUDIT_ONLY:
            if event.event_type not in ("SubtaskClaimed", "ResultRecorded", "SignalReceived"):
                found.append(
                    f"pause #{pause.number} had what it waited for at v{met_at}, and "
                    f"{event.event_type} came before its resume"
                )
                met_at = -1
    if met_at is not None and met_at >= 0 and resume is None:
        if not any(e.event_type in _TERMINAL for e in events):
            found.append(f"pause #{pause.number} had what it waited for and never resumed")
    return found


def _rule(pause: _Pause) -> str:
    return "every wait" if pause.until is None else f"FirstK({pause.until})"


def _rule_met(pause: _Pause, claimed: dict[str, str]) -> bool:
    open_waits = len(pause.waits) - len(claimed)
    if pause.until is None:
        return open_waits == 0
    successes = sum(outcome == "ok" for outcome in claimed.values())
    return successes >= pause.until or successes + open_waits < pause.until or open_waits == 0


# ---- 4. a resumed run is given what the log holds ----------------------------------------------


def _given(
    events: list[RecordedEvent], pause: _Pause | None, number: int, runs: list[Seen]
) -> list[str]:
    if pause is None:
        return [f"a run resumed from pause #{number}, which the log does not hold"]
    if not pause.resumes:
        return []  # runs in place whose append found the task ended meanwhile (a cancel)
    resume = pause.resumes[0]
    recorded = _recorded_fingerprint(events, resume)
    if recorded is None:
        return []  # no outcome of a run recorded (it failed, or the task was cancelled)
    given_up = {c["subtask_id"] for c in resume.data.get("abandoned", ())}
    expected: list[tuple[str, str, str, str, str | None]] = []
    for wait in pause.waits:
        claims = pause.claims.get(wait.wait_id)
        name = wait.name if wait.kind != "call" else None
        if claims and claims[0][1] is not None:
            result = claims[0][1].data
            value = canonical(result.get("value")).decode()
            expected.append((wait.wait_id, result["outcome"], value, wait.kind, name))
        elif wait.wait_id in given_up:
            expected.append((wait.wait_id, "cancelled", "null", wait.kind, name))
    if recorded == fingerprint(tuple(expected)):
        return []
    given = next((list(run) for run in runs if fingerprint(run) == recorded), "(no run's)")
    return [
        f"the run resumed from pause #{number} whose outcome the log holds was given {given}, "
        f"and the log holds {expected}"
    ]


def _stale(number: int, runs: list[Seen], logged: list[Logged]) -> list[str]:
    for given, held in zip(runs, logged, strict=True):
        results = {wait: (outcome, value) for wait, outcome, value, _, _ in given}
        for wait, outcome, value in held:
            if results.get(wait) != (outcome, value):
                return [
                    f"a run resumed from pause #{number} began when the log held {outcome} "
                    f"{value} for {wait}, and was given {results.get(wait)}: a stale copy"
                ]
    return []


def _recorded_fingerprint(events: list[RecordedEvent], resume: RecordedEvent) -> str | None:
    """The digest of what it was given that the run resumed by ``resume`` recorded with its
    outcome (``.world.fingerprint``), if the log holds its outcome."""
    for event in events:
        if event.stream_version <= resume.stream_version or event.event_type in _AUDIT_ONLY:
            continue
        if event.event_type == "TaskPaused":
            return event.data.get("state_delta", {}).get("seen")
        if event.event_type == "TaskCompleted" and isinstance(event.data["result"], dict):
            return event.data["result"].get("seen")
        if event.event_type in _TERMINAL or event.event_type == "TaskResumed":
            return None
    return None


# ---- 5. what a signal's sender hears agrees with the log ----------------------------------------


def _answers(observed: Observed, streams: dict[str, list[RecordedEvent]]) -> list[str]:
    found = []
    for spec in observed.scenario.tasks:
        events = streams.get(spec.task_id, [])
        received = _received(events)
        claimers = {e.data.get("message_id") for e in events if e.event_type == "SubtaskClaimed"}
        for signal in spec.signals:
            if signal.signal_id not in observed.signals_sent:
                continue  # not sent (signals turned off)
            answers = observed.signal_answers.get(signal.signal_id, [])
            found.extend(
                f"signal {signal.signal_id}: {p}"
                for p in _answer_problems(observed, signal, answers, received, claimers)
            )
    return found


def _answer_problems(
    observed: Observed,
    signal: SignalSpec,
    answers: list[Any],
    received: dict[str, RecordedEvent],
    claimers: set[Any],
) -> list[str]:
    signal_id = signal.signal_id
    if not answers:
        if _dead_lettered(observed, signal_id):
            return []
        return ["sent, and its sender never heard what became of it"]
    found = []
    statuses = [_status(answer) for answer in answers]
    for status in statuses:
        if status in ("taken", "kept", "duplicate") and signal_id not in received:
            found.append(f"its sender was told {status!r}, and the log holds no SignalReceived")
        if status == "taken" and signal_id not in claimers:
            found.append("its sender was told 'taken', and no wait claimed it")
        if status == "invalid" and signal.valid:
            found.append(f"its payload {signal.payload} fits, and it was refused as invalid")
        if status not in ("taken", "kept", "duplicate", "invalid", "undeliverable"):
            found.append(f"its sender was told {status!r}")
    if not signal.valid and (signal_id in received or signal_id in claimers):
        found.append(f"its payload {signal.payload} does not fit, and it was received")
    if all(s in ("invalid", "undeliverable") for s in statuses) and (
        signal_id in received or signal_id in claimers
    ):
        found.append(f"its sender heard only {sorted(set(statuses))}, and the log applied it")
    return found


def _status(answer: Any) -> str:
    if not isinstance(answer, dict):
        return repr(answer)
    if answer.get("status") == "ok":
        return str((answer.get("result") or {}).get("status"))
    return str((answer.get("error") or {}).get("type"))


def _dead_lettered(observed: Observed, signal_id: str) -> bool:
    answer = derived_id(derived_id(signal_id, ":signal"), ":result")
    return any(
        letter.properties.get("message_id") in (signal_id, answer)
        for letter in observed.dead_letters
    )


# ---- 6. nothing is left --------------------------------------------------------------------------


def _nothing_left(observed: Observed, streams: dict[str, list[RecordedEvent]]) -> list[str]:
    found = []
    for wait_id, task_id in observed.pending.items():
        if any(e.event_type in _TERMINAL for e in streams.get(task_id, [])):
            found.append(f"{task_id}: its wait {wait_id} is still pending, and it has finished")
    return found


def _kept(task_id: str, events: list[RecordedEvent], pauses: dict[int, _Pause]) -> list[str]:
    if not any(e.event_type == "SignalReceived" for e in events):
        return []
    taken = {
        claim.data.get("message_id")
        for pause in pauses.values()
        for claims in pause.claims.values()
        for claim, _ in claims
    }
    waiting = [s for s in _received(events) if s not in taken]
    kept = list(fold(task_id, events).kept)
    if kept != waiting:
        return [f"keeps the signals {kept}, and {waiting} were received and not taken"]
    return []
