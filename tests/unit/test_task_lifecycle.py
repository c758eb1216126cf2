"""Deadlines, extensions, cancellation and failure in the task's pure state machine.

``decide_timeout``, ``decide_extension``, ``decide_cancel`` and ``decide_failure``
(``events/task.py``) are driven the way the worker drives them: fold the stream from an
:class:`~waystation.events.memory.InMemoryEventStore`, decide, append at the version read (a
conflict means re-read and decide again), fold again. The in-memory store also keeps the
pending-calls projection (the sweeper's view), so every step checks that the projection agrees with
the fold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import pytest
from hypothesis import Phase, given, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st

from waystation.events import (
    AppendResult,
    Call,
    CancelledCall,
    Complete,
    DeadlineExtended,
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
    decide_cancel,
    decide_extension,
    decide_failure,
    decide_outcome,
    decide_reply,
    decide_timeout,
    event_id,
    fold,
    parse,
    subtask_id,
)
from waystation.events.memory import InMemoryEventStore
from waystation.events.task import FirstK, Wait

AFTER_EVERY_DEADLINE = math.inf  # the sweeper only offers calls whose deadline passed
NOW = 1_700_000_000.0
TIMEOUT = 30.0
MAX_DURATION = 3600.0
TIMEOUT_ERROR = {"type": "timeout", "message": "no reply before the call's deadline"}
T = TypeVar("T")

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
    """One task's stream: fold, decide, append (at the version read), like the worker."""

    def __init__(self, task_id: str = "t") -> None:
        self.task_id = task_id
        self.store = InMemoryEventStore()

    def recorded(self) -> list[RecordedEvent]:
        return run(self.store.read_stream(self.task_id))

    def events(self) -> list[DomainEvent]:
        return [parse(e) for e in self.recorded()]

    def state(self) -> TaskState:
        return fold(self.task_id, self.recorded())

    def pending(self) -> dict[str, float]:
        return run(self.store.pending_call_deadlines(self.task_id))

    def append(self, state: TaskState, events: list[DomainEvent], key: str) -> AppendResult:
        metadata = EventMetadata(worker_id="w", causation_id=key, correlation_id=self.task_id)
        return run(
            self.store.append(
                self.task_id,
                state.version,
                [
                    NewEvent.of(event_id(self.task_id, key, i), e, metadata)
                    for i, e in enumerate(events)
                ],
                prev_hash=state.last_hash,
            )
        )

    def apply(
        self, decide: Callable[[TaskState], list[DomainEvent]], key: str
    ) -> list[DomainEvent]:
        """Decide on the current state and append what was decided; the decided events."""
        state = self.state()
        events = decide(state)
        if events:
            self.append(state, events, key)
        return events


def started() -> TaskStarted:
    return TaskStarted(agent="boss", input={"go": 1}, reply_to="client.replies")


def pause_with(
    log: Log,
    waits: Sequence[Wait],
    *,
    now: float = NOW,
    until: FirstK | None = None,
    agent_version: str | None = None,
) -> list[DomainEvent]:
    """Run the task (new or resumed) to a pause on ``waits``; the events appended (the pause,
    then the claims of signals the task kept, when any)."""
    state = log.state()
    events = decide_outcome(
        state,
        Pause(waits, until=until),
        now=now,
        default_timeout=TIMEOUT,
        start=started() if state.status == "new" else None,
        agent_version=agent_version,
    )
    log.append(state, events, "run" if state.status == "new" else f"resume:{state.pause}")
    assert any(isinstance(e, TaskPaused) for e in events), events
    return events


def paused(calls: int = 2, *, timeouts: list[float | None] | None = None) -> Log:
    log = Log()
    timeouts = timeouts or [None] * calls
    pause_with(log, [Call(f"peer{i}", {"i": i}, timeout=t) for i, t in enumerate(timeouts)])
    return log


def reply(
    log: Log,
    subtask: str,
    message_id: str,
    value: Any = "v",
    *,
    outcome: Literal["ok", "error", "timeout"] = "ok",
) -> list[DomainEvent]:
    error = None if outcome == "ok" else {"type": outcome}

    def decide(state: TaskState) -> list[DomainEvent]:
        return decide_reply(
            state, subtask, outcome=outcome, value=value, error=error, message_id=message_id
        )

    state = log.state()
    events = decide(state)
    if events:
        claimed = isinstance(events[0], SubtaskClaimed)
        log.append(
            state, events, f"reply:{subtask}" if claimed else f"ignored:{subtask}:{message_id}"
        )
    return events


