"""``waystation.projections.activity``: the agent-minutes fold, its latency histogram and the
percentiles read from it, and the retention that keeps a rebuild equal to the live rows."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waystation.projections.activity import (
    BUCKETS,
    KEEP,
    LATENCY_BOUNDS,
    AgentMinute,
    fold_agent_minutes,
    latency_bucket,
    latency_quantile,
    merge_agent_minutes,
    minute_of,
)
from waystation.projections.model import UNKNOWN_AGENT, FeedEvent

T0 = datetime(2026, 11, 28, 5, 0, tzinfo=UTC)
MS = 1000  # microseconds


def feed(
    event_type: str,
    at: datetime,
    *,
    agent: str | None = "writer",
    started_at: datetime | None = None,
    stream: str = "t",
    position: int = 0,
) -> FeedEvent:
    return FeedEvent(
        tx_id=position,
        global_position=position,
        stream_id=stream,
        event_type=event_type,
        recorded_at=at,
        task_agent=agent,
        started_at=started_at,
    )


def histogram(*latencies_us: int) -> list[int]:
    counts = [0] * BUCKETS
    for latency in latencies_us:
        counts[latency_bucket(latency)] += 1
    return counts


# ---- the histogram ---------------------------------------------------------------------------


def test_the_buckets_run_from_1_ms_to_past_a_day_four_per_doubling() -> None:
    assert LATENCY_BOUNDS[0] == 1 * MS
    assert LATENCY_BOUNDS[-1] > 86_400 * 1_000_000 > LATENCY_BOUNDS[-5]
    ratios = [b / a for a, b in pairwise(LATENCY_BOUNDS)]
    assert all(abs(r - 2**0.25) < 0.001 for r in ratios), ratios
    assert BUCKETS == len(LATENCY_BOUNDS) + 1 == 108
    assert [latency_bucket(x) for x in (-5, 0, MS - 1, MS, 1188, 1189)] == [0, 0, 0, 1, 1, 2]
    assert latency_bucket(10**12) == BUCKETS - 1


@settings(max_examples=300)
@given(st.integers(min_value=MS, max_value=LATENCY_BOUNDS[-1] - 1))
def test_a_percentile_is_within_9_percent_of_the_true_latency(latency_us: int) -> None:
    """The precision the console may state: a factor of 2^(1/8) between 1 ms and 26.4 h."""
    shown = latency_quantile(histogram(latency_us), 0.5)
    assert shown is not None
    ratio = shown / (latency_us / 1e6)
    # 2^(1/8) = 1.0905, and the bounds are whole microseconds: 1.091 at worst
    assert 1 / 1.091 <= ratio <= 1.091, (latency_us, shown)


def test_percentiles_take_the_nearest_rank_and_say_none_without_samples() -> None:
    assert latency_quantile([0] * BUCKETS, 0.5) is None
    fast, slow = 10 * MS, 10_000 * MS
    p50 = latency_quantile(histogram(*[fast] * 99, slow), 0.5)
    p99 = latency_quantile(histogram(*[fast] * 99, slow), 0.99)
    assert p50 == p99 == pytest.approx(0.01, rel=0.1)  # rank 99 of 100 is still fast
    assert latency_quantile(histogram(*[fast] * 98, slow, slow), 0.99) == pytest.approx(
        10.0, rel=0.1
    )
    # the ends say "at most 1 ms" and "at least 26.4 h"
    assert latency_quantile(histogram(10), 0.5) == 0.001
    assert latency_quantile(histogram(10**12), 1.0) == LATENCY_BOUNDS[-1] / 1e6
    with pytest.raises(ValueError):
        latency_quantile(histogram(10), 0)


# ---- the fold --------------------------------------------------------------------------------


def test_each_kind_counts_in_its_own_minute_and_only_finishes_add_latency() -> None:
    start = T0 + timedelta(seconds=10)
    changes = fold_agent_minutes(
        [
            feed("TaskStarted", start),
            feed("TaskPaused", start),  # not counted
            feed("TaskCompleted", T0 + timedelta(minutes=1, seconds=5), started_at=start),
            feed("TaskFailed", T0 + timedelta(minutes=1, seconds=6), started_at=start),
            # finished in the transaction that started it: no latency the log can tell
            feed("TaskCompleted", T0 + timedelta(minutes=1, seconds=7)),
            feed("TaskCancelled", T0 + timedelta(minutes=1, seconds=8)),
            feed("TaskCancelled", T0 + timedelta(minutes=1, seconds=9), agent=None),
        ],
        newest=None,
    )
    first, second = T0, T0 + timedelta(minutes=1)
    rows = changes.increments
    assert set(rows) == {("writer", first), ("writer", second), (UNKNOWN_AGENT, second)}
    assert (rows["writer", first].started, sum(rows["writer", first].latency)) == (1, 0)
    row = rows["writer", second]
    assert (row.started, row.completed, row.failed, row.cancelled) == (0, 2, 1, 1)
    assert sum(row.latency) == 2
    assert row.latency[latency_bucket(55_000_000)] == 1  # 55 s
    assert row.latency[latency_bucket(56_000_000)] == 1
    assert rows[UNKNOWN_AGENT, second].cancelled == 1
    assert changes.newest == second and changes.cutoff == second - KEEP


def test_events_a_day_older_than_the_newest_minute_are_skipped_and_their_rows_go() -> None:
    old = T0 - KEEP - timedelta(minutes=1)
    rows = merge_agent_minutes({}, fold_agent_minutes([feed("TaskStarted", old)], newest=None))
    assert list(rows) == [("writer", old)]
    # a new minute moves the cut-off past the old row: it goes
    changes = fold_agent_minutes(
        [feed("TaskStarted", T0), feed("TaskStarted", old + timedelta(seconds=30))],
        newest=old,
    )
    assert ("writer", old) not in changes.increments, "an event already past the cut-off"
    assert list(merge_agent_minutes(rows, changes)) == [("writer", T0)]
    # exactly a day behind the newest minute is still kept
    kept = fold_agent_minutes([feed("TaskStarted", T0 - KEEP)], newest=T0)
    assert list(kept.increments) == [("writer", T0 - KEEP)]


# ---- any cut of the log into batches gives the same rows (G8) ---------------------------------

KINDS = ("TaskStarted", "TaskCompleted", "TaskFailed", "TaskCancelled", "TaskPaused")


STEPS = st.lists(
    st.tuples(
        st.integers(min_value=-3_600, max_value=14 * 3_600),
        st.sampled_from(KINDS),
        st.sampled_from(["planner", "writer", None]),
        st.none() | st.integers(min_value=0, max_value=10**11),
    ),
    max_size=60,
)


def _log(steps: list[tuple[int, str, str | None, int | None]]) -> list[FeedEvent]:
    """Events in commit order whose times wander (mostly forward, by the seconds of each step)
    over days, so that the cut-off moves, some events arrive already past it, and some rows
    outlive it only a while."""
    at = T0
    events = []
    for position, (seconds, kind, agent, took) in enumerate(steps):
        at += timedelta(seconds=seconds)
        finished = took is not None and kind in ("TaskCompleted", "TaskFailed")
        events.append(
            feed(
                kind,
                at,
                agent=agent,
                started_at=at - timedelta(microseconds=took)
                if finished and took is not None
                else None,
                stream=f"t{position}",
                position=position,
            )
        )
    return events


def _apply(
    rows: dict[tuple[str, datetime], AgentMinute], batch: list[FeedEvent]
) -> dict[tuple[str, datetime], AgentMinute]:
    """A batch as the runner applies it: the newest minute is the table's latest row."""
    newest = max((r.minute for r in rows.values()), default=None)
    return merge_agent_minutes(rows, fold_agent_minutes(batch, newest=newest))


