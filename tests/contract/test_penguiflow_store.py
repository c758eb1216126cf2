"""PenguiFlow's StateStore on Waystation's log (``workers/contrib/penguiflow``), against both
backends.

:class:`StateStoreContract` covers every method of PenguiFlow 3.11's protocol and every required
case of its spec (``shared/seeds/penguiflow-statestore-spec.md``); it runs on the in-memory log
and on PostgreSQL (this test run's database).
"""

from __future__ import annotations

import asyncio
import functools
import random
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, replace
from datetime import datetime
from typing import Any

import pytest
import pytest_asyncio

from waystation.contrib.penguiflow.streams import decode_value, jsonable
from waystation.events import GENESIS_HASH, EventStore, NewEvent, RecordedEvent, StoreUnavailable
from waystation.events.memory import InMemoryEventStore
from waystation.events.postgres import PostgresEventStore
from waystation.projections.audit import verify_stream

from ..support import penguiflow_capability, require

require(penguiflow_capability(), "the PenguiFlow StateStore tests")

from penguiflow.planner import PlannerEvent, Trajectory  # noqa: E402
from penguiflow.state import (  # noqa: E402
    RemoteBinding,
    StateUpdate,
    SteeringEvent,
    SteeringEventType,
    StoredEvent,
    TaskContextSnapshot,
    TaskState,
    TaskStatus,
    TaskType,
    UpdateType,
)
from penguiflow.steering import (  # noqa: E402
    MAX_STEERING_DEPTH,
    MAX_STEERING_KEYS,
    MAX_STEERING_LIST_ITEMS,
    MAX_STEERING_PAYLOAD_BYTES,
    MAX_STEERING_STRING,
)

from waystation.contrib.penguiflow import (  # noqa: E402
    GLOBAL_TRACE,
    WaystationStateStore,
    create_memory_store,
    create_store,
)

# ---- helpers -------------------------------------------------------------------------------------


def new_id(kind: str = "t") -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


def stored(trace: str | None, ts: float, kind: str = "node_start", **payload: Any) -> StoredEvent:
    return StoredEvent(
        trace_id=trace, ts=ts, kind=kind, node_name="n", node_id="n-1", payload=payload
    )


def task(session: str, task_id: str, status: TaskStatus, **snapshot: Any) -> TaskState:
    return TaskState(
        task_id=task_id,
        session_id=session,
        status=status,
        task_type=TaskType.BACKGROUND,
        priority=5,
        context_snapshot=TaskContextSnapshot(session_id=session, task_id=task_id, **snapshot),
        description="a test task",
    )


def update(session: str, task_id: str, update_id: str, step: int) -> StateUpdate:
    return StateUpdate(
        session_id=session,
        task_id=task_id,
        update_id=update_id,
        update_type=UpdateType.PROGRESS,
        content={"step": step},
    )


def round_trip(trajectory: Trajectory) -> dict[str, Any]:
    """What PenguiFlow's own store gives back: its ``from_serialised`` turns a ``None`` tool
    context into ``{}``."""
    return Trajectory.from_serialised(trajectory.serialise()).serialise()


class FaultyLog(EventStore):
    """A log whose appends and reads hang or fail, to show the adapter never raises nor blocks."""

    def __init__(self, inner: EventStore, mode: str) -> None:
        self.inner, self.mode = inner, mode

    async def _fault(self) -> None:
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.mode == "unavailable":
            raise StoreUnavailable("the database went away")
        raise RuntimeError("a bug below the adapter")

    async def append(self, *args: Any, **kwargs: Any) -> Any:
        await self._fault()

    async def read_stream(self, stream_id: str, *, after: int = 0) -> list[RecordedEvent]:
        await self._fault()
        return []

    async def last_event(self, stream_id: str) -> RecordedEvent | None:
        await self._fault()
        return None

    async def read_all(self, *args: Any, **kwargs: Any) -> Any:
        return await self.inner.read_all(*args, **kwargs)

    async def claim_outbox(self, *args: Any, **kwargs: Any) -> Any:
        return await self.inner.claim_outbox(*args, **kwargs)

    async def delete_outbox(self, ids: Sequence[int]) -> None:
        await self.inner.delete_outbox(ids)

    async def outbox_size(self, *, deployment: str | None = None) -> int:
        return await self.inner.outbox_size(deployment=deployment)

    async def outbox_oldest(self, *, deployment: str | None = None) -> float | None:
        return await self.inner.outbox_oldest(deployment=deployment)

    async def retry_outbox(self, *args: Any, **kwargs: Any) -> None:
        await self.inner.retry_outbox(*args, **kwargs)

    async def replace_outbox(self, *args: Any, **kwargs: Any) -> None:
        await self.inner.replace_outbox(*args, **kwargs)

    async def claim_expired_calls(self, *args: Any, **kwargs: Any) -> Any:
        return await self.inner.claim_expired_calls(*args, **kwargs)

    async def pending_call_deadlines(self, task_id: str) -> dict[str, float]:
        return await self.inner.pending_call_deadlines(task_id)