def time_out(log: Log, subtask: str) -> list[DomainEvent]:
    return log.apply(
        lambda s: decide_timeout(s, subtask, now=AFTER_EVERY_DEADLINE), f"timeout:{subtask}"
    )


def extend(
    log: Log, subtask: str, extend_by: float, now: float, key: str = "p"
) -> list[DomainEvent]:
    return log.apply(
        lambda s: decide_extension(
            s, subtask, extend_by=extend_by, now=now, max_duration=MAX_DURATION
        ),
        f"progress:{subtask}:{key}",
    )


def cancel(log: Log, reason: str | None = "stop") -> list[DomainEvent]:
    return log.apply(lambda s: decide_cancel(s, reason), "cancel")


def complete(log: Log, result: Any = "done") -> list[DomainEvent]:
    state = log.state()
    return log.apply(
        lambda s: decide_outcome(s, Complete(result), now=NOW, default_timeout=TIMEOUT),
        f"resume:{state.pause}",
    )


def projection_agrees(log: Log) -> None:
    """The sweeper's pending calls are exactly the fold's outstanding calls of a paused task."""
    state = log.state()
    expected = (
        {c.subtask_id: c.deadline_at for c in state.outstanding} if state.status == "paused" else {}
    )
    assert log.pending() == expected


# ---- timeouts ------------------------------------------------------------------------------------


def test_a_timeout_claims_its_call_records_a_timeout_and_the_last_one_resumes() -> None:
    log = paused(2)
    assert time_out(log, "t:1:0") == [
        SubtaskClaimed(subtask_id="t:1:0", pause=1),
        ResultRecorded(subtask_id="t:1:0", pause=1, outcome="timeout", error=TIMEOUT_ERROR),
    ]
    state = log.state()
    assert state.status == "paused"
    assert [c.subtask_id for c in state.outstanding] == ["t:1:1"]
    assert state.claims["t:1:0"] is None  # claimed by no message
    projection_agrees(log)

    assert time_out(log, "t:1:1")[-1] == TaskResumed(pause=1)
    state = log.state()
    assert state.status == "resumed"
    results = state.results_of_pause()
    assert [(r.subtask_id, r.agent, r.outcome, r.ok) for r in results] == [
        ("t:1:0", "peer0", "timeout", False),
        ("t:1:1", "peer1", "timeout", False),
    ]
    assert log.pending() == {}


def test_a_reply_and_a_timeout_each_complete_a_pause_the_same_way() -> None:
    log = paused(2)
    reply(log, "t:1:1", "m1", value=11)
    assert time_out(log, "t:1:0")[-1] == TaskResumed(pause=1)
    assert [(r.outcome, r.value) for r in log.state().results_of_pause()] == [
        ("timeout", None),
        ("ok", 11),
    ]


def _replied_then(log: Log) -> str:
    reply(log, "t:1:0", "m0")
    return "t:1:0"


def _timed_out_twice(log: Log) -> str:
    time_out(log, "t:1:0")
    return "t:1:0"


def _second_pause(log: Log) -> str:
    reply(log, "t:1:0", "m0")
    reply(log, "t:1:1", "m1")
    pause_with(log, [Call("peer0")])
    return "t:1:0"  # a call of the previous pause


def _resumed(log: Log) -> str:
    reply(log, "t:1:0", "m0")
    reply(log, "t:1:1", "m1")
    return "t:1:0"


def _completed(log: Log) -> str:
    _resumed(log)
    complete(log)
    return "t:1:1"


def _failed(log: Log) -> str:
    log.apply(lambda s: decide_failure(s, {"type": "Boom", "message": "x"}), "failed")
    return "t:1:0"


def _cancelled(log: Log) -> str:
    cancel(log)
    return "t:1:0"


CANNOT_TIME_OUT: dict[str, Callable[[Log], str]] = {
    "call already claimed by a reply": _replied_then,
    "call already timed out": _timed_out_twice,
    "unknown call": lambda log: "t:1:7",
    "call of another task": lambda log: "other:1:0",
    "call of an earlier pause": _second_pause,
    "task resumed": _resumed,
    "task completed": _completed,
    "task failed": _failed,
    "task cancelled": _cancelled,
}


@pytest.mark.parametrize("case", list(CANNOT_TIME_OUT))
def test_decide_timeout_decides_nothing_when_the_call_is_not_outstanding(case: str) -> None:
    log = paused(2)
    subtask = CANNOT_TIME_OUT[case](log)
    before = log.state()
    assert decide_timeout(before, subtask, now=AFTER_EVERY_DEADLINE) == []
    projection_agrees(log)


