"""Recording together the decisions on one stream that arrive together (a parent's replies).

Decisions that wait for their stream's lock meanwhile are recorded by whichever takes the lock
first, in one append, each decided on the state the ones before it leave; and those a pause
still expects more of may wait a few milliseconds for the rest (``gather``). Whatever cannot be
recorded together is recorded alone, by the recorder's own loop.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from waystation.events import NewEvent, RecordedEvent, TaskState, VersionConflict, fold
from waystation.events.chain import recorded_events
from waystation.runtime.decisions import (
    Applied,
    Cause,
    Decide,
    Extension,
    Key,
    Part,
    RunResumed,
    resumes,
)

if TYPE_CHECKING:
    from waystation.runtime.recorder import Recorder

__all__ = ["MAX_COMBINED", "Combiner"]

MAX_COMBINED = 20
"""At most this many waiting decisions are recorded in one append."""


@dataclass(frozen=True, slots=True)
class _FromLog:
    """A plan decided on this worker's copy of the stream that turned out stale: ``stream`` is
    the stream as the log holds it, to decide on again."""

    stream: list[RecordedEvent]


@dataclass(slots=True, eq=False)
class _Waiting:
    """A decision waiting for its stream's lock, which the holder may record with its own
    (``Recorder.append_decision``, ``combine``)."""

    decide: Decide
    key: Key
    cause: Cause
    run_resumed: RunResumed | None
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


@dataclass(frozen=True, slots=True)
class _Planned:
    """The decisions of a batch, in order, each on the state the ones before it leave."""

    history: list[RecordedEvent]
    """The stream's events they were decided on."""
    parts: list[tuple[_Waiting, Part, Extension | None]]
    """The decisions to append."""
    idle: list[tuple[_Waiting, TaskState]]
    """Those with nothing to do, with the state each decided on."""
    from_cache: bool
    """Whether ``history`` is this worker's copy of the stream rather than the log's."""


class _KeyShared:
    """Two decisions of a batch share a causation key (a duplicated message): each is recorded
    alone."""


_Plan = _Planned | _FromLog | _KeyShared


