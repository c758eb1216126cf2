"""Waits beyond peer calls in the task's pure state machine (issue 31): timers (``Sleep``),
signals (``Signal``, ``decide_signal``) and pauses that resume on the first k successes
(``FirstK``), beside calls.

Driven like the worker drives them, with the driver of ``test_task_lifecycle``: fold the stream
of an in-memory store, decide, append at the version read, fold again; and after every step the
store's pending-calls projection (what the sweeper claims: calls, signals and timers alike) must
list exactly the open waits the fold has. Each test asserts the exact events decided, since the
events are what the log keeps for ever.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, ClassVar

import pytest
from hypothesis import Phase, given, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from waystation.events import (
    GENESIS_HASH,
    Call,
    CallResult,
    CancelledCall,
    Complete,
    DomainEvent,
    EventMetadata,
    InvalidTransition,
    NewEvent,
    Pause,
    ReplyIgnored,
    ResultRecorded,
    SubtaskClaimed,
    TaskCancelled,
    TaskCompleted,
    TaskPaused,
    TaskResumed,
    TaskState,
    UnknownEvent,
    Upcasters,
    VersionConflict,
    decide_cancel,
    decide_extension,
    decide_outcome,
    decide_reply,
    decide_timeout,
    event_id,
    parse,
)
from waystation.events.chain import recorded_events
from waystation.events.model import SignalReceived, SignalRefused
from waystation.events.task import (
    MAX_IGNORED_REPLIES,
    MAX_KEPT_SIGNALS,
    FirstK,
    Signal,
    Sleep,
    Wait,
    decide_signal,
)

from .test_task_lifecycle import (
    AFTER_EVERY_DEADLINE,
    NOW,
    TIMEOUT,
    Log,
    Model,
    cancel,
    complete,
    decide_and_append,
    pause_with,
    projection_agrees,
    reply,
    started,
    time_out,
)

DAY = 86_400.0
APPROVAL = {"approved": True, "by": "ada"}


def signal(
    log: Log,
    name: str,
    payload: Any,
    signal_id: str,
    *,
    sender: str | None = "ops",
    invalid: str | None = None,
) -> list[DomainEvent]:
    """Send the task a signal as the worker records one: keyed by its id (its message id)."""
    events = log.apply(
        lambda s: decide_signal(
            s, name, payload, signal_id=signal_id, sender=sender, invalid=invalid
        ),
        f"signal:{signal_id}",
    )
    projection_agrees(log)
    return events


def fire(log: Log, wait_id: str, now: float) -> list[DomainEvent]:
    """What the sweeper records for ``wait_id`` when it finds it due at ``now``."""
    events = log.apply(lambda s: decide_timeout(s, wait_id, now=now), f"timeout:{wait_id}")
    projection_agrees(log)
    return events


def claimed(
    wait_id: str, pause: int, value: Any = None, message_id: str | None = None
) -> list[DomainEvent]:
    """The claim of ``wait_id`` with an ok result."""
    return [
        SubtaskClaimed(subtask_id=wait_id, pause=pause, message_id=message_id),
        ResultRecorded(subtask_id=wait_id, pause=pause, outcome="ok", value=value),
    ]


def paused_on(
    waits: list[Wait], *, until: FirstK | None = None, agent_version: str | None = None
) -> Log:
    log = Log()
    pause_with(log, waits, until=until, agent_version=agent_version)
    projection_agrees(log)
    return log


def stored(event: DomainEvent) -> NewEvent:
    return NewEvent.of(event_id("t", "k", 0), event, EventMetadata(worker_id="w"))


def first_pause(waits: list[Wait], until: FirstK | None = None) -> TaskPaused:
    [_, paused] = decide_outcome(
        TaskState("t"), Pause(waits, until=until), now=NOW, default_timeout=TIMEOUT, start=started()
    )
    assert isinstance(paused, TaskPaused)
    return paused


# ---- how a pause is stored -----------------------------------------------------------------------


def test_a_pause_of_calls_alone_is_stored_as_before_waits_had_kinds() -> None:
    """Schema version 1 and the keys the log held before issue 31, so that the stored bytes (and
    their hashes) are what older code wrote and older code still reads them."""
    paused = first_pause([Call("a", {"q": 1}), Call("b", timeout=5)])
    new = stored(paused)
    assert new.schema_version == 1
    assert set(new.data) == {"pause", "state_delta", "calls"}
    assert [set(call) for call in new.data["calls"]] == [
        {"subtask_id", "agent", "input", "deadline_at", "dispatched_at"}
    ] * 2
    assert stored(TaskResumed(pause=1)).data == {"pause": 1}
    assert stored(TaskResumed(pause=1)).schema_version == 1


@pytest.mark.parametrize(
    ("waits", "until", "agent_version"),
    [
        ([Call("a"), Signal("approval", timeout=60, schema={"type": "object"})], None, None),
        ([Sleep(30)], None, None),
        ([Call("a"), Call("b")], FirstK(1), None),
        ([Call("a")], None, "2.1.0"),
    ],
    ids=["signal", "timer", "first-k", "agent-version"],
)
def test_a_pause_that_uses_any_new_field_is_stored_as_v2_and_reads_back_equal(
    waits: list[Wait], until: FirstK | None, agent_version: str | None
) -> None:
    log = Log()
    [_, paused] = pause_with(log, waits, until=until, agent_version=agent_version)
    [_, recorded] = log.recorded()
    assert recorded.schema_version == 2
    assert parse(recorded) == paused
    state = log.state()
    assert (state.calls, state.until, state.agent_version) == (
        paused.calls,
        until.k if until else None,
        agent_version,
    )


def test_a_resume_that_abandons_waits_stores_them() -> None:
    abandoned = (CancelledCall(subtask_id="t:1:1", agent="b"),)
    assert stored(TaskResumed(pause=3, abandoned=abandoned)).data == {
        "pause": 3,
        "abandoned": [{"subtask_id": "t:1:1", "agent": "b"}],
    }


class CallBefore(BaseModel):
    """A pending call as code before issue 31 reads it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    subtask_id: str
    agent: str
    input: Any
    deadline_at: float
    dispatched_at: float | None = None


