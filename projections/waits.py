"""What a task waits for, in words: how ``waystation tasks``, ``history`` and ``state`` name a
pause's waits (peer calls, signals, timers), its ``FirstK``, what ended each wait, and the
signals a task keeps. Pure functions of the events and the folded state, so that the three
commands say the same thing the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from datetime import UTC, datetime

from waystation.events.codec import dumps
from waystation.events.model import PendingCall, SubtaskClaimed, TaskPaused
from waystation.events.task import TaskState

__all__ = [
    "counted",
    "describe_claim",
    "describe_pause",
    "describe_waits",
    "state_lines",
    "wait_label",
]


def counted(labels: Iterable[str]) -> str:
    """Labels in first-seen order, a repeated one once with its count: ``researcher ×3, x``."""
    counts = Counter(labels)
    return ", ".join(f"{label} ×{n}" if n > 1 else label for label, n in counts.items())


def describe_waits(labels: Iterable[str], first_k: int | None) -> str:
    """Open waits as ``tasks`` lists them: ``call researcher ×2, signal approval``, preceded by
    ``first K of:`` for a ``FirstK`` pause; ``-`` when none is open."""
    shown = counted(labels)
    if not shown:
        return "-"
    return f"first {first_k} of: {shown}" if first_k is not None else shown


def _seconds(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".") if value < 10 else f"{value:.0f}"


def describe_pause(paused: TaskPaused) -> str:
    """What a pause waits for: ``calling researcher ×3 (deadline in 300 s)``, then its signals
    and timers, its ``FirstK`` and the agent version that paused."""
    calls = [c for c in paused.calls if c.kind == "call"]
    parts = []
    if calls:
        timeouts = [c.deadline_at - c.dispatched_at for c in calls if c.dispatched_at is not None]
        deadline = f" (deadline in {_seconds(max(timeouts))} s)" if timeouts else ""
        parts.append(f"calling {counted(c.agent for c in calls)}{deadline}")
    others = []
    for wait in paused.calls:
        after = (
            f" {_seconds(wait.deadline_at - wait.dispatched_at)} s"
            if wait.dispatched_at is not None
            else ""
        )
        if wait.kind == "signal":
            others.append(f"signal {wait.name} (up to{after or ' its deadline'})")
        elif wait.kind == "timer":
            others.append(f"a timer of{after}" if after else "a timer")
    if others:
        parts.append("waiting for " + ", ".join(others))
    if paused.until is not None:
        parts.append(f"resuming on the first {paused.until} of {len(paused.calls)}")
    if paused.agent_version is not None:
        parts.append(f"agent version {paused.agent_version}")
    return ", ".join(parts)


def describe_claim(claim: SubtaskClaimed, wait: PendingCall | None) -> str:
    """A claim and what ended its wait: a reply, a signal, a deadline, a timer firing."""
    kind = wait.kind if wait is not None else "call"
    if claim.message_id is None:
        how = {
            "call": "no reply message: its deadline passed",
            "signal": "no signal: its wait timed out",
            "timer": "its timer fired",
        }[kind]
        return f"claimed {claim.subtask_id} ({how})"
    if kind == "signal":
        return f"claimed {claim.subtask_id} with signal {claim.message_id}"
    return f"claimed {claim.subtask_id}"


def _utc(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).isoformat()


def state_lines(state: TaskState) -> list[str]:
    """What ``state`` says of a task's waits: the agent version and ``FirstK`` of its pause, its
    open waits by kind with their deadlines, the results (a signal's with its sender), the waits
    a resume gave up and the signals kept for a later wait."""
    lines = []
    if state.agent_version is not None:
        lines.append(f"version      {state.agent_version} (the agent's, on its latest pause)")
    if state.until is not None:
        lines.append(f"resumes on   the first {state.until} of {len(state.calls)} wait(s)")
    kinds = Counter(wait.kind for wait in state.outstanding)
    by_kind = ", ".join(f"{n} {kind}" + ("s" if n > 1 else "") for kind, n in kinds.items())
    lines.append(
        f"outstanding  {len(state.outstanding)} wait(s)" + (f": {by_kind}" if by_kind else "")
    )
    for wait in state.outstanding:
        when = "fires" if wait.kind == "timer" else "deadline"
        lines.append(
            f"  {wait.subtask_id}  {wait_label(wait.kind, wait.agent, wait.name)}  {when} "
            f"{_utc(wait.deadline_at)}"
        )
    lines.append(f"results      {len(state.results)}")
    for result in state.results.values():
        value = dumps(result.value if result.ok else result.error).decode()
        sender = f"  from {result.sender}" if result.sender else ""
        lines.append(
            f"  {result.subtask_id}  {wait_label(result.kind, result.agent, result.name)}  "
            f"{result.outcome}  {value}{sender}"
        )
    if state.abandoned:
        lines.append(f"given up     {', '.join(sorted(state.abandoned))}")
    if state.kept:
        lines.append(f"kept         {len(state.kept)} signal(s) no wait has taken yet")
        for signal_id in state.kept:
            signal = state.signals[signal_id]
            sender = f"  from {signal.sender}" if signal.sender else ""
            lines.append(f"  {signal_id}  signal {signal.name}{sender}")
    return lines


def wait_label(kind: str, agent: str | None, name: str | None) -> str:
    """A wait in a word or two: ``call researcher``, ``signal approval``, ``timer``."""
    return f"{kind} {agent or name or ''}".rstrip()
