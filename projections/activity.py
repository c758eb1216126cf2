"""Per-agent activity by the minute, as pure functions: the fold of the ``agent_minutes``
projection, its latency histogram, and the percentiles read from it.

One row per (agent, minute): the tasks of the agent whose ``TaskStarted``, ``TaskCompleted``,
``TaskFailed`` or ``TaskCancelled`` was recorded in that minute (``recorded_at``, the database's
clock, truncated to the minute), and a histogram of the latencies of the tasks that completed
or failed in it. The web console's overview reads it (``agent_activity`` in
``waystation.projections.postgres``), so every figure comes from the log, whichever worker
serves the page.

What the figures cover: the log's tasks. A task that completes without pausing writes nothing
to the log (G10) unless the operator sets ``WAYSTATION_AUDIT_ALL_TASKS`` (or its agent keeps its
results, or it was a retry); such a task is not counted here at all. ``started`` counts a task
when its first event is recorded, which is the end of its first run (its first pause, or its
completion or failure), not when its message arrived.

Latency is the finish's ``recorded_at`` less the ``recorded_at`` of the stream's
``TaskStarted``: from the end of the task's first run (its first checkpoint) to its completion
or failure. So it spans every pause and every resumed run, but not the first run. A task whose
start and finish were recorded in the same transaction (it finished in its first run, logged
only because of auditing) has no duration the log can tell: it is counted as completed or failed
but adds nothing to the histogram. A cancelled task adds nothing either (when a cancel comes is
somebody's decision, not the task's speed).

The histogram has fixed log-scale buckets (:data:`LATENCY_BOUNDS`), four per doubling from 1 ms
to about 26 hours, plus one below 1 ms and one above. Buckets are integer counts added up on
upsert, so the rows are the same whatever batches the log is cut into, and a rebuild from
position zero reproduces them (G8). :func:`latency_quantile` gives a bucket's geometric middle,
within about 9% of the true value between 1 ms and 26 hours (a factor of 2^(1/8) = 1.0905; the
bounds are whole microseconds, so 1.091 at worst).

Old rows go: each batch deletes the rows more than :data:`KEEP` (24 hours) older than the newest
minute the log has counted so far, and skips events already that old. The cut-off follows the
log, not the clock, so that the live table and a rebuild at the same position hold the same rows
(the proof: an event is skipped only if its minute is below a cut-off that only grows, so every
minute at or after the final cut-off has all its events, and every minute before it is gone).
Without it a busy pool would add 1,440 rows per agent per day for ever, while the console shows
the last quarter of an hour and ``agent_stats`` keeps the all-time totals.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from .model import UNKNOWN_AGENT, FeedEvent

__all__ = [
    "BUCKETS",
    "KEEP",
    "LATENCY_BOUNDS",
    "AgentMinute",
    "AgentMinuteChanges",
    "add_histograms",
    "fold_agent_minutes",
    "latency_bucket",
    "latency_quantile",
    "merge_agent_minutes",
    "minute_of",
]

KEEP = timedelta(hours=24)
"""How far behind the newest counted minute the rows are kept."""

LATENCY_BOUNDS: tuple[int, ...] = tuple(round(1000 * 2 ** (k / 4)) for k in range(107))
"""The buckets' bounds in microseconds: 1 ms, 1.19 ms, 1.41 ms, ... up to 2^26.5 ms (26.4 h).
Bucket 0 holds latencies below the first bound, bucket ``i`` those from ``LATENCY_BOUNDS[i-1]``
to below ``LATENCY_BOUNDS[i]``, and the last bucket those from the last bound up."""

BUCKETS = len(LATENCY_BOUNDS) + 1
"""The length of every row's histogram (migration 0010 checks it)."""

_FINISHED = frozenset({"TaskCompleted", "TaskFailed"})


def latency_bucket(microseconds: int) -> int:
    """The bucket of a latency (a negative one, which clocks never give here, counts as 0)."""
    return bisect_right(LATENCY_BOUNDS, microseconds)