class PausedBefore(DomainEvent):
    event_type: ClassVar[str] = "TaskPaused"
    pause: int
    state_delta: dict[str, Any]
    calls: tuple[CallBefore, ...]


class ResumedBefore(DomainEvent):
    event_type: ClassVar[str] = "TaskResumed"
    pause: int


BEFORE: dict[str, type[DomainEvent]] = {"TaskPaused": PausedBefore, "TaskResumed": ResumedBefore}
"""The event types of code before issue 31 (with no upcasters): a worker of the previous
version, in a rolling upgrade, reads the same log."""


def read_before(event: DomainEvent) -> DomainEvent:
    """``event`` stored, then read by code before issue 31."""
    [recorded] = recorded_events("t", 0, [stored(event)], GENESIS_HASH)
    return parse(recorded, types=BEFORE, upcasters=Upcasters())


def test_older_code_reads_what_it_knows_and_sees_the_rest_as_newer_never_fails() -> None:
    """What uses none of the new waits reads as it did; what does is a newer version, which an
    older worker keeps as an unknown event and so decides nothing on. Never a validation error,
    which would fail its fold of the stream."""
    calls_alone = first_pause([Call("a", {"q": 1})])
    assert read_before(calls_alone) == PausedBefore(
        pause=1,
        state_delta={},
        calls=(
            CallBefore(
                subtask_id="t:1:0",
                agent="a",
                input={"q": 1},
                deadline_at=NOW + TIMEOUT,
                dispatched_at=NOW,
            ),
        ),
    )
    assert read_before(TaskResumed(pause=1)) == ResumedBefore(pause=1)
    abandoned = (CancelledCall(subtask_id="t:1:1", agent="b"),)
    for newer in (
        first_pause([Call("a"), Sleep(5)]),
        first_pause([Call("a"), Call("b")], FirstK(1)),
        TaskResumed(pause=1, abandoned=abandoned),
    ):
        unknown = read_before(newer)
        assert isinstance(unknown, UnknownEvent), newer
        assert (unknown.type_name, unknown.reason) == (newer.event_type, "newer-version")
        assert parse(recorded_events("t", 0, [stored(newer)], GENESIS_HASH)[0]) == newer


# ---- timers --------------------------------------------------------------------------------------


def test_a_timer_fires_once_at_its_deadline_with_an_ok_result() -> None:
    log = paused_on([Sleep(60), Call("a")])
    timer = log.state().calls[0]
    assert (timer.kind, timer.deadline_at, timer.agent) == ("timer", NOW + 60, "")
    assert log.pending() == {"t:1:0": NOW + 60, "t:1:1": NOW + TIMEOUT}
    assert fire(log, "t:1:0", NOW + 59.999) == []
    assert fire(log, "t:1:0", NOW + 60) == claimed("t:1:0", 1)
    assert fire(log, "t:1:0", NOW + 61) == []  # a second sweeper, or the same one again
    assert reply(log, "t:1:1", "ma", "A")[-1] == TaskResumed(pause=1)
    assert log.state().results_of_pause() == [
        CallResult(subtask_id="t:1:0", agent="", outcome="ok", kind="timer"),
        CallResult(subtask_id="t:1:1", agent="a", outcome="ok", value="A"),
    ]


def test_a_timer_alone_resumes_its_pause_when_it_fires() -> None:
    log = paused_on([Sleep(0)])
    assert log.pending() == {"t:1:0": NOW}
    assert fire(log, "t:1:0", NOW) == [*claimed("t:1:0", 1), TaskResumed(pause=1)]
    assert fire(log, "t:1:0", NOW + 1) == []


