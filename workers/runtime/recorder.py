"""Recording decisions: read a task's stream, decide, append, and hand on what the append committed.

Every flow of the worker records through a :class:`Recorder`: it folds the stream into the task's
state, asks the flow's pure ``decide`` function (``waystation.events.task``) for the events, and
appends them with the messages they imply (G4) in one statement, at the version it read; what
committed goes to the pipeline's publish step (``waystation.runtime.publishing``), which sends it
once the flow returns. A conflict
(another writer appended first) means read and decide again. Event ids derive from what caused them,
so a redelivery's or a re-run's append finds its events already there and writes nothing
(``AppendResult.duplicate``).

Two things spare reads: within a worker one lock per stream makes a parent's replies take turns
instead of conflicting (:class:`StreamLocks`), and the worker keeps the streams it appended to last
(:class:`StreamCache`), deciding from that copy first; a stale copy only costs a conflict, since
the append checks the version and the hash.

Why one module of some 450 lines: it is one job, a decision recorded alone (read, decide, append,
hand on what committed), whose steps share the retry loop's state; the locks and the copy of
streams, the decisions recorded together, a decision's parts and the outage waits are already apart.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from waystation.events import (
    AppendResult,
    DomainEvent,
    EventStore,
    NewEvent,
    OutboxMessage,
    RecordedEvent,
    StoreUnavailable,
    TaskFailed,
    TaskState,
    VersionConflict,
    event_id,
)
from waystation.observability.logs import add_to_context
from waystation.observability.observer import FINISHED, Observer
from waystation.protocol.actors import with_actor
from waystation.protocol.wire import TYPE_RESUME, Names, implied_messages, with_attempts
from waystation.runtime.combining import Combiner
from waystation.runtime.decisions import (
    MAX_CONFLICT_RETRIES,
    Applied,
    Cause,
    Decide,
    Extension,
    Key,
    Part,
    RunResumed,
    UnreadableStream,
    resumes,
)
from waystation.runtime.faults import FaultPlan
from waystation.runtime.outages import Outages
from waystation.runtime.publishing import committed_here
from waystation.runtime.streams import StreamCache, StreamLocks

__all__ = [
    "MAX_CONFLICT_RETRIES",
    "Applied",
    "Cause",
    "Extension",
    "Recorder",
    "RunResumed",
    "StreamCache",
    "StreamLocks",
    "UnreadableStream",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Recorder:
    """Reads, decides and appends for one worker; hands what committed to the publish step."""

    def __init__(
        self,
        store: EventStore,
        names: Names,
        observer: Observer,
        *,
        worker_id: str,
        clock: Callable[[], float],
        outbox_delay: float,
        faults: FaultPlan,
        stopping: Callable[[], bool] = lambda: False,
        cache_bytes: int = 32 * 1024 * 1024,
        cache_seconds: float = 60.0,
        gather_seconds: float = 0.0,
        gather_limit: int | None = None,
        reply_to: Callable[[str], str] | None = None,
    ) -> None:
        self.reply_to = reply_to
        """Where the requests of a pause of an agent's task ask for their replies (this
        worker's reply shard, ``waystation.runtime.routing``); None: the agent's shared reply
        queue."""
        self.stopping = stopping
        """True once the worker is stopping: an append then gives up on an outage."""
        self.store = store
        self.names = names
        self.observer = observer
        self.worker_id = worker_id
        self.clock = clock
        self.outbox_delay = outbox_delay
        self.faults = faults
        self.locks = StreamLocks()
        self.cache = StreamCache(max_bytes=cache_bytes, max_age=cache_seconds)
        self.combiner = Combiner(self, gather_seconds=gather_seconds, gather_limit=gather_limit)
        """Records together the decisions on one stream that wait for its lock (``combine``)."""

    def waiting(self, stream_id: str) -> int:
        """Combinable decisions waiting for the stream's lock now."""
        return self.combiner.waiting(stream_id)

    async def load(self, task_id: str) -> TaskState:
        return (await self.load_events(task_id))[0]

    async def load_events(
        self,
        task_id: str,
        *,
        cached: bool = False,
        known: list[RecordedEvent] | None = None,
        read: list[RecordedEvent] | None = None,
    ) -> tuple[TaskState, list[RecordedEvent], bool]:
        """The task's state, the events it was folded from, and whether they came from this
        worker's own copy (which may be stale) rather than from the log.

        ``known``: the stream up to some version, as this worker last had it (a copy that
        turned out stale, or must not be trusted alone). The log is then read from after it
        only: the log is append-only, so what it held stays as it was. ``read``: the stream as
        just read from the log (nothing is read)."""
        recorded = self.cache.take(task_id) if cached else None
        from_cache = recorded is not None
        if read is not None:
            recorded = read
        elif recorded is None:
            recorded = await self._read(task_id, known)
        else:
            self.observer.count("stream_cache_hits")
        state = self.cache.state_of(task_id, recorded)
        add_to_context(task_id=task_id, trace_id=state.trace_id)
        if state.unreadable:
            # deciding on part of the story could contradict what the unread events say
            raise UnreadableStream(f"task {task_id}: cannot read {', '.join(state.unreadable)}")
        return state, recorded, from_cache

    async def _read(self, task_id: str, known: list[RecordedEvent] | None) -> list[RecordedEvent]:
        """The stream from the log, read from after ``known`` when that links up (its last
        event's hash is the next one's ``prev_hash``), else whole."""
        if known:
            last = known[-1]
            newer = await self._through_outages(
                lambda: self.store.read_stream(task_id, after=last.stream_version)
            )
            if not newer or newer[0].prev_hash == last.hash:
                self.observer.count("stream_catch_ups")
                return [*known, *newer]
        return await self._through_outages(lambda: self.store.read_stream(task_id))

    async def _newer(self, task_id: str, copy: list[RecordedEvent]) -> list[RecordedEvent] | None:
        """None when the log holds nothing after this worker's ``copy`` of the stream (the copy
        is current: what was decided on it stands), else the stream as the log holds it."""
        stream = await self._read(task_id, copy)
        return None if len(stream) == len(copy) else stream

    def metadata(self, state: TaskState, cause: Cause) -> dict[str, Any]:
        """The metadata of the events of a decision, as the log stores it (``EventMetadata``'s
        fields, those that are None left out); one dict per decision, built without the model
        (validating and dumping one per event was ~1% of a worker's CPU)."""
        values = {
            "worker_id": self.worker_id,
            "amqp_user": cause.amqp_user,
            "causation_id": cause.message_id,
            "correlation_id": state.root_id or state.task_id,
            "trace_id": state.trace_id,
            "occurred_at": self.clock(),
            "deployment": self.names.prefix,
        }
        metadata = {key: value for key, value in values.items() if value is not None}
        if cause.actor is not None:  # a cancel's or a signal's only: the others cost nothing
            metadata["actor"] = cause.actor
        return metadata

    async def append_decision(
        self,
        task_id: str,
        decide: Decide,
        *,
        key: Key,
        cause: Cause,
        step: str,
        describe_new: Callable[[TaskState], TaskState] | None = None,
        run_resumed: RunResumed | None = None,
        combine: bool = False,
        gather: Callable[[TaskState], int] | None = None,
    ) -> Applied:
        """Read, decide, append; on a conflict (or when the same decision was already recorded
        by someone else) read and decide again. Returns the state decided on and the events
        appended ([] when there was nothing to do).

        A decision is recorded under its causation key, so the same key gives the same event ids:
        when a fresh decision comes back with the key whose events were just found in the log,
        it is recorded already (a redelivered ignored reply, a progress report seen twice), and
        committing it again would only find them again, forever.

        ``run_resumed``: the run step of a decision that resumes the task, between deciding and
        appending (:data:`RunResumed`: the run resumed in place, whose outcome joins the
        append, ``waystation.runtime.flows.in_place``); it runs again with every re-decision.

        ``combine``: decisions on one stream that wait for its lock meanwhile (a parent's replies
        arriving together) are recorded by whichever of them takes the lock first, in one
        append, each decided on the state the ones before it leave
        (``waystation.runtime.combining``). A decision that could not be combined is recorded alone,
        as without it.

        ``gather`` (with ``combine``): how many decisions of this kind the stream awaits, as
        this worker's copy of it says (the replies a pause still waits for). When the stream is
        free and its copy awaits more than have arrived, the decisions wait for the others, at
        most ``gather_seconds``, and are then recorded together: the replies to one pause, which
        arrive a few milliseconds apart, make one append instead of one each. The last one
        never waits (it completes the count); nothing waits while the worker stops."""
        if not combine or describe_new is not None:
            async with self.locks.hold(task_id):
                return await self._decide_alone(
                    task_id, decide, key, cause, step, describe_new, run_resumed
                )
        return await self.combiner.record(task_id, decide, key, cause, step, run_resumed, gather)

    async def _decide_alone(
        self,
        task_id: str,
        decide: Decide,
        key: Key,
        cause: Cause,
        step: str,
        describe_new: Callable[[TaskState], TaskState] | None,
        run_resumed: RunResumed | None,
    ) -> Applied:
        """:meth:`append_decision` for one decision, under its stream's lock."""
        found: str | None = None
        cached = True
        known: list[RecordedEvent] | None = None
        read: list[RecordedEvent] | None = None
        for _ in range(MAX_CONFLICT_RETRIES):
            # first from what this worker last wrote to the stream, if it is still cached:
            # a stale copy only costs a conflict, since the append checks the version; then
            # from the log, read from after what was seen last
            state, history, from_cache = await self.load_events(
                task_id, cached=cached, known=known, read=read
            )
            cached, known, read = False, history, None
            events = decide(state)
            resuming = run_resumed is not None and resumes(events)
            if from_cache and (not events or resuming):
                # nothing to do, says a copy that may be stale (a timeout on a pause this
                # worker has not seen), or a handler is about to run on this decision, never
                # on a copy that may be stale (the task may have been cancelled or timed out
                # meanwhile), however the append would settle it afterwards: only the log
                # can say the copy is current; when it is not, decide again on the log
                read = await self._newer(task_id, history)
                if read is not None:
                    continue
            if not events:
                return Applied(state, [])
            causation = key(events)
            if causation == found:
                return Applied(state, [])
            # the run step: a handler runs on the decision, and its outcome joins the append
            made = self.new_events(state, events, causation, cause) if resuming else []
            extension = await run_resumed(state, events, made) if run_resumed and resuming else None
            if extension is not None:
                events = extension.events
            described = state if state.exists or describe_new is None else describe_new(state)
            try:
                recorded = await self.commit(
                    described,
                    events,
                    causation,
                    cause,
                    step=step,
                    resume_attempts=extension.failed_runs if extension else 0,
                    resume_delay=extension.retry_delay if extension else 0.0,
                    history=history,
                    made=made if described is state else (),
                )
            except VersionConflict:
                self.observer.version_conflict()
                continue
            if recorded:
                return self._applied(state, events, extension)
            found = causation
        raise RuntimeError(f"{step} on {task_id}: gave up after {MAX_CONFLICT_RETRIES} conflicts")

    def _applied(
        self, state: TaskState, events: list[DomainEvent], extension: Extension | None
    ) -> Applied:
        """What a committed decision returns (and counts, when it resumed in place)."""
        if extension is None or extension.resumed_at is None:
            return Applied(state, events)
        if isinstance(events[-1], TaskFailed):
            self.observer.count("tasks_failed")
        log.debug("resumed in place from pause %d", state.pause)
        self.observer.resumed_in_place(max(0.0, self.clock() - extension.resumed_at))
        return Applied(state, events, extension.checkpoint_started)

    async def _through_outages(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation``; through an outage of the log, run it again until the log answers
        (or the worker stops). The flow around it stands: a handler that already ran is not
        run again, and an append that did commit before its connection dropped is
        recognised as a duplicate when repeated."""
        outages: Outages | None = None  # made at the first outage: most operations meet none
        while True:
            try:
                return await operation()
            except StoreUnavailable as error:
                if self.stopping():
                    raise
                outages = outages or Outages(self.observer)
                await outages.wait("database", error)

    async def _append(
        self, state: TaskState, events: list[NewEvent], messages: list[OutboxMessage]
    ) -> AppendResult:
        # shielded: a cancelled caller (its broker channel closed) must not cut the statement
        # in half; it commits or not, and a redelivery recognises it
        return await self._through_outages(
            lambda: asyncio.shield(
                self.store.append(
                    state.task_id,
                    state.version,
                    events,
                    prev_hash=state.last_hash,
                    outbox=messages,
                    outbox_delay=self.outbox_delay,
                )
            )
        )

    def new_events(
        self,
        state: TaskState,
        events: Sequence[DomainEvent],
        causation_key: str,
        cause: Cause,
        *,
        first: int = 0,
    ) -> list[NewEvent]:
        """``events`` made ready to append under ``causation_key``: their ids (the same key
        gives the same ids, numbered from ``first``) and one metadata for them."""
        metadata = self.metadata(state, cause)
        return [
            NewEvent.of(event_id(state.task_id, causation_key, index), event, metadata)
            for index, event in enumerate(events, start=first)
        ]

    def part(
        self,
        state: TaskState,
        events: Sequence[DomainEvent],
        causation_key: str,
        cause: Cause,
        *,
        resume_attempts: int = 0,
        resume_delay: float = 0.0,
        context: contextvars.Context | None = None,
        made: Sequence[NewEvent] = (),
    ) -> Part:
        """One decision made ready to append: its events with their ids and metadata, and the
        messages they imply (``resume_attempts``, ``resume_delay``: see :meth:`commit`;
        ``context``: see :class:`Part`; ``made``: see :class:`Extension`)."""
        if len(made) > len(events) or any(
            new.event_type != event.event_type for new, event in zip(made, events, strict=False)
        ):
            made = ()  # not these events' own: made anew
        new_events = [
            *made,
            *self.new_events(state, events[len(made) :], causation_key, cause, first=len(made)),
        ]
        reply_to = self.reply_to(state.agent) if self.reply_to and state.agent else None
        messages = implied_messages(self.names, state, events, reply_to)
        if cause.actor is not None:  # a cancel's or a signal's: peers cancelled carry it on
            messages = with_actor(messages, cause.actor)
        if resume_attempts:
            messages = [
                with_attempts(m, resume_attempts, delay=resume_delay)
                if m.properties.get("type") == TYPE_RESUME
                else m
                for m in messages
            ]
        return Part(state, list(events), new_events, messages, context)

    async def commit(
        self,
        state: TaskState,
        events: Sequence[DomainEvent],
        causation_key: str,
        cause: Cause,
        *,
        step: str,
        resume_attempts: int = 0,
        resume_delay: float = 0.0,
        history: list[RecordedEvent] | None = None,
        made: Sequence[NewEvent] = (),
    ) -> bool:
        """Append, and hand the messages to the publish step; False when the events were already
        recorded (nothing done).

        ``resume_attempts``: runs of the resumed handler that already failed in place; the resume
        message carries the count, so that the retries stay within the agent's attempts, and
        waits ``resume_delay`` seconds (the agent's backoff) in the broker first.
        ``history``: the stream's events ``state`` was folded from; the stream as it is after
        this append is then cached for the next decision on it (:class:`StreamCache`)."""
        part = self.part(
            state,
            events,
            causation_key,
            cause,
            resume_attempts=resume_attempts,
            resume_delay=resume_delay,
            made=made,
        )
        return await self._commit_parts([part], step=step, history=history)

    async def _commit_parts(
        self, parts: Sequence[Part], *, step: str, history: list[RecordedEvent] | None
    ) -> bool:
        """Append the decisions ``parts``, each made on the state the ones before it leave, in
        one statement at the first one's version; then hand what they imply to the publish
        step of the work they belong to. False when the first one's events were recorded
        already (nothing was written)."""
        committed = committed_here()
        state = parts[0].state
        new_events = [event for part in parts for event in part.new_events]
        messages = [message for part in parts for message in part.messages]
        result = await self._append(state, new_events, messages)
        if history is not None and not result.duplicate:
            self.cache.put(
                state.task_id,
                [*history, *result.recorded],
                finished=any(e.event_type in FINISHED for part in parts for e in part.events),
            )
        if result.duplicate:
            # recorded before (a redelivery or a re-run): its messages are the relay's to publish
            self.observer.duplicate("duplicate_appends")
            return False
        for part in parts:
            if part.context is None:
                self.observer.appended(part.state.agent, part.events, part.state)
            else:
                part.context.run(self.observer.appended, part.state.agent, part.events, part.state)
        for _ in parts:  # a fault point counts decisions, however many one append holds
            self.faults.hit(f"{step}.committed")
        # committed, so the outbox holds them (G4): the publish step sends them
        committed.add(step, len(parts), result.outbox_ids, messages)
        return True