def test_a_new_task_has_no_call_to_time_out() -> None:
    assert decide_timeout(TaskState(task_id="t"), "t:1:0", now=AFTER_EVERY_DEADLINE) == []


def test_a_reply_after_its_call_timed_out_is_ignored_as_late_and_changes_nothing() -> None:
    log = paused(2)
    time_out(log, "t:1:0")
    before = log.state()
    late = reply(log, "t:1:0", "m-late", value="too late")
    assert late == [
        ReplyIgnored(subtask_id="t:1:0", reason="late", message_id="m-late", outcome="ok")
    ]
    after = log.state()
    assert after.results == before.results and after.claims == before.claims
    assert after.status == "paused" and after.outstanding == before.outstanding
    # and still late once the task has finished
    reply(log, "t:1:1", "m1")
    complete(log)
    again = decide_reply(log.state(), "t:1:0", outcome="ok", value=1, message_id="m-later")
    assert [(type(e), e.reason) for e in again if isinstance(e, ReplyIgnored)] == [
        (ReplyIgnored, "late")
    ]
    # a second reply to a call a reply claimed stays a duplicate
    dup = decide_reply(log.state(), "t:1:1", outcome="ok", value=1, message_id="m1-dup")
    assert dup == [
        ReplyIgnored(subtask_id="t:1:1", reason="duplicate", message_id="m1-dup", outcome="ok")
    ]


@pytest.mark.parametrize("winner", ["timeout", "reply"])
def test_a_timeout_racing_a_reply_is_settled_by_the_version_check(winner: str) -> None:
    log = paused(1)
    read = log.state()
    by_timeout = decide_timeout(read, "t:1:0", now=AFTER_EVERY_DEADLINE)
    by_reply = decide_reply(read, "t:1:0", outcome="ok", value="r", message_id="m")
    first, second = (
        (("timeout:t:1:0", by_timeout), ("reply:t:1:0", by_reply))
        if winner == "timeout"
        else (("reply:t:1:0", by_reply), ("timeout:t:1:0", by_timeout))
    )
    log.append(read, first[1], first[0])
    with pytest.raises(VersionConflict):
        log.append(read, second[1], second[0])
    # the loser re-reads and decides again
    fresh = log.state()
    if winner == "timeout":
        assert [
            e.reason
            for e in decide_reply(fresh, "t:1:0", outcome="ok", message_id="m")
            if isinstance(e, ReplyIgnored)
        ] == ["late"]
    else:
        assert decide_timeout(fresh, "t:1:0", now=AFTER_EVERY_DEADLINE) == []
    events = log.events()
    assert sum(isinstance(e, SubtaskClaimed) for e in events) == 1
    assert sum(isinstance(e, TaskResumed) for e in events) == 1
    [result] = log.state().results_of_pause()
    assert result.outcome == ("timeout" if winner == "timeout" else "ok")


# ---- deadlines and extensions -------------------------------------------------------------------


def test_every_call_gets_a_deadline_from_dispatch_its_own_timeout_else_the_default() -> None:
    log = Log()
    [_, paused_event] = pause_with(
        log, [Call("a", timeout=5), Call("b"), Call("c", timeout=0.25)], now=NOW
    )
    assert isinstance(paused_event, TaskPaused)
    assert [(c.deadline_at, c.dispatched_at) for c in paused_event.calls] == [
        (NOW + 5, NOW),
        (NOW + TIMEOUT, NOW),
        (NOW + 0.25, NOW),
    ]
    assert log.pending() == {"t:1:0": NOW + 5, "t:1:1": NOW + TIMEOUT, "t:1:2": NOW + 0.25}


@pytest.mark.parametrize("timeout", [0, -1.0, math.inf, -math.inf, math.nan])
def test_a_call_timeout_must_be_a_positive_finite_number(timeout: float) -> None:
    with pytest.raises(InvalidTransition, match="timeout"):
        decide_outcome(
            TaskState(task_id="t"),
            Pause([Call("peer", timeout=timeout)]),
            now=NOW,
            default_timeout=TIMEOUT,
            start=started(),
        )


