"""``waystation verify`` and ``history`` on waits of every kind (issue 31): each invariant of
signals, timers and ``FirstK`` pauses broken on purpose in a stream with a correct hash chain shows
as exactly that problem, and the streams the task's own decide functions write, with every kind
of wait, verify clean; the timeline and the past state say what each pause waited for, who sent
each signal and what a resume gave up.

A stream here is a boss that pauses on a peer call, a signal named ``approval`` and a timer,
resuming on the first of them (``FirstK(1)``) or on all three.
"""

from __future__ import annotations

from waystation.events import (
    CancelledCall,
    DomainEvent,
    PendingCall,
    ResultRecorded,
    SubtaskClaimed,
    TaskCompleted,
    TaskPaused,
    TaskResumed,
    TaskStarted,
)
from waystation.events.memory import InMemoryEventStore
from waystation.events.model import SignalReceived, SignalRefused
from waystation.events.simulation import simulate
from waystation.projections.audit import verify_stream
from waystation.projections.history import pauses, state_as_of, timeline

from .test_audit import TASK, build, kinds

CALL, SIGNAL, TIMER = (f"{TASK}:1:{i}" for i in range(3))


def signal_wait(wait_id: str) -> PendingCall:
    return PendingCall(
        subtask_id=wait_id,
        agent="",
        input=None,
        deadline_at=900.0,
        kind="signal",
        name="approval",
    )


def pause(until: int | None = None) -> TaskPaused:
    return TaskPaused(
        pause=1,
        state_delta={},
        calls=(
            PendingCall(subtask_id=CALL, agent="researcher", input=1, deadline_at=300.0),
            signal_wait(SIGNAL),
            PendingCall(subtask_id=TIMER, agent="", input=None, deadline_at=60.0, kind="timer"),
        ),
        until=until,
        agent_version="v2",
    )


def signal(signal_id: str = "s1", name: str = "approval") -> SignalReceived:
    return SignalReceived(signal_id=signal_id, name=name, payload={"ok": True}, sender="alice")


def claim(wait: str, outcome: str = "ok", message_id: str | None = None) -> list[DomainEvent]:
    return [
        SubtaskClaimed(subtask_id=wait, pause=1, message_id=message_id),
        ResultRecorded(subtask_id=wait, pause=1, outcome=outcome),  # type: ignore[arg-type]
    ]


def first_by_signal() -> list[DomainEvent]:
    """FirstK(1): the signal comes first; the call and the timer are given up."""
    return [
        TaskStarted(agent="boss", input=None),
        pause(until=1),
        signal(),
        *claim(SIGNAL, message_id="s1"),
        TaskResumed(
            pause=1,
            abandoned=(
                CancelledCall(subtask_id=CALL, agent="researcher"),
                CancelledCall(subtask_id=TIMER, agent=""),
            ),
        ),
        TaskCompleted(result=None),
    ]


def all_three() -> list[DomainEvent]:
    """Every wait ends: the timer fires, the call replies, the signal times out."""
    return [
        TaskStarted(agent="boss", input=None),
        pause(),
        *claim(TIMER),
        *claim(CALL, message_id="reply-1"),
        *claim(SIGNAL, outcome="timeout"),
        TaskResumed(pause=1),
    ]


def test_clean_streams_of_every_kind_of_wait_verify() -> None:
    assert verify_stream(build(first_by_signal())) == []
    assert verify_stream(build(all_three())) == []


async def test_the_streams_the_state_machine_writes_with_every_kind_of_wait_verify() -> None:
    store = InMemoryEventStore()
    tasks = await simulate(store, tasks=300, writers=3, seed=31, waits=True)
    recorded = [t.recorded for t in tasks]
    types = {e.event_type for stream in recorded for e in stream}
    assert {"SignalReceived", "TaskResumed"} <= types
    assert any(e.data.get("abandoned") for stream in recorded for e in stream)
    assert [p for stream in recorded for p in verify_stream(stream)] == []


def test_a_signal_wait_claimed_twice_is_a_double_claim() -> None:
    events = first_by_signal()
    events[5:5] = [signal("s2"), SubtaskClaimed(subtask_id=SIGNAL, pause=1, message_id="s2")]
    assert kinds(verify_stream(build(events))) == [(7, "double-claim")]