@pytest.mark.parametrize(
    "until",
    [
        NOW + 3600,
        int(NOW) + 3600,
        datetime.fromtimestamp(NOW + 3600, UTC),
        datetime.fromtimestamp(NOW + 3600, timezone(timedelta(hours=-5))),
    ],
    ids=["epoch", "epoch-int", "utc", "other-zone"],
)
def test_a_timer_until_a_moment_is_due_at_that_moment(until: Any) -> None:
    [timer] = first_pause([Sleep(until=until)]).calls
    assert timer.deadline_at == pytest.approx(NOW + 3600, abs=1e-6)
    assert timer.dispatched_at == NOW


def test_a_timer_until_a_moment_already_past_is_due_at_once() -> None:
    [timer] = first_pause([Sleep(until=NOW - 10)]).calls
    assert timer.deadline_at == NOW


@pytest.mark.parametrize(
    ("sleep", "message"),
    [
        (Sleep(), "seconds or until="),
        (Sleep(5, until=NOW + 5), "seconds or until="),
        (Sleep(until=datetime(2030, 1, 1)), "aware datetime"),
        (Sleep(until="tomorrow"), "datetime or seconds since the epoch"),
        (Sleep(until=True), "datetime or seconds since the epoch"),
        (Sleep(-1), "must be >= 0"),
        (Sleep(True), "must be >= 0"),
        (Sleep("5"), "must be >= 0"),
        (Sleep(float("nan")), "at most"),
        (Sleep(367 * DAY), "at most"),
        (Sleep(until=NOW + 367 * DAY), "at most"),
    ],
    ids=[
        "no-argument",
        "both",
        "naive-datetime",
        "text",
        "bool-until",
        "negative",
        "bool",
        "string",
        "nan",
        "over-366-days",
        "until-over-366-days",
    ],
)
def test_an_invalid_timer_is_refused(sleep: Sleep, message: str) -> None:
    with pytest.raises(InvalidTransition, match=message):
        first_pause([Call("a"), sleep])


def test_a_timer_of_366_days_is_the_longest_allowed() -> None:
    [timer] = first_pause([Sleep(366 * DAY)]).calls
    assert timer.deadline_at == NOW + 366 * DAY


# ---- signals -------------------------------------------------------------------------------------


def test_a_signal_is_taken_by_the_wait_open_on_its_name_and_resumes_the_pause() -> None:
    log = paused_on([Signal("approval", timeout=3600)])
    assert log.pending() == {"t:1:0": NOW + 3600}
    assert signal(log, "approval", APPROVAL, "s1", sender="ada") == [
        SignalReceived(signal_id="s1", name="approval", payload=APPROVAL, sender="ada"),
        *claimed("t:1:0", 1, APPROVAL, message_id="s1"),
        TaskResumed(pause=1),
    ]
    state = log.state()
    assert state.kept == ()
    assert state.results_of_pause() == [
        CallResult(
            subtask_id="t:1:0",
            agent="",
            outcome="ok",
            value=APPROVAL,
            kind="signal",
            name="approval",
            sender="ada",
        )
    ]


def test_a_signal_without_a_timeout_is_waited_for_a_day() -> None:
    log = paused_on([Signal("approval")])
    assert log.pending() == {"t:1:0": NOW + DAY}


def test_a_signal_sent_again_with_the_same_id_is_applied_once() -> None:
    log = paused_on([Signal("approval"), Signal("approval")])
    signal(log, "approval", 1, "s1")
    assert signal(log, "approval", 2, "s1") == []
    assert [c.subtask_id for c in log.state().outstanding] == ["t:1:1"]
    # and a kept signal sent again is kept once
    signal(log, "other", 3, "s2")
    assert signal(log, "other", 3, "s2") == []
    assert log.state().kept == ("s2",)


def test_a_signal_sent_before_its_wait_is_kept_and_taken_by_the_next_pause() -> None:
    log = paused_on([Call("a")])
    assert signal(log, "approval", APPROVAL, "s1") == [
        SignalReceived(signal_id="s1", name="approval", payload=APPROVAL, sender="ops")
    ]
    assert log.state().kept == ("s1",)
    assert log.state().status == "paused"
    reply(log, "t:1:0", "m0")
    [paused, *taken] = pause_with(log, [Call("b"), Signal("approval")])
    assert isinstance(paused, TaskPaused)
    # taken in the pause's own append; the call still open, so no resume
    assert taken == claimed("t:2:1", 2, APPROVAL, message_id="s1")
    state = log.state()
    assert (state.status, state.kept) == ("paused", ())
    assert [c.subtask_id for c in state.outstanding] == ["t:2:0"]
    projection_agrees(log)


def test_a_kept_signal_that_is_all_a_pause_waits_for_resumes_it_at_once() -> None:
    log = paused_on([Call("a")])
    reply(log, "t:1:0", "m0")
    signal(log, "approval", APPROVAL, "s1")  # the task is resumed: no wait is open
    assert log.state().kept == ("s1",)
    [_, *taken] = pause_with(log, [Signal("approval")])
    assert taken == [*claimed("t:2:0", 2, APPROVAL, message_id="s1"), TaskResumed(pause=2)]
    assert log.state().status == "resumed"
    projection_agrees(log)


