"""Each defect of issue 11 put back, one at a time, to check that the simulation catches it; and
defects only the world-against-log invariants (``.reality``) can see: a reply
lost between the broker and the log, an ack before its effect, requests published before their
pause, cancels naming the wrong calls; and defects of the waits beyond peer calls (issue 31): a
signal consumed twice, a timer fired twice.

A mutation undoes one fix by patching the code that made it (nothing else changes), for as long
as the ``mutated`` block runs; one of the second kind patches a plausible bug in instead.
``scripts/simulate --mutation NAME`` runs seeds with it; the test
``test_the_simulation_catches_each_defect_put_back`` requires every one to be caught.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import waystation.brokers.port
import waystation.events.memory
import waystation.events.task
import waystation.runtime.flows
import waystation.runtime.flows.base
import waystation.runtime.flows.cancel
import waystation.runtime.flows.reply
import waystation.runtime.flows.undeliverable
import waystation.runtime.outbox
import waystation.runtime.publishing
import waystation.runtime.recorder
import waystation.runtime.settle
import waystation.runtime.sweeper
import waystation.runtime.worker
from waystation.agent import AgentSpec
from waystation.brokers.port import Delivery
from waystation.events import (
    CancelledCall,
    DomainEvent,
    ExpiredCall,
    InvalidTransition,
    OutboxMessage,
    ReplyIgnored,
    ResultRecorded,
    TaskCancelled,
    TaskPaused,
    TaskResumed,
    TaskState,
    decide_cancel,
    decide_failure,
    decide_reply,
    decide_timeout,
    fold,
    parse_subtask_id,
)
from waystation.events.chain import recorded_events
from waystation.events.model import RecordedEvent
from waystation.protocol.intake import Rejection
from waystation.protocol.wire import TYPE_CANCEL, TYPE_TASK, implied_messages
from waystation.runtime.flows.base import Steps, error_of, resume_context
from waystation.runtime.flows.reply import handle_reply
from waystation.runtime.flows.resume import handle_resume
from waystation.runtime.recorder import Cause
from waystation.runtime.verdicts import Verdict, ack, dead, requeue

__all__ = ["MUTATIONS", "mutated"]

Patch = tuple[Any, str, Any]


def _old_attempt_of(delivery: Delivery) -> int:
    """Before the retry counter was Waystation's own: the broker's ``x-delivery-count`` alone
    (RabbitMQ 4.3 no longer counts a requeue in it)."""
    count = delivery.headers.get("x-delivery-count", 0)
    return count + 1 if isinstance(count, int) and count >= 0 else 1


def _old_retry(failed_runs: int) -> Verdict:
    return requeue()


async def _answer_by_plain_publish(
    self: waystation.runtime.settle.Settler, message: OutboxMessage
) -> None:
    await self.broker.publish(message)


async def _tell_nobody(*_: Any) -> None:
    return None


async def _no_retry_through_outages(
    self: waystation.runtime.recorder.Recorder, operation: Callable[[], Awaitable[Any]]
) -> Any:
    return await operation()


async def _sequential_sweep(self: waystation.runtime.sweeper.DeadlineSweeper) -> None:
    """The sweeper before each timeout was recorded in a task of its own: one timeout after the
    other, each waiting for its stream's lock."""
    while True:
        try:
            expired = await self.store.claim_expired_calls(
                limit=waystation.runtime.sweeper.SWEEP_BATCH,
                lease=waystation.runtime.sweeper.SWEEP_LEASE,
                deployment=self.deployment,
            )
            for call in expired:
                await self.record_timeout(call)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            logging.getLogger(__name__).warning("deadline sweep: %s", error)
        await asyncio.sleep(self.interval)