def test_an_extension_moves_the_deadline_to_now_plus_extend_by() -> None:
    log = paused(2, timeouts=[10, 10])
    assert extend(log, "t:1:0", 60, now=NOW + 5) == [
        DeadlineExtended(subtask_id="t:1:0", pause=1, deadline_at=NOW + 65)
    ]
    state = log.state()
    assert [c.deadline_at for c in state.calls] == [NOW + 65, NOW + 10]
    assert state.calls[0].dispatched_at == NOW  # the bound stays measured from dispatch
    assert log.pending() == {"t:1:0": NOW + 65, "t:1:1": NOW + 10}
    # the extended call still times out like any other, and resumes with the rest
    time_out(log, "t:1:1")
    assert time_out(log, "t:1:0")[-1] == TaskResumed(pause=1)


def test_an_extension_is_bounded_by_the_maximum_duration_from_dispatch() -> None:
    log = paused(1, timeouts=[10])
    assert extend(log, "t:1:0", 10 * MAX_DURATION, now=NOW + 1) == [
        DeadlineExtended(subtask_id="t:1:0", pause=1, deadline_at=NOW + MAX_DURATION)
    ]
    # at the bound, no extension moves it any more, however late or large
    assert extend(log, "t:1:0", 10 * MAX_DURATION, now=NOW + MAX_DURATION - 1, key="2") == []
    assert log.pending() == {"t:1:0": NOW + MAX_DURATION}


def test_an_extension_never_brings_a_deadline_forward() -> None:
    log = paused(1, timeouts=[100])
    assert extend(log, "t:1:0", 5, now=NOW + 1) == []
    assert log.state().calls[0].deadline_at == NOW + 100


def test_a_call_without_its_dispatch_time_is_bounded_from_now() -> None:
    """Pauses recorded before calls carried ``dispatched_at`` can still be extended."""
    log = Log()
    state = log.state()
    legacy = TaskPaused(
        pause=1,
        state_delta={},
        calls=(PendingCall(subtask_id="t:1:0", agent="peer", input=None, deadline_at=NOW + 1),),
    )
    log.append(state, [started(), legacy], "run")
    assert extend(log, "t:1:0", 10 * MAX_DURATION, now=NOW + 2) == [
        DeadlineExtended(subtask_id="t:1:0", pause=1, deadline_at=NOW + 2 + MAX_DURATION)
    ]


def _after_all(log: Log) -> str:
    return _resumed(log)


CANNOT_EXTEND: dict[str, tuple[Callable[[Log], str], float]] = {
    "zero": (lambda log: "t:1:0", 0.0),
    "negative": (lambda log: "t:1:0", -5.0),
    "claimed by a reply": (_replied_then, 60.0),
    "timed out": (_timed_out_twice, 60.0),
    "unknown call": (lambda log: "t:1:9", 60.0),
    "earlier pause": (_second_pause, 60.0),
    "task resumed": (_after_all, 60.0),
    "task completed": (_completed, 60.0),
    "task cancelled": (_cancelled, 60.0),
}


@pytest.mark.parametrize("case", list(CANNOT_EXTEND))
def test_decide_extension_decides_nothing_when_it_cannot_apply(case: str) -> None:
    log = paused(2)
    make, extend_by = CANNOT_EXTEND[case]
    subtask = make(log)
    state = log.state()
    assert (
        decide_extension(
            state, subtask, extend_by=extend_by, now=NOW + 1, max_duration=MAX_DURATION
        )
        == []
    )


@settings(max_examples=200, deadline=None)
@given(
    timeout=st.floats(min_value=0.001, max_value=2 * MAX_DURATION),
    steps=st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=900),  # time passing before the report
            st.floats(min_value=-10, max_value=2 * MAX_DURATION),  # extend_by
        ),
        max_size=12,
    ),
)
def test_deadlines_only_move_later_and_never_past_the_bound(
    timeout: float, steps: list[tuple[float, float]]
) -> None:
    log = paused(1, timeouts=[timeout])
    model = NOW + timeout
    now = NOW
    for n, (elapsed, extend_by) in enumerate(steps):
        now += elapsed
        before = log.state().calls[0].deadline_at
        events = extend(log, "t:1:0", extend_by, now=now, key=str(n))
        if extend_by > 0:
            model = max(model, min(now + extend_by, NOW + MAX_DURATION))
        deadline = log.state().calls[0].deadline_at
        assert deadline == model
        assert deadline >= before
        assert (events != []) == (deadline > before)
        assert deadline <= max(NOW + timeout, NOW + MAX_DURATION)
        assert log.pending() == {"t:1:0": deadline}


# ---- cancellation --------------------------------------------------------------------------------