def test_two_waits_on_one_name_take_two_signals_in_the_order_they_came() -> None:
    log = paused_on([Signal("vote"), Signal("vote")])
    assert signal(log, "vote", "first", "s1")[1:] == claimed("t:1:0", 1, "first", "s1")
    assert signal(log, "vote", "second", "s2")[1:] == [
        *claimed("t:1:1", 1, "second", "s2"),
        TaskResumed(pause=1),
    ]
    # kept ones too, oldest first
    signal(log, "vote", "third", "s3")
    signal(log, "vote", "fourth", "s4")
    [_, *taken] = pause_with(log, [Signal("vote"), Signal("vote")])
    assert taken == [
        *claimed("t:2:0", 2, "third", "s3"),
        *claimed("t:2:1", 2, "fourth", "s4"),
        TaskResumed(pause=2),
    ]


def test_a_kept_signal_waits_for_a_wait_on_its_own_name() -> None:
    log = paused_on([Call("a")])
    signal(log, "other", 1, "s1")
    reply(log, "t:1:0", "m0")
    assert pause_with(log, [Signal("approval")])[1:] == []
    assert log.state().kept == ("s1",)
    assert signal(log, "approval", 2, "s2")[1:] == [
        *claimed("t:2:0", 2, 2, "s2"),
        TaskResumed(pause=2),
    ]
    assert log.state().kept == ("s1",)


def test_a_reply_with_the_message_id_of_a_kept_signal_leaves_the_signal_kept() -> None:
    """Message ids are the publishers' own: a peer's reply may carry the id a signal has. Only a
    signal's wait takes a kept signal."""
    log = paused_on([Call("a")])
    signal(log, "approval", APPROVAL, "42")
    reply(log, "t:1:0", "42")
    assert log.state().kept == ("42",)
    [_, *taken] = pause_with(log, [Signal("approval")])
    assert taken == [*claimed("t:2:0", 2, APPROVAL, "42"), TaskResumed(pause=2)]


@pytest.mark.parametrize("ending", ["completed", "cancelled"])
def test_a_signal_for_a_finished_task_is_refused_for_audit(ending: str) -> None:
    log = paused_on([Signal("approval")])
    if ending == "completed":
        signal(log, "approval", 1, "s1")
        complete(log)
    else:
        cancel(log)
    before = log.state()
    assert signal(log, "approval", 2, "s2", sender="bob") == [
        SignalRefused(signal_id="s2", name="approval", reason="finished", sender="bob")
    ]
    after = log.state()
    assert (after.status, after.kept, after.signals.keys()) == (
        before.status,
        before.kept,
        before.signals.keys(),
    )


def test_an_invalid_signal_is_refused_and_its_wait_goes_on() -> None:
    log = paused_on([Signal("approval", schema={"type": "object"})])
    detail = "approved: field required"
    assert signal(log, "approval", {"nope": 1}, "s1", invalid=detail) == [
        SignalRefused(
            signal_id="s1", name="approval", reason="invalid", detail=detail, sender="ops"
        )
    ]
    state = log.state()
    assert state.open_signal_wait("approval") is not None
    assert (state.status, state.kept) == ("paused", ())
    assert signal(log, "approval", APPROVAL, "s2")[-1] == TaskResumed(pause=1)


def test_past_the_kept_limit_a_signal_no_wait_takes_is_refused() -> None:
    log = paused_on([Signal("approval"), Call("a")])
    for n in range(MAX_KEPT_SIGNALS):
        signal(log, "later", n, f"k{n}")
    assert len(log.state().kept) == MAX_KEPT_SIGNALS
    assert signal(log, "later", "x", "over") == [
        SignalRefused(signal_id="over", name="later", reason="too-many", sender="ops")
    ]
    # a signal a wait takes is never kept: still applied
    assert signal(log, "approval", APPROVAL, "s1")[1:] == claimed("t:1:0", 1, APPROVAL, "s1")


def test_past_the_audit_limit_a_refused_signal_is_not_recorded() -> None:
    """Refusals count with the ignored replies: no sender grows a stream without bound."""
    log = paused_on([Signal("approval")])
    for n in range(MAX_IGNORED_REPLIES):
        assert len(signal(log, "approval", n, f"bad{n}", invalid="no")) == 1
    assert log.state().ignored_replies == MAX_IGNORED_REPLIES
    assert signal(log, "approval", 1, "one-more", invalid="no") == []
    assert decide_reply(log.state(), "t:9:9", outcome="ok", message_id="m") == []
    # a valid signal is still applied
    assert signal(log, "approval", APPROVAL, "good")[-1] == TaskResumed(pause=1)


def test_a_signal_for_a_task_with_no_stream_is_not_recorded() -> None:
    """Not paused yet, finished without the log (G10), or never was: the worker tells the
    sender it could not be delivered."""
    assert decide_signal(TaskState("t"), "approval", 1, signal_id="s1") == []