async def _timeout_on_the_workers_clock(
    self: waystation.runtime.sweeper.DeadlineSweeper, call: ExpiredCall
) -> None:
    """Before timeouts were decided on the database's clock: the timeout decided on the
    sweeping worker's own clock."""
    await self.recorder.append_decision(
        call.task_id,
        lambda state: decide_timeout(state, call.subtask_id, now=self.clock()),
        key=lambda _: f"timeout:{call.subtask_id}",
        cause=Cause(message_id=f"deadline:{call.subtask_id}"),
        step="timeout",
    )


async def _ack_then_record_reply(steps: Steps, delivery: Delivery, body: Any) -> Verdict:
    """The reply flow acking its delivery first, then recording it (G1 broken): a crash or an
    outage in between loses the reply."""
    await steps.broker.ack(delivery)
    await handle_reply(steps, delivery, body)
    return ack()  # (the worker's own ack then finds it settled already: logged, harmless)


async def _drop_reply_when_stream_busy(steps: Steps, delivery: Delivery, body: Any) -> Verdict:
    """A reply that finds another of its task being recorded on this worker acked unrecorded,
    on the belief that the other one's append takes it along (it does not): the call then
    times out as if its peer never answered."""
    try:
        task_id, _, _ = parse_subtask_id(delivery.correlation_id or "")
    except ValueError:
        return await handle_reply(steps, delivery, body)
    if steps.recorder.locks.busy(task_id):
        return ack()
    return await handle_reply(steps, delivery, body)


async def _ack_then_resume(steps: Steps, delivery: Delivery, spec: AgentSpec, body: Any) -> Verdict:
    """The resume flow acking its message first, then running the resumed handler (G1 broken):
    a crash or a failed run in between leaves the task resumed and nobody to run it."""
    await steps.broker.ack(delivery)
    await handle_resume(steps, delivery, spec, body)
    return ack()


async def _late_replies_dead_lettered(steps: Steps, delivery: Delivery, body: Any) -> Verdict:
    """Replies found through an index of pending calls, which forgets a task's calls when it
    ends: a reply to a finished task dead-lettered as for an unknown task, not recorded late."""
    try:
        task_id, _, _ = parse_subtask_id(delivery.correlation_id or "")
    except ValueError:
        return await handle_reply(steps, delivery, body)
    if (await steps.recorder.load(task_id)).finished:
        return dead("unknown-task", f"no pending call of {task_id!r}")
    return await handle_reply(steps, delivery, body)


async def _unstorable_reply_only_dead_lettered(
    steps: Steps, delivery: Delivery, why: Rejection
) -> Verdict:
    """A reply whose body the log cannot store dead-lettered without failing its call: the call
    waits for its deadline, and the log never says why."""
    return dead(why.reason, why.detail)


def _ignored_replies_unrecorded(state: TaskState, subtask: str, **given: Any) -> list[DomainEvent]:
    """Duplicate and late replies acked without their audit record."""
    events = decide_reply(state, subtask, **given)
    return [] if events and isinstance(events[0], ReplyIgnored) else events


def _late_replies_called_duplicates(
    state: TaskState, subtask: str, **given: Any
) -> list[DomainEvent]:
    events = decide_reply(state, subtask, **given)
    if events and isinstance(events[0], ReplyIgnored) and events[0].reason == "late":
        return [events[0].model_copy(update={"reason": "duplicate"})]
    return events


def _cancel_naming_every_call(state: TaskState, reason: str | None = None) -> list[DomainEvent]:
    """TaskCancelled.pending listing every call of the pause, those already claimed too."""
    events = decide_cancel(state, reason)
    if events and state.status == "paused":
        every = tuple(CancelledCall(subtask_id=c.subtask_id, agent=c.agent) for c in state.calls)
        return [TaskCancelled(reason=reason, pending=every)]
    return events


def _cancel_forgetting_a_call(state: TaskState, reason: str | None = None) -> list[DomainEvent]:
    """TaskCancelled.pending without the last outstanding call: its peer works on, uncancelled."""
    events = decide_cancel(state, reason)
    if events and isinstance(events[0], TaskCancelled) and events[0].pending:
        return [events[0].model_copy(update={"pending": events[0].pending[:-1]})]
    return events


