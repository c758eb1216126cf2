"""What a chaos run will do, pure functions of its seed and options.

* :func:`plan_faults`: when each fault lands: the kinds shuffled, one per equal slice of the
  results, at a random point of its slice, after a random delay; :func:`fault_span`: the
  results the faults are spread over;
* :func:`plan_tasks`: which tasks are special (docs/failures.md: when the broker says no): a
  share whose ``reply_to`` is a full queue that rejects publishes (drained late, or never), a
  share whose result is larger than a message may be (over the workers' limit, or over the
  broker's; :func:`padding`); :func:`expected_answer` says what each must get.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any

FAULT_KINDS = ("kill", "close", "pg-restart")


# ---- the fault plan ------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    """``kill`` (SIGKILL a worker, start a replacement), ``close`` (every broker connection of
    the run's vhost) or ``pg-restart`` (the run's PostgreSQL cluster stopped and started)."""
    after_results: int
    """It lands once this many results are in..."""
    delay: float
    """...and this many seconds later (a random moment in whatever is in flight)."""


def plan_faults(
    results_span: int, kills: int, closes: int, pg_restarts: int, seed: int
) -> list[PlannedFault]:
    """The faults in the order they land, spread over the first ``results_span`` results: the
    span is cut into one equal slice per fault, each fault lands at a random point of its slice
    (so no two pile up, and none waits for the end)."""
    kinds = ["kill"] * kills + ["close"] * closes + ["pg-restart"] * pg_restarts
    rng = random.Random(seed)
    rng.shuffle(kinds)
    width = results_span / max(1, len(kinds))
    return [
        PlannedFault(
            kind,
            max(1, int(width * (index + rng.random()))),
            round(rng.uniform(0.0, 1.0), 3),
        )
        for index, kind in enumerate(kinds)
    ]


# ---- the tasks: which are special, and what each must get ----------------------------------

TASK_KINDS = ("normal", "full-drained", "full-never", "over-worker", "over-broker")
"""``normal``: the example job, answered with its total. ``full-drained``: its ``reply_to`` is a
queue that rejects publishes (``x-overflow: reject-publish``), kept full a while and then
drained: its result is refused, retried with backoff by the outbox, and arrives.
``full-never``: the same, never drained: its result is refused until the workers'
``WAYSTATION_REFUSED_RETRY_SECONDS`` have passed, then dead-lettered (``refused``); that dead
letter is its answer. ``over-worker``: its result is larger than the workers'
``WAYSTATION_MAX_MESSAGE_BYTES`` allows: the task fails at once (``MessageTooLarge``) and its
publisher gets that error. ``over-broker``: its result fits the workers' limit but not the
broker's ``max_message_size``: dead-lettered (``too-large``), its publisher gets an
``undeliverable-result`` error."""
FULL_KINDS = ("full-drained", "full-never")
OVERSIZED_KINDS = ("over-worker", "over-broker")


@dataclass(frozen=True)
class TaskMix:
    """What share of the tasks is special (see :data:`TASK_KINDS`)."""

    full_share: float = 0.0
    """Tasks whose ``reply_to`` is a full queue that rejects publishes..."""
    never_drained: float = 0.0
    """...of which this fraction is never drained."""
    oversized_share: float = 0.0
    """Tasks whose result is larger than a message may be..."""
    over_broker: bool = False
    """...half of them over the broker's limit (when it has one here), the rest over the
    workers'."""


def _share(tasks: int, share: float) -> int:
    """``share`` of ``tasks``, at least one when the share is not zero."""
    return 0 if share <= 0 else max(1, round(tasks * share))


def _split(count: int, fraction: float) -> int:
    """The part of ``count`` that ``fraction`` asks for, at least one of each side when there are
    two or more and the fraction is strictly between 0 and 1."""
    if count == 0 or fraction <= 0:
        return 0
    if fraction >= 1:
        return count
    part = round(count * fraction)
    return min(count - 1, max(1, part)) if count >= 2 else part