def test_a_signal_wait_times_out_with_a_message_naming_the_signal() -> None:
    log = paused_on([Signal("approval", timeout=600), Call("a")])
    assert fire(log, "t:1:0", NOW + 599) == []
    error = {"type": "timeout", "message": "no signal 'approval' before the wait's deadline"}
    assert fire(log, "t:1:0", NOW + 600) == [
        SubtaskClaimed(subtask_id="t:1:0", pause=1),
        ResultRecorded(subtask_id="t:1:0", pause=1, outcome="timeout", error=error),
    ]
    assert fire(log, "t:1:0", NOW + 601) == []
    # a signal that comes after its wait timed out is kept: it is addressed by name
    assert signal(log, "approval", APPROVAL, "late") == [
        SignalReceived(signal_id="late", name="approval", payload=APPROVAL, sender="ops")
    ]
    state = log.state()
    assert state.kept == ("late",)
    assert state.results["t:1:0"].outcome == "timeout"


@pytest.mark.parametrize("kind", ["signal", "timer"])
def test_a_reply_naming_a_signal_or_timer_wait_claims_nothing(kind: str) -> None:
    log = paused_on([Signal("approval") if kind == "signal" else Sleep(60), Call("a")])
    assert reply(log, "t:1:0", "m0") == [
        ReplyIgnored(subtask_id="t:1:0", reason="unknown-call", message_id="m0", outcome="ok")
    ]
    assert [c.subtask_id for c in log.state().outstanding] == ["t:1:0", "t:1:1"]
    projection_agrees(log)


@pytest.mark.parametrize("winner", ["cancel", "signal"])
def test_a_cancel_racing_a_signal_is_settled_by_the_version_check(winner: str) -> None:
    log = paused_on([Signal("approval")])
    read = log.state()
    by_cancel = decide_cancel(read, "stop")
    by_signal = decide_signal(read, "approval", 1, signal_id="s1")
    decided = {"cancel": ("cancel", by_cancel), "signal": ("signal:s1", by_signal)}
    first, second = decided[winner], decided["signal" if winner == "cancel" else "cancel"]
    log.append(read, first[1], first[0])
    with pytest.raises(VersionConflict):
        log.append(read, second[1], second[0])
    fresh = log.state()
    if winner == "cancel":
        assert decide_signal(fresh, "approval", 1, signal_id="s1") == [
            SignalRefused(signal_id="s1", name="approval", reason="finished")
        ]
    else:  # the task resumed: a cancel now names nothing pending, and ends it once
        assert decide_cancel(fresh, "stop") == [TaskCancelled(reason="stop")]
    projection_agrees(log)


# ---- first k -------------------------------------------------------------------------------------


def test_first_k_resumes_on_the_kth_success_and_abandons_the_open_waits() -> None:
    log = paused_on([Call("a"), Call("b"), Signal("approval"), Call("c")], until=FirstK(2))
    assert log.state().until == 2
    assert reply(log, "t:1:1", "mb", None, outcome="error") == [
        SubtaskClaimed(subtask_id="t:1:1", pause=1, message_id="mb"),
        ResultRecorded(subtask_id="t:1:1", pause=1, outcome="error", error={"type": "error"}),
    ]
    assert reply(log, "t:1:0", "ma", value="A") == claimed("t:1:0", 1, "A", "ma")
    projection_agrees(log)
    assert reply(log, "t:1:3", "mc", value="C") == [
        *claimed("t:1:3", 1, "C", "mc"),
        TaskResumed(pause=1, abandoned=(CancelledCall(subtask_id="t:1:2", agent=""),)),
    ]
    state = log.state()
    assert state.status == "resumed" and state.abandoned == {"t:1:2"}
    assert state.outstanding == ()  # a wait given up is no longer waited for
    assert log.pending() == {}  # the abandoned wait's row went with the resume
    projection_agrees(log)
    # results in wait order, the abandoned one cancelled
    assert [(r.subtask_id, r.kind, r.outcome, r.value) for r in state.results_of_pause()] == [
        ("t:1:0", "call", "ok", "A"),
        ("t:1:1", "call", "error", None),
        ("t:1:2", "signal", "cancelled", None),
        ("t:1:3", "call", "ok", "C"),
    ]
    assert state.results_of_pause()[2].name == "approval"


def test_first_k_resumes_early_once_k_can_no_longer_be_reached() -> None:
    log = paused_on([Call("a"), Call("b"), Call("c")], until=FirstK(2))
    assert len(reply(log, "t:1:0", "ma", None, outcome="error")) == 2
    assert time_out(log, "t:1:2")[-1] == TaskResumed(
        pause=1, abandoned=(CancelledCall(subtask_id="t:1:1", agent="b"),)
    )
    assert [r.outcome for r in log.state().results_of_pause()] == ["error", "cancelled", "timeout"]
    projection_agrees(log)