def _no_cancel_on_timeout(
    names: Any, state: TaskState, events: Sequence[DomainEvent], reply_to: str | None = None
) -> list[OutboxMessage]:
    """A call's deadline recorded without a cancel to its peer (G6 broken)."""
    timed_out = {
        f"{e.subtask_id}:cancel"
        for e in events
        if isinstance(e, ResultRecorded) and e.outcome == "timeout"
    }
    return [
        m
        for m in implied_messages(names, state, events, reply_to)
        if not (m.properties.get("type") == TYPE_CANCEL and m.message_id in timed_out)
    ]


def _is_request(message: OutboxMessage) -> bool:
    properties = message.properties
    return properties.get("type") == TYPE_TASK and properties.get("correlation_id") == (
        message.message_id
    )


_commit_parts = waystation.runtime.recorder.Recorder._commit_parts
_collecting = waystation.runtime.publishing.PublishStep.collecting
_broker_here: contextvars.ContextVar[Any] = contextvars.ContextVar("broker_here")


@contextlib.contextmanager
def _collecting_with_the_broker(self: waystation.runtime.publishing.PublishStep) -> Iterator[Any]:
    """The publish step's scope, with its broker at hand for :func:`_requests_before_the_pause`
    (the recorder itself never holds one)."""
    token = _broker_here.set(self.outbox.broker)
    try:
        with _collecting(self) as committed:
            yield committed
    finally:
        _broker_here.reset(token)


async def _requests_before_the_pause(
    self: waystation.runtime.recorder.Recorder,
    parts: Sequence[Any],
    *,
    step: str,
    history: list[Any] | None,
) -> bool:
    """The dual path (G5 broken): a pause's peer requests published straight from memory before
    its append, and no outbox rows written for them; a reply can overtake the checkpoint, and a
    request whose publish failed is lost."""
    requests = [m for part in parts for m in part.messages if _is_request(m)]
    if requests:
        with contextlib.suppress(Exception):
            await _broker_here.get().publish_all(requests)
        parts = [
            dataclasses.replace(part, messages=[m for m in part.messages if not _is_request(m)])
            for part in parts
        ]
    return await _commit_parts(self, parts, step=step, history=history)


async def _answer_without_waiting(
    self: waystation.runtime.settle.Settler, message: OutboxMessage
) -> None:
    """An answer published without waiting for it: the delivery is acked first, and a crash in
    between loses the answer of a task that wrote nothing (G10)."""

    async def later() -> None:
        with contextlib.suppress(Exception):
            await self.broker.publish(message)

    task = asyncio.get_running_loop().create_task(later())
    _background.add(task)
    task.add_done_callback(_background.discard)


_background: set[asyncio.Task[None]] = set()


async def _relay_keeping_its_unsent(self: waystation.runtime.outbox.OutboxPublisher) -> None:
    """The relay before each row had a fate of its own. A row whose publish failed
    for any reason but "unroutable" stayed in the relay's unsent list, which it retried alone,
    never claiming another row, for as long as the broker said no."""
    unsent: list[Any] = []
    while True:
        try:
            entries = unsent or await self.store.claim_outbox(
                limit=waystation.runtime.outbox.RELAY_BATCH,
                lease=waystation.runtime.outbox.RELAY_LEASE,
                deployment=self.deployment,
            )
            unsent = []
            if entries:
                errors = await self.broker.publish_all([e.message for e in entries])
                for entry, error in zip(entries, errors, strict=True):
                    if error is None:
                        self._forget(entry.id)
                    elif isinstance(error, waystation.brokers.port.Unroutable):
                        await self._undeliverable(entry, error)
                    else:
                        unsent.append(entry)
                if len(entries) == waystation.runtime.outbox.RELAY_BATCH and not unsent:
                    continue
        except asyncio.CancelledError:
            raise
        except Exception as error:
            logging.getLogger(__name__).warning("outbox relay: %s", error)
        await asyncio.sleep(self.poll_interval)