def conversation(
    session: str, context_id: str | None, task_id: str, *, trace: str | None = None, **scope: Any
) -> RemoteBinding:
    """A conversation binding of ``session`` to the skill ``echo`` of ``agent``, as PenguiFlow's
    remote nodes save them."""
    return RemoteBinding(
        trace_id=trace or new_id(),
        context_id=context_id,
        task_id=task_id,
        agent_url="agent",
        router_session_id=session,
        remote_skill="echo",
        last_remote_task_id=task_id,
        metadata={"source": "remote_node"},
        **scope,
    )


class ListingFaults(FaultyLog):
    """A log on which listing a saved binding under its session (an append to a session's
    bindings) fails (mode ``bug``: the process dies between saving a binding to its trace and
    listing it) or waits for :attr:`release` (mode ``held``: a slow process, overtaken by
    another; :attr:`held` is set once one waits); everything else works."""

    def __init__(self, inner: EventStore, mode: str) -> None:
        super().__init__(inner, mode)
        self.held, self.release = asyncio.Event(), asyncio.Event()

    async def append(self, stream_id: str, *args: Any, **kwargs: Any) -> Any:
        if stream_id.startswith("penguiflow:session:") and stream_id.endswith(":bindings"):
            if self.mode == "held":
                self.held.set()
                await self.release.wait()
            else:
                await self._fault()
        return await self.inner.append(stream_id, *args, **kwargs)

    async def read_stream(self, stream_id: str, *, after: int = 0) -> list[RecordedEvent]:
        return await self.inner.read_stream(stream_id, after=after)

    async def last_event(self, stream_id: str) -> RecordedEvent | None:
        return await self.inner.last_event(stream_id)


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


# ---- the contract --------------------------------------------------------------------------------