def test_cancelling_a_paused_task_names_every_call_it_still_waits_for() -> None:
    log = paused(3)
    reply(log, "t:1:1", "m1")
    assert cancel(log, "no longer needed") == [
        TaskCancelled(
            reason="no longer needed",
            pending=(
                CancelledCall(subtask_id="t:1:0", agent="peer0"),
                CancelledCall(subtask_id="t:1:2", agent="peer2"),
            ),
        )
    ]
    state = log.state()
    assert state.status == "cancelled" and state.finished
    assert state.error == {"type": "cancelled", "message": "no longer needed"}
    assert log.pending() == {}


def test_after_a_cancel_nothing_applies_and_late_replies_are_audited() -> None:
    log = paused(2)
    reply(log, "t:1:1", "m1")
    cancel(log)
    state = log.state()
    assert decide_cancel(state, "again") == []  # a duplicate cancel changes nothing
    assert decide_timeout(state, "t:1:0", now=AFTER_EVERY_DEADLINE) == []
    assert decide_extension(state, "t:1:0", extend_by=60, now=NOW, max_duration=MAX_DURATION) == []
    assert decide_failure(state, {"type": "Boom"}) == []
    with pytest.raises(InvalidTransition):
        decide_outcome(state, Complete(1), now=NOW, default_timeout=TIMEOUT)
    assert decide_reply(state, "t:1:0", outcome="ok", message_id="late") == [
        ReplyIgnored(subtask_id="t:1:0", reason="late", message_id="late", outcome="ok")
    ]
    assert decide_reply(state, "t:1:1", outcome="ok", message_id="m1") == []  # a redelivery


def test_cancelling_a_resumed_task_names_no_calls() -> None:
    log = paused(1)
    reply(log, "t:1:0", "m0")
    assert cancel(log, None) == [TaskCancelled(reason=None, pending=())]
    assert log.state().status == "cancelled"


def test_cancelling_a_task_not_recorded_yet_takes_its_stream() -> None:
    log = Log()
    assert cancel(log) == [TaskCancelled(reason="stop", pending=())]
    state = log.state()
    assert state.status == "cancelled" and state.agent is None
    # its first run, deciding on the empty stream it read before, finds the stream taken
    with pytest.raises(VersionConflict):
        log.append(
            TaskState(task_id="t"),
            decide_outcome(
                TaskState(task_id="t"),
                Pause([Call("peer")]),
                now=NOW,
                default_timeout=TIMEOUT,
                start=started(),
            ),
            "run",
        )
    assert log.pending() == {}


@pytest.mark.parametrize("finish", [_completed, _failed], ids=["completed", "failed"])
def test_a_finished_task_cannot_be_cancelled(finish: Callable[[Log], str]) -> None:
    log = paused(2)
    finish(log)
    status = log.state().status
    assert cancel(log) == []
    assert log.state().status == status


@pytest.mark.parametrize("winner", ["cancel", "completion"])
def test_a_cancel_racing_the_completion_leaves_exactly_one_terminal_event(winner: str) -> None:
    log = paused(1)
    reply(log, "t:1:0", "m0")
    read = log.state()
    cancelled = decide_cancel(read, "race")
    completed = decide_outcome(read, Complete("r"), now=NOW, default_timeout=TIMEOUT)
    order = [("cancel", cancelled), ("resume:1", completed)]
    if winner == "completion":
        order.reverse()
    log.append(read, order[0][1], order[0][0])
    with pytest.raises(VersionConflict):
        log.append(read, order[1][1], order[1][0])
    fresh = log.state()
    if winner == "completion":
        assert decide_cancel(fresh, "race") == []
        assert fresh.status == "completed"
    else:
        assert fresh.status == "cancelled"  # the worker sees it is no longer resumed and stops
        with pytest.raises(InvalidTransition):
            decide_outcome(fresh, Complete("r"), now=NOW, default_timeout=TIMEOUT)
    terminal = [e for e in log.events() if type(e).terminal]
    assert len(terminal) == 1


# ---- failure -------------------------------------------------------------------------------------


def test_the_failure_of_a_new_task_records_its_start_and_the_error() -> None:
    log = Log()
    error = {"type": "RuntimeError", "message": "boom"}
    assert log.apply(lambda s: decide_failure(s, error, start=started()), "failed") == [
        started(),
        TaskFailed(error=error),
    ]
    state = log.state()
    assert state.status == "failed" and state.error == error and state.reply_to == "client.replies"
    with pytest.raises(InvalidTransition):
        decide_failure(TaskState(task_id="other"), error)