def test_an_abandoned_wait_takes_no_late_reply_timeout_or_signal() -> None:
    log = paused_on([Call("a"), Call("b"), Signal("approval", timeout=5)], until=FirstK(1))
    reply(log, "t:1:0", "ma")
    assert log.state().abandoned == {"t:1:1", "t:1:2"}
    for state in (log.state(), _after_next_pause(log)):
        assert decide_reply(state, "t:1:1", outcome="ok", value=1, message_id="late") == [
            ReplyIgnored(subtask_id="t:1:1", reason="late", message_id="late", outcome="ok")
        ]
        assert decide_timeout(state, "t:1:1", now=AFTER_EVERY_DEADLINE) == []
        assert decide_timeout(state, "t:1:2", now=AFTER_EVERY_DEADLINE) == []
    # the signal the abandoned wait asked for is kept for a later wait, not taken by it
    assert signal(log, "approval", APPROVAL, "s1") == [
        SignalReceived(signal_id="s1", name="approval", payload=APPROVAL, sender="ops")
    ]
    assert "t:1:2" not in log.state().claims


def _after_next_pause(log: Log) -> TaskState:
    pause_with(log, [Call("z")])
    projection_agrees(log)
    return log.state()


def test_first_k_of_every_wait_resumes_at_the_first_failure() -> None:
    """k of k waits: k is out of reach once one fails, so it resumes then, giving up the rest
    (waiting for all would wait for them)."""
    paused = first_pause([Call("a"), Sleep(5)], until=FirstK(2))
    assert paused.until == 2
    log = paused_on([Call("a"), Call("b"), Sleep(5)], until=FirstK(3))
    assert reply(log, "t:1:1", "mb", None, outcome="error")[-1] == TaskResumed(
        pause=1,
        abandoned=(
            CancelledCall(subtask_id="t:1:0", agent="a"),
            CancelledCall(subtask_id="t:1:2", agent=""),
        ),
    )
    projection_agrees(log)


@pytest.mark.parametrize(
    "until", [FirstK(0), FirstK(4), FirstK(-1), FirstK(True), FirstK(1.0), "any", 2]
)
def test_a_first_k_that_cannot_apply_is_refused(until: Any) -> None:
    with pytest.raises(InvalidTransition, match="FirstK"):
        first_pause([Call("a"), Call("b"), Call("c")], until=until)


def test_first_k_counts_a_fired_timer_as_a_success() -> None:
    log = paused_on([Sleep(10), Signal("approval")], until=FirstK(1))
    assert fire(log, "t:1:0", NOW + 10) == [
        *claimed("t:1:0", 1),
        TaskResumed(pause=1, abandoned=(CancelledCall(subtask_id="t:1:1", agent=""),)),
    ]
    assert [(r.kind, r.outcome) for r in log.state().results_of_pause()] == [
        ("timer", "ok"),
        ("signal", "cancelled"),
    ]


def test_a_first_k_pause_met_by_kept_signals_resumes_in_its_own_append() -> None:
    log = paused_on([Call("a")])
    signal(log, "vote", "yes", "s1")
    reply(log, "t:1:0", "ma")
    [_, *taken] = pause_with(log, [Call("b"), Signal("vote"), Sleep(60)], until=FirstK(1))
    assert taken == [
        *claimed("t:2:1", 2, "yes", "s1"),
        TaskResumed(
            pause=2,
            abandoned=(
                CancelledCall(subtask_id="t:2:0", agent="b"),
                CancelledCall(subtask_id="t:2:2", agent=""),
            ),
        ),
    ]
    assert log.pending() == {}
    projection_agrees(log)


# ---- cancel and extensions -----------------------------------------------------------------------


def test_a_cancel_names_only_the_calls_it_leaves_open() -> None:
    """Signals and timers just end with the task: there is no peer to tell."""
    log = paused_on([Signal("approval"), Sleep(60), Call("x"), Call("y")])
    reply(log, "t:1:3", "my")
    assert cancel(log) == [
        TaskCancelled(reason="stop", pending=(CancelledCall(subtask_id="t:1:2", agent="x"),))
    ]
    assert log.pending() == {}
    # a pause on signals and timers alone names none
    log = paused_on([Signal("approval"), Sleep(60)])
    assert cancel(log) == [TaskCancelled(reason="stop")]
    assert log.pending() == {}
    assert fire(log, "t:1:1", AFTER_EVERY_DEADLINE) == []


@pytest.mark.parametrize(
    "wait", [Signal("approval", timeout=60), Sleep(60)], ids=["signal", "timer"]
)
def test_no_progress_report_extends_a_signal_or_a_timer(wait: Wait) -> None:
    state = paused_on([wait, Call("a")]).state()

    def extended(wait_id: str) -> list[DomainEvent]:
        return decide_extension(state, wait_id, extend_by=600, now=NOW + 1, max_duration=DAY)

    assert extended("t:1:0") == []
    assert [type(e).__name__ for e in extended("t:1:1")] == ["DeadlineExtended"]


# ---- random interleavings ------------------------------------------------------------------------

NAMES = ("approval", "vote")
ACTIONS = (
    *["signal"] * 3,
    "duplicate-signal",
    "invalid-signal",
    *["reply"] * 3,
    "late-reply",
    *["timeout"] * 2,
    "cancel",
    *["run"] * 4,
)


