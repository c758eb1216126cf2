"""Property tests of the task's pure state machine (``events/task.py``).

A tiny driver plays the runtime's part without a broker or a database: it folds the task's stream
from an :class:`~waystation.events.memory.InMemoryEventStore`, asks ``decide_*`` what to append,
turns the decided :class:`~waystation.events.model.DomainEvent` objects into ``NewEvent`` rows with
the deterministic
:func:`~waystation.events.task.event_id` (the causation keys the worker uses), appends them at the
version it read, and folds again. Hypothesis chooses the script (how often the handler pauses, how
many calls, what it does to its state) and the order in which replies, redeliveries, genuine
duplicates, replies for unknown calls and resume messages arrive.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import pytest
from hypothesis import Phase, given, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st

from waystation.events import (
    AppendResult,
    Call,
    Complete,
    DomainEvent,
    EventMetadata,
    InvalidTransition,
    NewEvent,
    Pause,
    PendingCall,
    RecordedEvent,
    ReplyIgnored,
    ResultRecorded,
    SubtaskClaimed,
    TaskCancelled,
    TaskCompleted,
    TaskFailed,
    TaskPaused,
    TaskResumed,
    TaskStarted,
    TaskState,
    VersionConflict,
    apply_delta,
    canonical,
    decide_outcome,
    decide_reply,
    event_id,
    fold,
    parse,
    parse_subtask_id,
    subtask_id,
)
from waystation.events.memory import InMemoryEventStore
from waystation.events.model import SignalReceived, SignalRefused
from waystation.events.simulation import simulate
from waystation.events.task import MAX_IGNORED_REPLIES, over_ignored_limit

NOW = 1_700_000_000.0
DEFAULT_TIMEOUT = 30.0
T = TypeVar("T")
Outcome = Literal["ok", "error", "timeout"]

# ---- strategies ----------------------------------------------------------------------------------

# what the log can store: no NUL character (jsonb refuses it), no NaN or infinity
storable_text = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=8
)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | storable_text
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(storable_text.filter(lambda k: len(k) <= 4), children, max_size=3)
    ),
    max_leaves=8,
)
# Values that collide a lot (equal in Python yet different in JSON: 1, 1.0, True; 0.0 and -0.0)
# so that updates often repeat, or nearly repeat, what the state already holds.
colliding_values = st.sampled_from(
    [0, 1, 1.0, True, False, 0.0, -0.0, "x", [1], [1.0], {"k": 1}, {"k": True}, 1e16, 10**16]
)
state_values = st.one_of(
    colliding_values, colliding_values, json_values.filter(lambda v: v is not None)
)
state_updates = st.dictionaries(
    st.sampled_from(["a", "b", "c"]), st.none() | state_values, max_size=3
)
task_ids = st.text(alphabet="ab:-_é", min_size=1, max_size=10)


@dataclass(frozen=True)
class PauseSpec:
    timeouts: tuple[float | None, ...]
    update: dict[str, Any]

    def outcome(self, pause: int) -> Pause:
        calls = [
            Call(agent=f"peer{index % 3}", input={"pause": pause, "index": index}, timeout=timeout)
            for index, timeout in enumerate(self.timeouts)
        ]
        return Pause(calls=calls, update=self.update)


pause_specs = st.builds(
    PauseSpec,
    timeouts=st.lists(
        st.none() | st.floats(min_value=0.001, max_value=86_400), min_size=1, max_size=6
    ).map(tuple),
    update=state_updates,
)


@dataclass(frozen=True)
class Script:
    """What the handler does: pause ``len(pauses)`` times, then complete with ``result``."""

    pauses: tuple[PauseSpec, ...]
    result: Any


scripts = st.builds(
    Script, pauses=st.lists(pause_specs, min_size=1, max_size=3).map(tuple), result=json_values
)


# ---- the driver ----------------------------------------------------------------------------------


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine of the in-memory store, which completes without ever suspending."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    coroutine.close()
    raise AssertionError("the in-memory store suspended; it must complete without awaiting")


class Log:
    """One task's stream, and the writer's side of the runtime: fold, decide, append."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.store = InMemoryEventStore()

    def recorded(self) -> list[RecordedEvent]:
        return run(self.store.read_stream(self.task_id))

    def state(self) -> TaskState:
        return fold(self.task_id, self.recorded())

    def events(self) -> list[DomainEvent]:
        return [parse(event) for event in self.recorded()]

    def new_events(self, events: list[DomainEvent], key: str) -> list[NewEvent]:
        metadata = EventMetadata(worker_id="w", causation_id=key, correlation_id=self.task_id)
        return [
            NewEvent.of(event_id(self.task_id, key, index), event, metadata)
            for index, event in enumerate(events)
        ]

    def append(self, state: TaskState, events: list[DomainEvent], key: str) -> AppendResult:
        return run(
            self.store.append(
                self.task_id,
                state.version,
                self.new_events(events, key),
                prev_hash=state.last_hash,
            )
        )


def started(task_id: str) -> TaskStarted:
    return TaskStarted(agent="orchestrator", input={"task": task_id}, reply_to="client.replies")


def reply_key(subtask: str, events: list[DomainEvent], message_id: str | None) -> str:
    """The causation key the worker uses for a reply's events."""
    if isinstance(events[0], SubtaskClaimed):
        return f"reply:{subtask}"
    return f"ignored:{subtask}:{message_id}"


def start_task(log: Log, outcome: Pause) -> TaskState:
    state = TaskState(task_id=log.task_id)
    events = decide_outcome(
        state, outcome, now=NOW, default_timeout=DEFAULT_TIMEOUT, start=started(log.task_id)
    )
    log.append(state, events, "run")
    return log.state()