def test_the_failure_of_a_resumed_run_ends_the_task_once() -> None:
    log = paused(1)
    reply(log, "t:1:0", "m0")
    assert log.apply(lambda s: decide_failure(s, {"type": "E"}), "failed") == [
        TaskFailed(error={"type": "E"})
    ]
    assert log.state().status == "failed"
    assert decide_failure(log.state(), {"type": "E"}) == []
    assert log.pending() == {}


def test_a_failure_while_calls_are_pending_drops_them_from_the_sweep() -> None:
    log = paused(2)
    assert set(log.pending()) == {"t:1:0", "t:1:1"}
    log.apply(lambda s: decide_failure(s, {"type": "E"}), "failed")
    assert log.pending() == {}
    assert decide_timeout(log.state(), "t:1:0", now=AFTER_EVERY_DEADLINE) == []


# ---- random interleavings ------------------------------------------------------------------------


@dataclass
class Model:
    """What the scenario did, to check the stream against."""

    first: dict[str, tuple[str, Any]] = field(default_factory=dict)
    """Per sub-task, what claimed it: ("reply", value) or ("timeout", None)."""
    cancelled_pending: tuple[CancelledCall, ...] | None = None
    appended: int = 0
    conflicts: int = 0
    refused: int = 0
    """Decisions refused with InvalidTransition, each on a state the model calls invalid."""


def decide_and_append(
    log: Log,
    model: Model,
    state: TaskState,
    decide: Callable[[TaskState], list[DomainEvent]],
    key: Callable[[list[DomainEvent]], str],
    invalid: Callable[[TaskState], bool] = lambda state: False,
) -> list[DomainEvent]:
    """Decide on ``state`` (the current one, or a stale read: a racing writer, which then gets a
    conflict, re-reads and decides again) and append like a worker; the events appended, [] when
    nothing was. ``invalid`` is the model's word on which states this input is invalid for:
    there, and only there, the decision must be refused."""
    found: str | None = None
    for _ in range(10):
        try:
            events = decide(state)
        except InvalidTransition as refusal:
            assert invalid(state), f"refused on a {state.status} state: {refusal}"
            model.refused += 1
            events = []
        else:
            assert not invalid(state), f"decided {events} on a {state.status} state"
        if not events:
            fresh = log.state()
            if fresh.version == state.version:
                return []
            state = fresh  # a stale reader decided nothing; the real one re-reads
            continue
        causation = key(events)
        if causation == found:
            # decided again what the log already holds under this key: nothing new
            return []
        try:
            result = log.append(state, events, causation)
        except VersionConflict:
            model.conflicts += 1
            state = log.state()
            continue
        if result.duplicate:
            # these ids are in the log already (another writer, same cause): re-read and
            # decide again, as the worker does (a racing second reply becomes an audit)
            found = causation
            state = log.state()
            continue
        model.appended += 1
        return events
    raise AssertionError("no decision converged")


# weighted: a cancel ends the scenario, so it comes rarely; runs happen only when resumed
ACTIONS = (
    *["reply"] * 3,
    "redeliver",
    *["timeout"] * 2,
    "extend",
    "cancel",
    *["run"] * 4,
    "fail",
)