class StateStoreContract:
    @pytest.fixture
    def log(self) -> EventStore:
        raise NotImplementedError("a backend's test class provides the log")

    @pytest.fixture
    def adapter(self, log: EventStore) -> WaystationStateStore:
        return WaystationStateStore(log)

    async def streams_verify(self, log: EventStore, *streams: str) -> None:
        for stream in streams:
            events = await log.read_stream(stream)
            assert events, stream
            assert verify_stream(events) == [], stream

    # -- save_event / load_history --

    async def test_a_saved_event_comes_back_with_every_field(
        self, adapter: WaystationStateStore, log: EventStore
    ) -> None:
        trace = new_id()
        sent = stored(trace, 1_702_857_600.25, "node_success", latency_ms=100, nested={"a": [1]})
        await adapter.save_event(sent)
        assert await adapter.load_history(trace) == [sent]
        await self.streams_verify(log, f"penguiflow:trace:{trace}")
        assert adapter.errors == {}

    async def test_an_unknown_trace_has_an_empty_history(
        self, adapter: WaystationStateStore
    ) -> None:
        assert await adapter.load_history(new_id()) == []

    async def test_history_is_in_ascending_time_and_ties_keep_the_order_of_saving(
        self, adapter: WaystationStateStore
    ) -> None:
        trace = new_id()
        saves = [stored(trace, ts, kind) for ts, kind in [(3.0, "c"), (1.0, "a"), (2.0, "b1")]]
        saves += [stored(trace, 2.0, "b2"), stored(trace, 2.0, "b3")]
        for event in saves:
            await adapter.save_event(event)
        assert [e.kind for e in await adapter.load_history(trace)] == ["a", "b1", "b2", "b3", "c"]

    async def test_saving_the_same_event_again_stores_it_once(
        self, adapter: WaystationStateStore, log: EventStore
    ) -> None:
        trace = new_id()
        event = stored(trace, 1.0, "node_retry", attempt=2)
        for _ in range(3):
            await adapter.save_event(event)
        # another adapter (another process) recognises it too
        await WaystationStateStore(log).save_event(stored(trace, 1.0, "node_retry", attempt=2))
        assert await adapter.load_history(trace) == [event]
        assert len(await log.read_stream(f"penguiflow:trace:{trace}")) == 1

    async def test_kinds_never_seen_before_are_stored_as_they_are(
        self, adapter: WaystationStateStore
    ) -> None:
        trace = new_id()
        kinds = ["remote_stream_event", "session.task", "from_penguiflow_4"]
        for ts, kind in enumerate(kinds):
            await adapter.save_event(stored(trace, float(ts), kind))
        assert [e.kind for e in await adapter.load_history(trace)] == kinds

    async def test_an_event_without_a_trace_goes_to_the_global_trace(
        self, adapter: WaystationStateStore
    ) -> None:
        marker = new_id("global")
        await adapter.save_event(stored(None, 5.0, "trace_cancel_drop", marker=marker))
        mine = [
            e for e in await adapter.load_history(GLOBAL_TRACE) if e.payload == {"marker": marker}
        ]
        assert [(e.trace_id, e.kind) for e in mine] == [(None, "trace_cancel_drop")]

    async def test_payloads_the_log_cannot_hold_as_json_are_kept_losslessly(
        self, adapter: WaystationStateStore
    ) -> None:
        trace = new_id()
        payload = {"nul": "a\x00b", "big": 2**70, "float": 0.1, "unicode": "naïve ✓"}
        await adapter.save_event(stored(trace, 1.0, **payload))
        [back] = await adapter.load_history(trace)
        assert back.payload == payload and adapter.errors == {}

    # -- never throws, never blocks --

    @pytest.mark.parametrize("mode", ["hang", "unavailable", "bug"])
    async def test_no_method_raises_or_blocks_when_the_log_fails(
        self, log: EventStore, mode: str
    ) -> None:
        adapter = WaystationStateStore(FaultyLog(log, mode), timeout=0.2)
        session, trace = new_id("s"), new_id()
        saves = [
            adapter.save_event(stored(trace, 1.0)),
            adapter.save_remote_binding(RemoteBinding(trace, None, "t", "http://peer")),
            adapter.save_planner_state("tok", {"a": 1}),
            adapter.save_memory_state("k", {"a": 1}),
            adapter.save_task(task(session, "t", TaskStatus.PENDING)),
            adapter.save_update(update(session, "t", "u", 1)),
            adapter.save_steering(
                SteeringEvent(session_id=session, task_id="t", event_type=SteeringEventType.PAUSE)
            ),
            adapter.save_trajectory(trace, session, Trajectory(query="q")),
            adapter.save_planner_event(trace, PlannerEvent("step_start", 1.0, 0)),
            adapter.mark_binding_terminal(trace_id=trace, context_id=None, task_id="t"),
        ]
        assert await asyncio.wait_for(asyncio.gather(*saves), 60) == [None] * len(saves)
        reads = [
            adapter.load_history(trace),
            adapter.load_planner_state("tok"),
            adapter.load_memory_state("k"),
            adapter.list_tasks(session),
            adapter.list_updates(session),
            adapter.list_steering(session),
            adapter.get_trajectory(trace, session),
            adapter.list_traces(session),
            adapter.list_planner_events(trace),
            adapter.find_binding(
                router_session_id=session, agent_url="http://peer", remote_skill="s"
            ),
            adapter.list_bindings(router_session_id=session),
        ]
        assert await asyncio.wait_for(asyncio.gather(*reads), 60) == [
            [],
            None,
            None,
            [],
            [],
            [],
            None,
            [],
            [],
            None,
            [],
        ]
        assert sum(adapter.errors.values()) == len(saves) + len(reads)
        assert adapter.errors["save_event"] == 1 and adapter.errors["load_history"] == 1

    # -- remote bindings --

    async def test_a_remote_binding_is_an_idempotent_upsert(
        self, adapter: WaystationStateStore, log: EventStore
    ) -> None:
        trace = new_id()
        first = RemoteBinding(trace, "ctx", "task-1", "http://worker-a:8080")
        await adapter.save_remote_binding(first)
        await adapter.save_remote_binding(first)
        assert len(await log.read_stream(f"penguiflow:bindings:{trace}")) == 1
        moved = RemoteBinding(trace, "ctx", "task-1", "http://worker-b:8080", is_terminal=True)
        other = RemoteBinding(trace, None, "task-2", "http://worker-a:8080")
        await adapter.save_remote_binding(moved)
        await adapter.save_remote_binding(other)
        assert await adapter.list_remote_bindings(trace) == [moved, other]

    async def test_a_binding_saved_as_it_was_before_is_the_binding_again(
        self, adapter: WaystationStateStore
    ) -> None:
        trace = new_id()
        live = RemoteBinding(trace, "ctx", "task-1", "http://worker-a:8080")
        for saved in (live, replace(live, is_terminal=True), live):  # last write wins
            await adapter.save_remote_binding(saved)
            assert await adapter.list_remote_bindings(trace) == [saved]

    async def test_binding_metadata_the_log_cannot_hold_as_json_is_kept_losslessly(
        self, adapter: WaystationStateStore
    ) -> None:
        session = new_id("session")
        odd = {"nul": "a\x00b", "big": 2**70, "unicode": "naïve ✓", "remote_task_state": "working"}
        binding = replace(conversation(session, "ctx", "task-1"), metadata=odd)
        await adapter.save_remote_binding(binding)
        assert await adapter.list_remote_bindings(binding.trace_id) == [binding]
        assert await adapter.list_bindings(router_session_id=session) == [binding]
        found = await adapter.find_binding(
            router_session_id=session, agent_url="agent", remote_skill="echo"
        )
        assert found == binding and adapter.errors == {}

    async def test_a_binding_recorded_before_bindings_were_encoded_is_still_read(
        self, adapter: WaystationStateStore, log: EventStore
    ) -> None:
        session, trace = new_id("session"), new_id()
        earlier = conversation(session, "ctx", "task-1", trace=trace)
        plain = jsonable(asdict(earlier))  # as the adapter recorded a binding until now
        await log.append(
            f"penguiflow:bindings:{trace}",
            0,
            [NewEvent(uuid.uuid4(), "penguiflow.RemoteBindingSaved", {"binding": plain})],
            prev_hash=GENESIS_HASH,
        )
        assert await adapter.list_remote_bindings(trace) == [earlier]
        await adapter.mark_binding_terminal(trace_id=trace, context_id="ctx", task_id="task-1")
        assert await adapter.list_remote_bindings(trace) == [replace(earlier, is_terminal=True)]
        assert await adapter.list_bindings(router_session_id=session) == [
            replace(earlier, is_terminal=True)
        ]
        assert adapter.errors == {}

    # -- conversation bindings (PenguiFlow 3.11: find_binding, list_bindings, ...) --

    async def test_a_binding_is_found_by_its_session_agent_skill_and_exact_scope(
        self, adapter: WaystationStateStore
    ) -> None:
        session = new_id("session")
        find = functools.partial(
            adapter.find_binding, router_session_id=session, agent_url="agent", remote_skill="echo"
        )
        await adapter.save_remote_binding(RemoteBinding(new_id(), "ctx-0", "task-0", "agent"))
        assert await find() is None  # saved without a session: not a conversation binding
        scoped = conversation(session, "ctx-1", "task-1", tenant_id="tenant-a", user_id="user-a")
        await adapter.save_remote_binding(scoped)
        for tenant, user in [("tenant-a", None), (None, "user-a"), ("tenant-b", "user-a")]:
            assert await find(tenant_id=tenant, user_id=user) is None
        assert await find(tenant_id="tenant-a", user_id="user-a") == scoped
        assert (
            await adapter.find_binding(
                router_session_id=new_id("session"),
                agent_url="agent",
                remote_skill="echo",
                tenant_id="tenant-a",
                user_id="user-a",
            )
            is None
        )
        assert await find(tenant_id="tenant-a", user_id="user-a", remote_skill="other") is None
        assert await find(tenant_id="tenant-a", user_id="user-a", agent_url="other") is None
        unscoped = conversation(session, "ctx-2", "task-2")
        await adapter.save_remote_binding(unscoped)
        assert await find(tenant_id="tenant-a", user_id="user-a") == scoped
        assert await find() == unscoped
        await adapter.mark_binding_terminal(
            trace_id=scoped.trace_id, context_id="ctx-1", task_id="task-1"
        )
        await adapter.mark_binding_terminal(
            trace_id=unscoped.trace_id, context_id="ctx-2", task_id="task-2"
        )
        assert await find() is None and await find(tenant_id="tenant-a", user_id="user-a") is None
        assert await adapter.list_bindings(router_session_id=session) == [
            replace(scoped, is_terminal=True),
            replace(unscoped, is_terminal=True),
        ]
        assert adapter.errors == {}

    async def test_the_newest_live_binding_is_found_when_an_older_one_ends(
        self, adapter: WaystationStateStore
    ) -> None:
        session = new_id("session")
        first, second = (
            conversation(session, "ctx", "task-1"),
            conversation(session, "ctx", "task-2"),
        )
        await adapter.save_remote_binding(first)
        await adapter.save_remote_binding(second)
        find = functools.partial(
            adapter.find_binding, router_session_id=session, agent_url="agent", remote_skill="echo"
        )
        assert await find() == second
        await adapter.mark_binding_terminal(
            trace_id=first.trace_id, context_id="ctx", task_id="task-1"
        )
        assert await find() == second
        await adapter.mark_binding_terminal(
            trace_id=second.trace_id, context_id="ctx", task_id="task-2"
        )
        assert await find() is None
        # saved again as it was (a new turn of the same remote task): live again
        await adapter.save_remote_binding(first)
        assert await find() == first

    async def test_a_binding_saved_terminal_is_listed_but_never_found(
        self, adapter: WaystationStateStore
    ) -> None:
        session = new_id("session")
        ended = conversation(session, "ctx", "task-1", is_terminal=True)
        await adapter.save_remote_binding(ended)
        assert (
            await adapter.find_binding(
                router_session_id=session, agent_url="agent", remote_skill="echo"
            )
            is None
        )
        assert await adapter.list_bindings(router_session_id=session) == [ended]
        assert await adapter.list_bindings(router_session_id=new_id("session")) == []

    async def test_bindings_are_listed_once_each_newest_state_in_the_order_first_saved(
        self, adapter: WaystationStateStore, log: EventStore
    ) -> None:
        session = new_id("session")
        one, two = conversation(session, "ctx", "task-1"), conversation(session, None, "task-2")
        await adapter.save_remote_binding(one)
        await adapter.save_remote_binding(two)
        await adapter.save_remote_binding(one)  # a repeat: nothing new is written
        changed = replace(one, metadata={"awaiting_remote_input": True})
        await adapter.save_remote_binding(changed)
        assert await adapter.list_bindings(router_session_id=session) == [changed, two]
        assert len(await log.read_stream(f"penguiflow:session:{session}:bindings")) == 3

    async def test_a_binding_moved_to_another_session_leaves_the_first(
        self, adapter: WaystationStateStore
    ) -> None:
        before, after = new_id("session"), new_id("session")
        binding = conversation(before, "ctx", "task-1")
        await adapter.save_remote_binding(binding)
        moved = replace(binding, router_session_id=after)
        await adapter.save_remote_binding(moved)
        assert await adapter.list_bindings(router_session_id=before) == []
        assert (
            await adapter.find_binding(
                router_session_id=before, agent_url="agent", remote_skill="echo"
            )
            is None
        )
        assert await adapter.list_bindings(router_session_id=after) == [moved]

    async def test_marking_an_unknown_binding_terminal_writes_nothing(
        self, adapter: WaystationStateStore, log: EventStore
    ) -> None:
        trace = new_id()
        await adapter.mark_binding_terminal(trace_id=trace, context_id=None, task_id="nobody")
        assert await log.read_stream(f"penguiflow:bindings:{trace}") == []
        # another binding of the trace is not touched either
        await adapter.save_remote_binding(RemoteBinding(trace, "ctx", "task-1", "agent"))
        await adapter.mark_binding_terminal(trace_id=trace, context_id=None, task_id="task-1")
        assert await adapter.list_remote_bindings(trace) == [
            RemoteBinding(trace, "ctx", "task-1", "agent")
        ]
        assert adapter.errors == {}

    async def test_bindings_saved_by_one_process_are_found_and_ended_by_another(
        self, log: EventStore
    ) -> None:
        session, trace = new_id("session"), new_id()
        writers = [WaystationStateStore(log) for _ in range(4)]
        bindings = [conversation(session, "ctx", f"task-{n}", trace=trace) for n in range(12)]
        await asyncio.gather(
            *(writers[n % 4].save_remote_binding(b) for n, b in enumerate(bindings))
        )
        reader = WaystationStateStore(log)
        listed = await reader.list_bindings(router_session_id=session)
        assert sorted(listed, key=lambda b: b.task_id) == sorted(bindings, key=lambda b: b.task_id)
        newest = listed[-1]
        assert (
            await reader.find_binding(
                router_session_id=session, agent_url="agent", remote_skill="echo"
            )
            == newest
        )
        await reader.mark_binding_terminal(trace_id=trace, context_id="ctx", task_id=newest.task_id)
        assert (
            await writers[0].find_binding(
                router_session_id=session, agent_url="agent", remote_skill="echo"
            )
            == listed[-2]
        )
        assert all(w.errors == {} for w in [*writers, reader])

    async def test_a_save_cut_off_before_its_session_listing_is_completed_by_a_retry(
        self, log: EventStore
    ) -> None:
        session = new_id("session")
        binding = conversation(session, "ctx", "task-1")
        crashed = WaystationStateStore(ListingFaults(log, "bug"))
        await crashed.save_remote_binding(binding)
        assert crashed.errors == {"save_remote_binding": 1}
        retried = WaystationStateStore(log)
        assert await retried.list_remote_bindings(binding.trace_id) == [binding]  # half done
        assert await retried.list_bindings(router_session_id=session) == []
        await retried.save_remote_binding(binding)
        assert await retried.list_bindings(router_session_id=session) == [binding]
        # the same for an end cut off before its listing, and retried
        await crashed.mark_binding_terminal(
            trace_id=binding.trace_id, context_id="ctx", task_id="task-1"
        )
        await retried.mark_binding_terminal(
            trace_id=binding.trace_id, context_id="ctx", task_id="task-1"
        )
        assert await retried.list_bindings(router_session_id=session) == [
            replace(binding, is_terminal=True)
        ]
        assert retried.errors == {}

    async def test_a_listing_that_arrives_late_does_not_bring_back_an_older_state(
        self, log: EventStore
    ) -> None:
        session = new_id("session")
        older = conversation(session, "ctx", "task-1")
        newer = replace(older, metadata={"remote_task_state": "completed"}, is_terminal=True)
        held = ListingFaults(log, "held")
        slow = asyncio.create_task(
            WaystationStateStore(held, timeout=60).save_remote_binding(older)
        )
        await asyncio.wait_for(held.held.wait(), 60)  # saved to its trace, not yet listed
        await WaystationStateStore(log).save_remote_binding(newer)
        held.release.set()
        await asyncio.wait_for(slow, 60)
        stream = await log.read_stream(f"penguiflow:session:{session}:bindings")
        assert [decode_value(e.data["binding"])["is_terminal"] for e in stream] == [
            True,
            False,
        ]  # late
        assert await WaystationStateStore(log).list_bindings(router_session_id=session) == [newer]

    # -- planner state --

    async def test_planner_state_comes_back_exactly_as_saved(
        self, adapter: WaystationStateStore
    ) -> None:
        token = uuid.uuid4().hex
        payload = {
            "trajectory": {"version": 1, "steps": [{"action": {"next_node": "x"}}]},
            "reason": "await_input",
            "payload": {"floats": [0.1, 1e16, -0.0, 1.7976931348623157e308], "int": 2**70},
            "constraints": None,
            "tool_context": {"tenant_id": "t", "text": "a\x00b ✓"},
        }
        await adapter.save_planner_state(token, payload)
        loaded = await adapter.load_planner_state(token)
        assert loaded == payload
        assert repr(loaded) == repr(payload)  # 1e16 stays a float, -0.0 keeps its sign

    async def test_a_token_is_consumed_by_its_first_read(
        self, adapter: WaystationStateStore
    ) -> None:
        token = uuid.uuid4().hex
        await adapter.save_planner_state(token, {"data": "value"})
        assert await adapter.load_planner_state(token) == {"data": "value"}
        assert await adapter.load_planner_state(token) is None
        # a late retry of the same save does not bring a consumed token back
        await adapter.save_planner_state(token, {"data": "value"})
        assert await adapter.load_planner_state(token) is None

    async def test_a_missing_token_is_none_not_an_empty_dict(
        self, adapter: WaystationStateStore
    ) -> None:
        assert await adapter.load_planner_state(uuid.uuid4().hex) is None

    async def test_a_token_expires_after_its_ttl(self, log: EventStore) -> None:
        clock = Clock()
        adapter = WaystationStateStore(log, clock=clock)
        assert adapter.planner_state_ttl == 3600.0
        live, late = uuid.uuid4().hex, uuid.uuid4().hex
        await adapter.save_planner_state(live, {"n": 1})
        await adapter.save_planner_state(late, {"n": 2})
        clock.now += 3599
        assert await adapter.load_planner_state(live) == {"n": 1}
        clock.now += 2
        assert await adapter.load_planner_state(late) is None

    async def test_two_readers_of_one_token_exactly_one_gets_it(self, log: EventStore) -> None:
        for _ in range(20):
            token = uuid.uuid4().hex
            await WaystationStateStore(log).save_planner_state(token, {"secret": token})
            readers = [WaystationStateStore(log) for _ in range(2)]
            got = await asyncio.gather(*(r.load_planner_state(token) for r in readers))
            assert sorted(got, key=lambda g: g is None) == [{"secret": token}, None]

    async def test_saving_a_token_again_with_a_new_payload_replaces_it(
        self, adapter: WaystationStateStore
    ) -> None:
        token = uuid.uuid4().hex
        await adapter.save_planner_state(token, {"v": 1})
        await adapter.save_planner_state(token, {"v": 2})
        assert await adapter.load_planner_state(token) == {"v": 2}
        assert await adapter.load_planner_state(token) is None

    # -- memory state --

    async def test_memory_state_is_an_upsert_where_the_last_write_wins(
        self, adapter: WaystationStateStore
    ) -> None:
        key = f"tenant:user:{new_id('session')}"
        assert await adapter.load_memory_state(key) is None
        empty: dict[str, Any] = {"turns": []}
        full = {"turns": [{"role": "user", "content": "hello"}], "health": "healthy"}
        for state in (empty, full, empty):  # back to an earlier value: still the last write
            await adapter.save_memory_state(key, state)
            assert await adapter.load_memory_state(key) == state
        await adapter.save_memory_state(key, empty)  # the same again: nothing new is written
        assert await adapter.load_memory_state(key) == empty

    async def test_concurrent_memory_writers_leave_one_of_their_values(
        self, log: EventStore
    ) -> None:
        key = new_id("memory")
        values = [{"writer": n} for n in range(8)]
        await asyncio.gather(*(WaystationStateStore(log).save_memory_state(key, v) for v in values))
        stream = await log.read_stream(f"penguiflow:memory:{key}")
        assert sorted(e.data["state"]["json"]["writer"] for e in stream) == list(range(8))
        assert (
            await WaystationStateStore(log).load_memory_state(key)
            == stream[-1].data["state"]["json"]
        )

    # -- tasks --

    async def test_tasks_are_upserted_and_listed_by_session(
        self, adapter: WaystationStateStore
    ) -> None:
        session = new_id("session")
        assert await adapter.list_tasks(session) == []
        one = task(session, "one", TaskStatus.PENDING, context_version=3, context_hash="abc123")
        two = task(session, "two", TaskStatus.RUNNING, llm_context={"k": [1, 2]})
        await adapter.save_task(one)
        await adapter.save_task(two)
        await adapter.save_task(one)  # a repeat
        one.update_status(TaskStatus.COMPLETE)
        one.result = {"answer": 42}
        await adapter.save_task(one)
        listed = {t.task_id: t for t in await adapter.list_tasks(session)}
        assert listed == {"one": one, "two": two}
        snapshot = listed["one"].context_snapshot
        assert (snapshot.context_version, snapshot.context_hash) == (3, "abc123")
        assert isinstance(listed["one"].created_at, datetime)
        assert listed["one"].created_at.tzinfo is not None
        assert await adapter.list_tasks(new_id("session")) == []

    # -- updates --

    async def test_updates_are_idempotent_by_update_id_with_an_exclusive_cursor(
        self, adapter: WaystationStateStore
    ) -> None:
        session = new_id("session")
        sent = [update(session, "t", f"update-{i}", i) for i in range(5)]
        for u in sent + sent[:2]:
            await adapter.save_update(u)
        assert await adapter.list_updates(session) == sent
        assert await adapter.list_updates(session, since_id="update-2") == sent[3:]
        assert await adapter.list_updates(session, since_id="update-4") == []
        assert await adapter.list_updates(session, since_id="no-such-id") == sent
        assert await adapter.list_updates(new_id("session")) == []

    async def test_update_filters_apply_before_the_limit_of_500_by_default(
        self, adapter: WaystationStateStore
    ) -> None:
        session = new_id("session")
        mine = [update(session, "mine", f"m{i}", i) for i in range(510)]
        noise = [update(session, "other", f"o{i}", i) for i in range(20)]
        await asyncio.gather(*(adapter.save_update(u) for u in noise + mine))
        everything = await adapter.list_updates(session)
        assert len(everything) == 500
        listed = await adapter.list_updates(session, task_id="mine")
        assert [u.update_id for u in listed] == [u.update_id for u in mine[:500]]
        rest = await adapter.list_updates(session, task_id="mine", since_id=listed[-1].update_id)
        assert [u.update_id for u in rest] == [u.update_id for u in mine[500:]]
        assert len(await adapter.list_updates(session, task_id="mine", limit=3)) == 3

    # -- steering --

    async def test_steering_is_sanitised_before_it_is_stored(
        self, adapter: WaystationStateStore, log: EventStore
    ) -> None:
        session = new_id("session")
        deep: dict[str, Any] = {"x": 1}
        for _ in range(MAX_STEERING_DEPTH + 2):
            deep = {"d": deep}
        clamped = SteeringEvent(
            session_id=session,
            task_id="t",
            event_type=SteeringEventType.USER_MESSAGE,
            payload={
                "text": "y" * (MAX_STEERING_STRING + 10),
                "deep": deep,
                "keys": {f"k{i}": i for i in range(MAX_STEERING_KEYS + 5)},
                "items": list(range(MAX_STEERING_LIST_ITEMS + 5)),
            },
        )
        huge = SteeringEvent(
            session_id=session,
            task_id="t",
            event_type=SteeringEventType.INJECT_CONTEXT,
            payload={f"huge{i}": "z" * 1000 for i in range(40)},
        )
        await adapter.save_steering(clamped)
        await adapter.save_steering(huge)
        first, second = await adapter.list_steering(session)
        assert len(first.payload["text"]) == MAX_STEERING_STRING
        assert first.payload["keys"]["__truncated_keys__"] is True
        assert len(first.payload["keys"]) == MAX_STEERING_KEYS + 1
        assert first.payload["items"][-1] == "<truncated>"
        assert len(first.payload["items"]) == MAX_STEERING_LIST_ITEMS + 1
        depth, level = 0, first.payload["deep"]
        while isinstance(level, dict):
            depth, level = depth + 1, level["d"]
        assert level == "<truncated>" and depth < MAX_STEERING_DEPTH
        assert second.payload["truncated"] is True
        assert len(second.payload["summary"]) <= MAX_STEERING_STRING
        # what the log holds is the sanitised form: the raw input never reached it
        raw = str([e.data for e in await log.read_stream(f"penguiflow:session:{session}:steering")])
        assert "huge39" not in raw and "y" * (MAX_STEERING_STRING + 1) not in raw
        assert len(raw.encode()) < 4 * MAX_STEERING_PAYLOAD_BYTES

    async def test_steering_is_idempotent_by_event_id_with_a_cursor_and_task_filter(
        self, adapter: WaystationStateStore
    ) -> None:
        session = new_id("session")
        events = [
            SteeringEvent(
                session_id=session,
                task_id=f"t{i % 2}",
                event_id=f"e{i}",
                event_type=SteeringEventType.PRIORITIZE,
                payload={"priority": i},
                source="user" if i else "system",
            )
            for i in range(6)
        ]
        for event in events + events[:3]:
            await adapter.save_steering(event)
        assert await adapter.list_steering(session) == events
        assert await adapter.list_steering(session, since_id="e1") == events[2:]
        assert await adapter.list_steering(session, task_id="t1", since_id="e1") == [
            events[3],
            events[5],
        ]
        assert await adapter.list_steering(session, since_id="unknown", limit=2) == events[:2]

    # -- trajectories --

    async def test_trajectories_are_kept_per_trace_and_listed_newest_first(
        self, adapter: WaystationStateStore
    ) -> None:
        session = new_id("session")
        traces = [new_id("trace") for _ in range(3)]
        for n, trace in enumerate(traces):
            await adapter.save_trajectory(trace, session, Trajectory(query=f"q{n}"))
        assert await adapter.list_traces(session) == traces[::-1]
        assert await adapter.list_traces(session, limit=2) == traces[:0:-1]
        got = await adapter.get_trajectory(traces[0], session)
        assert got is not None and got.serialise() == round_trip(Trajectory(query="q0"))
        assert await adapter.get_trajectory(traces[0], "another-session") is None
        assert await adapter.get_trajectory(new_id("trace"), session) is None
        # saving the oldest again, changed, moves it to the front; an unchanged save does not
        changed = Trajectory(query="q0", metadata={"turn": 2})
        await adapter.save_trajectory(traces[0], session, changed)
        await adapter.save_trajectory(traces[1], session, Trajectory(query="q1"))
        assert await adapter.list_traces(session) == [traces[0], traces[2], traces[1]]
        again = await adapter.get_trajectory(traces[0], session)
        assert again is not None and again.serialise() == round_trip(changed)
        assert await adapter.list_traces(new_id("session")) == []

    # -- planner events --

    async def test_planner_events_are_append_only_in_emission_order(
        self, adapter: WaystationStateStore
    ) -> None:
        trace = new_id()
        sent = [
            PlannerEvent("step_start", 2.0, 0, node_name="plan"),
            PlannerEvent("llm_stream_chunk", 1.0, 0, extra={"text": "he", "done": False}),
            PlannerEvent("step_complete", 3.0, 1, latency_ms=12.5, token_estimate=40),
        ]
        for event in sent:
            await adapter.save_planner_event(trace, event)
        await adapter.save_planner_event(trace, sent[0])  # a retry
        assert await adapter.list_planner_events(trace) == sent
        assert await adapter.get_events(trace) == sent
        assert await adapter.list_planner_events(new_id()) == []

    # -- load --

    async def test_1000_concurrent_saves_of_100_traces_half_repeats_store_each_event_once(
        self, log: EventStore
    ) -> None:
        rng = random.Random(12)
        adapters = [WaystationStateStore(log, timeout=120) for _ in range(4)]  # four "processes"
        traces = [new_id() for _ in range(100)]
        distinct = [
            stored(trace, float(rng.randint(0, 3)), f"k{n}") for trace in traces for n in range(5)
        ]
        calls = [*distinct, *distinct]
        rng.shuffle(calls)
        await asyncio.gather(*(rng.choice(adapters).save_event(e) for e in calls))
        assert all(a.errors == {} for a in adapters)
        reader = adapters[0]
        for trace in traces:
            history = await reader.load_history(trace)
            expected = [e for e in distinct if e.trace_id == trace]
            assert sorted(history, key=lambda e: e.kind) == sorted(expected, key=lambda e: e.kind)
            assert [e.ts for e in history] == sorted(e.ts for e in history)
            versions = [
                v.stream_version for v in await log.read_stream(f"penguiflow:trace:{trace}")
            ]
            assert versions == [1, 2, 3, 4, 5]
        await self.streams_verify(log, *(f"penguiflow:trace:{t}" for t in traces))

    async def test_every_stream_the_adapter_writes_verifies(
        self, adapter: WaystationStateStore, log: EventStore
    ) -> None:
        session, trace, token = new_id("session"), new_id(), uuid.uuid4().hex
        await adapter.save_event(stored(trace, 1.0))
        await adapter.save_remote_binding(
            RemoteBinding(trace, None, "t", "http://peer", router_session_id=session)
        )
        await adapter.mark_binding_terminal(trace_id=trace, context_id=None, task_id="t")
        await adapter.save_planner_state(token, {"a": 1})
        assert await adapter.load_planner_state(token) == {"a": 1}
        await adapter.save_memory_state(session, {"a": 1})
        await adapter.save_task(task(session, "t", TaskStatus.PENDING))
        await adapter.save_update(update(session, "t", "u", 1))
        await adapter.save_steering(
            SteeringEvent(session_id=session, task_id="t", event_type=SteeringEventType.PAUSE)
        )
        await adapter.save_trajectory(trace, session, Trajectory(query="q"))
        await adapter.save_planner_event(trace, PlannerEvent("finish", 1.0, 0))
        streams = [
            f"penguiflow:trace:{trace}",
            f"penguiflow:bindings:{trace}",
            f"penguiflow:pause:{token}",
            f"penguiflow:memory:{session}",
            f"penguiflow:session:{session}:tasks",
            f"penguiflow:session:{session}:updates",
            f"penguiflow:session:{session}:steering",
            f"penguiflow:session:{session}:traces",
            f"penguiflow:session:{session}:bindings",
            f"penguiflow:trajectory:{trace}",
            f"penguiflow:planner:{trace}",
        ]
        await self.streams_verify(log, *streams)
        assert adapter.errors == {}