def paused_task(task_id: str, calls: int, update: Mapping[str, Any] | None = None) -> Log:
    log = Log(task_id)
    start_task(log, Pause(calls=[Call(f"peer{i}") for i in range(calls)], update=update or {}))
    return log


def deliver(
    log: Log, subtask: str, message_id: str | None, value: Any = None, outcome: Outcome = "ok"
) -> list[DomainEvent]:
    """Decide on one reply and append what was decided; returns the decided events."""
    state = log.state()
    events = decide_reply(state, subtask, outcome=outcome, value=value, message_id=message_id)
    if events:
        log.append(state, events, reply_key(subtask, events, message_id))
    return events


def intended_state(state: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """The state a handler means by ``update`` (an independent model: None deletes)."""
    merged = {**state, **update}
    return {key: value for key, value in merged.items() if value is not None}


def state_of(state: TaskState) -> dict[str, Any]:
    return dict(state.state)


# ---- the scenario: one task, random deliveries ---------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    subtask: str
    message_id: str
    outcome: Outcome
    value: Any
    kind: Literal["primary", "redelivery", "duplicate", "unknown"]


@dataclass(frozen=True)
class Resume:
    pause: int


@dataclass
class Observed:
    """What the scenario saw, to check against the stream at the end."""

    first_reply: dict[str, Delivery] = field(default_factory=dict)
    results_at_resume: dict[int, list[tuple[str, str, Any]]] = field(default_factory=dict)
    intended: dict[str, Any] = field(default_factory=dict)
    resumes_run: list[int] = field(default_factory=list)
    ignored: set[tuple[str, str]] = field(default_factory=set)


def deliveries_for(data: st.DataObject, task_id: str, pause: int, calls: int) -> list[Delivery]:
    """Each call's reply plus random redeliveries, genuine duplicates and unknown-call replies."""
    found: list[Delivery] = []
    for index in range(calls):
        sub = subtask_id(task_id, pause, index)
        primary = Delivery(
            sub,
            f"m-{pause}-{index}",
            data.draw(st.sampled_from(["ok", "error", "timeout"])),
            data.draw(json_values),
            "primary",
        )
        found.append(primary)
        for copy in range(data.draw(st.integers(0, 2))):
            found.append(
                Delivery(sub, primary.message_id, primary.outcome, primary.value, "redelivery")
            )
            if data.draw(st.booleans()):
                found.append(
                    Delivery(sub, f"m-{pause}-{index}-dup{copy}", "ok", ["dup", copy], "duplicate")
                )
    unknown = [
        subtask_id(task_id, pause, calls),
        subtask_id(task_id, pause, calls + 7),
        subtask_id(task_id, pause + 10, 0),
        subtask_id(task_id + "x", pause, 0),
    ]
    for number in range(data.draw(st.integers(0, 2))):
        sub = data.draw(st.sampled_from(unknown))
        found.append(Delivery(sub, f"m-unknown-{pause}-{number}", "ok", None, "unknown"))
    return found


def handle_delivery(log: Log, delivery: Delivery, observed: Observed) -> None:
    before = log.state()
    events = decide_reply(
        before,
        delivery.subtask,
        outcome=delivery.outcome,
        value=delivery.value,
        message_id=delivery.message_id,
    )
    current = {call.subtask_id for call in before.outstanding}
    if delivery.subtask in before.claims:
        if before.claims[delivery.subtask] == delivery.message_id:
            assert events == [], "a redelivery of the claiming message must decide nothing"
        else:
            assert events == [
                ReplyIgnored(
                    subtask_id=delivery.subtask,
                    reason="duplicate",
                    message_id=delivery.message_id,
                    outcome=delivery.outcome,
                )
            ]
    elif before.finished:
        assert [(type(e), getattr(e, "reason", None)) for e in events] == [(ReplyIgnored, "late")]
    elif before.status == "paused" and delivery.subtask in current:
        assert delivery.kind != "unknown"
        observed.first_reply[delivery.subtask] = delivery
        expected: list[DomainEvent] = [
            SubtaskClaimed(
                subtask_id=delivery.subtask, pause=before.pause, message_id=delivery.message_id
            ),
            ResultRecorded(
                subtask_id=delivery.subtask,
                pause=before.pause,
                outcome=delivery.outcome,
                value=delivery.value,
            ),
        ]
        if current == {delivery.subtask}:
            expected.append(TaskResumed(pause=before.pause))
        assert events == expected
    else:
        assert [(type(e), getattr(e, "reason", None)) for e in events] == [
            (ReplyIgnored, "unknown-call")
        ]
    if not events:
        return
    result = log.append(before, events, reply_key(delivery.subtask, events, delivery.message_id))
    if isinstance(events[0], ReplyIgnored):
        # an ignored reply delivered again decides the same audit event, with the same ids
        seen = (delivery.subtask, delivery.message_id)
        assert result.duplicate == (seen in observed.ignored)
        observed.ignored.add(seen)
        if result.duplicate:
            assert log.state().version == before.version
            return
    else:
        assert not result.duplicate
    after = log.state()
    if any(isinstance(e, ReplyIgnored) for e in events):
        # audit only: nothing but the version and the head hash moves
        assert_same_task(before, after)
    # a re-run of the very same decision (a crash after the commit, before the ack) writes nothing
    again = log.append(before, events, reply_key(delivery.subtask, events, delivery.message_id))
    assert again.duplicate and again.version == after.version and again.last_hash == after.last_hash
    assert log.state().version == after.version


def assert_same_task(before: TaskState, after: TaskState) -> None:
    for name in ("status", "pause", "calls", "result", "error", "known_calls", "agent", "input"):
        assert getattr(after, name) == getattr(before, name), name
    assert dict(after.claims) == dict(before.claims)
    assert dict(after.results) == dict(before.results)
    assert canonical(state_of(after)) == canonical(state_of(before))


def handle_resume(
    log: Log, resume: Resume, script: Script, observed: Observed, data: st.DataObject
) -> list[Delivery]:
    """Run the handler again after pause ``resume.pause``, as the resume message would."""
    state = log.state()
    if state.status != "resumed" or state.pause != resume.pause:
        return []  # a duplicate resume message: already done, nothing to run
    observed.resumes_run.append(resume.pause)
    assert len(state.results_of_pause()) == len(state.calls)
    observed.results_at_resume[resume.pause] = [
        (r.subtask_id, r.outcome, r.value) for r in state.results_of_pause()
    ]
    if resume.pause < len(script.pauses):
        return record_pause(log, state, script.pauses[resume.pause], observed, data)
    events = decide_outcome(
        state, Complete(script.result), now=NOW, default_timeout=DEFAULT_TIMEOUT
    )
    assert events == [TaskCompleted(result=script.result)]
    log.append(state, events, f"resume:{resume.pause}")
    return []


def record_pause(
    log: Log, before: TaskState, spec: PauseSpec, observed: Observed, data: st.DataObject
) -> list[Delivery]:
    number = before.pause + 1
    now = NOW + number
    events = decide_outcome(
        before,
        spec.outcome(number),
        now=now,
        default_timeout=DEFAULT_TIMEOUT,
        start=started(log.task_id) if before.status == "new" else None,
    )
    paused = events[-1]
    assert isinstance(paused, TaskPaused) and paused.pause == number
    # deterministic ids, call order, deadlines measured from dispatch
    assert [c.subtask_id for c in paused.calls] == [
        subtask_id(log.task_id, number, i) for i in range(len(spec.timeouts))
    ]
    assert [c.deadline_at for c in paused.calls] == [
        now + (DEFAULT_TIMEOUT if t is None else t) for t in spec.timeouts
    ]
    # a minimal delta: None only for keys that exist, values only where they change the JSON
    previous = state_of(before)
    for key, value in paused.state_delta.items():
        if value is None:
            assert key in previous
        else:
            assert key not in previous or canonical(previous[key]) != canonical(value)
    for key, value in spec.update.items():
        if key not in paused.state_delta:
            assert (value is None and key not in previous) or (
                key in previous and canonical(previous[key]) == canonical(value)
            ), f"{key!r} was dropped from the delta but changes the state"
    observed.intended = intended_state(observed.intended, spec.update)
    assert canonical(apply_delta(previous, paused.state_delta)) == canonical(observed.intended)
    key = "run" if before.status == "new" else f"resume:{before.pause}"
    log.append(before, events, key)
    after = log.state()
    assert after.status == "paused" and after.pause == number
    assert canonical(state_of(after)) == canonical(observed.intended)
    return deliveries_for(data, log.task_id, number, len(spec.timeouts))


def check_final_stream(log: Log, script: Script, observed: Observed) -> None:
    state = log.state()
    events = log.events()
    pauses = len(script.pauses)
    assert state.status == "completed"
    assert canonical(state.result) == canonical(script.result)
    assert canonical(state_of(state)) == canonical(observed.intended)
    assert isinstance(events[0], TaskStarted)
    assert isinstance(events[-1], (TaskCompleted, ReplyIgnored))
    assert sum(isinstance(e, TaskCompleted) for e in events) == 1
    assert [e.pause for e in events if isinstance(e, TaskPaused)] == list(range(1, pauses + 1))
    # exactly one resume per pause, and each handler run saw every result, in call order
    assert [e.pause for e in events if isinstance(e, TaskResumed)] == list(range(1, pauses + 1))
    assert observed.resumes_run == list(range(1, pauses + 1))
    expected_subtasks = {
        subtask_id(log.task_id, number, index)
        for number, spec in enumerate(script.pauses, start=1)
        for index in range(len(spec.timeouts))
    }
    claims = [e for e in events if isinstance(e, SubtaskClaimed)]
    assert sorted(c.subtask_id for c in claims) == sorted(expected_subtasks)  # one claim each
    for position, event in enumerate(events):
        if isinstance(event, SubtaskClaimed):
            recorded = events[position + 1]
            assert isinstance(recorded, ResultRecorded)
            assert recorded.subtask_id == event.subtask_id and recorded.pause == event.pause
            first = observed.first_reply[event.subtask_id]
            assert event.message_id == first.message_id  # the first reply wins
            assert canonical([recorded.outcome, recorded.value]) == canonical(
                [first.outcome, first.value]
            )
    for number, spec in enumerate(script.pauses, start=1):
        ids = [subtask_id(log.task_id, number, i) for i in range(len(spec.timeouts))]
        first = [observed.first_reply[sub] for sub in ids]
        assert canonical(observed.results_at_resume[number]) == canonical(
            [(d.subtask, d.outcome, d.value) for d in first]
        )
        # the resume comes right after the last result of its pause, the next pause after it
        resumed_at = next(
            i for i, e in enumerate(events) if isinstance(e, TaskResumed) and e.pause == number
        )
        last_result = max(
            i for i, e in enumerate(events) if isinstance(e, ResultRecorded) and e.pause == number
        )
        assert resumed_at == last_result + 1
    # audit events change nothing: folding the stream without them gives the same task
    kept = [e for e in log.recorded() if e.event_type != "ReplyIgnored"]
    assert_same_task(state, fold(log.task_id, kept))


@settings(max_examples=100, deadline=None, phases=[p for p in Phase if p is not Phase.explain])
@given(script=scripts, task_id=task_ids, data=st.data())
def test_any_order_of_replies_claims_once_resumes_once_and_completes(
    script: Script, task_id: str, data: st.DataObject
) -> None:
    log = Log(task_id)
    observed = Observed()
    pool: list[Delivery | Resume] = list(
        record_pause(log, log.state(), script.pauses[0], observed, data)
    )
    steps = 0
    while pool:
        steps += 1
        assert steps < 1_000
        item = pool.pop(data.draw(st.integers(0, len(pool) - 1)))
        if isinstance(item, Resume):
            pool.extend(handle_resume(log, item, script, observed, data))
            continue
        version = log.state().version
        handle_delivery(log, item, observed)
        resumed = [e for e in log.events()[version:] if isinstance(e, TaskResumed)]
        for event in resumed:
            # the resume message, sometimes delivered twice
            pool.extend([Resume(event.pause)] * data.draw(st.integers(1, 2)))
        if log.state().finished and data.draw(st.booleans()):
            # a late reply for a call the task has no claim for
            pool.append(Delivery(subtask_id(task_id, 99, 0), "m-late", "ok", "late", "unknown"))
    check_final_stream(log, script, observed)


# ---- racing writers ------------------------------------------------------------------------------


@dataclass
class Writer:
    """A worker handling one message at a time: read the stream, decide, append."""

    item: Delivery | Resume | None = None
    state: TaskState | None = None
    events: list[DomainEvent] | None = None


@settings(max_examples=100, deadline=None, phases=[p for p in Phase if p is not Phase.explain])
@given(
    script=scripts,
    writers=st.integers(2, 3),
    data=st.data(),
)
def test_racing_writers_rereading_after_a_conflict_still_claim_once_and_resume_once(
    script: Script, writers: int, data: st.DataObject
) -> None:
    task_id = "race"
    log = Log(task_id)
    observed = Observed()
    pool: list[Delivery | Resume] = list(
        record_pause(log, log.state(), script.pauses[0], observed, data)
    )
    workers = [Writer() for _ in range(writers)]
    conflicts = 0
    steps = 0
    while pool or any(w.item is not None for w in workers):
        steps += 1
        assert steps < 5_000
        writer = data.draw(st.sampled_from(workers))
        if writer.item is None:
            if not pool:
                continue
            writer.item = pool.pop(data.draw(st.integers(0, len(pool) - 1)))
            writer.state = None
            continue
        if writer.state is None:
            # read the stream and decide (the other writers may move it before we append)
            writer.state = log.state()
            if isinstance(writer.item, Resume):
                state = writer.state
                if state.status != "resumed" or state.pause != writer.item.pause:
                    writer.item = None
                    continue
                if writer.item.pause < len(script.pauses):
                    spec = script.pauses[writer.item.pause]
                    outcome: Pause | Complete = spec.outcome(writer.item.pause + 1)
                else:
                    outcome = Complete(script.result)
                writer.events = decide_outcome(
                    state, outcome, now=NOW, default_timeout=DEFAULT_TIMEOUT
                )
            else:
                writer.events = decide_reply(
                    writer.state,
                    writer.item.subtask,
                    outcome=writer.item.outcome,
                    value=writer.item.value,
                    message_id=writer.item.message_id,
                )
            continue
        item, state, events = writer.item, writer.state, writer.events
        assert events is not None
        if not events:
            writer.item = None
            continue
        if isinstance(item, Resume):
            key = f"resume:{item.pause}"
        else:
            key = reply_key(item.subtask, events, item.message_id)
        version = state.version
        try:
            result = log.append(state, events, key)
        except VersionConflict:
            conflicts += 1
            writer.state = None  # re-read and decide again
            continue
        writer.item = None
        if result.duplicate:
            # the same ids were recorded by another writer (same claim, same resume): nothing new
            continue
        new = log.events()[version:]
        if isinstance(item, Delivery) and isinstance(new[0], SubtaskClaimed):
            observed.first_reply[item.subtask] = item
        for event in new:
            if isinstance(event, TaskResumed):
                pool.extend([Resume(event.pause)] * data.draw(st.integers(1, 2)))
            if isinstance(event, TaskPaused):
                pool.extend(deliveries_for(data, task_id, event.pause, len(event.calls)))
    state = log.state()
    events = log.events()
    number_of_pauses = len(script.pauses)
    assert state.status == "completed"
    assert [e.pause for e in events if isinstance(e, TaskPaused)] == list(
        range(1, number_of_pauses + 1)
    )
    assert [e.pause for e in events if isinstance(e, TaskResumed)] == list(
        range(1, number_of_pauses + 1)
    )
    claims = [e.subtask_id for e in events if isinstance(e, SubtaskClaimed)]
    expected = [
        subtask_id(task_id, number, index)
        for number, spec in enumerate(script.pauses, start=1)
        for index in range(len(spec.timeouts))
    ]
    assert sorted(claims) == sorted(expected)
    assert sum(isinstance(e, TaskCompleted) for e in events) == 1
    for event in events:
        if isinstance(event, SubtaskClaimed):
            assert event.message_id == observed.first_reply[event.subtask_id].message_id
    hypothesis_event(f"version conflicts: {min(conflicts, 3)}{'+' if conflicts > 3 else ''}")


def test_the_loser_of_a_race_gets_a_version_conflict_and_redecides() -> None:
    log = paused_task("t", calls=2)
    first_reader = log.state()
    second_reader = log.state()
    winner = decide_reply(first_reader, "t:1:0", outcome="ok", value="A", message_id="a")
    loser = decide_reply(second_reader, "t:1:1", outcome="ok", value="B", message_id="b")
    assert not any(isinstance(e, TaskResumed) for e in winner + loser)  # each thinks one is left
    log.append(first_reader, winner, reply_key("t:1:0", winner, "a"))
    with pytest.raises(VersionConflict) as conflict:
        log.append(second_reader, loser, reply_key("t:1:1", loser, "b"))
    assert conflict.value.expected_version == second_reader.version
    redecided = deliver(log, "t:1:1", "b", value="B")
    assert isinstance(redecided[-1], TaskResumed)  # the re-read shows it is now the last one
    state = log.state()
    assert state.status == "resumed"
    assert [(r.subtask_id, r.value) for r in state.results_of_pause()] == [
        ("t:1:0", "A"),
        ("t:1:1", "B"),
    ]


# ---- directed cases ------------------------------------------------------------------------------


def test_redelivery_of_the_claiming_message_decides_nothing_even_after_completion() -> None:
    log = paused_task("t", calls=1)
    assert [type(e) for e in deliver(log, "t:1:0", "m1", value=1)] == [
        SubtaskClaimed,
        ResultRecorded,
        TaskResumed,
    ]
    assert deliver(log, "t:1:0", "m1", value=1) == []
    state = log.state()
    log.append(state, decide_outcome(state, Complete("done"), now=NOW, default_timeout=1), "r")
    assert decide_reply(log.state(), "t:1:0", outcome="ok", value=1, message_id="m1") == []
    duplicate = decide_reply(log.state(), "t:1:0", outcome="ok", value=2, message_id="m2")
    assert duplicate == [
        ReplyIgnored(subtask_id="t:1:0", reason="duplicate", message_id="m2", outcome="ok")
    ]


def test_a_reply_without_a_message_id_is_never_taken_for_a_redelivery() -> None:
    log = paused_task("t", calls=2)
    deliver(log, "t:1:0", None, value=1)
    again = decide_reply(log.state(), "t:1:0", outcome="ok", value=1, message_id=None)
    assert [(type(e), e.reason) for e in again] == [(ReplyIgnored, "duplicate")]  # type: ignore[attr-defined]


def test_a_late_reply_after_completion_is_ignored_as_late() -> None:
    log = paused_task("t", calls=1)
    deliver(log, "t:1:0", "m1", value=1)
    state = log.state()
    log.append(state, decide_outcome(state, Complete(1), now=NOW, default_timeout=1), "r")
    assert log.state().status == "completed"
    events = deliver(log, "t:2:0", "m-late", value=3)
    assert events == [
        ReplyIgnored(subtask_id="t:2:0", reason="late", message_id="m-late", outcome="ok")
    ]
    assert log.state().status == "completed"


def test_a_reply_for_a_call_still_pending_when_the_task_failed_is_late() -> None:
    log = paused_task("t", calls=2)
    deliver(log, "t:1:0", "m1")
    state = log.state()
    log.append(state, [TaskFailed(error={"reason": "cancelled"})], "fail")
    events = deliver(log, "t:1:1", "m2", value="too late")
    assert [(type(e), e.reason) for e in events] == [(ReplyIgnored, "late")]  # type: ignore[attr-defined]
    assert "t:1:1" not in log.state().claims


def test_replies_for_calls_the_task_never_made_are_unknown_calls() -> None:
    log = paused_task("t", calls=2)
    for sub in ("t:1:2", "t:2:0", "u:1:0", "t:0:0"):
        assert [(type(e), e.reason) for e in deliver(log, sub, f"m-{sub}")] == [  # type: ignore[attr-defined]
            (ReplyIgnored, "unknown-call")
        ]
    assert log.state().claims == {}
    assert len(log.state().outstanding) == 2


def test_past_the_bound_of_ignored_replies_none_is_recorded_but_a_claim_still_is() -> None:
    log = paused_task("t", calls=2)
    for n in range(MAX_IGNORED_REPLIES):
        assert [type(e) for e in deliver(log, "t:9:0", f"junk-{n}")] == [ReplyIgnored]
    state = log.state()
    assert state.ignored_replies == MAX_IGNORED_REPLIES
    assert decide_reply(state, "t:9:0", outcome="ok", message_id="junk-more") == []
    assert over_ignored_limit(state, "t:9:0", "junk-more")
    claimed = deliver(log, "t:1:0", "m1", value=1)  # a real reply is applied as ever
    assert [type(e) for e in claimed] == [SubtaskClaimed, ResultRecorded]
    assert not over_ignored_limit(log.state(), "t:1:0", "m1")  # (its redelivery)
    assert decide_reply(log.state(), "t:1:0", outcome="ok", value=1, message_id="m1") == []


def test_a_reply_between_resume_and_the_next_pause_is_an_unknown_call() -> None:
    log = paused_task("t", calls=1)
    deliver(log, "t:1:0", "m1")
    assert log.state().status == "resumed"
    events = deliver(log, "t:2:0", "m2")
    assert [(type(e), e.reason) for e in events] == [(ReplyIgnored, "unknown-call")]  # type: ignore[attr-defined]


@given(result=json_values, record=st.booleans(), task_id=task_ids)
def test_a_new_task_that_completes_writes_nothing_unless_audited(
    result: Any, record: bool, task_id: str
) -> None:
    start = started(task_id)
    events = decide_outcome(
        TaskState(task_id=task_id),
        Complete(result),
        now=NOW,
        default_timeout=DEFAULT_TIMEOUT,
        start=start,
        record_completion=record,
    )
    if record:
        assert events == [start, TaskCompleted(result=result)]
        log = Log(task_id)
        log.append(TaskState(task_id=task_id), events, "run")
        state = log.state()
        assert state.status == "completed" and canonical(state.result) == canonical(result)
    else:
        assert events == []


def test_decide_outcome_refuses_what_does_not_apply() -> None:
    new = TaskState(task_id="t")
    with pytest.raises(InvalidTransition):
        decide_outcome(new, Complete(1), now=NOW, default_timeout=1)  # a new task needs its start
    log = paused_task("t", calls=1)
    for outcome in (Complete(1), Pause(calls=[Call("p")])):
        with pytest.raises(InvalidTransition):
            decide_outcome(log.state(), outcome, now=NOW, default_timeout=1)  # paused, not running
    deliver(log, "t:1:0", "m")
    state = log.state()
    log.append(state, decide_outcome(state, Complete(1), now=NOW, default_timeout=1), "r")
    with pytest.raises(InvalidTransition):
        decide_outcome(log.state(), Complete(2), now=NOW, default_timeout=1)  # finished


@pytest.mark.parametrize(
    ("calls", "default_timeout"),
    [
        ([], 10.0),
        ([Call("p", timeout=0)], 10.0),
        ([Call("p", timeout=-1.5)], 10.0),
        ([Call("p"), Call("q", timeout=0.0)], 10.0),
        ([Call("p")], 0.0),
        ([Call("p")], -1.0),
        ([Call("")], 10.0),
        (["not a call"], 10.0),
    ],
)
@pytest.mark.parametrize("status", ["new", "resumed"])
def test_a_bad_pause_is_an_invalid_transition(
    calls: list[Any], default_timeout: float, status: str
) -> None:
    if status == "new":
        state, start = TaskState(task_id="t"), started("t")
    else:
        log = paused_task("t", calls=1)
        deliver(log, "t:1:0", "m")
        state, start = log.state(), None
        assert state.status == "resumed"
    with pytest.raises(InvalidTransition):
        decide_outcome(
            state, Pause(calls=calls), now=NOW, default_timeout=default_timeout, start=start
        )


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


UNSTORABLE = {
    "nan": math.nan,
    "infinity": [1, -math.inf],
    "nul in a string": {"text": "a\x00b"},
    "nul in a key": {"a\x00": 1},
    "a lone surrogate": {"text": "\ud800"},
    "not json": {"when": object()},
    "a set": {1, 2},
    "beyond 64 bits": 2**70,
    "too deep": _nested(300),
}


@pytest.mark.parametrize("value", UNSTORABLE.values(), ids=UNSTORABLE.keys())
@pytest.mark.parametrize("status", ["new", "resumed"])
@pytest.mark.parametrize("where", ["result", "call input", "state update"])
def test_an_outcome_the_log_cannot_store_is_refused_before_anything_is_appended(
    value: Any, status: str, where: str
) -> None:
    """Such an outcome used to fail inside the commit, as an error the worker took for
    transient, so it was retried to the delivery limit (or a resumed task stayed resumed)."""
    if status == "new":
        state, start = TaskState(task_id="t"), started("t")
    else:
        log = paused_task("t", calls=1)
        deliver(log, "t:1:0", "m")
        state, start = log.state(), None
    outcome: Complete | Pause = {
        "result": Complete(value),
        "call input": Pause(calls=[Call("p", value)]),
        "state update": Pause(calls=[Call("p")], update={"k": value}),
    }[where]
    with pytest.raises(InvalidTransition, match="cannot be stored"):
        decide_outcome(
            state, outcome, now=NOW, default_timeout=1, start=start, record_completion=True
        )


def test_a_call_must_name_an_agent_a_queue_can_have() -> None:
    for agent in ("x" * 201, "a\x00b"):
        with pytest.raises(InvalidTransition, match="names no agent"):
            decide_outcome(
                TaskState(task_id="t"),
                Pause(calls=[Call(agent)]),
                now=NOW,
                default_timeout=1,
                start=started("t"),
            )


def test_state_keys_must_be_strings() -> None:
    with pytest.raises(InvalidTransition):
        decide_outcome(
            TaskState(task_id="t"),
            Pause(calls=[Call("p")], update={1: "x"}),  # type: ignore[dict-item]
            now=NOW,
            default_timeout=1,
            start=started("t"),
        )


# ---- state deltas --------------------------------------------------------------------------------


@given(
    state=st.dictionaries(st.sampled_from("abcdef"), state_values, max_size=6),
    update=state_updates,
)
def test_apply_delta_replaces_keys_and_none_deletes(
    state: dict[str, Any], update: dict[str, Any]
) -> None:
    before = dict(state)
    merged = apply_delta(state, update)
    assert state == before  # the input is not mutated
    for key, value in update.items():
        if value is None:
            assert key not in merged
        else:
            assert merged[key] is value
    for key in state.keys() - update.keys():
        assert merged[key] is state[key]
    assert set(merged) == (set(state) | {k for k, v in update.items() if v is not None}) - {
        k for k, v in update.items() if v is None
    }


@settings(max_examples=200)
@given(
    first=state_updates,
    second=state_updates,
    third=state_updates,
)
def test_state_round_trips_through_the_log_byte_identically(
    first: dict[str, Any], second: dict[str, Any], third: dict[str, Any]
) -> None:
    """Each pause's delta is minimal, and folding reproduces exactly the state the handler meant."""
    log = Log("t")
    intended: dict[str, Any] = {}
    for number, update in enumerate((first, second, third), start=1):
        before = log.state()
        events = decide_outcome(
            before,
            Pause(calls=[Call("p")], update=update),
            now=NOW,
            default_timeout=DEFAULT_TIMEOUT,
            start=started("t") if number == 1 else None,
        )
        paused = events[-1]
        assert isinstance(paused, TaskPaused)
        previous = state_of(before)
        intended = intended_state(intended, update)
        changed = {
            key
            for key in set(previous) | set(intended)
            if key not in previous
            or key not in intended
            or canonical(previous[key]) != canonical(intended[key])
        }
        assert set(paused.state_delta) == changed  # minimal: exactly the keys that change
        assert all((paused.state_delta[key] is None) == (key not in intended) for key in changed)
        log.append(before, events, "run" if number == 1 else f"resume:{number - 1}")
        assert canonical(state_of(log.state())) == canonical(intended)
        deliver(log, subtask_id("t", number, 0), f"m{number}")
    # fold is a pure function of the stream: folding again gives the same state
    assert canonical(state_of(fold("t", log.recorded()))) == canonical(intended)


def test_updates_equal_in_python_but_not_in_json_are_kept() -> None:
    """``1 == 1.0 == True`` in Python; the state must still become what the handler returned."""
    log = Log("t")
    start_task(log, Pause(calls=[Call("p")], update={"a": 1, "b": 0, "c": [1]}))
    deliver(log, "t:1:0", "m")
    before = log.state()
    update = {"a": True, "b": 0.0, "c": [1.0]}
    events = decide_outcome(
        before, Pause(calls=[Call("p")], update=update), now=NOW, default_timeout=1
    )
    paused = events[-1]
    assert isinstance(paused, TaskPaused)
    assert paused.state_delta == update
    log.append(before, events, "resume:1")
    assert canonical(state_of(log.state())) == canonical(update)


def test_mutating_a_loaded_state_persists_nothing() -> None:
    log = Log("t")
    start_task(log, Pause(calls=[Call("p")], update={"items": [1, 2], "nested": {"k": "v"}}))
    state = log.state()
    head = log.recorded()[-1].hash
    state.state["items"].append(3)
    state.state["nested"]["k"] = "changed"
    state.input["task"] = "changed"
    with pytest.raises(TypeError):
        state.state["new"] = 1  # type: ignore[index]
    again = log.state()
    assert dict(again.state) == {"items": [1, 2], "nested": {"k": "v"}}
    assert again.input == {"task": "t"}
    assert log.recorded()[-1].hash == head


# ---- ids -----------------------------------------------------------------------------------------


@given(task_id=st.text(min_size=1), pause=st.integers(0, 10**9), index=st.integers(0, 10**6))
def test_subtask_ids_round_trip_even_when_the_task_id_has_colons(
    task_id: str, pause: int, index: int
) -> None:
    value = subtask_id(task_id, pause, index)
    assert parse_subtask_id(value) == (task_id, pause, index)
    assert subtask_id(task_id, pause, index) == value  # deterministic


def test_subtask_ids_of_a_task_id_with_colons() -> None:
    assert subtask_id("a:b:c", 2, 3) == "a:b:c:2:3"
    assert parse_subtask_id("a:b:c:2:3") == ("a:b:c", 2, 3)
    assert parse_subtask_id("::1:0") == (":", 1, 0)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "t",
        "t:1",
        ":1:0",
        "t:x:0",
        "t:1:y",
        "t:1:",
        "t::0",
        "t:1_0:0",
        "t: 1:0",
        "t:+1:0",
        "t:-1:0",
        "t:01:0",
        "t:1:00",
        "t:1:\u0661",
    ],
)
def test_what_is_not_a_subtask_id_is_a_value_error(value: str) -> None:
    with pytest.raises(ValueError):
        parse_subtask_id(value)