@st.composite
def pauses(draw: st.DrawFn) -> tuple[list[Wait], FirstK | None]:
    """A pause of one to four waits of every kind, waiting for all or for the first k."""
    waits: list[Wait] = draw(
        st.lists(
            st.one_of(
                st.builds(Call, st.sampled_from(("p0", "p1"))),
                st.builds(Signal, st.sampled_from(NAMES)),
                st.builds(Sleep, st.sampled_from((0, 10))),
            ),
            min_size=1,
            max_size=4,
        )
    )
    k = draw(st.none() | st.integers(1, len(waits)))
    return waits, None if k is None else FirstK(k)


@settings(max_examples=150, deadline=None, phases=[p for p in Phase if p is not Phase.explain])
@given(plan=st.lists(pauses(), min_size=1, max_size=3), data=st.data())
def test_any_interleaving_claims_each_wait_and_each_signal_once_and_resumes_by_the_rule(
    plan: list[tuple[list[Wait], FirstK | None]], data: st.DataObject
) -> None:
    """Signals (new, sent again, invalid), replies (also to abandoned calls), timeouts and timer
    firings, cancels and resumed runs, in any order, each decided on the current state or a
    stale read (which then conflicts, re-reads and decides again). Then every open wait gets
    its end and every resumed run goes on, so the task ends. The stream must claim each wait and
    each signal at most once, resume each pause exactly once and only when its rule is met, and
    the pending-calls projection must agree with the fold after every step."""
    log = Log()
    model = Model()
    sent: dict[str, tuple[str, Any]] = {}
    """Every valid signal sent: its name and payload, by id (the first, when sent again)."""
    pause_with(log, plan[0][0], until=plan[0][1])
    snapshots = [log.state()]

    def act(decide: Any, key: Any) -> list[DomainEvent]:
        read = data.draw(st.sampled_from(snapshots[-3:]), label="read")
        return decide_and_append(log, model, read, decide, key)

    def send(
        name: str, payload: Any, signal_id: str, invalid: str | None = None, key: str = ""
    ) -> None:
        if not invalid:
            sent.setdefault(signal_id, (name, payload))
        act(
            lambda s: decide_signal(s, name, payload, signal_id=signal_id, invalid=invalid),
            lambda e: key or f"signal:{signal_id}",
        )

    for step in range(data.draw(st.integers(1, 30), label="steps")):
        current = log.state()
        waits = [w.subtask_id for w in current.calls] or ["t:1:0"]
        wait_id = data.draw(st.sampled_from(waits), label="wait")
        action = data.draw(st.sampled_from(ACTIONS), label="action")
        if action == "signal":
            send(data.draw(st.sampled_from(NAMES), label="name"), step, f"s{step}")
        elif action == "duplicate-signal" and sent:
            signal_id = data.draw(st.sampled_from(sorted(sent)), label="again")
            # under a key of its own, so that only the signal's id can tell it is the same
            send(sent[signal_id][0], "again", signal_id, key=f"signal:{signal_id}:{step}")
        elif action == "invalid-signal":
            send(data.draw(st.sampled_from(NAMES), label="name"), "bad", f"bad{step}", "bad")
        elif action in ("reply", "late-reply"):
            target = (
                data.draw(st.sampled_from(sorted(current.abandoned)), label="abandoned")
                if action == "late-reply" and current.abandoned
                else wait_id
            )
            message = f"m-{target}-{step}"
            model.first[message] = ("reply", step)
            act(
                lambda s, t=target, m=message, v=step: decide_reply(
                    s, t, outcome="ok", value=v, message_id=m
                ),
                lambda e, t=target, m=message: (
                    f"reply:{t}" if isinstance(e[0], SubtaskClaimed) else f"ignored:{t}:{m}"
                ),
            )
        elif action == "timeout":
            act(
                lambda s, w=wait_id: decide_timeout(s, w, now=AFTER_EVERY_DEADLINE),
                lambda e, w=wait_id: f"timeout:{w}",
            )
        elif action == "cancel" and data.draw(st.booleans(), label="really cancel"):
            act(lambda s: decide_cancel(s, "random"), lambda e: "cancel")
        elif action == "run" and current.status == "resumed":
            run_next(log, model, plan, act)
        snapshots.append(log.state())
        projection_agrees(log)

    ended_by_the_steps = log.state().finished
    for _ in range(4 * len(plan) + 1):
        state = log.state()
        if state.finished:
            break
        if state.status == "resumed":
            run_next(log, model, plan, act)
        else:
            for wait in state.outstanding:
                if wait.kind == "call":
                    model.first[f"m-end-{wait.subtask_id}"] = ("reply", "end")
                    reply(log, wait.subtask_id, f"m-end-{wait.subtask_id}", "end")
                elif wait.kind == "signal":
                    send(wait.name or "", "end", f"end-{wait.subtask_id}")
                else:
                    fire(log, wait.subtask_id, AFTER_EVERY_DEADLINE)
                if log.state().status != "paused":
                    break
        projection_agrees(log)
    check_waits(log, plan, sent, {m: value for m, (_, value) in model.first.items()})
    hypothesis_event(f"ended {log.state().status} {'in' if ended_by_the_steps else 'after'} steps")
    hypothesis_event(f"first-k pauses: {sum(until is not None for _, until in plan)}")
    hypothesis_event(f"conflicts: {min(model.conflicts, 3)}")


