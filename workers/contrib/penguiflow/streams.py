"""Writing PenguiFlow's records to Waystation's event log: stream names, lossless values, and
the two ways a record is appended.

* :meth:`LogWriter.record`: a fact with an id of its own (uuid5 of what identifies it). A repeat
  of the same fact carries the same id, which the log recognises as a duplicate: nothing is
  written twice. Records of one stream that arrive together in one process are appended in one
  statement (group commit); a conflict with another process re-reads the stream's head and
  tries again.
* :meth:`LogWriter.put`: a register whose last write wins (or one register per key of a
  stream). It appends after the head it read (the version check), with an id derived from that
  head and the value, so a retry of the same write is a duplicate and a write racing another
  re-reads the head and tries again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from waystation.events import GENESIS_HASH, EventStore, NewEvent, RecordedEvent, VersionConflict
from waystation.events.codec import unstorable
from waystation.events.errors import IntegrityError, StoreUnavailable

__all__ = [
    "NAMESPACE",
    "LogWriter",
    "Written",
    "decode_value",
    "encode_value",
    "fingerprint",
    "jsonable",
    "stream_name",
]

NAMESPACE = uuid.UUID("6b7c0f3e-2f1d-5c0e-9a57-70656e677569")
"""The uuid5 namespace of every id the adapter derives."""

PREFIX = "penguiflow:"
_MAX_KEY_CHARS = 200
_MAX_ATTEMPTS = 100
_MAX_BATCH = 200
_HEADS = 10_000


def fingerprint(value: Any) -> str:
    """SHA-256 of ``value`` as canonical JSON (sorted keys, non-JSON values as ``str``): the
    fingerprint of the spec, by which a repeated save is recognised."""
    try:
        raw = json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        raw = repr(value)
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()


def derived_id(*parts: object) -> uuid.UUID:
    return uuid.uuid5(NAMESPACE, "\x1f".join(str(part) for part in parts))


def stream_name(kind: str, *keys: str) -> str:
    """``penguiflow:<kind>:<key>…``; a key too long for the log's index (or holding a NUL) is
    replaced by its SHA-256, which the records keep in full. Keys may hold colons: the name
    stays unambiguous because only the last key (``tasks``, ``updates``, …) is ever fixed."""
    safe = [
        key
        if len(key) <= _MAX_KEY_CHARS and "\x00" not in key
        else "sha256-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        for key in keys
    ]
    return PREFIX + kind + "".join(":" + key for key in safe)


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data: objects through ``str`` (as the spec's fingerprint takes
    them), tuples as lists, NaN and infinity as their names."""

    def walk(item: Any) -> Any:
        if isinstance(item, float) and not math.isfinite(item):
            return str(item)
        if isinstance(item, Mapping):
            return {str(k): walk(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [walk(v) for v in item]
        return item

    return json.loads(json.dumps(walk(value), ensure_ascii=False, default=str))


def encode_value(value: Any, *, exact: bool = False) -> dict[str, Any]:
    """A value as the log stores it, losslessly: as JSON (``{"json": …}``) when the log holds it
    as it is, otherwise (``exact``, or a NUL character, an integer beyond 64 bits, …) as the text
    of its JSON (``{"json_text": "…"}``), which keeps every float, integer and character."""
    plain = jsonable(value)
    if not exact and unstorable(plain) is None:
        try:
            orjson.dumps(plain)
        except (TypeError, orjson.JSONEncodeError):
            pass
        else:
            return {"json": plain}
    return {"json_text": json.dumps(plain, ensure_ascii=True)}


def decode_value(stored: Mapping[str, Any]) -> Any:
    if "json_text" in stored:
        return json.loads(stored["json_text"])
    return stored.get("json")


@dataclass(frozen=True, slots=True)
class Written:
    """Where a record or register value stands in its stream after a write."""

    version: int
    new: bool
    """False when the log already held it (a repeat, or an equal register value)."""


@dataclass(slots=True)
class _Pending:
    event: NewEvent
    done: asyncio.Future[Written]


class LogWriter:
    """Appends the adapter's records; shared by every method of one adapter."""

    def __init__(self, store: EventStore, metadata: Mapping[str, Any]) -> None:
        self.store = store
        self._metadata = dict(metadata)
        self._queues: dict[str, list[_Pending]] = {}
        self._writers: dict[str, asyncio.Task[None]] = {}
        self._heads: OrderedDict[str, tuple[int, bytes]] = OrderedDict()
        self.conflicts = 0

    def new_event(self, event_id: uuid.UUID, event_type: str, data: dict[str, Any]) -> NewEvent:
        return NewEvent(event_id, event_type, data, dict(self._metadata))

    # ---- heads ----

    async def head(self, stream: str) -> tuple[int, bytes]:
        cached = self._heads.get(stream)
        if cached is not None:
            self._heads.move_to_end(stream)
            return cached
        last = await self.store.last_event(stream)
        found = (last.stream_version, last.hash) if last is not None else (0, GENESIS_HASH)
        self._remember(stream, found)
        return found

    def _remember(self, stream: str, head: tuple[int, bytes]) -> None:
        self._heads[stream] = head
        self._heads.move_to_end(stream)
        while len(self._heads) > _HEADS:
            self._heads.popitem(last=False)

    def forget(self, stream: str) -> None:
        self._heads.pop(stream, None)

    # ---- records: group commit ----

    async def record(self, stream: str, event: NewEvent) -> Written:
        """Append ``event`` unless the log holds its id already; see the module docstring."""
        done: asyncio.Future[Written] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(stream, []).append(_Pending(event, done))
        # an abandoned wait (the caller's timeout) must not leave an unretrieved exception
        done.add_done_callback(lambda future: future.cancelled() or future.exception())
        if stream not in self._writers:
            self._writers[stream] = asyncio.create_task(self._drain(stream))
        # the caller may give up (its timeout); the write goes on for the others in its batch
        return await asyncio.shield(done)

    async def _drain(self, stream: str) -> None:
        try:
            while queue := self._queues.pop(stream, None):
                for start in range(0, len(queue), _MAX_BATCH):
                    await self._write_batch(stream, queue[start : start + _MAX_BATCH])
        except BaseException as error:  # cancelled (the loop is closing): nobody waits forever
            _settle(self._queues.pop(stream, []), error=error)
            raise
        finally:
            del self._writers[stream]

    async def _write_batch(self, stream: str, batch: list[_Pending]) -> None:
        by_id: dict[uuid.UUID, list[_Pending]] = {}
        for pending in batch:
            by_id.setdefault(pending.event.event_id, []).append(pending)
        events = [waiting[0].event for waiting in by_id.values()]
        try:
            if len(events) > 1:
                written = await self._append_batch(stream, events)
                if written is not None:
                    for waiting in by_id.values():
                        _settle(waiting, result=Written(written, True))
                    return
            # one at a time: a single record, or a batch that met a repeat, a conflict or an
            # outage (each is then retried on its own)
            for event in events:
                waiting = by_id.pop(event.event_id)
                try:
                    _settle(waiting, result=await self._append_one(stream, event))
                except Exception as error:
                    _settle(waiting, error=error)
        except BaseException as error:
            for waiting in by_id.values():
                _settle(waiting, error=error)
            raise

    async def _append_batch(self, stream: str, events: list[NewEvent]) -> int | None:
        """The stream's version after appending all of ``events`` in one statement, or None when
        that did not work out at once (one of them is there already, or the head moved)."""
        try:
            version, prev_hash = await self.head(stream)
            result = await self.store.append(stream, version, events, prev_hash=prev_hash)
        except (VersionConflict, IntegrityError, StoreUnavailable):
            self.forget(stream)
            return None
        if result.duplicate:
            self.forget(stream)
            return None
        self._remember(stream, (result.version, result.last_hash))
        return result.version

    async def _append_one(self, stream: str, event: NewEvent) -> Written:
        for attempt in range(_MAX_ATTEMPTS):
            try:
                version, prev_hash = await self.head(stream)
                result = await self.store.append(stream, version, [event], prev_hash=prev_hash)
            except VersionConflict:
                self.conflicts += 1
                self.forget(stream)
                await _backoff(attempt)
                continue
            except StoreUnavailable:
                # it may have committed: the retry meets it as a duplicate
                self.forget(stream)
                await _backoff(attempt, base=0.05)
                continue
            if result.duplicate:
                self.forget(stream)  # the head is not the duplicate's version
                return Written(result.version, False)
            self._remember(stream, (result.version, result.last_hash))
            return Written(result.version, True)
        raise VersionConflict(stream, -1)

    # ---- registers ----

    async def put(
        self,
        stream: str,
        event_type: str,
        data: dict[str, Any],
        *,
        same: str,
        key: str | None = None,
    ) -> Written:
        """Make ``data`` the register's value (its newest event); ``same`` is the fingerprint of
        what makes two values equal (an equal value is not written again). With ``key`` the
        stream holds one register per key (``data["key"]``): the value compared is the newest
        event of that key, and a write still appends after the stream's head."""
        for attempt in range(_MAX_ATTEMPTS):
            try:
                last, current = await self._current(stream, key)
                if current is not None and current.data.get("fingerprint") == same:
                    return Written(current.stream_version, False)
                version = last.stream_version if last is not None else 0
                prev_hash = last.hash if last is not None else GENESIS_HASH
                fields = {**data, "fingerprint": same}
                if key is not None:
                    fields["key"] = key
                event = self.new_event(derived_id(stream, version, same), event_type, fields)
                result = await self.store.append(stream, version, [event], prev_hash=prev_hash)
            except VersionConflict:
                self.conflicts += 1
                await _backoff(attempt)
                continue
            except StoreUnavailable:
                await _backoff(attempt, base=0.05)
                continue
            return Written(result.version, not result.duplicate)
        raise VersionConflict(stream, -1)

    async def _current(
        self, stream: str, key: str | None
    ) -> tuple[RecordedEvent | None, RecordedEvent | None]:
        """The stream's head, and the register's value: the head itself, or the newest event
        of ``key``."""
        if key is None:
            last = await self.store.last_event(stream)
            return last, last
        events = await self.store.read_stream(stream)
        current = next((e for e in reversed(events) if e.data.get("key") == key), None)
        return (events[-1] if events else None), current

    async def append_at(
        self, stream: str, after: RecordedEvent | None, event: NewEvent
    ) -> Literal["written", "repeat", "moved"]:
        """Append ``event`` right after ``after`` (None: as the stream's first event): ``moved``
        when another writer appended there first, ``repeat`` when the log already holds
        ``event``'s id (an earlier try of ours, or another writer's with the same id)."""
        version = after.stream_version if after is not None else 0
        prev_hash = after.hash if after is not None else GENESIS_HASH
        try:
            result = await self.store.append(stream, version, [event], prev_hash=prev_hash)
        except VersionConflict:
            self.conflicts += 1
            return "moved"
        return "repeat" if result.duplicate else "written"

    async def close(self) -> None:
        """Wait for the records still being written."""
        while self._writers:
            await asyncio.gather(*self._writers.values(), return_exceptions=True)


def _settle(
    waiting: list[_Pending], *, result: Written | None = None, error: BaseException | None = None
) -> None:
    for pending in waiting:
        if pending.done.done():
            continue
        if error is not None:
            pending.done.set_exception(error)
        else:
            assert result is not None
            pending.done.set_result(result)


async def _backoff(attempt: int, base: float = 0.002) -> None:
    """Spread writers that met: full jitter, growing to a quarter of a second."""
    await asyncio.sleep(random.uniform(0, min(0.25, base * 2 ** min(attempt, 10))))