def test_one_signal_taken_by_two_waits_is_found() -> None:
    two = TaskPaused(pause=1, state_delta={}, calls=(signal_wait(SIGNAL), signal_wait(CALL)))
    events = [
        TaskStarted(agent="boss", input=None),
        two,
        signal(),
        *claim(SIGNAL, message_id="s1"),
        *claim(CALL, message_id="s1"),
        TaskResumed(pause=1),
    ]
    problems = verify_stream(build(events))
    assert kinds(problems) == [(6, "signal-reused")]
    assert f"signal s1 claims {CALL}, but {SIGNAL} took it" in problems[0].message


def test_a_signal_recorded_twice_with_one_id_is_found() -> None:
    events = first_by_signal()
    events.insert(3, signal())
    assert kinds(verify_stream(build(events))) == [(4, "double-signal")]


def test_a_signal_wait_claimed_by_no_signal_or_one_of_another_name_is_found() -> None:
    unrecorded = first_by_signal()
    del unrecorded[2]  # the SignalReceived
    assert kinds(verify_stream(build(unrecorded))) == [(3, "claim-without-signal")]

    after = first_by_signal()
    after.insert(4, after.pop(2))  # recorded only after the claim that names it
    assert kinds(verify_stream(build(after))) == [(3, "claim-without-signal")]

    other_name = first_by_signal()
    other_name[2] = signal(name="webhook")
    problems = verify_stream(build(other_name))
    assert kinds(problems) == [(4, "claim-without-signal")]
    assert "named 'webhook'" in problems[0].message


def test_a_first_k_resume_before_k_successes_while_k_is_reachable_is_found() -> None:
    events = [
        TaskStarted(agent="boss", input=None),
        pause(until=2),
        *claim(TIMER),
        TaskResumed(
            pause=1,
            abandoned=(
                CancelledCall(subtask_id=CALL, agent="researcher"),
                CancelledCall(subtask_id=SIGNAL, agent=""),
            ),
        ),
    ]
    problems = verify_stream(build(events))
    assert kinds(problems) == [(5, "early-resume")]
    assert "(first 2) after 1 success(es)" in problems[0].message


def test_a_first_k_resume_once_k_is_out_of_reach_is_right() -> None:
    events = [
        TaskStarted(agent="boss", input=None),
        pause(until=2),
        *claim(CALL, outcome="error", message_id="reply-1"),
        *claim(SIGNAL, outcome="timeout"),
        TaskResumed(pause=1, abandoned=(CancelledCall(subtask_id=TIMER, agent=""),)),
    ]
    assert verify_stream(build(events)) == []


def test_a_resume_that_gives_up_other_waits_than_the_open_ones_is_found() -> None:
    kept_one = first_by_signal()
    kept_one[5] = TaskResumed(pause=1, abandoned=(CancelledCall(subtask_id=CALL, agent="x"),))
    problems = verify_stream(build(kept_one))
    assert kinds(problems) == [(6, "wrong-abandoned")]
    assert "were still open" in problems[0].message and TIMER in problems[0].message

    gave_up_a_finished_one = all_three()
    gave_up_a_finished_one[-1] = TaskResumed(
        pause=1, abandoned=(CancelledCall(subtask_id=TIMER, agent=""),)
    )
    assert kinds(verify_stream(build(gave_up_a_finished_one))) == [(9, "wrong-abandoned")]


def test_a_claim_of_a_wait_given_up_is_found() -> None:
    events = first_by_signal()
    events[6:6] = claim(CALL, message_id="late-reply")
    assert kinds(verify_stream(build(events))) == [(7, "claim-after-abandon")]


def test_a_timer_that_fires_with_another_outcome_than_ok_is_found() -> None:
    events = all_three()
    events[2:4] = claim(TIMER, outcome="timeout")
    problems = verify_stream(build(events))
    assert kinds(problems) == [(4, "wrong-outcome")]
    assert "fired with outcome timeout" in problems[0].message


