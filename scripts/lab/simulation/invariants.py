"""What must hold after every simulated run, whatever the faults (issue 11, section 3).

:func:`problems` returns one line per broken invariant (empty when the run is correct):

* every submitted task answers its publisher, and every copy of the answer is the same;
* the answer agrees with the log: the task's terminal event (or, for a task that completed without
  peers and so wrote nothing, G10, an ``ok``); a cancel answered ``cancelled`` is in the log;
* every stream verifies (hash chain, contiguous versions, one claim per sub-task, one resume per
  pause, nothing after a terminal event) and ends in a terminal event;
* everything settles within a bound past the last deadline, and every timeout is recorded soon
  after its deadline, by the database's clock, whatever the workers' clocks say;
* a handler is retried at most the delivery limit times (plus a run for each delivery a crash or
  a dropped connection took back), a resumed handler never starts for a task the log says is
  finished, and no worker meets an exception it did not expect;
* an outcome the log cannot store fails its task at once, saying so; an answer whose publisher
  is gone is counted as undelivered (``results_undelivered``), never kept as a dead letter;
* no message is left in a queue, unsettled or unpublished, and none disappears: each one the
  broker took was acked by a consumer or dead-lettered, and every dead letter carries a reason;
* the paused-tasks projection built along the way from batches of the log equals the one built
  from the whole log at once, and what folding each stream says;
* what happened in the world (the broker's ledger, every commit, publish and ack in order) is
  what the log says: ``.reality``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import UTC, datetime
from typing import Any

from waystation.events import RecordedEvent, canonical, fold
from waystation.events.codec import loads
from waystation.projections.audit import verify_stream
from waystation.projections.model import FeedEvent, PausedTask, fold_paused_tasks, open_waits
from waystation.protocol.wire import HEADER_ATTEMPTS
from waystation.runtime.outbox import REFUSED_BACKOFF
from waystation.runtime.sweeper import SWEEP_LEASE

from . import reality, refusals, waits
from .loop import EPOCH
from .scenario import REFUSED_RETRY, TaskSpec
from .world import RESULTS, SETTLE_BOUND, Observed

TIMEOUT_SLACK = 10.0
"""Seconds past its deadline (the database's clock) by which a timeout must be recorded: a few
sweep intervals."""

__all__ = ["apply_feed", "problems"]

_TERMINAL = {"TaskCompleted": "ok", "TaskFailed": "error", "TaskCancelled": "cancelled"}
_AUDIT_ONLY = ("ReplyIgnored", "SignalRefused")
"""Events recorded for audit, even after a task's end: they decide nothing."""


def _moment(event: RecordedEvent) -> datetime:
    return datetime.fromtimestamp(EPOCH + event.global_position, UTC)


def _feed(event: RecordedEvent, history: list[RecordedEvent]) -> FeedEvent:
    """The event as the projections' feed gives it (the SQL of
    ``waystation.projections.postgres``)."""
    data = event.data
    started = history[0] if history and history[0].event_type == "TaskStarted" else None
    kind = event.event_type
    paused = next((e for e in reversed(history) if e.event_type == "TaskPaused"), None)
    return FeedEvent(
        tx_id=event.tx_id,
        global_position=event.global_position,
        stream_id=event.stream_id,
        event_type=kind,
        recorded_at=_moment(event),
        task_agent=started.data["agent"] if started else None,
        subtask_id=data.get("subtask_id"),
        pause=data.get("pause") if kind in ("TaskPaused", "TaskResumed") else None,
        outcome=data.get("outcome") if kind == "ResultRecorded" else None,
        deadline_at=data.get("deadline_at") if kind == "DeadlineExtended" else None,
        waits=open_waits(data["calls"]) if kind == "TaskPaused" else None,
        first_k=data.get("until") if kind == "TaskPaused" else None,
        agent_version=data.get("agent_version") if kind == "TaskPaused" else None,
        while_paused=kind == "TaskCancelled" and _paused(history),
        paused_at=_moment(paused) if paused is not None and kind == "TaskResumed" else None,
        call_agent=None,
    )


def _paused(history: list[RecordedEvent]) -> bool:
    """Whether the latest pause of a stream had not resumed (``FeedEvent.while_paused``)."""
    ends = (e.event_type for e in reversed(history))
    return next((t for t in ends if t in ("TaskPaused", "TaskResumed")), None) == "TaskPaused"


def apply_feed(
    rows: dict[str, Any], streams: dict[str, list[RecordedEvent]], batch: list[RecordedEvent]
) -> None:
    """Fold one batch of the log (in commit order) into the paused-tasks ``rows``."""
    feed = []
    for event in batch:
        feed.append(_feed(event, streams[event.stream_id]))
        streams[event.stream_id].append(event)
    touched = {e.stream_id for e in batch}
    changes = fold_paused_tasks({t: rows[t] for t in touched if t in rows}, feed)
    for task_id in changes.deletes:
        rows.pop(task_id, None)
    rows.update(changes.upserts)


def _row(row: Any) -> tuple[str, int]:
    assert isinstance(row, PausedTask)
    return row.status, row.pause


def problems(observed: Observed) -> list[str]:
    found: list[str] = []
    scenario = observed.scenario
    if observed.stalled:
        found.append(f"the run stalled: {observed.stalled}")
    streams: dict[str, list[RecordedEvent]] = defaultdict(list)
    for event in observed.log:
        streams[event.stream_id].append(event)
    if observed.settled_at is None:
        found.append("the run never settled (some task never answered, or messages never drained)")
    else:
        # a publisher's full queue holds its answer back until it is drained, or, drained too
        # late, until the refused answer is dead-lettered
        held = max(
            (d + REFUSED_RETRY + REFUSED_BACKOFF.maximum for d in observed.drained.values()),
            default=0.0,
        )
        bound = max(observed.last_deadline, held, 0.0) + SETTLE_BOUND
        if observed.settled_at > bound:
            found.append(
                f"settled only at +{observed.settled_at:.0f}s, past the last deadline "
                f"(+{observed.last_deadline:.0f}s) or drain plus {SETTLE_BOUND:.0f}s"
            )
    for spec in scenario.tasks:
        if spec.gone:
            found.extend(_gone_problems(observed, spec.task_id))
        else:
            found.extend(_task_problems(observed, spec, streams))
        if spec.bad:
            found.extend(_bad_problems(observed, spec, streams))
    found.extend(_undelivered_problems(observed, sum(spec.gone for spec in scenario.tasks)))
    found.extend(_worker_problems(observed, streams))
    found.extend(_timeout_problems(observed, streams))
    for stream_id, events in streams.items():
        found.extend(f"{stream_id}: {p.kind}: {p.message}" for p in verify_stream(events))
        decisive = [e for e in events if e.event_type not in _AUDIT_ONLY]
        if decisive and decisive[-1].event_type not in _TERMINAL:
            state = fold(stream_id, events)
            found.append(f"{stream_id}: left {state.status} at pause {state.pause}")
    found.extend(_broker_problems(observed))
    found.extend(_projection_problems(observed, streams))
    found.extend(reality.problems(observed, streams))
    found.extend(refusals.problems(observed, streams))
    found.extend(waits.problems(observed, streams))
    return found


def _task_problems(
    observed: Observed, spec: TaskSpec, streams: dict[str, list[RecordedEvent]]
) -> list[str]:
    found: list[str] = []
    task_id, agent = spec.task_id, spec.agent
    bodies = observed.results.get(task_id, [])
    if not bodies:
        if _kept_as_refused(observed, spec):
            return []  # its queue refused it for longer than the workers try: a dead letter
        return [f"{task_id}: its publisher never got a result"]
    distinct = {canonical(loads(body)) for body in bodies}
    events = streams.get(task_id, [])
    if len(distinct) > 1 and not _answered_then_cancelled_across_a_crash(observed, task_id, events):
        found.append(f"{task_id}: different results {sorted(d.decode() for d in distinct)}")
    answer = loads(bodies[0])
    terminal = next((e for e in reversed(events) if e.event_type in _TERMINAL), None)
    if terminal is None:
        if events:
            return found  # an unfinished stream is reported with the streams
        if answer["status"] != "ok" and agent == "researcher":
            found.append(f"{task_id}: no stream, yet the answer is {answer}")
        if observed.scenario.audit_all_tasks and answer["status"] == "ok":
            found.append(f"{task_id}: completed with auditing on, yet its stream is empty")
        return found
    expected = _TERMINAL[terminal.event_type]
    cancelled_before_start = terminal.event_type == "TaskCancelled" and (
        not events or events[0].event_type != "TaskStarted"
    )
    if answer["status"] != expected:
        if _too_large_for_the_broker(observed, spec, answer, expected):
            pass  # its result was over the broker's limit: kept as a dead letter, and said so
        elif not (cancelled_before_start and answer["status"] == "ok"):
            found.append(f"{task_id}: answered {answer['status']}, the log says {expected}")
        elif not _answered_before_the_cancel(observed, task_id, terminal):
            found.append(f"{task_id}: answered ok after its worker could see the cancel")
    elif expected == "ok" and canonical(answer.get("result")) != canonical(terminal.data["result"]):
        found.append(f"{task_id}: answered {answer.get('result')}, the log says {terminal.data}")
    for reply in observed.cancel_answers.get(task_id, []):
        status = reply.get("result", {}).get("status") if isinstance(reply, dict) else None
        if status == "cancelled" and terminal.event_type != "TaskCancelled":
            found.append(f"{task_id}: a cancel was told 'cancelled', the log says {expected}")
    return found


def _kept_as_refused(observed: Observed, spec: TaskSpec) -> bool:
    """Whether ``spec``'s answer was refused by its publisher's full queue for longer than the
    workers try (``refused_retry_seconds``), and kept as a dead letter instead."""
    return spec.task_id in observed.full_queues and any(
        letter.properties.get("correlation_id") == spec.task_id
        and letter.headers.get("x-waystation-reason") == "refused"
        for letter in observed.dead_letters
    )


def _too_large_for_the_broker(
    observed: Observed, spec: TaskSpec, answer: dict[str, Any], expected: str
) -> bool:
    """Whether ``spec`` completed with a result the workers may send and the broker refuses for
    its size, which its publisher is told about (``undeliverable-result``) instead."""
    limit = observed.scenario.broker_max_bytes
    error = answer.get("error") if isinstance(answer.get("error"), dict) else {}
    return (
        expected == "ok"
        and limit is not None
        and spec.big > limit
        and answer["status"] == "error"
        and error.get("type") == "undeliverable-result"
        and "too-large" in str(error.get("message"))
    )


def _gone_problems(observed: Observed, task_id: str) -> list[str]:
    kept = [
        letter
        for letter in observed.dead_letters
        if letter.properties.get("correlation_id") == task_id
        and letter.headers.get("x-waystation-reason") == "unroutable"
    ]
    if kept:
        return [f"{task_id}: its publisher is gone, and its answer was dead-lettered (unroutable)"]
    return []


def _undelivered_problems(observed: Observed, gone: int) -> list[str]:
    """Each of the ``gone`` publishers' answers was counted as undelivered (at least once: a
    crash may send one twice)."""
    counted = observed.counters.get("results_undelivered", 0)
    if counted < gone:
        return [f"{gone} publishers were gone, but only {counted} results counted undelivered"]
    return []


def _bad_problems(
    observed: Observed, spec: TaskSpec, streams: dict[str, list[RecordedEvent]]
) -> list[str]:
    task_id = spec.task_id
    events = streams.get(task_id, [])
    terminal = next((e for e in reversed(events) if e.event_type in _TERMINAL), None)
    if terminal is None or terminal.event_type == "TaskCancelled":
        return []
    if terminal.event_type == "TaskCompleted":
        return [f"{task_id}: an outcome no log can store was recorded as completed"]
    error = terminal.data.get("error") or {}
    if error.get("type") == "InvalidTransition" and "cannot be stored" in error.get("message", ""):
        return []
    if error.get("type") == "RuntimeError":
        return []  # its handler raised on every attempt before it could return the bad outcome
    if error.get("type") == "Permanent" and spec.permanent:
        return []  # its resumed run gave up before it could return the bad outcome
    if error.get("type") == "DeliveryLimitReached":
        # its workers died holding it past the crash limit before a run could fail it (whether
        # the returns were enough is checked with the workers: _worker_problems)
        return []
    return [f"{task_id}: an outcome the log cannot store failed as {error}"]


def _worker_problems(observed: Observed, streams: dict[str, list[RecordedEvent]]) -> list[str]:
    found = [f"a resumed handler ran for a finished task: {run}" for run in observed.late_runs]
    returns = observed.returned
    # a duplicated message (a publisher that retried a lost confirm), or a worker that died
    # between sending a retry and acking what it retried, may start a second line of retries:
    # each may add the delivery limit again
    lines = 1 + observed.duplicated + returns
    bound = observed.scenario.delivery_limit * lines + returns
    for (task_id, pause), failed in observed.failed_runs.items():
        if failed > bound:
            found.append(f"{task_id}: its handler failed {failed} times at pause {pause}")
    # a run that did not raise runs again only if its message came again (a crash, a drop, a
    # duplicate, a relay republishing what its writer's confirm had not yet cleared), or when
    # resumed in place and an append found the stream moved on: another writer's conflicting
    # events, or the same decision recorded by a racing reply (a duplicate append)
    counters = observed.counters
    copies = Counter(m.properties.get("message_id") for m in observed.published)
    republished = sum(count - 1 for count in copies.values())
    again = (
        1
        + returns
        + republished  # by relays (counted by the ledger: a relay that crashed counts nothing)
        + counters.get("version_conflicts", 0)
        + counters.get("duplicate_appends", 0)
    )
    for (task_id, pause), runs in observed.runs.items():
        succeeded = runs - observed.failed_runs.get((task_id, pause), 0)
        if succeeded > again:
            found.append(f"{task_id}: its handler ran {succeeded} times at pause {pause}")
    # a run that raised Permanent is never retried, whatever path it took (in place or not): no
    # resume counting a failed run goes out for it, and it runs again only as any run may
    retries: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for sent in observed.chronicle.sent:
        failed = (sent.message.properties.get("headers") or {}).get(HEADER_ATTEMPTS)
        if isinstance(failed, int):
            retries[sent.message.message_id].append((sent.at, failed))
    for (task_id, pause), raised_at in observed.permanent_raised.items():
        runs = observed.runs.get((task_id, pause), 0)
        if runs > again:
            found.append(f"{task_id}: raised Permanent at pause {pause}, and ran {runs} times")
        # a retry of that run is a resume counting failed runs as none sent before it did (a
        # relay may send again one that was); a copy of the resume running beside it (a
        # duplicate, a relay's second send) may have failed as one worth trying again, and its
        # retry may go out after the Permanent: each such run owes at most one retry
        sent = retries.get(f"{task_id}:resume:{pause}", [])
        before = {failed for at, failed in sent if at <= raised_at}
        after = {failed for at, failed in sent if at > raised_at and failed not in before}
        owed = observed.retryable_failed.get((task_id, pause), 0) - len(before)
        if len(after) > max(owed, 0):
            found.append(f"{task_id}: raised Permanent at pause {pause}, and was retried")
    if returns <= 2 * observed.scenario.delivery_limit:
        for stream_id, events in streams.items():
            for event in events:
                if (event.data.get("error") or {}).get("type") == "DeliveryLimitReached":
                    found.append(f"{stream_id}: failed at the crash limit with {returns} returns")
    unexpected = observed.counters.get("processing_errors", 0)
    if unexpected:
        found.append(f"workers met {unexpected} unexpected exception(s) (processing_errors)")
    return found


def _timeout_problems(observed: Observed, streams: dict[str, list[RecordedEvent]]) -> list[str]:
    slack = TIMEOUT_SLACK
    if observed.crashes or observed.drops or observed.storage_failures_injected:
        # a sweeper that died, or lost the answer to its claim, holds its lease till it ends
        slack += 2 * SWEEP_LEASE
    slow = {spec.task_id: spec.slow for spec in observed.scenario.tasks}
    found = []
    for stream_id, events in streams.items():
        # the last reply of a pause is recorded only with what its handler, run in place, then
        # decides: a deadline passing during a slow run is timed out, by another sweeper once
        # the lease of this worker's (waiting on the stream) runs out
        # (docs/deadlines-and-cancellation.md)
        allowed = slack + (SWEEP_LEASE + slow.get(stream_id, 0.0) if slow.get(stream_id) else 0)
        deadlines: dict[str, float] = {}
        for event in events:
            if event.event_type == "TaskPaused":
                deadlines.update((c["subtask_id"], c["deadline_at"]) for c in event.data["calls"])
            elif event.event_type == "DeadlineExtended":
                deadlines[event.data["subtask_id"]] = event.data["deadline_at"]
            elif (
                event.event_type == "ResultRecorded"
                and event.data["outcome"] == "timeout"
                and event.recorded_at is not None
            ):
                late = event.recorded_at.timestamp() - deadlines[event.data["subtask_id"]]
                if late > allowed:
                    found.append(
                        f"{event.data['subtask_id']}: timeout recorded {late:.1f}s after its "
                        f"deadline (allowed {allowed:.0f}s)"
                    )
    return found


def _answered_before_the_cancel(observed: Observed, task_id: str, cancelled: RecordedEvent) -> bool:
    """A task that calls no peers writes nothing (G10), so a cancel can cross its answer: fine
    as long as the flow that answered last looked at the log before the cancel committed."""
    answers = [
        m
        for m in observed.published
        if m.routing_key in (RESULTS, observed.full_queues.get(task_id))
        and m.properties.get("correlation_id") == task_id
    ]
    if not answers or cancelled.recorded_at is None:
        return False
    first = min(answers, key=lambda m: m.enqueued_at)
    looked = [
        at
        for at, reader in observed.reads.get(task_id, [])
        if reader == first.published_by and at <= first.enqueued_at
    ]
    return bool(looked) and max(looked) < cancelled.recorded_at.timestamp()


def _answered_then_cancelled_across_a_crash(
    observed: Observed, task_id: str, events: list[RecordedEvent]
) -> bool:
    """The one case where a publisher may hear two answers (docs/deadlines-and-cancellation.md):
    a task that calls no peers records nothing (G10); it answered ``ok`` (having looked at the
    log before the cancel committed), and its worker died before acking it; the redelivery, after
    the cancel, answers ``cancelled``. Nothing in the log can tell that the first run answered."""
    if not (len(events) == 1 and events[0].event_type == "TaskCancelled"):
        return False
    cancelled_at = events[0].recorded_at
    answers = [
        m
        for m in observed.published
        if m.routing_key in (RESULTS, observed.full_queues.get(task_id))
        and m.properties.get("correlation_id") == task_id
    ]
    returned = any(
        m.delivery_count or m.acquired_count
        for m in observed.published
        if m.properties.get("message_id") == task_id and m.properties.get("type") == "task"
    )
    if not returned or cancelled_at is None:
        return False
    statuses = {loads(m.body)["status"] for m in answers}
    late_cancelled = all(
        m.enqueued_at >= cancelled_at.timestamp()
        for m in answers
        if loads(m.body)["status"] == "cancelled"
    )
    return (
        statuses == {"ok", "cancelled"}
        and late_cancelled
        and _answered_before_the_cancel(observed, task_id, events[0])
    )


def _broker_problems(observed: Observed) -> list[str]:
    found: list[str] = []
    if observed.leftovers:
        found.append(f"messages left unsettled at the end: {observed.leftovers}")
    if observed.outbox_left:
        found.append(f"{observed.outbox_left} outbox row(s) never published")
    for message in observed.published:
        if message.fate == "dropped":
            found.append(
                f"message {message.properties.get('message_id')} to {message.routing_key} "
                "disappeared without a dead letter"
            )
    for letter in observed.dead_letters:
        headers = letter.headers
        if not (headers.get("x-waystation-reason") or headers.get("x-first-death-reason")):
            found.append(f"dead letter {letter.properties.get('message_id')} has no reason")
    return found


def _projection_problems(observed: Observed, streams: dict[str, list[RecordedEvent]]) -> list[str]:
    incremental = {task_id: _row(row) for task_id, row in observed.projected.items()}
    whole: dict[str, Any] = {}
    apply_feed(whole, defaultdict(list), list(observed.log))
    at_once = {task_id: _row(row) for task_id, row in whole.items()}
    folded = {
        stream_id: (state.status, state.pause)
        for stream_id, events in streams.items()
        if (state := fold(stream_id, events)).status in ("paused", "resumed")
    }
    found = []
    if incremental != at_once:
        found.append(f"paused tasks built in batches {incremental} != at once {at_once}")
    if at_once != folded:
        found.append(f"paused tasks projected {at_once} != folded from the streams {folded}")
    return found