class Combiner:
    """Decisions on one stream that wait for its lock, recorded in one append by whichever takes
    the lock first (``Recorder.append_decision``, ``combine`` and ``gather``)."""

    def __init__(
        self, recorder: Recorder, *, gather_seconds: float, gather_limit: int | None
    ) -> None:
        self.recorder = recorder
        self._waiting: dict[str, list[_Waiting]] = {}
        """Per stream, the combinable decisions waiting for its lock, in arrival order."""
        self.gather_seconds = gather_seconds
        """How long a combinable decision that the stream expects more of waits for them
        (``Recorder.append_decision``, ``gather``); 0: not at all."""
        self.gather_limit = gather_limit
        """The most decisions that can wait together (the deliveries a consumer may hold at
        once, its prefetch): a stream expecting more is not waited for, since the rest could
        not arrive before the first are settled. None: no limit."""
        self._gathering: dict[str, _Gathering] = {}
        """Per stream, the decisions being gathered now: how many, and what wakes them."""

    def waiting(self, stream_id: str) -> int:
        """Combinable decisions waiting for the stream's lock now."""
        return len(self._waiting.get(stream_id, ()))

    async def record(
        self,
        task_id: str,
        decide: Decide,
        key: Key,
        cause: Cause,
        step: str,
        run_resumed: RunResumed | None,
        gather: Callable[[TaskState], int] | None,
    ) -> Applied:
        """``Recorder.append_decision`` with ``combine``: wait for the stream's lock with
        the others (and for the rest of those expected, with ``gather``), then record them
        together, or alone when they cannot be."""
        mine = _Waiting(decide, key, cause, run_resumed)
        waiting = self._waiting.setdefault(task_id, [])
        waiting.append(mine)
        try:
            if gather is not None:
                await self._gather(task_id, waiting, gather)
            async with self.recorder.locks.hold(task_id):
                if mine.applied is None and mine in waiting and len(waiting) > 1:
                    batch = waiting[:MAX_COMBINED]
                    del waiting[:MAX_COMBINED]
                    await self._decide_together(task_id, batch, step)
                if mine.applied is not None:
                    return mine.applied
                # alone: nothing else waited, or they could not all be recorded together
                return await self.recorder._decide_alone(
                    task_id, decide, key, cause, step, None, run_resumed
                )
        finally:
            if mine in waiting:
                waiting.remove(mine)
            if not waiting and self._waiting.get(task_id) is waiting:
                del self._waiting[task_id]

    async def _gather(
        self, task_id: str, waiting: list[_Waiting], gather: Callable[[TaskState], int]
    ) -> None:
        """Wait until the stream's copy's count of expected decisions have arrived, or
        ``gather_seconds`` passed (see ``Recorder.append_decision``)."""
        gathering = self._gathering.get(task_id)
        if gathering is None:
            if self.gather_seconds <= 0 or len(waiting) > 1 or self.recorder.locks.busy(task_id):
                return
            if self.recorder.stopping():
                return
            copy = self.recorder.cache.peek(task_id)  # the state its copy of the stream folds into
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
            self.recorder.observer.count("decisions_gathered", gathering.joined)
            return
        gathering.joined += 1
        if len(waiting) >= gathering.expected:
            gathering.wake()
        # shielded: one of them cancelled must not cancel the others' wait
        await asyncio.shield(gathering.arrived)

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
            if isinstance(plan, _KeyShared):
                return
            history, parts, idle, from_cache = plan.history, plan.parts, plan.idle, plan.from_cache
            if parts:
                try:
                    committed = await self.recorder._commit_parts(
                        [part for _, part, _ in parts], step=step, history=history
                    )
                except VersionConflict:
                    self.recorder.observer.version_conflict()
                    if from_cache:
                        # decided on a stale copy: once more, on the log
                        cached, known = False, history
                        continue
                    return
                if not committed:
                    return
                self.recorder.observer.count("decisions_combined", len(parts))
            for waiting, part, extension in parts:
                waiting.applied = self.recorder._applied(part.state, part.events, extension)
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
        """The decisions of ``batch`` in order, each on the state the ones before leave
        (:class:`_Planned`); :class:`_FromLog` when one needed the log rather than this worker's
        copy of the stream, and the copy was not current; :class:`_KeyShared` when two share a
        causation key. ``cached``, ``known``, ``read``: see ``Recorder.load_events``."""
        state, history, from_cache = await self.recorder.load_events(
            task_id, cached=cached, known=known, read=read
        )
        parts: list[tuple[_Waiting, Part, Extension | None]] = []
        idle: list[tuple[_Waiting, TaskState]] = []
        keys: set[str] = set()
        for waiting in batch:
            events = waiting.decide(state)
            resuming = waiting.run_resumed is not None and resumes(events)
            if from_cache and (not events or resuming):
                # the rules of deciding alone: only the log can say the copy is current; when
                # it is, the decisions taken on it so far stand
                stream = await self.recorder._newer(task_id, history)
                if stream is not None:
                    return _FromLog(stream)
                from_cache = False
            if not events:
                idle.append((waiting, state))
                continue
            causation = waiting.key(events)
            if causation in keys:
                return _KeyShared()
            keys.add(causation)
            extension = None
            made: list[NewEvent] = []
            if resuming:
                assert waiting.run_resumed is not None
                # the run step, in its own delivery's context: the run is a child of that
                # delivery's trace
                made = self.recorder.new_events(state, events, causation, waiting.cause)
                extension = await asyncio.create_task(
                    waiting.run_resumed(state, events, made), context=waiting.context
                )
                if extension is not None:
                    events = extension.events
            part = self.recorder.part(
                state,
                events,
                causation,
                waiting.cause,
                resume_attempts=extension.failed_runs if extension else 0,
                resume_delay=extension.retry_delay if extension else 0.0,
                context=waiting.context,
                made=made,
            )
            parts.append((waiting, part, extension))
            if resuming:
                break  # the rest decide on what the resumed run records: alone
            # the next decides on the state this one leaves (its events chained once: the
            # append gives them back)
            appended = recorded_events(task_id, state.version, part.new_events, state.last_hash)
            state = fold(task_id, appended, start=state)
        return _Planned(history, parts, idle, from_cache)
