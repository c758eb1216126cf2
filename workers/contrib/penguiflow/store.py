"""PenguiFlow's StateStore on Waystation's event log.

Every record PenguiFlow saves becomes an event of a stream of its own kind, never a task
stream (the worker's projections and ``waystation verify`` read past their types):

==============================================  ===============================================
stream                                          events
==============================================  ===============================================
``penguiflow:trace:<trace id>``                 ``penguiflow.EventSaved`` (``None``: ``__global__``)
``penguiflow:bindings:<trace id>``              ``penguiflow.RemoteBindingSaved``
``penguiflow:session:<id>:bindings``            ``penguiflow.RemoteBindingListed``
``penguiflow:pause:<token>``                    ``penguiflow.PlannerStateIssued`` / ``…Consumed``
``penguiflow:memory:<key>``                     ``penguiflow.MemoryStateSaved``
``penguiflow:session:<id>:tasks``               ``penguiflow.TaskSaved``
``penguiflow:session:<id>:updates``             ``penguiflow.UpdateSaved``
``penguiflow:session:<id>:steering``            ``penguiflow.SteeringSaved``
``penguiflow:session:<id>:traces``              ``penguiflow.TraceListed``
``penguiflow:trajectory:<trace id>``            ``penguiflow.TrajectorySaved``
``penguiflow:planner:<trace id>``               ``penguiflow.PlannerEventSaved``
==============================================  ===============================================

Every query is answered from one stream, read through the log's index on ``(stream_id,
stream_version)``: no projection is needed, and what a method returns is always what the
log holds at that moment. (A conversation binding is kept in its trace's stream and listed,
each state of it, under its router session's, which is what ``find_binding`` and
``list_bindings`` read.) A repeated save carries the same event id (uuid5 of the spec's
fingerprint, or of the record's own idempotency key) and is recognised as a duplicate; see
:mod:`waystation.contrib.penguiflow.streams` for how records and last-write-wins registers are
appended.

No method raises into PenguiFlow (the spec's "must not throw"): each is bounded by ``timeout``,
and a failure is logged (``statestore_<method>_failed``), counted in :attr:`errors` (and the
``waystation_penguiflow_store_errors_total`` counter when a registry is given) and answered with
the spec's safe default (nothing saved; ``[]`` or ``None`` read).

Why one module of some 570 lines: it has one job, PenguiFlow's protocol method by method, each a
few lines over :class:`~waystation.contrib.penguiflow.streams.LogWriter` (how records are appended
and encoded is already apart, in ``streams``). Splitting it by PenguiFlow's capability protocols
would mean mixins sharing the guard, the writer and the reader, and a method looked for in
several files.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Any, TypeVar

from penguiflow.planner import PlannerEvent, Trajectory
from penguiflow.state import (
    RemoteBinding,
    StateUpdate,
    SteeringEvent,
    StoredEvent,
    TaskState,
    TaskStateModel,
)
from penguiflow.steering import sanitize_steering_event
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PrometheusCounter

from waystation.contrib.penguiflow.streams import (
    LogWriter,
    decode_value,
    derived_id,
    encode_value,
    fingerprint,
    jsonable,
    stream_name,
)
from waystation.events import EventStore, RecordedEvent

__all__ = ["GLOBAL_TRACE", "WaystationStateStore"]

log = logging.getLogger(__name__)

GLOBAL_TRACE = "__global__"
"""Where events without a trace go (the spec's sentinel)."""

T = TypeVar("T")


def _never_raises(
    default: Callable[[], Any],
) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    def wrap(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(method)
        async def guarded(self: WaystationStateStore, *args: Any, **kwargs: Any) -> T:
            try:
                async with asyncio.timeout(self.timeout):
                    return await method(self, *args, **kwargs)
            except Exception as error:
                self._failed(method.__name__, error, args)
                return default()  # type: ignore[no-any-return]

        return guarded

    return wrap


def _dump(model: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = jsonable(model.model_dump(mode="json", fallback=str))
    return dumped


class WaystationStateStore:
    """The whole StateStore protocol of PenguiFlow 3.11 on an :class:`~events.EventStore`."""

    def __init__(
        self,
        store: EventStore,
        *,
        artifact_store: Any = None,
        timeout: float = 5.0,
        planner_state_ttl: float = 3600.0,
        deployment: str | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        owns_store: bool = False,
    ) -> None:
        self.store = store
        self.timeout = timeout
        self.planner_state_ttl = planner_state_ttl
        self._artifact_store = artifact_store
        self._clock = clock
        self._owns_store = owns_store
        metadata: dict[str, Any] = {"source": "penguiflow"}
        if deployment is not None:
            metadata["deployment"] = deployment
        self._log = LogWriter(store, metadata)
        self._reader = uuid.uuid4().hex
        self.errors: Counter[str] = Counter()
        """Failures by method since this adapter was made."""
        self._error_counter = (
            PrometheusCounter(
                "waystation_penguiflow_store_errors",
                "StateStore calls that failed and answered with the spec's safe default",
                ["method"],
                registry=registry,
            )
            if registry is not None
            else None
        )

    def _failed(self, method: str, error: Exception, args: Sequence[Any]) -> None:
        self.errors[method] += 1
        if self._error_counter is not None:
            self._error_counter.labels(method).inc()
        log.warning(
            "statestore_%s_failed: %r",
            method,
            error,
            extra={
                "event": f"statestore_{method}_failed",
                "method": method,
                "exception": repr(error),
            },
        )

    async def close(self) -> None:
        await self._log.close()
        if self._owns_store:
            await self.store.close()

    async def _read(self, stream: str) -> list[RecordedEvent]:
        return await self.store.read_stream(stream)

    # ---- the audit log (required) ----

    @_never_raises(lambda: None)
    async def save_event(self, event: StoredEvent) -> None:
        trace = event.trace_id or GLOBAL_TRACE
        payload = dict(event.payload)
        fields = {
            "trace_id": trace,
            "ts": event.ts,
            "kind": event.kind,
            "node_name": event.node_name,
            "node_id": event.node_id,
        }
        stream = stream_name("trace", trace)
        data = {
            **fields,
            "trace_id": event.trace_id,
            "ts": float(event.ts),
            "payload": encode_value(payload),
        }
        event_id = derived_id(stream, fingerprint({**fields, "payload": payload}))
        await self._log.record(stream, self._log.new_event(event_id, "penguiflow.EventSaved", data))

    @_never_raises(list)
    async def load_history(self, trace_id: str) -> Sequence[StoredEvent]:
        recorded = await self._read(stream_name("trace", trace_id))
        # ascending time, ties in the order they were stored (the stream's versions)
        recorded.sort(key=lambda e: (e.data["ts"], e.stream_version))
        return [
            StoredEvent(
                trace_id=e.data["trace_id"],
                ts=e.data["ts"],
                kind=e.data["kind"],
                node_name=e.data["node_name"],
                node_id=e.data["node_id"],
                payload=decode_value(e.data["payload"]),
            )
            for e in recorded
            if e.event_type == "penguiflow.EventSaved"
        ]

    # ---- remote bindings and conversation bindings ----

    @_never_raises(lambda: None)
    async def save_remote_binding(self, binding: RemoteBinding) -> None:
        await self._save_binding(jsonable(asdict(binding)))

    async def _save_binding(self, data: dict[str, Any]) -> None:
        """``data`` becomes the binding of its ``(context_id, task_id)`` in its trace's stream
        (last write wins), then is listed under every router session that binding has had, so
        a session it moved away from sees it go. A retry after a crash between the two finds
        the binding saved and lists it: the listing's id is that of the state it lists."""
        stream = stream_name("bindings", data["trace_id"])
        key = _binding_key(data)
        stored = encode_value(data)  # metadata may hold what the log cannot as JSON
        saved = await self._log.put(
            stream,
            "penguiflow.RemoteBindingSaved",
            {"binding": stored},
            same=fingerprint(data),
            key=json.dumps(key),
        )
        sessions = {
            binding["router_session_id"]
            for binding in map(_binding_of, await self._read(stream))
            if _binding_key(binding) == key
        }
        for session in sorted(s for s in sessions if s is not None):
            listing = stream_name("session", session, "bindings")
            event = self._log.new_event(
                derived_id(listing, data["trace_id"], saved.version),
                "penguiflow.RemoteBindingListed",
                {"trace_version": saved.version, "binding": stored},
            )
            await self._log.record(listing, event)

    async def list_remote_bindings(self, trace_id: str) -> list[RemoteBinding]:
        """The bindings of a trace, the newest save of each ``(context_id, task_id)`` (not part
        of PenguiFlow's protocol: for auditors and tests)."""
        latest: dict[tuple[Any, Any], dict[str, Any]] = {}
        for data in map(_binding_of, await self._read(stream_name("bindings", trace_id))):
            latest.pop(_binding_key(data), None)
            latest[_binding_key(data)] = data
        return [RemoteBinding(**data) for data in latest.values()]

    @_never_raises(list)
    async def list_bindings(self, *, router_session_id: str) -> Sequence[RemoteBinding]:
        return await self._session_bindings(router_session_id)

    async def _session_bindings(self, router_session_id: str) -> list[RemoteBinding]:
        # the newest state of each binding listed under the session, in the order they were
        # first listed (the reference's), leaving out those that moved to another session
        states: dict[tuple[Any, ...], tuple[int, dict[str, Any]]] = {}
        for event in await self._read(stream_name("session", router_session_id, "bindings")):
            data, version = _binding_of(event), event.data["trace_version"]
            key = (data["trace_id"], *_binding_key(data))
            if key not in states or version > states[key][0]:
                states[key] = (version, data)
        return [
            RemoteBinding(**data)
            for _, data in states.values()
            if data["router_session_id"] == router_session_id
        ]

    @_never_raises(lambda: None)
    async def find_binding(
        self,
        *,
        router_session_id: str,
        agent_url: str,
        remote_skill: str,
        tenant_id: str | None = None,
        user_id: str | None = None,
    ) -> RemoteBinding | None:
        # the newest of the session's live bindings to this agent and skill whose scope is
        # exactly the one asked for (a scoped binding is not found unscoped, nor the converse)
        for binding in reversed(await self._session_bindings(router_session_id)):
            if (
                (binding.agent_url, binding.remote_skill) == (agent_url, remote_skill)
                and not binding.is_terminal
                and (binding.tenant_id, binding.user_id) == (tenant_id, user_id)
            ):
                return binding
        return None

    @_never_raises(lambda: None)
    async def mark_binding_terminal(
        self, *, trace_id: str, context_id: str | None, task_id: str
    ) -> None:
        key, stream = (context_id, task_id), stream_name("bindings", trace_id)
        current = next(
            (
                binding
                for binding in map(_binding_of, reversed(await self._read(stream)))
                if _binding_key(binding) == key
            ),
            None,
        )
        if current is not None:
            # saved even when already terminal: a retry after a crash lists it
            await self._save_binding({**current, "is_terminal": True})

    # ---- planner pause state: one-time tokens ----

    @_never_raises(lambda: None)
    async def save_planner_state(self, token: str, payload: dict[str, Any]) -> None:
        stream = stream_name("pause", token)
        stored = encode_value(payload, exact=True)
        data = {
            "token": token,
            "payload": stored,
            "expires_at": self._clock() + self.planner_state_ttl,
        }
        # a late retry of a save whose token was consumed meanwhile does not bring it back
        event_id = derived_id(stream, "issued", fingerprint(stored))
        issued = self._log.new_event(event_id, "penguiflow.PlannerStateIssued", data)
        await self._log.record(stream, issued)

    @_never_raises(lambda: None)
    async def load_planner_state(self, token: str) -> dict[str, Any] | None:
        stream = stream_name("pause", token)
        while True:
            events = await self._read(stream)
            if not events:
                return None
            issued = next(
                (e for e in reversed(events) if e.event_type == "penguiflow.PlannerStateIssued"),
                None,
            )
            if issued is None or events[-1].event_type != "penguiflow.PlannerStateIssued":
                return None  # never issued, or consumed since
            if issued.data["expires_at"] <= self._clock():
                return None
            consume = self._log.new_event(
                derived_id(stream, "consumed", issued.stream_version),
                "penguiflow.PlannerStateConsumed",
                {"token": token, "issued_version": issued.stream_version, "by": self._reader},
            )
            # the version check: of two readers appending after the same head, one wins
            outcome = await self._log.append_at(stream, events[-1], consume)
            if outcome == "written" or (outcome == "repeat" and await self._consumed_by_us(stream)):
                return dict(decode_value(issued.data["payload"]))
            if outcome == "repeat":
                return None
            # "moved": re-read; it was consumed, or issued again

    async def _consumed_by_us(self, stream: str) -> bool:
        last = await self.store.last_event(stream)
        return last is not None and last.data.get("by") == self._reader

    # ---- memory state: last write wins ----

    @_never_raises(lambda: None)
    async def save_memory_state(self, key: str, state: dict[str, Any]) -> None:
        stored = encode_value(state)
        await self._log.put(
            stream_name("memory", key),
            "penguiflow.MemoryStateSaved",
            {"key": key, "state": stored},
            same=fingerprint(stored),
        )

    @_never_raises(lambda: None)
    async def load_memory_state(self, key: str) -> dict[str, Any] | None:
        last = await self.store.last_event(stream_name("memory", key))
        return dict(decode_value(last.data["state"])) if last is not None else None

    # ---- session tasks and their updates ----

    @_never_raises(lambda: None)
    async def save_task(self, state: TaskState) -> None:
        data = _dump(TaskStateModel.from_state(state))
        stream = stream_name("session", state.session_id, "tasks")
        event_id = derived_id(stream, fingerprint(data))
        event = self._log.new_event(
            event_id,
            "penguiflow.TaskSaved",
            {"task_id": state.task_id, "state": encode_value(data)},
        )
        await self._log.record(stream, event)

    @_never_raises(list)
    async def list_tasks(self, session_id: str) -> Sequence[TaskState]:
        latest: dict[str, Any] = {}
        for event in await self._read(stream_name("session", session_id, "tasks")):
            latest[event.data["task_id"]] = decode_value(event.data["state"])
        return [_task_state(TaskStateModel.model_validate(data)) for data in latest.values()]

    async def _save_in_session(
        self, kind: str, event_type: str, record: Any, record_id: str, task_id: str
    ) -> None:
        """A record of a session's ``kind`` stream, idempotent by ``record_id``."""
        stream = stream_name("session", record.session_id, kind)
        event = self._log.new_event(
            derived_id(stream, kind, record_id),
            event_type,
            {"id": record_id, "task_id": task_id, "record": encode_value(_dump(record))},
        )
        await self._log.record(stream, event)

    async def _list_in_session(
        self,
        kind: str,
        model: type[T],
        session_id: str,
        task_id: str | None,
        since_id: str | None,
        limit: int,
    ) -> list[T]:
        found = _page(
            await self._read(stream_name("session", session_id, kind)), task_id, since_id, limit
        )
        return [model.model_validate(decode_value(e.data["record"])) for e in found]  # type: ignore[attr-defined]

    @_never_raises(lambda: None)
    async def save_update(self, update: StateUpdate) -> None:
        await self._save_in_session(
            "updates", "penguiflow.UpdateSaved", update, update.update_id, update.task_id
        )

    @_never_raises(list)
    async def list_updates(
        self,
        session_id: str,
        *,
        task_id: str | None = None,
        since_id: str | None = None,
        limit: int = 500,
    ) -> Sequence[StateUpdate]:
        return await self._list_in_session(
            "updates", StateUpdate, session_id, task_id, since_id, limit
        )

    # compatibility names PenguiFlow's adapters fall back to (state/adapters.py)
    save_task_update = save_update
    list_task_updates = list_updates

    # ---- steering ----

    @_never_raises(lambda: None)
    async def save_steering(self, event: SteeringEvent) -> None:
        sanitized = sanitize_steering_event(event)  # untrusted input: stored only once clamped
        await self._save_in_session(
            "steering", "penguiflow.SteeringSaved", sanitized, event.event_id, event.task_id
        )

    @_never_raises(list)
    async def list_steering(
        self,
        session_id: str,
        *,
        task_id: str | None = None,
        since_id: str | None = None,
        limit: int = 500,
    ) -> Sequence[SteeringEvent]:
        return await self._list_in_session(
            "steering", SteeringEvent, session_id, task_id, since_id, limit
        )

    # ---- trajectories ----

    @_never_raises(lambda: None)
    async def save_trajectory(self, trace_id: str, session_id: str, trajectory: Trajectory) -> None:
        stored = encode_value(trajectory.serialise())
        saved = await self._log.put(
            stream_name("trajectory", trace_id),
            "penguiflow.TrajectorySaved",
            {"trace_id": trace_id, "session_id": session_id, "trajectory": stored},
            same=fingerprint([session_id, stored]),
        )
        # listed under its session once per version of the trajectory: a save that changed it
        # moves the trace to the front; a retry after a crash between the two appends lists it
        listing = stream_name("session", session_id, "traces")
        event = self._log.new_event(
            derived_id(listing, trace_id, saved.version),
            "penguiflow.TraceListed",
            {"trace_id": trace_id, "trajectory_version": saved.version},
        )
        await self._log.record(listing, event)

    @_never_raises(lambda: None)
    async def get_trajectory(self, trace_id: str, session_id: str) -> Trajectory | None:
        last = await self.store.last_event(stream_name("trajectory", trace_id))
        if last is None or last.data["session_id"] != session_id:
            return None
        return Trajectory.from_serialised(decode_value(last.data["trajectory"]))

    @_never_raises(list)
    async def list_traces(self, session_id: str, limit: int = 50) -> list[str]:
        newest_first: dict[str, None] = {}
        for event in reversed(await self._read(stream_name("session", session_id, "traces"))):
            newest_first.setdefault(event.data["trace_id"], None)
        return list(newest_first)[: max(limit, 0)]

    # ---- planner events ----

    @_never_raises(lambda: None)
    async def save_planner_event(self, trace_id: str, event: PlannerEvent) -> None:
        data = jsonable(asdict(event))
        stream = stream_name("planner", trace_id)
        record = self._log.new_event(
            derived_id(stream, fingerprint(data)),
            "penguiflow.PlannerEventSaved",
            {"trace_id": trace_id, "event": encode_value(data)},
        )
        await self._log.record(stream, record)

    @_never_raises(list)
    async def list_planner_events(self, trace_id: str) -> list[PlannerEvent]:
        return [
            PlannerEvent(**decode_value(e.data["event"]))
            for e in await self._read(stream_name("planner", trace_id))
        ]

    async def get_events(self, trace_id: str) -> list[PlannerEvent]:
        """The older name of :meth:`list_planner_events` (PenguiFlow's playground)."""
        return await self.list_planner_events(trace_id)

    # ---- artifacts ----

    @property
    def artifact_store(self) -> Any:
        return self._artifact_store


def _page(
    events: list[RecordedEvent], task_id: str | None, since_id: str | None, limit: int
) -> list[RecordedEvent]:
    """The records after ``since_id`` (exclusive; an unknown cursor is no cursor), of
    ``task_id`` when given, the first ``limit`` of them: filtered before the limit, so paging
    on the last id returned sees every record once."""
    start = 0
    if since_id is not None:
        for index, event in enumerate(events):
            if event.data["id"] == since_id:
                start = index + 1
                break
    found = [e for e in events[start:] if task_id is None or e.data["task_id"] == task_id]
    return found[: max(limit, 0)]


def _binding_of(event: RecordedEvent) -> dict[str, Any]:
    """The binding a record holds: encoded (``encode_value``), or as it is in a record written
    before bindings were encoded (a binding has no field ``json`` nor ``json_text``)."""
    stored: dict[str, Any] = event.data["binding"]
    return dict(decode_value(stored)) if {"json", "json_text"} & stored.keys() else stored


def _binding_key(data: dict[str, Any]) -> tuple[Any, Any]:
    """What identifies a binding within its trace."""
    return (data["context_id"], data["task_id"])


def _task_state(model: TaskStateModel) -> TaskState:
    return TaskState(
        task_id=model.task_id,
        session_id=model.session_id,
        status=model.status,
        task_type=model.task_type,
        priority=model.priority,
        context_snapshot=model.context_snapshot,
        trace_id=model.trace_id,
        result=model.result,
        error=model.error,
        description=model.description,
        progress=model.progress,
        created_at=model.created_at,
        updated_at=model.updated_at,
    )