def _headers_as_they_came(headers: Any) -> dict[str, Any]:
    """The copies of a delivery re-publishing its headers as decoded, which the
    client library cannot always write again (a long string that was not UTF-8)."""
    return dict(headers)


async def _resume_in_place_handing_every_failure_over(
    steps: waystation.runtime.flows.base.Steps,
    state: TaskState,
    events: list[DomainEvent],
    made: list[Any],
) -> waystation.runtime.recorder.Extension | None:
    """A resumed run in place, before it followed its agent's policy. Anything it
    raised but an invalid outcome was handed over to a resume message, to run again, whatever
    the policy said (a ``Permanent`` error, ``retries=0``), and without its backoff."""
    if not (steps.settings.resume_in_place and events and isinstance(events[-1], TaskResumed)):
        return None
    spec = steps.app.agents.get(state.agent or "")
    if spec is None or spec.limited:
        return None
    decided_at = steps.clock()
    resumed = fold(
        state.task_id,
        recorded_events(state.task_id, state.version, made, state.last_hash),
        start=state,
    )
    try:
        outcome = await steps.run_handler(spec, resume_context(spec, resumed))
        following = steps.decide_outcome(resumed, outcome, spec)
    except InvalidTransition as error:
        failed = [*events, *decide_failure(resumed, error_of(error))]
        return waystation.runtime.recorder.Extension(
            failed, checkpoint_started=None, resumed_at=decided_at
        )
    except Exception:
        return waystation.runtime.recorder.Extension(
            events, checkpoint_started=None, resumed_at=None, failed_runs=1
        )
    return waystation.runtime.recorder.Extension(
        [*events, *following], checkpoint_started=None, resumed_at=decided_at
    )


async def _copy_taken_for_current(
    self: waystation.runtime.recorder.Recorder, task_id: str, copy: list[RecordedEvent]
) -> list[RecordedEvent] | None:
    """A worker's cached copy of a stream taken for current without asking the log."""
    return None


def _kept_signal_taken_by_every_wait(state: TaskState, pause: TaskPaused) -> list[DomainEvent]:
    """A new pause's signal waits each take the oldest signal the task keeps under their name,
    the one a wait before took too (what it took is not counted): one signal, two claims."""
    task = waystation.events.task
    events: list[DomainEvent] = []
    paused = dataclasses.replace(
        state, status="paused", pause=pause.pause, calls=pause.calls, until=pause.until
    )
    for wait in pause.calls:
        kept = [k for k in state.kept if state.signals[k].name == wait.name]
        if wait.kind != "signal" or not kept:
            continue
        payload = state.signals[kept[0]].payload
        events.extend(task._claim(paused, wait.subtask_id, "ok", payload, kept[0]))
        if isinstance(events[-1], TaskResumed):
            break
        paused = task._after_claim(paused, wait.subtask_id, kept[0], "ok")
    return events


def _timer_fires_whatever_claimed_it(
    state: TaskState, subtask: str, *, now: float
) -> list[DomainEvent]:
    """``decide_timeout`` firing a due timer of the pause that waits, claimed or not."""
    call = next((c for c in state.calls if c.subtask_id == subtask), None)
    if call is None or call.kind != "timer" or state.status != "paused" or call.deadline_at > now:
        return decide_timeout(state, subtask, now=now)
    return waystation.events.task._claim(state, subtask, "ok")


async def _timeout_keyed_by_its_sweep(
    self: waystation.runtime.sweeper.DeadlineSweeper, call: ExpiredCall
) -> None:
    """A deadline's decision keyed by the sweep that found it (``call.now``), not by its wait:
    a second sweep's decision is not recognised as the same one."""
    with self.publishing.collecting() as committed:
        await self.recorder.append_decision(
            call.task_id,
            lambda state: waystation.runtime.sweeper.decide_timeout(
                state, call.subtask_id, now=call.now or self.clock()
            ),
            key=lambda _: f"timeout:{call.subtask_id}:{call.now}",
            cause=Cause(message_id=f"deadline:{call.subtask_id}"),
            step="timeout",
        )
    await self.publishing.publish(committed)