@settings(max_examples=150, deadline=None, phases=[p for p in Phase if p is not Phase.explain])
@given(
    calls_per_pause=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    data=st.data(),
)
def test_any_interleaving_claims_each_call_once_and_ends_exactly_once(
    calls_per_pause: list[int], data: st.DataObject
) -> None:
    """Replies, redeliveries, timeouts, extensions, cancels, failures and resumed runs in any
    order, each decided either on the current state or on a stale read (a racing writer, which
    then gets a conflict, re-reads and decides again). Then every call still outstanding is
    answered and every resumed run completes, so each scenario ends: exactly once."""
    log = Log()
    model = Model()
    pause_with(log, [Call(f"peer{i}") for i in range(calls_per_pause[0])])
    snapshots: list[TaskState] = [log.state()]
    clock = NOW

    def act(
        decide: Callable[[TaskState], list[DomainEvent]],
        key: Callable[[list[DomainEvent]], str],
        invalid: Callable[[TaskState], bool] = lambda state: False,
    ) -> list[DomainEvent]:
        read = data.draw(st.sampled_from(snapshots[-3:]), label="read")
        return decide_and_append(log, model, read, decide, key, invalid)

    for step in range(data.draw(st.integers(1, 40), label="steps")):
        clock += 1
        current = log.state()
        subtasks = [c.subtask_id for c in current.calls] or ["t:1:0"]
        action = data.draw(st.sampled_from(ACTIONS), label="action")
        sub = data.draw(st.sampled_from(subtasks), label="subtask")
        if action in ("reply", "redeliver"):
            message = f"m-{sub}" if action == "redeliver" else f"m-{sub}-{step}"
            value = ["value", step]
            events = act(
                lambda s, sub=sub, message=message, value=value: decide_reply(
                    s, sub, outcome="ok", value=value, message_id=message
                ),
                lambda e, sub=sub, message=message: (
                    f"reply:{sub}"
                    if isinstance(e[0], SubtaskClaimed)
                    else f"ignored:{sub}:{message}"
                ),
            )
            if events and isinstance(events[0], SubtaskClaimed):
                model.first.setdefault(sub, ("reply", value))
        elif action == "timeout":
            events = act(
                lambda s, sub=sub: decide_timeout(s, sub, now=AFTER_EVERY_DEADLINE),
                lambda e, sub=sub: f"timeout:{sub}",
            )
            if events:
                model.first.setdefault(sub, ("timeout", None))
        elif action == "extend":
            by = data.draw(st.floats(min_value=1, max_value=100), label="extend_by")
            act(
                lambda s, sub=sub, by=by, now=clock: decide_extension(
                    s, sub, extend_by=by, now=now, max_duration=MAX_DURATION
                ),
                lambda e, step=step, sub=sub: f"progress:{sub}:{step}",
            )
        elif action == "cancel":
            outstanding = tuple(
                CancelledCall(subtask_id=c.subtask_id, agent=c.agent) for c in current.outstanding
            )
            events = act(lambda s: decide_cancel(s, "random"), lambda e: "cancel")
            if events:
                [cancelled] = events
                assert isinstance(cancelled, TaskCancelled)
                model.cancelled_pending = cancelled.pending
                if current.status == "paused" and log.state().version == current.version + 1:
                    assert cancelled.pending == outstanding
        elif action == "run" and current.status == "resumed":
            number = current.pause
            if number < len(calls_per_pause):
                outcome: Pause | Complete = Pause(
                    [Call(f"peer{i}") for i in range(calls_per_pause[number])]
                )
            else:
                outcome = Complete({"pauses": number})
            act(
                # the run belongs to pause ``number``: on a read where another pause is resumed
                # it decides nothing; on one that is not running at all (a stale read, paused
                # still; or finished) recording an outcome is invalid, and must be refused
                lambda s, outcome=outcome, number=number, now=clock: (
                    decide_outcome(s, outcome, now=now, default_timeout=TIMEOUT)
                    if s.status != "resumed" or s.pause == number
                    else []
                ),
                lambda e, number=number: f"resume:{number}",
                invalid=lambda s: s.status not in ("new", "resumed"),
            )
        elif action == "fail" and current.status == "resumed" and data.draw(st.booleans()):
            act(
                lambda s: decide_failure(s, {"type": "E"}) if s.status == "resumed" else [],
                lambda e: "failed",
            )
        snapshots.append(log.state())
        projection_agrees(log)

    ended_by_the_steps = log.state().finished
    drive_to_the_end(log, model, calls_per_pause)
    check_stream(log, model, calls_per_pause)
    hypothesis_event(f"ended {log.state().status} {'in' if ended_by_the_steps else 'after'} steps")
    hypothesis_event(f"conflicts: {min(model.conflicts, 3)}")
    hypothesis_event(f"refused as invalid: {min(model.refused, 3)}")


def drive_to_the_end(log: Log, model: Model, calls_per_pause: list[int]) -> None:
    """Answer every outstanding call and complete every resumed run until the task ends."""
    for _ in range(2 * len(calls_per_pause) + 1):
        state = log.state()
        if state.finished:
            return
        if state.status == "paused":
            for call in state.outstanding:
                value = ["end", call.subtask_id]
                events = reply(log, call.subtask_id, f"m-end-{call.subtask_id}", value)
                assert isinstance(events[0], SubtaskClaimed), events
                model.first.setdefault(call.subtask_id, ("reply", value))
        else:
            assert state.status == "resumed", f"a task {state.status} cannot go on"
            number = state.pause
            outcome: Pause | Complete = (
                Pause([Call(f"peer{i}") for i in range(calls_per_pause[number])])
                if number < len(calls_per_pause)
                else Complete({"pauses": number})
            )
            decided = log.apply(
                lambda s, outcome=outcome: decide_outcome(
                    s, outcome, now=NOW, default_timeout=TIMEOUT
                ),
                f"resume:{number}",
            )
            assert decided, f"the run of pause {number} decided nothing"
        projection_agrees(log)
    raise AssertionError(f"the task never ended: {[type(e).__name__ for e in log.events()]}")