@settings(max_examples=300, deadline=None)
@given(STEPS, st.lists(st.integers(min_value=1, max_value=10), min_size=1, max_size=30))
def test_any_batches_give_the_rows_of_the_whole_log_within_a_day_of_its_newest_minute(
    steps: list[tuple[int, str, str | None, int | None]], sizes: list[int]
) -> None:
    events = _log(steps)
    rows: dict[tuple[str, datetime], AgentMinute] = {}
    index = 0
    for size in sizes * (len(events) // len(sizes) + 1):
        if index >= len(events):
            break
        rows = _apply(rows, events[index : index + size])
        index += size
    # expected, counted directly: every event of the kept minutes, none of the others
    counted = [e for e in events if e.event_type != "TaskPaused"]
    newest = max((minute_of(e.recorded_at) for e in counted), default=None)
    expected: dict[tuple[str, datetime], AgentMinute] = {}
    for event in counted:
        assert newest is not None
        minute = minute_of(event.recorded_at)
        if minute < newest - KEEP:
            continue
        key = (event.task_agent or UNKNOWN_AGENT, minute)
        row = expected.setdefault(key, AgentMinute(*key))
        field = {
            "TaskStarted": "started",
            "TaskCompleted": "completed",
            "TaskFailed": "failed",
            "TaskCancelled": "cancelled",
        }[event.event_type]
        setattr(row, field, getattr(row, field) + 1)
        if event.started_at is not None:
            took = (event.recorded_at - event.started_at) // timedelta(microseconds=1)
            row.latency[sum(1 for bound in LATENCY_BOUNDS if bound <= took)] += 1
    assert rows == expected
    assert rows == _apply({}, events), "one batch"


def test_the_latency_buckets_agree_with_a_plain_count_of_the_bounds() -> None:
    for latency in (0, 999, 1000, 1001, 12_345, 86_400_000_000, 10**12):
        assert latency_bucket(latency) == sum(1 for b in LATENCY_BOUNDS if b <= latency)
    assert math.isclose(LATENCY_BOUNDS[-1] / 3.6e9, 26.4, rel_tol=0.01)