def test_a_signal_wait_whose_outcome_is_not_its_signal_or_its_timeout_is_found() -> None:
    timed_out_ok = all_three()
    timed_out_ok[6:8] = claim(SIGNAL, outcome="ok")
    assert kinds(verify_stream(build(timed_out_ok))) == [(8, "wrong-outcome")]

    signalled_timeout = first_by_signal()
    signalled_timeout[3:5] = claim(SIGNAL, outcome="timeout", message_id="s1")
    # and with no success, its FirstK(1) was not met when it resumed
    assert kinds(verify_stream(build(signalled_timeout))) == [
        (5, "wrong-outcome"),
        (6, "early-resume"),
    ]


# ---- history: the timeline and the state of waits -----------------------------------------------


def kept_then_taken() -> list[DomainEvent]:
    """A signal comes before its wait (kept), the next pause's wait takes it at once; a refused
    one follows the end."""
    second = pause(until=1).model_copy(update={"pause": 2})
    second = second.model_copy(
        update={
            "calls": tuple(
                c.model_copy(update={"subtask_id": c.subtask_id.replace(":1:", ":2:")})
                for c in second.calls
            )
        }
    )
    return [
        *first_by_signal()[:-1],
        signal("s2"),
        second,
        SubtaskClaimed(subtask_id=f"{TASK}:2:1", pause=2, message_id="s2"),
        ResultRecorded(subtask_id=f"{TASK}:2:1", pause=2, outcome="ok", value={"ok": True}),
        TaskResumed(
            pause=2,
            abandoned=(
                CancelledCall(subtask_id=f"{TASK}:2:0", agent="researcher"),
                CancelledCall(subtask_id=f"{TASK}:2:2", agent=""),
            ),
        ),
        TaskCompleted(result=None),
        SignalRefused(
            signal_id="s3", name="approval", reason="finished", detail=None, sender="bob"
        ),
    ]


def test_the_timeline_shows_waits_signals_with_their_senders_and_what_a_resume_gave_up() -> None:
    stream = build(kept_then_taken())
    assert verify_stream(stream) == []
    entries = timeline(stream)
    summaries = [e.summary for e in entries]
    assert summaries[1] == (
        "paused #1 calling researcher, waiting for signal approval (up to its deadline), "
        "a timer, resuming on the first 1 of 3, agent version v2"
    )
    assert summaries[2] == f'signal approval (s1) from alice {{"ok":true}}: taken by {SIGNAL}'
    assert summaries[3] == f"claimed {SIGNAL} with signal s1"
    assert summaries[5] == f"resumed from pause #1 after 0.040 s, giving up {CALL}, {TIMER}"
    assert summaries[6] == (
        f'signal approval (s2) from alice {{"ok":true}}: kept, then taken by {TASK}:2:1 at v9'
    )
    assert summaries[-1] == "refused signal approval (s3) from bob: finished"
    assert [e.sender for e in entries if e.sender] == ["alice", "alice", "bob"]
    assert [span.agent_version for span in pauses(stream)] == ["v2", "v2"]

    fired = timeline(build(all_three()))
    assert fired[2].summary == f"claimed {TIMER} (its timer fired)"
    assert fired[6].summary == f"claimed {SIGNAL} (no signal: its wait timed out)"


def test_the_state_as_of_a_point_shows_open_waits_by_kind_and_kept_signals() -> None:
    events = kept_then_taken()
    stream = build(events)
    before_second_pause = state_as_of(TASK, stream, position=7).to_json()
    assert before_second_pause["abandoned"] == [CALL, TIMER]
    assert before_second_pause["kept_signals"] == [
        {"signal_id": "s2", "name": "approval", "sender": "alice"}
    ]
    [taken] = before_second_pause["results"]
    assert (taken["kind"], taken["name"], taken["sender"]) == ("signal", "approval", "alice")

    waiting = state_as_of(TASK, build(all_three()[:2]), position=2).to_json()
    assert [(w["kind"], w["agent"], w["name"]) for w in waiting["outstanding"]] == [
        ("call", "researcher", None),
        ("signal", "", "approval"),
        ("timer", "", None),
    ]
    assert (waiting["first_k"], waiting["agent_version"]) == (None, "v2")
