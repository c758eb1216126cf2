"""Recording decisions: read a task's stream, decide, append, and hand on what the append implies.

Every flow of the worker records through a :class:`Recorder`: it folds the stream into the task's
state, asks the flow's pure ``decide`` function (``waystation.events.task``) for the events, and
appends them with the messages they imply (G4) in one statement, at the version it read. A conflict
(another writer appended first) means read and decide again. Event ids derive from what caused them,
so a redelivery's or a re-run's append finds its events already there and writes nothing
(``AppendResult.duplicate``).

Two things spare reads: within a worker one lock per stream makes a parent's replies take turns
instead of conflicting (:class:`StreamLocks`), and the worker keeps the streams it appended to last
(:class:`StreamCache`), deciding from that copy first; a stale copy only costs a conflict, since
the append checks the version and the hash.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from waystation.brokers.port import Delivery
from waystation.events import (
    AppendResult,
    DomainEvent,
    EventStore,
    NewEvent,
    OutboxMessage,
    RecordedEvent,
    StoreUnavailable,
    TaskFailed,
    TaskResumed,
    TaskState,
    VersionConflict,
    event_id,
    fold,
)
from waystation.events.chain import recorded_events
from waystation.events.codec import dumps
from waystation.logs import add_to_context
from waystation.observability.observer import FINISHED, Observer
from waystation.protocol.wire import TYPE_RESUME, Names, implied_messages, with_attempts
from waystation.runtime.faults import FaultPlan
from waystation.runtime.outbox import OutboxPublisher

__all__ = [
    "MAX_CONFLICT_RETRIES",
    "Applied",
    "Cause",
    "Extension",
    "Recorder",
    "StreamCache",
    "StreamLocks",
    "UnreadableStream",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_CONFLICT_RETRIES = 50
MAX_COMBINED = 20
"""At most this many waiting decisions are recorded in one append."""


class UnreadableStream(Exception):
    """A task's stream holds events this worker cannot read (a newer version wrote them)."""


@dataclass(frozen=True, slots=True)
class Cause:
    """What made the worker append: recorded as the events' causation and actor."""

    message_id: str | None = None
    amqp_user: str | None = None

    @classmethod
    def of(cls, delivery: Delivery) -> Cause:
        return cls(delivery.message_id or delivery.correlation_id, delivery.user_id)


@dataclass(frozen=True, slots=True)
class Applied:
    state: TaskState
    """The state the decision was taken on."""
    events: list[DomainEvent]
    """What was appended; [] when there was nothing to do."""
    checkpoint_started: float | None = None
    """perf_counter() when a handler run in place returned a pause."""


@dataclass(frozen=True, slots=True)
class Extension:
    """What an ``extend`` hook adds to a decision: the events to append instead, with when the
    handler that produced them returned a pause and when the resume was decided."""

    events: list[DomainEvent]
    checkpoint_started: float | None
    resumed_at: float | None
    """None when the run in place failed (the decision goes on by resume message)."""
    failed_runs: int = 0
    retry_delay: float = 0.0
    """With ``failed_runs``: the agent's backoff, which the resume message waits in the broker."""
    made: Sequence[NewEvent] = ()
    """The first of ``events`` as already made ready to append (:meth:`Recorder.new_events`,
    under the decision's causation key), given again instead of made anew: chained once."""


Extend = Callable[[TaskState, list[DomainEvent], str], Coroutine[Any, Any, Extension | None]]
"""``extend(state, events, causation_key)``: what to append instead of a decision's ``events``
on ``state``, recorded under ``causation_key`` (None: the decision as it is)."""
Decide = Callable[[TaskState], list[DomainEvent]]
Key = Callable[[list[DomainEvent]], str]


@dataclass(frozen=True, slots=True)
class _FromLog:
    """A plan decided on this worker's copy of the stream that turned out stale: ``stream`` is
    the stream as the log holds it, to decide on again."""

    stream: list[RecordedEvent]


@dataclass(frozen=True, slots=True)
class _Part:
    """One decision ready to append (:meth:`Recorder.part`)."""

    state: TaskState
    """The state it was decided on."""
    events: list[DomainEvent]
    new_events: list[NewEvent]
    messages: list[OutboxMessage]
    context: contextvars.Context | None = None
    """The context of the delivery it answers, when another one's task records it: its spans
    are recorded there (their parent is that delivery's, not the recording one's)."""


@dataclass(slots=True, eq=False)
class _Waiting:
    """A decision waiting for its stream's lock, which the holder may record with its own
    (:meth:`Recorder.append_decision`, ``combine``)."""

    decide: Decide
    key: Key
    cause: Cause
    extend: Extend | None
    applied: Applied | None = None
    """Set by the worker's task that recorded it with others."""
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    """Its delivery's context (the trace it belongs to), where the task that records it runs
    its resumed handler and records its spans."""


