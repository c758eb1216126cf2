"""``waystation.projections.model``: the shapes its results take outside the projections, and
what the paused-tasks fold keeps of each wait."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from waystation.projections.model import (
    AgentCounts,
    FeedEvent,
    OpenWait,
    fold_agent_stats,
    fold_paused_tasks,
)


def test_agent_counts_show_the_mean_pause_instead_of_the_total() -> None:
    counts = AgentCounts(
        completed=4,
        failed=1,
        cancelled=2,
        paused_now=3,
        timeouts=5,
        pauses_resumed=2,
        pause_microseconds=3_000_000,
    )
    assert counts.to_json() == {
        "completed": 4,
        "failed": 1,
        "cancelled": 2,
        "paused_now": 3,
        "timeouts": 5,
        "pauses_resumed": 2,
        "mean_pause_seconds": 1.5,
    }
    assert AgentCounts().to_json()["mean_pause_seconds"] is None


# ---- the paused-tasks fold: what each task waits for ---------------------------------------------

T0 = datetime(2026, 11, 28, tzinfo=UTC)


def feed(event_type: str, position: int, **fields: Any) -> FeedEvent:
    return FeedEvent(
        tx_id=position,
        global_position=position,
        stream_id="t",
        event_type=event_type,
        recorded_at=T0 + timedelta(seconds=position),
        task_agent="boss",
        **fields,
    )


CALL = OpenWait("t:1:0", "call", 100.0, agent="researcher")
SIGNAL = OpenWait("t:1:1", "signal", 200.0, name="approval")
TIMER = OpenWait("t:1:2", "timer", 50.0)


def first_of_three() -> FeedEvent:
    return feed(
        "TaskPaused", 1, pause=1, waits=(CALL, SIGNAL, TIMER), first_k=1, agent_version="v7"
    )


def test_a_paused_row_lists_each_open_wait_its_kind_and_deadline() -> None:
    changes = fold_paused_tasks({}, [first_of_three()])
    row = changes.upserts["t"]
    assert (row.status, row.waits, row.first_k, row.agent_version) == (
        "paused",
        (CALL, SIGNAL, TIMER),
        1,
        "v7",
    )
    assert (row.waits_expected, row.waits_recorded, row.earliest_deadline) == (3, 0, 50.0)
    assert [w.label for w in row.waits] == ["call researcher", "signal approval", "timer"]
    assert [OpenWait.from_json(w.to_json()) for w in row.waits] == list(row.waits)


def test_a_result_closes_its_wait_and_an_extension_moves_only_that_deadline() -> None:
    changes = fold_paused_tasks(
        {},
        [
            first_of_three(),
            feed("DeadlineExtended", 2, subtask_id=CALL.subtask_id, deadline_at=400.0),
            feed("ResultRecorded", 3, subtask_id=TIMER.subtask_id, pause=1, outcome="ok"),
        ],
    )
    row = changes.upserts["t"]
    assert row.waits == (replace(CALL, deadline_at=400.0), SIGNAL)
    assert (row.waits_recorded, row.earliest_deadline, row.status) == (1, 200.0, "paused")


def test_a_first_k_resume_gives_up_the_open_waits_and_the_row_says_resumed() -> None:
    rows = fold_paused_tasks({}, [first_of_three()]).upserts
    changes = fold_paused_tasks(
        rows,
        [
            feed("ResultRecorded", 2, subtask_id=SIGNAL.subtask_id, pause=1, outcome="ok"),
            feed("TaskResumed", 3, pause=1),
        ],
    )
    row = changes.upserts["t"]
    assert (row.status, row.waits, row.waits_recorded, row.waits_expected) == ("resumed", (), 1, 3)
    assert row.earliest_deadline is None


def test_a_signal_wait_that_times_out_counts_against_no_agent() -> None:
    counts = fold_agent_stats(
        [
            feed("ResultRecorded", 1, outcome="timeout", call_agent=""),
            feed("ResultRecorded", 2, outcome="timeout", call_agent="researcher"),
        ]
    )
    assert set(counts) == {"researcher"} and counts["researcher"].timeouts == 1