@given(text=st.text(max_size=30))
def test_parse_subtask_id_accepts_only_what_subtask_id_produces(text: str) -> None:
    try:
        task_id, pause, index = parse_subtask_id(text)
    except ValueError:
        return
    assert subtask_id(task_id, pause, index) == text


@given(
    stream=st.text(max_size=12),
    key=st.text(max_size=12),
    index=st.integers(0, 100),
    other=st.tuples(st.text(max_size=12), st.text(max_size=12), st.integers(0, 100)),
)
def test_event_ids_are_deterministic_and_distinct_per_cause(
    stream: str, key: str, index: int, other: tuple[str, str, int]
) -> None:
    first = event_id(stream, key, index)
    assert first == event_id(stream, key, index)
    assert isinstance(first, uuid.UUID) and first.version == 5
    if other != (stream, key, index) and "\x1f" not in "".join((stream, key, *other[:2])):
        assert event_id(*other) != first


def test_a_rerun_of_the_same_pause_decides_the_same_events() -> None:
    """Flovyn bug 1: the same inputs give the same ids and events, so a re-run is a duplicate."""
    outcome = Pause(calls=[Call("a", {"x": 1}), Call("b", timeout=5)], update={"k": 1})
    first = decide_outcome(TaskState("t"), outcome, now=NOW, default_timeout=9, start=started("t"))
    second = decide_outcome(TaskState("t"), outcome, now=NOW, default_timeout=9, start=started("t"))
    assert first == second
    log = Log("t")
    log.append(TaskState("t"), first, "run")
    assert log.append(TaskState("t"), second, "run").duplicate
    assert len(log.recorded()) == 2
    paused = log.events()[1]
    assert isinstance(paused, TaskPaused)
    assert paused.calls == (
        PendingCall(
            subtask_id="t:1:0", agent="a", input={"x": 1}, deadline_at=NOW + 9, dispatched_at=NOW
        ),
        PendingCall(
            subtask_id="t:1:1", agent="b", input=None, deadline_at=NOW + 5, dispatched_at=NOW
        ),
    )


