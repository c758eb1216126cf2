"""This worker's hold on task streams: one lock per stream, and a copy of the streams it appended
to last (both serve :class:`~waystation.runtime.recorder.Recorder`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence

from waystation.events import RecordedEvent, TaskState, fold
from waystation.events.codec import dumps

__all__ = ["StreamCache", "StreamLocks"]


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
    with huge inputs or results cannot hold a worker's memory. And by age: a copy
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