def plan_tasks(tasks: int, held_back: int, mix: TaskMix, seed: int) -> list[str]:
    """The kind of each task, by position (a pure function of the seed). The special ones are
    drawn among the first ``tasks - held_back``: the held-back tail (submitted once every fault
    has landed) stays plain, so that the run does not end waiting for a special one."""
    eligible = max(0, tasks - held_back)
    full = _share(tasks, mix.full_share)
    never = _split(full, mix.never_drained)
    oversized = _share(tasks, mix.oversized_share)
    over_broker = _split(oversized, 0.5) if mix.over_broker else 0
    wanted = (
        ["full-never"] * never
        + ["full-drained"] * (full - never)
        + ["over-broker"] * over_broker
        + ["over-worker"] * (oversized - over_broker)
    )
    if len(wanted) > eligible:
        raise ValueError(f"{len(wanted)} special tasks do not fit in the first {eligible}")
    kinds = ["normal"] * tasks
    rng = random.Random(seed + 2)
    for index, kind in zip(rng.sample(range(eligible), len(wanted)), wanted, strict=True):
        kinds[index] = kind
    return kinds


@dataclass(frozen=True)
class Expected:
    """What one task must get."""

    kind: str
    result: Any
    """The result of its ``ok`` answer (also what the dead letter of a ``full-never`` task
    holds); None when its answer is an error."""
    error_type: str | None = None
    """The ``error.type`` of its error answer."""
    letter: str | None = None
    """Answered by a dead letter of this reason instead of a result (``full-never``)."""
    may_letter: frozenset[str] = frozenset()
    """Reasons of the dead letters of its messages that its kind explains."""


def expected_answer(kind: str, result: Any) -> Expected:
    """What a task of ``kind`` (:data:`TASK_KINDS`) whose job sums to ``result`` must get."""
    if kind in ("normal", "full-drained"):
        return Expected(kind, result)
    if kind == "full-never":
        return Expected(kind, result, letter="refused", may_letter=frozenset({"refused"}))
    if kind == "over-worker":
        # failed at once; when its resumed run came as a message (its worker died holding the
        # last reply), that message is dead-lettered as the failure's cause
        return Expected(
            kind, None, error_type="MessageTooLarge", may_letter=frozenset({"handler-failed"})
        )
    if kind == "over-broker":
        # (the result may be dead-lettered twice: once as the broker closed the channel it
        # came on, again when a relay met its row)
        return Expected(
            kind, None, error_type="undeliverable-result", may_letter=frozenset({"too-large"})
        )
    raise ValueError(f"no such kind of task: {kind!r}")


# ---- an oversized task's padding, and the faults' span ----------------------------------------

OVER_BROKER_PAD = 4 * 1024
"""A result over the broker's limit is this much larger than it..."""
OVER_BROKER_ROOM = OVER_BROKER_PAD + 8 * 1024
"""...and fits the workers' limit with this much room (the envelope's 1 KiB included)."""


def task_mix(args: argparse.Namespace) -> TaskMix:
    return TaskMix(
        full_share=args.full_queue_share,
        never_drained=args.never_drained,
        oversized_share=args.oversized_share,
        over_broker=bool(args.broker_max_message_size),
    )


def padding(kind: str, args: argparse.Namespace) -> int:
    """How much an oversized task of ``kind`` pads its result."""
    if kind == "over-worker":
        return int(args.max_message_bytes)
    if kind == "over-broker":
        return int(args.broker_max_message_size) + OVER_BROKER_PAD
    return 0


def fault_span(tasks: int, in_flight: int) -> int:
    """The faults land within the first this many results. The last ``in_flight`` tasks are
    held back until every fault has landed, so at most ``tasks - in_flight`` results can come
    before; ending the span a tenth of those and a full window earlier leaves the tasks still to
    submit that keep work in flight while a fault waits for the workers to be healthy."""
    return max(1, int(0.9 * (tasks - in_flight)) - in_flight)