def _bucket_seconds(bucket: int) -> float:
    """What a bucket stands for: the geometric middle of its bounds; for the first (below 1 ms)
    its upper bound, for the last (26.4 h and more) its lower bound."""
    if bucket == 0:
        return LATENCY_BOUNDS[0] / 1e6
    if bucket >= len(LATENCY_BOUNDS):
        return LATENCY_BOUNDS[-1] / 1e6
    return math.sqrt(LATENCY_BOUNDS[bucket - 1] * LATENCY_BOUNDS[bucket]) / 1e6


def latency_quantile(histogram: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0 < q <= 1) of a histogram, in seconds, by nearest rank; None when it
    holds no sample."""
    if not 0 < q <= 1:
        raise ValueError(f"a quantile is in (0, 1], not {q}")
    total = sum(histogram)
    if not total:
        return None
    rank = math.ceil(q * total)
    seen = 0
    for bucket, count in enumerate(histogram):
        seen += count
        if seen >= rank:
            return _bucket_seconds(bucket)
    raise AssertionError("unreachable: the ranks end at the total")


def add_histograms(histograms: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """Bucket by bucket sums (of histograms of :data:`BUCKETS` buckets)."""
    total = [0] * BUCKETS
    for histogram in histograms:
        for bucket, count in enumerate(histogram):
            total[bucket] += count
    return tuple(total)


def minute_of(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def _microseconds(start: datetime, end: datetime) -> int:
    delta = end - start
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


@dataclass(slots=True)
class AgentMinute:
    """One agent's counts in one minute (a row, or what a batch adds to it)."""

    agent: str
    minute: datetime
    started: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    latency: list[int] = field(default_factory=lambda: [0] * BUCKETS)
    """Completed and failed tasks per latency bucket (:data:`LATENCY_BOUNDS`)."""

    @property
    def key(self) -> tuple[str, datetime]:
        return (self.agent, self.minute)


@dataclass(frozen=True, slots=True)
class AgentMinuteChanges:
    increments: dict[tuple[str, datetime], AgentMinute]
    """What the batch adds to each (agent, minute) row (a missing row starts at zero)."""
    newest: datetime | None
    """The newest minute counted so far, this batch included (None: none ever was)."""

    @property
    def cutoff(self) -> datetime | None:
        """Rows of minutes before this go."""
        return None if self.newest is None else self.newest - KEEP


def fold_agent_minutes(
    events: Iterable[FeedEvent], *, newest: datetime | None
) -> AgentMinuteChanges:
    """What a batch adds to the rows, given the newest minute counted before it (``newest``,
    the table's latest minute). Events older than the cut-off at their turn are skipped."""
    increments: dict[tuple[str, datetime], AgentMinute] = {}
    for event in events:
        kind = event.event_type
        if kind != "TaskStarted" and kind not in _FINISHED and kind != "TaskCancelled":
            continue
        minute = minute_of(event.recorded_at)
        if newest is not None:
            if minute < newest - KEEP:
                continue
            newest = max(newest, minute)
        else:
            newest = minute
        key = (event.task_agent or UNKNOWN_AGENT, minute)
        row = increments.get(key)
        if row is None:
            row = increments[key] = AgentMinute(*key)
        if kind == "TaskStarted":
            row.started += 1
        elif kind == "TaskCancelled":
            row.cancelled += 1
        else:
            if kind == "TaskCompleted":
                row.completed += 1
            else:
                row.failed += 1
            if event.started_at is not None:
                row.latency[latency_bucket(_microseconds(event.started_at, event.recorded_at))] += 1
    return AgentMinuteChanges(increments, newest)


def merge_agent_minutes(
    rows: Mapping[tuple[str, datetime], AgentMinute], changes: AgentMinuteChanges
) -> dict[tuple[str, datetime], AgentMinute]:
    """``rows`` with ``changes`` applied: the increments added, the rows before the cut-off
    gone. What the table in PostgreSQL does with them (:mod:`.postgres.tables`), in memory."""
    merged = dict(rows)
    for key, increment in changes.increments.items():
        row = merged.get(key) or AgentMinute(*key)
        merged[key] = AgentMinute(
            *key,
            started=row.started + increment.started,
            completed=row.completed + increment.completed,
            failed=row.failed + increment.failed,
            cancelled=row.cancelled + increment.cancelled,
            latency=list(add_histograms([row.latency, increment.latency])),
        )
    cutoff = changes.cutoff
    return {k: r for k, r in merged.items() if cutoff is None or r.minute >= cutoff}