def check_stream(log: Log, model: Model, calls_per_pause: list[int]) -> None:
    events = log.events()
    decisive = [e for e in events if not type(e).audit_only]
    terminal = [i for i, e in enumerate(decisive) if type(e).terminal]
    assert len(terminal) == 1, decisive
    assert terminal[0] == len(decisive) - 1, "an event after the terminal one"
    claims = [e.subtask_id for e in events if isinstance(e, SubtaskClaimed)]
    assert len(claims) == len(set(claims)), "a sub-task claimed twice"
    resumed = [e.pause for e in events if isinstance(e, TaskResumed)]
    assert len(resumed) == len(set(resumed)), "a pause resumed twice"
    pauses = [e for e in events if isinstance(e, TaskPaused)]
    assert [p.pause for p in pauses] == list(range(1, len(pauses) + 1))
    for position, event in enumerate(events):
        if isinstance(event, SubtaskClaimed):
            recorded = events[position + 1]
            assert isinstance(recorded, ResultRecorded) and recorded.subtask_id == event.subtask_id
            kind, value = model.first[event.subtask_id]
            if kind == "timeout":
                assert recorded.outcome == "timeout" and event.message_id is None
            else:
                assert recorded.outcome == "ok" and recorded.value == value
        if isinstance(event, TaskResumed):
            # right after the last result of its pause, which had every call claimed
            pause = next(p for p in pauses if p.pause == event.pause)
            claimed_before = {
                e.subtask_id for e in events[:position] if isinstance(e, SubtaskClaimed)
            }
            assert {c.subtask_id for c in pause.calls} <= claimed_before
            assert isinstance(events[position - 1], ResultRecorded)
        if isinstance(event, DeadlineExtended):
            pause = next(p for p in pauses if p.pause == event.pause)
            call = next(c for c in pause.calls if c.subtask_id == event.subtask_id)
            assert event.deadline_at <= (call.dispatched_at or 0) + MAX_DURATION
    state = log.state()
    assert state.finished and log.pending() == {}, state.status
    ending = decisive[-1]
    if state.status == "completed":
        # every pause the handler asked for, each call claimed and each pause resumed
        assert [len(p.calls) for p in pauses] == calls_per_pause
        assert set(claims) == {c.subtask_id for p in pauses for c in p.calls}
        assert resumed == [p.pause for p in pauses]
        assert ending == TaskCompleted(result={"pauses": len(calls_per_pause)})
    elif state.status == "failed":
        assert ending == TaskFailed(error={"type": "E"})
        assert isinstance(decisive[-2], TaskResumed), "only a resumed run fails"
    else:
        assert state.status == "cancelled"
        [cancelled] = [e for e in events if isinstance(e, TaskCancelled)]
        assert cancelled.pending == model.cancelled_pending
        # a cancel names exactly the calls it left unanswered
        assert not {c.subtask_id for c in cancelled.pending} & set(claims)
    # audit-only events change nothing
    kept = [e for e in log.recorded() if e.event_type != "ReplyIgnored"]
    without = fold(log.task_id, kept)
    assert (without.status, dict(without.claims), dict(without.results)) == (
        state.status,
        dict(state.claims),
        dict(state.results),
    )
    assert subtask_id("t", 1, 0) in state.known_calls


def test_a_timeout_is_not_recorded_while_the_deadline_is_still_ahead() -> None:
    """A sweeper that leased a call just before its deadline was extended records nothing."""
    log = Log("t")
    log.apply(
        lambda s: decide_outcome(
            s, Pause([Call("peer", timeout=10)]), now=NOW, default_timeout=9, start=started()
        ),
        "run",
    )
    state = log.state()
    assert decide_timeout(state, "t:1:0", now=NOW + 9.999) == []
    assert [type(e).__name__ for e in decide_timeout(state, "t:1:0", now=NOW + 10)] == [
        "SubtaskClaimed",
        "ResultRecorded",
        "TaskResumed",
    ]


def test_a_call_timeout_is_capped_by_the_maximum_call_duration() -> None:
    (_, paused) = decide_outcome(
        TaskState("t"),
        Pause([Call("peer", timeout=1e13), Call("peer", timeout=5)]),
        now=NOW,
        default_timeout=9,
        max_timeout=60,
        start=started(),
    )
    assert isinstance(paused, TaskPaused)
    assert [c.deadline_at - NOW for c in paused.calls] == [60, 5]