async def artifacts_are_found_and_kept(adapter: WaystationStateStore) -> None:
    """PenguiFlow finds the factory's artifact store and it keeps what it is given (the store
    itself is covered by tests/contract/test_penguiflow_artifacts.py)."""
    from penguiflow.artifacts import ArtifactScope, discover_artifact_store

    found = discover_artifact_store(adapter)
    assert found is adapter.artifact_store and found is not None
    data = uuid.uuid4().bytes * 100
    ref = await found.put_bytes(
        data,
        mime_type="application/octet-stream",
        scope=ArtifactScope(session_id=new_id("session")),
    )
    assert await found.get(ref.id) == data and ref.size_bytes == len(data)


class TestOnTheInMemoryLog(StateStoreContract):
    @pytest.fixture
    def log(self) -> EventStore:
        return InMemoryEventStore()

    async def test_the_factory_gives_an_artifact_store(self, log: EventStore) -> None:
        await artifacts_are_found_and_kept(create_memory_store(log))


class TestOnPostgreSQL(StateStoreContract):
    @pytest_asyncio.fixture
    async def log(self, database_url: str) -> AsyncIterator[EventStore]:
        store = PostgresEventStore.from_url(database_url, pool_size=8)
        yield store
        await store.close()

    async def test_the_factory_gives_an_artifact_store(self, database_url: str) -> None:
        adapter = await create_store(database_url=database_url)
        try:
            await artifacts_are_found_and_kept(adapter)
        finally:
            await adapter.close()


def test_a_long_or_odd_key_gets_a_stream_name_the_index_can_hold() -> None:
    from waystation.contrib.penguiflow.streams import stream_name

    assert stream_name("trace", "abc") == "penguiflow:trace:abc"
    assert stream_name("memory", "tenant:user:s") == "penguiflow:memory:tenant:user:s"
    for odd in ("x" * 5000, "nul\x00"):
        name = stream_name("trace", odd)
        assert name.startswith("penguiflow:trace:sha256-") and len(name) < 100
    assert stream_name("trace", "x" * 5000) != stream_name("trace", "x" * 5001)