def run_next(
    log: Log, model: Model, plan: list[tuple[list[Wait], FirstK | None]], act: Any
) -> None:
    """The resumed run of the latest pause: the plan's next pause, or completion."""
    number = log.state().pause
    outcome = (
        Pause(plan[number][0], until=plan[number][1])
        if number < len(plan)
        else Complete({"pauses": number})
    )
    act(
        # a stale read of another pause decides nothing; one not running is a stale read too,
        # which the version check settles
        lambda s: (
            decide_outcome(s, outcome, now=NOW, default_timeout=TIMEOUT)
            if s.status == "resumed" and s.pause == number
            else []
        ),
        lambda e: f"resume:{number}",
    )


def check_waits(
    log: Log,
    plan: list[tuple[list[Wait], FirstK | None]],
    sent: dict[str, tuple[str, Any]],
    replies: dict[str, Any],
) -> None:
    """The stream against the rules: ``sent`` the signals sent, ``replies`` the value of every
    reply sent, by message id."""
    events = log.events()
    state = log.state()
    assert state.finished and log.pending() == {}, state.status
    claims = [e for e in events if isinstance(e, SubtaskClaimed)]
    assert len({c.subtask_id for c in claims}) == len(claims), "a wait claimed twice"
    received = [e.signal_id for e in events if isinstance(e, SignalReceived)]
    assert len(set(received)) == len(received), "a signal recorded twice"
    taken = [c.message_id for c in claims if c.message_id in set(received)]
    assert len(set(taken)) == len(taken), "a signal taken by two waits"
    resumes = Counter(e.pause for e in events if isinstance(e, TaskResumed))
    assert all(n == 1 for n in resumes.values()), resumes
    pauses = {e.pause: e for e in events if isinstance(e, TaskPaused)}
    assert list(pauses) == list(range(1, len(pauses) + 1))
    if state.status == "completed":
        assert sorted(resumes) == list(pauses) == list(range(1, len(plan) + 1))
        decisive = [e for e in events if not type(e).audit_only]
        assert decisive[-1] == TaskCompleted(result={"pauses": len(plan)})
    signals: dict[str, SignalReceived] = {}
    ended: dict[str, str] = {}  # wait id -> its outcome
    abandoned: set[str] = set()
    for position, event in enumerate(events):
        if isinstance(event, SignalReceived):
            signals[event.signal_id] = event
            assert (event.name, event.payload) == sent[event.signal_id]
        elif isinstance(event, SubtaskClaimed):
            assert event.subtask_id not in abandoned, "an abandoned wait claimed"
        elif isinstance(event, ResultRecorded):
            claim = events[position - 1]
            assert isinstance(claim, SubtaskClaimed) and claim.subtask_id == event.subtask_id
            pause = pauses[event.pause]
            wait = next(w for w in pause.calls if w.subtask_id == event.subtask_id)
            ended[wait.subtask_id] = event.outcome
            if event.outcome == "timeout" or wait.kind == "timer":
                assert claim.message_id is None
                assert event.outcome == ("ok" if wait.kind == "timer" else "timeout")
            elif wait.kind == "signal":  # taken by a signal of its name, recorded before it
                taken_by = signals[claim.message_id or ""]
                assert (taken_by.name, taken_by.payload) == (wait.name, event.value)
            else:
                assert event.value == replies[claim.message_id or ""]
            # the pause resumes right after the result that meets its rule, and only then
            following = events[position + 1] if position + 1 < len(events) else None
            assert isinstance(following, TaskResumed) == _rule_met(pause, ended), (pause, ended)
        elif isinstance(event, TaskResumed):
            pause = pauses[event.pause]
            still_open = [w.subtask_id for w in pause.calls if w.subtask_id not in ended]
            assert [c.subtask_id for c in event.abandoned] == still_open
            abandoned.update(still_open)
        elif isinstance(event, ReplyIgnored) and event.reason == "late":
            assert (
                event.subtask_id in ended
                or event.subtask_id in abandoned
                or any(type(e).terminal for e in events[:position])
            )


def _rule_met(pause: TaskPaused, ended: dict[str, str]) -> bool:
    """Whether ``pause`` may resume with the results ``ended`` holds: every wait ended, or
    (``FirstK``) k of them succeeded, or k can no longer be reached."""
    still_open = sum(w.subtask_id not in ended for w in pause.calls)
    if pause.until is None:
        return still_open == 0
    successes = sum(ended.get(w.subtask_id) == "ok" for w in pause.calls)
    return successes >= pause.until or successes + still_open < pause.until