# ---- a fold that goes on from a state ------------------------------------------------------------


def _same_state(going_on: TaskState, whole: TaskState) -> bool:
    """Equal, and equal in what equality leaves out (the agents of every call)."""
    return going_on == whole and dict(going_on.call_agents) == dict(whole.call_agents)


@pytest.mark.parametrize("seed", range(3))
async def test_a_fold_going_on_from_a_state_is_the_fold_of_the_whole_stream(seed: int) -> None:
    """``fold(t, later, start=fold(t, earlier))`` is ``fold(t, earlier + later)`` at every split
    of every stream of a simulated log (pauses, replies, duplicates, timeouts, extensions,
    second pauses, cancellations, failures, signals, timers, first-k pauses), also going on
    event by event, and with an event this code cannot read."""
    store = InMemoryEventStore()
    tasks = await simulate(store, tasks=60, writers=3, seed=seed, in_flight=6, waits=True)
    assert len(tasks) == 60
    unreadable = RecordedEvent(
        stream_id="x",
        stream_version=0,
        event_id=uuid.uuid4(),
        event_type="FromTheFuture",
        data={},
        metadata={},
        schema_version=1,
        prev_hash=bytes(32),
        hash=bytes(32),
    )
    seen: set[str] = set()
    for task in tasks:
        stream = await store.read_stream(task.task_id)
        seen.update(event.event_type for event in stream)
        if stream and stream[0].event_type == "TaskStarted":  # traced, as a worker records it
            metadata = {**stream[0].metadata, "trace_id": f"trace-{task.task_id}"}
            stream[0] = dataclasses.replace(stream[0], metadata=metadata)
        stream.insert(len(stream) // 2, unreadable)
        whole = fold(task.task_id, stream)
        assert whole.trace_id == (f"trace-{task.task_id}" if whole.agent else None)
        assert whole.call_agents.keys() == whole.known_calls
        for split in range(len(stream) + 1):
            start = fold(task.task_id, stream[:split])
            assert _same_state(fold(task.task_id, stream[split:], start=start), whole), split
        step = fold(task.task_id, [])
        for event in stream:
            step = fold(task.task_id, [event], start=step)
        assert _same_state(step, whole)
    assert seen >= {
        "TaskStarted",
        "TaskPaused",
        "SubtaskClaimed",
        "ResultRecorded",
        "ReplyIgnored",
        "TaskResumed",
        "DeadlineExtended",
        "TaskCompleted",
        "TaskFailed",
        "TaskCancelled",
        "SignalReceived",
    }, seen


@pytest.mark.parametrize("seed", range(3))
async def test_the_simulated_log_has_every_kind_of_wait_and_the_pending_calls_agree(
    seed: int,
) -> None:
    """What the projection tests and the rebuild benchmark replay (``events/simulation.py``)
    holds every kind of wait and what ends it, and the store's pending calls (the sweeper's
    view) are exactly each task's open waits."""
    store = InMemoryEventStore()
    tasks = await simulate(store, tasks=400, writers=8, seed=seed, leave_paused=0.15, waits=True)
    seen: set[str] = set()
    for task in tasks:
        stream = await store.read_stream(task.task_id)
        state = fold(task.task_id, stream)
        open_waits = {c.subtask_id: c.deadline_at for c in state.outstanding}
        assert await store.pending_call_deadlines(task.task_id) == (
            open_waits if state.status == "paused" else {}
        )
        seen.update(_what_the_stream_shows(stream))
    assert seen == {
        "call wait",
        "signal wait",
        "timer wait",
        "a pause on a signal alone",
        "a signal taken by its open wait",
        "a kept signal taken by the pause that waits for it",
        "a signal refused",
        "a signal's wait timed out",
        "a timer fired",
        "a first-k resume abandoning waits",
        "a late reply to an abandoned wait",
        "a cancel while paused naming no call",
    }


def _what_the_stream_shows(stream: list[RecordedEvent]) -> set[str]:
    shows: set[str] = set()
    waits: dict[str, PendingCall] = {}
    abandoned: set[str] = set()
    paused_in: dict[int, int] = {}  # pause -> the transaction that recorded it
    paused = False
    before: DomainEvent | None = None
    for recorded in stream:
        event = parse(recorded)
        if isinstance(event, TaskPaused):
            waits |= {w.subtask_id: w for w in event.calls}
            paused_in[event.pause] = recorded.tx_id
            paused = True
            shows.update(f"{w.kind} wait" for w in event.calls)
            if [w.kind for w in event.calls] == ["signal"]:
                shows.add("a pause on a signal alone")
        elif isinstance(event, SubtaskClaimed) and waits[event.subtask_id].kind == "signal":
            if event.message_id is None:
                shows.add("a signal's wait timed out")
            elif isinstance(before, SignalReceived):
                shows.add("a signal taken by its open wait")
            else:  # a signal kept before its wait: taken in the pause's own append
                assert paused_in[event.pause] == recorded.tx_id, event
                shows.add("a kept signal taken by the pause that waits for it")
        elif isinstance(event, ResultRecorded) and waits[event.subtask_id].kind == "timer":
            assert event.outcome == "ok"
            shows.add("a timer fired")
        elif isinstance(event, TaskResumed):
            paused = False
            abandoned |= {c.subtask_id for c in event.abandoned}
            if event.abandoned:
                shows.add("a first-k resume abandoning waits")
        elif isinstance(event, ReplyIgnored) and event.subtask_id in abandoned:
            shows.add("a late reply to an abandoned wait")
        elif isinstance(event, SignalRefused):
            shows.add("a signal refused")
        elif isinstance(event, TaskCancelled) and paused and not event.pending:
            shows.add("a cancel while paused naming no call")
        before = event
    return shows