_follow_pending_calls = waystation.events.memory.InMemoryEventStore._follow_pending_calls


def _fired_timers_stay_pending(
    self: waystation.events.memory.InMemoryEventStore, recorded: list[RecordedEvent]
) -> None:
    """The pending waits forgetting a claimed wait only when it is a call or a signal's: a
    fired timer stays, offered to the sweepers again each time its lease runs out."""
    timers = {wait: entry for wait, entry in self._pending.items() if entry[5] == "timer"}
    _follow_pending_calls(self, recorded)
    ended = {
        e.stream_id
        for e in recorded
        if e.event_type in ("TaskCompleted", "TaskFailed", "TaskCancelled")
    }
    for wait, entry in timers.items():
        if entry[0] not in ended and any(
            e.event_type == "SubtaskClaimed" and e.data["subtask_id"] == wait for e in recorded
        ):
            self._pending[wait] = entry


MUTATIONS: dict[str, list[Patch]] = {
    # an outcome the log cannot store reached the commit
    "unstorable-outcome": [(waystation.events.task, "_require_storable", lambda value, what: None)],
    # a cancel before a task's first run was recorded left its publisher unanswered
    "cancel-before-first-run": [
        (waystation.runtime.flows.base.Steps, "answer_cancelled_before_start", _tell_nobody)
    ],
    # a handler ran in place on a stale copy of its stream (and a timeout that the copy found
    # nothing to do for was dropped): the copy a worker cached taken for current, never checked
    # against the log. (Putting back ``resumes`` as always False, as this once did, turns resume
    # in place off altogether; only one seed in 6,000 failed with it.)
    "stale-cache": [(waystation.runtime.recorder.Recorder, "_newer", _copy_taken_for_current)],
    # an answer to a queue that is gone failed the flow, which re-ran the handler
    "unroutable-answer": [(waystation.runtime.settle.Settler, "answer", _answer_by_plain_publish)],
    # attempts counted by the broker's x-delivery-count, retries by requeueing
    "broker-counting": [
        (waystation.runtime.flows.base, "retry", _old_retry),
        (waystation.runtime.flows.base, "attempt_of", _old_attempt_of),
    ],
    # an outage of the log re-ran the whole flow, its handler included
    "outage-reruns-handler": [
        (waystation.runtime.recorder.Recorder, "_through_outages", _no_retry_through_outages)
    ],
    # a timeout decided on the worker's clock, which may be behind the database's
    "worker-clock-timeouts": [
        (
            waystation.runtime.sweeper.DeadlineSweeper,
            "record_timeout",
            _timeout_on_the_workers_clock,
        )
    ],
    # the sweeper waited on each stream's lock in turn
    "sequential-sweeper": [(waystation.runtime.sweeper.DeadlineSweeper, "run", _sequential_sweep)],
    # the world against the log ("When the broker says no", section 2):
    # G1: the reply flow acked its delivery, then appended
    "reply-acked-before-append": [
        (waystation.runtime.flows, "handle_reply", _ack_then_record_reply)
    ],
    # a reply lost between the broker and the log (acked unrecorded), turned into a timeout
    "reply-lost-when-stream-busy": [
        (waystation.runtime.flows, "handle_reply", _drop_reply_when_stream_busy)
    ],
    # G1: the resume flow acked its message, then ran the resumed handler
    "resume-acked-before-its-run": [(waystation.runtime.flows, "handle_resume", _ack_then_resume)],
    # a reply to a finished task dead-lettered (unknown-task) instead of recorded as late
    "late-replies-dead-lettered": [
        (waystation.runtime.flows, "handle_reply", _late_replies_dead_lettered)
    ],
    # a reply the log cannot store dead-lettered, its call left to time out
    "unstorable-reply-unrecorded": [
        (waystation.runtime.worker, "handle_unstorable_reply", _unstorable_reply_only_dead_lettered)
    ],
    # duplicate and late replies acked without their audit record
    "ignored-replies-unrecorded": [
        (waystation.runtime.flows.reply, "decide_reply", _ignored_replies_unrecorded)
    ],
    # late replies recorded as duplicates
    "late-replies-called-duplicates": [
        (waystation.runtime.flows.reply, "decide_reply", _late_replies_called_duplicates)
    ],
    # G5, the dual path: requests published before the pause commits, outbox rows forgotten
    "requests-before-pause-commits": [
        (waystation.runtime.recorder.Recorder, "_commit_parts", _requests_before_the_pause),
        (waystation.runtime.publishing.PublishStep, "collecting", _collecting_with_the_broker),
    ],
    # G7: a cancel naming the claimed calls too, or leaving one outstanding call out
    "cancel-names-claimed-calls": [
        (waystation.runtime.flows.cancel, "decide_cancel", _cancel_naming_every_call)
    ],
    "cancel-forgets-a-call": [
        (waystation.runtime.flows.cancel, "decide_cancel", _cancel_forgetting_a_call)
    ],
    # G6: a timeout without a cancel to the peer
    "timeout-without-cancel": [
        (waystation.runtime.recorder, "implied_messages", _no_cancel_on_timeout)
    ],
    # G10 with G1: an answer published without waiting, after the ack
    "answer-after-ack": [(waystation.runtime.settle.Settler, "answer", _answer_without_waiting)],
    # issue 30: an answer to a publisher that did not wait dead-lettered (unroutable), where it
    # is counted as undelivered; each path that meets it reads the rule under its own name
    "gone-publisher-dead-lettered": [
        (module, "to_gone_publisher", lambda message, error: False)
        for module in (
            waystation.runtime.settle,
            waystation.runtime.outbox,
            waystation.runtime.flows.undeliverable,
        )
    ],
    # issue 28: one refused outbox row stopped its worker's relay
    "relay-stalls-on-a-refusal": [
        (waystation.runtime.outbox.OutboxPublisher, "relay", _relay_keeping_its_unsent)
    ],
    # issue 28: the copies of a delivery re-published headers the client cannot write
    "copies-unsanitized": [(waystation.runtime.settle, "sendable", _headers_as_they_came)],
    # issue 28: a resumed run in place that raised Permanent ran again by resume message
    "resume-in-place-ignores-the-policy": [
        (
            waystation.runtime.flows.reply,
            "run_in_place",
            _resume_in_place_handing_every_failure_over,
        ),
    ],
    # issue 31: a signal the task kept taken by two waits of the pause that takes it
    "signal-consumed-twice": [
        (waystation.events.task, "_take_kept_signals", _kept_signal_taken_by_every_wait)
    ],
    # issue 31: a timer fired again once its lease ran out, whatever claimed it. Each of the three
    # keeps a timer from firing twice on its own: decide_timeout's claim check, the pending wait
    # forgotten with its claim, and the decision's id keyed by the wait (a second decision is
    # recognised as the same one), so the three are put back together
    "timer-fires-twice": [
        (waystation.runtime.sweeper, "decide_timeout", _timer_fires_whatever_claimed_it),
        (waystation.runtime.sweeper.DeadlineSweeper, "record_timeout", _timeout_keyed_by_its_sweep),
        (
            waystation.events.memory.InMemoryEventStore,
            "_follow_pending_calls",
            _fired_timers_stay_pending,
        ),
    ],
}


@contextlib.contextmanager
def mutated(name: str | None) -> Iterator[None]:
    """Apply mutation ``name`` (None: none) for the duration of the block."""
    if name is None:
        yield
        return
    saved = [
        (owner, attribute, getattr(owner, attribute)) for owner, attribute, _ in MUTATIONS[name]
    ]
    for owner, attribute, replacement in MUTATIONS[name]:
        setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        for owner, attribute, original in saved:
            setattr(owner, attribute, original)