@dataclass(slots=True, eq=False)
class _Gathering:
    """Decisions on one stream waiting for the rest of those it expects (``expected``)."""

    expected: int
    arrived: asyncio.Future[None]
    joined: int = 1
    """How many have waited in it (the first, and those that came while it waited)."""

    def wake(self) -> None:
        if not self.arrived.done():
            self.arrived.set_result(None)


_Plan = (
    tuple[
        list[RecordedEvent],
        list[tuple[_Waiting, _Part, Extension | None]],
        list[tuple[_Waiting, TaskState]],
        bool,
    ]
    | _FromLog
    | None
)


def resumes(events: Sequence[DomainEvent]) -> bool:
    """Whether a decision resumes its task (so a handler may run on it)."""
    return bool(events) and isinstance(events[-1], TaskResumed)


class StreamLocks:
    """One lock per task stream within this worker.

    A parent's replies arrive together; without this, the ones this worker takes race each other
    to the same stream version and all but one conflict and re-read. With it they take turns,
    and conflicts remain only between workers (where the version check settles them).
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def busy(self, stream_id: str) -> bool:
        """Whether a decision holds or waits for the stream's lock now."""
        return stream_id in self._locks

    @contextlib.asynccontextmanager
    async def hold(self, stream_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(stream_id, (asyncio.Lock(), 0))
        self._locks[stream_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[stream_id]
            if users == 1:
                del self._locks[stream_id]
            else:
                self._locks[stream_id] = (lock, users - 1)


_Entry = tuple[list[RecordedEvent], int, float, TaskState | None]
"""A stream's events in :class:`StreamCache`, their size in bytes, when they were put, and
their fold once one was asked for."""


class StreamCache:
    """The streams this worker appended to last, as they were after its append (bounded, LRU).

    The next decision on such a stream (a reply landing on the worker that paused the task, or
    on the one that recorded the previous reply) starts from this copy instead of reading the
    stream again. The copy may be stale, when another worker appended since: then the append,
    which checks the expected version and hash, fails with a conflict and the stream is read.
    An entry is taken out when used, so a failed attempt never sees it again.

    Bounded by count and by bytes (the JSON of the events' data and metadata): a few streams
    with huge inputs or results cannot hold a worker's memory (defect j). And by age: a copy
    put ``max_age`` seconds ago goes (taking one and putting it back after an append makes it
    young again). Without it, the copies of streams whose task went on
    on another worker (its last reply recorded there) stayed until evicted, and the cache
    filled towards its bounds whatever the worker was doing; a pause that lasts longer costs
    one read of the stream at its next reply.
    """

    def __init__(
        self,
        streams: int = 1024,
        max_bytes: int = 32 * 1024 * 1024,
        max_age: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_streams = streams
        self._max_bytes = max_bytes
        self._max_age = max_age
        self._clock = clock
        self._bytes = 0
        self._streams: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        """Per stream: its events, their size, and when they were put (so the oldest first)."""
        self._taken: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        """What ``take`` handed out, so that putting it back with a few more events only
        measures those; within the same bounds (a copy taken and never put back, its decision
        taken elsewhere or failed, must not hold memory outside them)."""
        self._taken_bytes = 0

    @property
    def size(self) -> tuple[int, int]:
        """(streams, bytes) ready to take now."""
        return len(self._streams), self._bytes

    @property
    def held(self) -> tuple[int, int]:
        """(streams, bytes) this cache keeps a reference to: ready, or handed out and not put
        back yet. Both stay within the bounds."""
        return len(self._streams) + len(self._taken), self._bytes + self._taken_bytes

    def put(self, stream_id: str, events: list[RecordedEvent], *, finished: bool) -> None:
        self._drop(stream_id)
        taken = self._untake(stream_id)
        if finished:
            return  # nothing more is decided on it but late replies, which read it
        known = len(taken[0]) if taken is not None else 0
        if taken is not None and 0 < known <= len(events) and events[known - 1] is taken[0][-1]:
            size = taken[1] + _bytes_of(events[known:])
        else:
            size = _bytes_of(events)
        if size > self._max_bytes:
            return
        self._streams[stream_id] = (events, size, self._clock(), None)
        self._bytes += size
        self._shrink()
        self._expire()

    def peek(self, stream_id: str) -> TaskState | None:
        """The state the copy of the stream folds into, the copy left in place (None when there
        is none, or it aged); folded once, however often asked and whoever takes it next
        (:meth:`state_of`)."""
        self._expire()
        entry = self._streams.get(stream_id)
        if entry is None:
            return None
        events, size, put_at, state = entry
        if state is None:
            state = fold(stream_id, events)
            self._streams[stream_id] = (events, size, put_at, state)  # (keeps its place)
        return state

    def state_of(self, stream_id: str, events: list[RecordedEvent]) -> TaskState:
        """``fold(stream_id, events)``, without folding again a copy this cache handed out
        (``take``) that ``peek`` folded already."""
        taken = self._taken.get(stream_id)
        if taken is not None and taken[0] is events and taken[3] is not None:
            return taken[3]
        return fold(stream_id, events)

    def take(self, stream_id: str) -> list[RecordedEvent] | None:
        self._expire()
        entry = self._drop(stream_id)
        if entry is None:
            return None
        self._untake(stream_id)
        self._taken[stream_id] = entry
        self._taken_bytes += entry[1]
        self._shrink()
        return entry[0]

    def _untake(self, stream_id: str) -> _Entry | None:
        entry = self._taken.pop(stream_id, None)
        if entry is not None:
            self._taken_bytes -= entry[1]
        return entry

    def _shrink(self) -> None:
        """Within the bounds again: the copies put longest ago go first, ready or handed out
        (one taken and never put back: decided elsewhere, or failed)."""
        while (
            len(self._streams) + len(self._taken) > self._max_streams
            or self._bytes + self._taken_bytes > self._max_bytes
        ):
            ready = next(iter(self._streams.items()), None)
            taken = next(iter(self._taken.items()), None)
            if taken is None or (ready is not None and ready[1][2] <= taken[1][2]):
                assert ready is not None
                self._drop(ready[0])
            else:
                self._untake(taken[0])

    def _expire(self) -> None:
        """Drop the copies put ``max_age`` seconds ago or earlier (the oldest come first), ready
        or handed out."""
        oldest = self._clock() - self._max_age
        _expire_from(self._streams, self._drop, oldest)
        _expire_from(self._taken, self._untake, oldest)

    def _drop(self, stream_id: str) -> _Entry | None:
        entry = self._streams.pop(stream_id, None)
        if entry is not None:
            self._bytes -= entry[1]
        return entry


def _expire_from(copies: dict[str, _Entry], drop: Callable[[str], object], oldest: float) -> None:
    """Drop the copies of ``copies`` (in the order they were put) put at ``oldest`` or before."""
    while copies:
        first, (_, _, put_at, _) = next(iter(copies.items()))
        if put_at > oldest:
            break
        drop(first)


def _bytes_of(events: Sequence[RecordedEvent]) -> int:
    return sum(len(dumps(e.data)) + len(dumps(e.metadata)) for e in events)


class Recorder:
    """Reads, decides and appends for one worker; hands committed messages to the outbox."""

    def __init__(
        self,
        store: EventStore,
        names: Names,
        outbox: OutboxPublisher,
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
        self.outbox = outbox
        self.observer = observer
        self.worker_id = worker_id
        self.clock = clock
        self.outbox_delay = outbox_delay
        self.faults = faults
        self.locks = StreamLocks()
        self.cache = StreamCache(max_bytes=cache_bytes, max_age=cache_seconds)
        self._waiting: dict[str, list[_Waiting]] = {}
        """Per stream, the combinable decisions waiting for its lock, in arrival order."""
        self.gather_seconds = gather_seconds
        """How long a combinable decision that the stream expects more of waits for them
        (:meth:`append_decision`, ``gather``); 0: not at all."""
        self.gather_limit = gather_limit
        """The most decisions that can wait together (the deliveries a consumer may hold at
        once, its prefetch): a stream expecting more is not waited for, since the rest could
        not arrive before the first are settled. None: no limit."""
        self._gathering: dict[str, _Gathering] = {}
        """Per stream, the decisions being gathered now: how many, and what wakes them."""

    def waiting(self, stream_id: str) -> int:
        """Combinable decisions waiting for the stream's lock now."""
        return len(self._waiting.get(stream_id, ()))

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
        return {key: value for key, value in values.items() if value is not None}

    async def append_decision(
        self,
        task_id: str,
        decide: Decide,
        *,
        key: Key,
        cause: Cause,
        step: str,
        describe_new: Callable[[TaskState], TaskState] | None = None,
        extend: Extend | None = None,
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

        ``extend`` may add to a decision before it is appended (the resumed run's outcome, see
        ``waystation.runtime.flows.reply``); it runs again with every re-decision.

        ``combine``: decisions on one stream that wait for its lock meanwhile (a parent's replies
        arriving together) are recorded by whichever of them takes the lock first, in one
        append, each decided on the state the ones before it leave (:meth:`_decide_together`).
        A decision that could not be combined is recorded alone, as without it.

        ``gather`` (with ``combine``): how many decisions of this kind the stream awaits, as
        this worker's copy of it says (a pause's outstanding calls). When the stream is free
        and its copy awaits more than have arrived, the decisions wait for the others, at most
        ``gather_seconds``, and are then recorded together: the replies to one pause, which
        arrive a few milliseconds apart, make one append instead of one each. The last one
        never waits (it completes the count); nothing waits while the worker stops."""
        if not combine or describe_new is not None:
            async with self.locks.hold(task_id):
                return await self._decide_alone(
                    task_id, decide, key, cause, step, describe_new, extend
                )
        mine = _Waiting(decide, key, cause, extend)
        waiting = self._waiting.setdefault(task_id, [])
        waiting.append(mine)
        try:
            if gather is not None:
                await self._gather(task_id, waiting, gather)
            async with self.locks.hold(task_id):
                if mine.applied is None and mine in waiting and len(waiting) > 1:
                    batch = waiting[:MAX_COMBINED]
                    del waiting[:MAX_COMBINED]
                    await self._decide_together(task_id, batch, step)
                if mine.applied is not None:
                    return mine.applied
                # alone: nothing else waited, or they could not all be recorded together
                return await self._decide_alone(task_id, decide, key, cause, step, None, extend)
        finally:
            if mine in waiting:
                waiting.remove(mine)
            if not waiting and self._waiting.get(task_id) is waiting:
                del self._waiting[task_id]

    async def _gather(
        self, task_id: str, waiting: list[_Waiting], gather: Callable[[TaskState], int]
    ) -> None:
        """Wait until the stream's copy's count of expected decisions have arrived, or
        ``gather_seconds`` passed (see :meth:`append_decision`)."""
        gathering = self._gathering.get(task_id)
        if gathering is None:
            if self.gather_seconds <= 0 or len(waiting) > 1 or self.locks.busy(task_id):
                return
            if self.stopping():
                return
            copy = self.cache.peek(task_id)  # the state its copy of the stream folds into
            if copy is None:
                return
            expected = gather(copy)
            if expected <= 1 or (self.gather_limit is not None and expected > self.gather_limit):
                return
            loop = asyncio.get_running_loop()
            gathering = _Gathering(expected, loop.create_future())
            self._gathering[task_id] = gathering
            timer = loop.call_later(self.gather_seconds, gathering.wake)
            try:
                await asyncio.shield(gathering.arrived)
            finally:
                # cancelled too (its channel closed): the others go on without it
                timer.cancel()
                gathering.wake()
                if self._gathering.get(task_id) is gathering:
                    del self._gathering[task_id]
            self.observer.count("decisions_gathered", gathering.joined)
            return
        gathering.joined += 1
        if len(waiting) >= gathering.expected:
            gathering.wake()
        # shielded: one of them cancelled must not cancel the others' wait
        await asyncio.shield(gathering.arrived)

    async def _decide_alone(
        self,
        task_id: str,
        decide: Decide,
        key: Key,
        cause: Cause,
        step: str,
        describe_new: Callable[[TaskState], TaskState] | None,
        extend: Extend | None,
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
            if from_cache and (not events or (extend is not None and resumes(events))):
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
            extension = await extend(state, events, causation) if extend else None
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
                    made=extension.made if extension and described is state else (),
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

    async def _decide_together(self, task_id: str, batch: list[_Waiting], step: str) -> None:
        """Record the decisions of ``batch`` in one append, each decided on the state the ones
        before it leave, and give each its :class:`Applied`. Left to record alone (their
        ``applied`` stays None): those after one that resumes the task (they decide on what
        the resumed run records), and all of them on a conflict, a duplicate, or two decisions
        under one causation key (a duplicated message), and on a conflict unless the batch
        was decided on this worker's cached copy of the stream (then it is decided once more,
        on the log).

        The rules of deciding alone hold: a decision that finds nothing to do, or would run a
        handler, on the cached copy (which may be stale) makes the whole batch be decided again
        on the log itself."""
        cached = True
        known: list[RecordedEvent] | None = None
        read: list[RecordedEvent] | None = None
        while True:
            plan = await self._plan(task_id, batch, cached=cached, known=known, read=read)
            read = None
            if isinstance(plan, _FromLog):
                cached, read = False, plan.stream
                continue
            if not isinstance(plan, tuple):
                return
            history, parts, idle, from_cache = plan
            if parts:
                try:
                    committed = await self._commit_parts(
                        [part for _, part, _ in parts], step=step, history=history
                    )
                except VersionConflict:
                    self.observer.version_conflict()
                    if from_cache:
                        # decided on a stale copy: once more, on the log
                        cached, known = False, history
                        continue
                    return
                if not committed:
                    return
                self.observer.count("decisions_combined", len(parts))
            for waiting, part, extension in parts:
                waiting.applied = self._applied(part.state, part.events, extension)
            for waiting, state in idle:
                waiting.applied = Applied(state, [])
            return

    async def _plan(
        self,
        task_id: str,
        batch: list[_Waiting],
        *,
        cached: bool,
        known: list[RecordedEvent] | None,
        read: list[RecordedEvent] | None = None,
    ) -> _Plan:
        """The decisions of ``batch`` in order, each on the state the ones before leave:
        ``(history, parts, idle, from_cache)`` with the stream's events read, the decisions to
        append, those with nothing to do and whether the events came from this worker's copy;
        :class:`_FromLog` when one needed the log rather than that copy, and the copy was not
        current; None when two share a causation key. ``cached``, ``known``, ``read``: see
        :meth:`load_events`."""
        state, history, from_cache = await self.load_events(
            task_id, cached=cached, known=known, read=read
        )
        parts: list[tuple[_Waiting, _Part, Extension | None]] = []
        idle: list[tuple[_Waiting, TaskState]] = []
        keys: set[str] = set()
        for waiting in batch:
            events = waiting.decide(state)
            resuming = waiting.extend is not None and resumes(events)
            if from_cache and (not events or resuming):
                # the rules of deciding alone: only the log can say the copy is current; when
                # it is, the decisions taken on it so far stand
                stream = await self._newer(task_id, history)
                if stream is not None:
                    return _FromLog(stream)
                from_cache = False
            if not events:
                idle.append((waiting, state))
                continue
            causation = waiting.key(events)
            if causation in keys:
                return None
            keys.add(causation)
            extension = None
            if resuming:
                assert waiting.extend is not None
                # in its own delivery's context: the run is a child of that delivery's trace
                extension = await asyncio.create_task(
                    waiting.extend(state, events, causation), context=waiting.context
                )
                if extension is not None:
                    events = extension.events
            part = self.part(
                state,
                events,
                causation,
                waiting.cause,
                resume_attempts=extension.failed_runs if extension else 0,
                resume_delay=extension.retry_delay if extension else 0.0,
                context=waiting.context,
                made=extension.made if extension else (),
            )
            parts.append((waiting, part, extension))
            if resuming:
                break  # the rest decide on what the resumed run records: alone
            # the next decides on the state this one leaves (its events chained once: the
            # append gives them back)
            appended = recorded_events(task_id, state.version, part.new_events, state.last_hash)
            state = fold(task_id, appended, start=state)
        return history, parts, idle, from_cache

    async def _through_outages(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation``; through an outage of the log, run it again until the log answers
        (or the worker stops). The flow around it stands: a handler that already ran is not
        run again (defect k), and an append that did commit before its connection dropped is
        recognised as a duplicate when repeated."""
        backoff = 0.1
        while True:
            try:
                return await operation()
            except StoreUnavailable as error:
                if self.stopping():
                    raise
                log.warning("event log unavailable (%s); retrying in %.1fs", error, backoff)
                self.observer.outage("database")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

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
    ) -> _Part:
        """One decision made ready to append: its events with their ids and metadata, and the
        messages they imply (``resume_attempts``, ``resume_delay``: see :meth:`commit`;
        ``context``: see :class:`_Part`; ``made``: see :class:`Extension`)."""
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
        if resume_attempts:
            messages = [
                with_attempts(m, resume_attempts, delay=resume_delay)
                if m.properties.get("type") == TYPE_RESUME
                else m
                for m in messages
            ]
        return _Part(state, list(events), new_events, messages, context)

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
        """Append and publish; False when the events were already recorded (nothing done).

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
        self, parts: Sequence[_Part], *, step: str, history: list[RecordedEvent] | None
    ) -> bool:
        """Append the decisions ``parts``, each made on the state the ones before it leave, in
        one statement at the first one's version; then publish what they imply. False when
        the first one's events were recorded already (nothing was written)."""
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
        if messages:
            # committed, so the outbox holds them (G4): send now, and let their confirms arrive
            # while this delivery is acked and the next one handled
            self.outbox.send_committed(result.outbox_ids, messages)
            await asyncio.sleep(0)  # let it hand its frames to the connection first
        for _ in parts:
            self.faults.hit(f"{step}.published")
        return True
