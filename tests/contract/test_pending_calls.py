"""The pending-calls contract (``events/store.py``): ``claim_expired_calls`` and
``pending_call_deadlines``, run against every backend.

The projection is kept by the append itself (PostgreSQL: a statement trigger, migrations 0002
and 0008; in memory: the same rules in Python). It holds every kind of wait a pause has (issue
31): peer calls, signals and timers, each swept at its deadline with its kind.
:class:`PendingCallsContract` holds the suite; each backend subclasses it and provides the
``store`` fixture.

The PostgreSQL database is shared by the whole test session, so these tests look only at their
own calls, and leave none behind: every task they pause is cancelled at teardown (a terminal
event removes its calls), so no worker of a later test ever sweeps them. The calls they want
expired have deadlines in 1970, older than any other test's, so a claim (which takes the oldest
first) reaches them before anything else.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
import pytest_asyncio
from alembic import command
from alembic.config import Config
from sqlalchemy import text

from scripts.lab.harness.database import fresh_database_url
from waystation import migrations
from waystation.events import (
    GENESIS_HASH,
    CancelledCall,
    DeadlineExtended,
    DomainEvent,
    EventMetadata,
    EventStore,
    ExpiredCall,
    NewEvent,
    PendingCall,
    ResultRecorded,
    SubtaskClaimed,
    TaskCancelled,
    TaskCompleted,
    TaskFailed,
    TaskPaused,
    TaskResumed,
    TaskStarted,
    VersionConflict,
    event_id,
    fold,
)
from waystation.events.memory import InMemoryEventStore
from waystation.events.model import WaitKind
from waystation.events.postgres import PostgresEventStore

from ..support import WINDOW, Services, eventually

PAST = 1_000_000.0  # 1970-01-12: expired for every backend's clock
FUTURE = 4_000_000_000.0  # 2096


class Tasks:
    """Streams of paused tasks written through the store's ordinary append."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.ids: list[str] = []

    def new_id(self) -> str:
        task_id = f"pending-{uuid.uuid4()}"
        self.ids.append(task_id)
        return task_id

    async def append(
        self, task_id: str, events: list[DomainEvent], key: str, deployment: str | None = None
    ) -> None:
        state = fold(task_id, await self.store.read_stream(task_id))
        metadata = EventMetadata(worker_id="contract", causation_id=key, deployment=deployment)
        await self.store.append(
            task_id,
            state.version,
            [NewEvent.of(event_id(task_id, key, i), e, metadata) for i, e in enumerate(events)],
            prev_hash=state.last_hash,
        )

    async def paused(
        self,
        deadlines: list[float],
        agent: str = "peer",
        task_id: str | None = None,
        deployment: str | None = None,
    ) -> str:
        """A new task paused on one call per deadline (sub-tasks ``<task>:1:<i>``)."""
        task_id = task_id or self.new_id()
        await self.append(
            task_id,
            [TaskStarted(agent="boss", input=None), pause(task_id, 1, deadlines, agent)],
            "run",
            deployment,
        )
        return task_id

    async def paused_on_waits(self, deadlines: list[float]) -> str:
        """A new task paused on a call, a signal and a timer (:func:`mixed_pause`)."""
        task_id = self.new_id()
        await self.append(
            task_id,
            [TaskStarted(agent="boss", input=None), mixed_pause(task_id, 1, deadlines)],
            "run",
        )
        return task_id

    async def claim(self, subtask: str, outcome: str = "ok", *, last: bool = False) -> None:
        task_id, number, _ = subtask.rsplit(":", 2)
        events: list[DomainEvent] = [
            SubtaskClaimed(subtask_id=subtask, pause=int(number)),
            ResultRecorded(subtask_id=subtask, pause=int(number), outcome=outcome),  # type: ignore[arg-type]
        ]
        if last:
            events.append(TaskResumed(pause=int(number)))
        await self.append(task_id, events, f"reply:{subtask}")

    async def end(self, task_id: str, event: DomainEvent | None = None) -> None:
        await self.append(task_id, [event or TaskCancelled(reason="cleanup")], "end")

    async def cleanup(self) -> None:
        for task_id in self.ids:
            state = fold(task_id, await self.store.read_stream(task_id))
            if state.exists and not state.finished:
                await self.end(task_id)


def pause(
    task_id: str,
    number: int,
    deadlines: list[float],
    agent: str = "peer",
    kinds: Sequence[WaitKind] = (),
    until: int | None = None,
) -> TaskPaused:
    """A pause on one wait per deadline (sub-tasks ``<task>:<number>:<i>``), of ``kinds`` (calls
    when not given; a signal is named ``approval``)."""
    return TaskPaused(
        pause=number,
        state_delta={},
        calls=tuple(
            PendingCall(
                subtask_id=f"{task_id}:{number}:{i}",
                agent=agent if kind == "call" else "",
                input={"i": i} if kind == "call" else None,
                deadline_at=deadline,
                dispatched_at=deadline - 1,
                kind=kind,
                name="approval" if kind == "signal" else None,
            )
            for i, (deadline, kind) in enumerate(
                zip(deadlines, kinds or ["call"] * len(deadlines), strict=True)
            )
        ),
        until=until,
    )


def mixed_pause(task_id: str, number: int, deadlines: list[float]) -> TaskPaused:
    """A pause on a peer call, a signal and a timer, due at ``deadlines``, resumed on the first
    success."""
    return pause(task_id, number, deadlines, kinds=("call", "signal", "timer"), until=1)


def first_of(task_id: str, number: int, taken: int, abandoned: list[int]) -> list[DomainEvent]:
    """The claim of wait ``taken`` of a :func:`mixed_pause` that resumes it, giving up
    ``abandoned``."""
    subtask = f"{task_id}:{number}:{taken}"
    return [
        SubtaskClaimed(subtask_id=subtask, pause=number),
        ResultRecorded(subtask_id=subtask, pause=number, outcome="ok"),
        TaskResumed(
            pause=number,
            abandoned=tuple(
                CancelledCall(subtask_id=f"{task_id}:{number}:{i}", agent="peer" if i == 0 else "")
                for i in abandoned
            ),
        ),
    ]


def mine(claimed: list[ExpiredCall], tasks: Tasks) -> list[ExpiredCall]:
    return [call for call in claimed if call.task_id in tasks.ids]


async def claim_all_of_mine(store: EventStore, tasks: Tasks, **kwargs: Any) -> list[ExpiredCall]:
    return mine(await store.claim_expired_calls(limit=10_000, **kwargs), tasks)


class PendingCallsContract:
    """The suite; a backend's subclass provides ``store``."""

    @pytest.fixture
    def store(self) -> EventStore:
        raise NotImplementedError("a backend's test class provides the store")

    @pytest_asyncio.fixture
    async def tasks(self, store: EventStore) -> AsyncIterator[Tasks]:
        tasks = Tasks(store)
        yield tasks
        await tasks.cleanup()

    async def test_a_pause_lists_its_calls_with_their_deadlines(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        deadlines = [FUTURE, FUTURE + 0.5, FUTURE + 1234.25]
        task_id = await tasks.paused(deadlines)
        found = await store.pending_call_deadlines(task_id)
        assert set(found) == {f"{task_id}:1:{i}" for i in range(3)}
        for i, deadline in enumerate(deadlines):
            assert found[f"{task_id}:1:{i}"] == pytest.approx(deadline, abs=1e-5)

    async def test_a_task_never_paused_has_no_pending_calls(self, store: EventStore) -> None:
        assert await store.pending_call_deadlines(f"nobody-{uuid.uuid4()}") == {}

    async def test_only_expired_calls_are_claimed_with_their_task_and_agent(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        task_id = await tasks.paused([PAST, FUTURE, PAST + 1], agent="slowpoke")
        other = await tasks.paused([FUTURE])
        before = time.time()
        claimed = await claim_all_of_mine(store, tasks)
        after = time.time()
        assert sorted((c.subtask_id, c.task_id, c.agent) for c in claimed) == [
            (f"{task_id}:1:0", task_id, "slowpoke"),
            (f"{task_id}:1:2", task_id, "slowpoke"),
        ]
        # the store's own clock said they expired, and says when: timeouts are decided on it
        for call in claimed:
            assert before - 5 <= call.now <= after + 5
        assert set(await store.pending_call_deadlines(other)) == {f"{other}:1:0"}

    async def test_a_sweeper_of_one_deployment_claims_only_that_deployments_calls(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        ours = await tasks.paused([PAST], deployment="ours.")
        theirs = await tasks.paused([PAST], deployment="theirs.")
        claimed = mine(await store.claim_expired_calls(limit=10_000, deployment="ours."), tasks)
        assert [c.task_id for c in claimed] == [ours]
        claimed = mine(await store.claim_expired_calls(limit=10_000, deployment="theirs."), tasks)
        assert [c.task_id for c in claimed] == [theirs]

    async def test_a_call_whose_deadline_is_now_or_later_is_not_claimed_until_it_passes(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        task_id = await tasks.paused([time.time() + WINDOW])
        assert await claim_all_of_mine(store, tasks) == []
        claimed: list[ExpiredCall] = []

        async def claimable() -> bool:
            claimed.extend(await claim_all_of_mine(store, tasks))
            return bool(claimed)

        await eventually(claimable, 30, "the call to be claimable once its deadline passed", 0.2)
        assert [c.subtask_id for c in claimed] == [f"{task_id}:1:0"]

    async def test_a_claim_leases_its_calls_and_an_expired_lease_frees_them(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        task_id = await tasks.paused([PAST, PAST])
        first = await claim_all_of_mine(store, tasks, lease=WINDOW)
        assert len(first) == 2
        # leased: no other sweeper gets them meanwhile
        assert await claim_all_of_mine(store, tasks, lease=WINDOW) == []
        again: list[ExpiredCall] = []

        async def claimable() -> bool:
            again.extend(await claim_all_of_mine(store, tasks, lease=30))
            return bool(again)

        await eventually(claimable, 30, "the calls to be claimable when their lease ran out", 0.2)
        assert sorted(c.subtask_id for c in again) == [f"{task_id}:1:0", f"{task_id}:1:1"]
        # still pending: a lease records nothing; only the log does
        assert len(await store.pending_call_deadlines(task_id)) == 2

    async def test_claims_take_the_oldest_deadlines_first_and_honour_the_limit(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        task_id = await tasks.paused([PAST + 3, PAST + 1, PAST + 2])
        claimed = await store.claim_expired_calls(limit=2, lease=30)
        assert [c.subtask_id for c in claimed] == [f"{task_id}:1:1", f"{task_id}:1:2"]
        rest = await store.claim_expired_calls(limit=2, lease=30)
        assert rest[0].subtask_id == f"{task_id}:1:0"
        assert await store.claim_expired_calls(limit=0) == []

    async def test_a_claimed_call_leaves_the_pending_calls_and_the_last_claim_empties_them(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        task_id = await tasks.paused([PAST, PAST])
        await tasks.claim(f"{task_id}:1:0", "timeout")
        assert set(await store.pending_call_deadlines(task_id)) == {f"{task_id}:1:1"}
        assert [c.subtask_id for c in await claim_all_of_mine(store, tasks)] == [f"{task_id}:1:1"]
        await tasks.claim(f"{task_id}:1:1", last=True)
        assert await store.pending_call_deadlines(task_id) == {}

    async def test_the_next_pause_lists_only_its_own_calls(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        task_id = await tasks.paused([FUTURE])
        await tasks.claim(f"{task_id}:1:0", last=True)
        await tasks.append(task_id, [pause(task_id, 2, [PAST, FUTURE])], "resume:1")
        assert set(await store.pending_call_deadlines(task_id)) == {
            f"{task_id}:2:0",
            f"{task_id}:2:1",
        }
        assert [c.subtask_id for c in await claim_all_of_mine(store, tasks)] == [f"{task_id}:2:0"]

    async def test_a_first_k_resume_and_the_next_pause_in_one_append_list_the_next_pause(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        """A ``FirstK`` pause resumed in place: the resume gives up the open waits of its pause
        and the run's next pause follows in the same append; the rules apply in append order,
        so the next pause's waits stay. (In memory, the removals once came after every insert
        and took them too: the task waited for ever. Found by the simulation, issue 31.)"""
        task_id = await tasks.paused([FUTURE, FUTURE])
        await tasks.append(
            task_id,
            [
                SubtaskClaimed(subtask_id=f"{task_id}:1:0", pause=1),
                ResultRecorded(subtask_id=f"{task_id}:1:0", pause=1, outcome="ok"),
                TaskResumed(
                    pause=1,
                    abandoned=(CancelledCall(subtask_id=f"{task_id}:1:1", agent="peer"),),
                ),
                pause(task_id, 2, [PAST, FUTURE]),
            ],
            f"reply:{task_id}:1:0",
        )
        assert set(await store.pending_call_deadlines(task_id)) == {
            f"{task_id}:2:0",
            f"{task_id}:2:1",
        }
        assert [c.subtask_id for c in await claim_all_of_mine(store, tasks)] == [f"{task_id}:2:0"]

    async def test_an_extension_moves_a_deadline_and_frees_a_leased_call(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        task_id = await tasks.paused([PAST, PAST])
        leased = await claim_all_of_mine(store, tasks, lease=30)
        assert len(leased) == 2
        await tasks.append(
            task_id,
            [DeadlineExtended(subtask_id=f"{task_id}:1:0", pause=1, deadline_at=FUTURE)],
            "progress:0",
        )
        found = await store.pending_call_deadlines(task_id)
        assert found[f"{task_id}:1:0"] == pytest.approx(FUTURE, abs=1e-5)
        assert found[f"{task_id}:1:1"] == pytest.approx(PAST, abs=1e-5)
        # moved but still in the past (an extension the sweeper raced): claimable again at once,
        # its lease gone with the deadline it was taken for
        await tasks.append(
            task_id,
            [DeadlineExtended(subtask_id=f"{task_id}:1:1", pause=1, deadline_at=PAST + 5)],
            "progress:1",
        )
        assert [c.subtask_id for c in await claim_all_of_mine(store, tasks)] == [f"{task_id}:1:1"]

    async def test_giving_up_waits_forgets_them_but_not_the_next_pause_of_the_same_append(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        """A ``FirstK`` pause resumed early gives up its open waits (``TaskResumed.abandoned``),
        and a run resumed in place appends its next pause with it: that pause's waits stay."""
        task_id = await tasks.paused([PAST, PAST, FUTURE])
        given_up = tuple(CancelledCall(subtask_id=f"{task_id}:1:{i}", agent="peer") for i in (1, 2))
        await tasks.append(
            task_id,
            [
                SubtaskClaimed(subtask_id=f"{task_id}:1:0", pause=1),
                ResultRecorded(subtask_id=f"{task_id}:1:0", pause=1, outcome="ok"),
                TaskResumed(pause=1, abandoned=given_up),
                pause(task_id, 2, [PAST]),
            ],
            f"reply:{task_id}:1:0",
        )
        assert set(await store.pending_call_deadlines(task_id)) == {f"{task_id}:2:0"}
        assert [c.subtask_id for c in await claim_all_of_mine(store, tasks)] == [f"{task_id}:2:0"]

    @pytest.mark.parametrize(
        "terminal",
        [
            TaskCancelled(reason="x"),
            TaskFailed(error={"type": "E"}),
            TaskCompleted(result=1),
        ],
        ids=lambda e: e.event_type,
    )
    async def test_a_terminal_event_removes_every_call_of_its_task_and_no_other(
        self, store: EventStore, tasks: Tasks, terminal: DomainEvent
    ) -> None:
        ended = await tasks.paused([PAST, FUTURE, PAST])
        kept = await tasks.paused([PAST])
        await tasks.end(ended, terminal)
        assert await store.pending_call_deadlines(ended) == {}
        assert set(await store.pending_call_deadlines(kept)) == {f"{kept}:1:0"}
        assert [c.task_id for c in await claim_all_of_mine(store, tasks)] == [kept]

    async def test_an_append_that_fails_changes_no_pending_call(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        task_id = await tasks.paused([PAST, FUTURE])
        metadata = EventMetadata(worker_id="contract").model_dump(exclude_none=True)
        stale = [
            NewEvent(
                event_id=uuid.uuid4(),
                event_type="TaskCancelled",
                data=TaskCancelled(reason="stale").model_dump(mode="json"),
                metadata=metadata,
            )
        ]
        with pytest.raises(VersionConflict):
            await store.append(task_id, 1, stale, prev_hash=GENESIS_HASH)
        assert len(await store.pending_call_deadlines(task_id)) == 2
        assert [c.subtask_id for c in await claim_all_of_mine(store, tasks)] == [f"{task_id}:1:0"]

    async def test_the_same_pause_appended_again_is_a_duplicate_that_lists_nothing_twice(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        task_id = await tasks.paused([PAST])
        events = [TaskStarted(agent="boss", input=None), pause(task_id, 1, [PAST])]
        metadata = EventMetadata(worker_id="contract", causation_id="run")
        result = await store.append(
            task_id,
            0,
            [NewEvent.of(event_id(task_id, "run", i), e, metadata) for i, e in enumerate(events)],
            prev_hash=GENESIS_HASH,
        )
        assert result.duplicate
        assert list(await store.pending_call_deadlines(task_id)) == [f"{task_id}:1:0"]
        assert len(await claim_all_of_mine(store, tasks)) == 1

    async def test_concurrent_sweepers_never_claim_the_same_call(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        ids = [await tasks.paused([PAST + n, PAST + n + 0.5]) for n in range(10)]
        rounds = await asyncio.gather(
            *(store.claim_expired_calls(limit=3, lease=30) for _ in range(8))
        )
        claimed = [c.subtask_id for batch in rounds for c in mine(batch, tasks)]
        assert len(claimed) == len(set(claimed)), "a call leased to two sweepers"
        assert set(claimed) <= {f"{t}:1:{i}" for t in ids for i in range(2)}
        # whatever the first round left is still there for the next, each exactly once
        claimed += [c.subtask_id for c in await claim_all_of_mine(store, tasks)]
        assert sorted(claimed) == sorted(f"{t}:1:{i}" for t in ids for i in range(2))

    async def test_every_kind_of_wait_is_pending_and_claimed_with_its_kind(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        task_id = await tasks.paused_on_waits([PAST, PAST + 1, PAST + 2])
        found = await store.pending_call_deadlines(task_id)
        assert sorted(found) == [f"{task_id}:1:{i}" for i in range(3)]
        claimed = await claim_all_of_mine(store, tasks)
        assert [(c.subtask_id, c.agent, c.kind) for c in claimed] == [
            (f"{task_id}:1:0", "peer", "call"),
            (f"{task_id}:1:1", "", "signal"),
            (f"{task_id}:1:2", "", "timer"),
        ]

    async def test_a_wait_stored_before_waits_had_kinds_is_claimed_as_a_call(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        task_id = await tasks.paused([PAST])
        [stored] = [e for e in await store.read_stream(task_id) if e.event_type == "TaskPaused"]
        assert stored.schema_version == 1 and "kind" not in stored.data["calls"][0]
        assert [c.kind for c in await claim_all_of_mine(store, tasks)] == ["call"]

    async def test_a_resume_that_abandons_waits_removes_them_and_no_other_tasks(
        self, store: EventStore, tasks: Tasks
    ) -> None:
        task_id = await tasks.paused_on_waits([PAST] * 3)
        other = await tasks.paused([PAST])
        await tasks.append(task_id, first_of(task_id, 1, 1, [0, 2]), "signal:s1")
        assert await store.pending_call_deadlines(task_id) == {}
        assert [c.task_id for c in await claim_all_of_mine(store, tasks)] == [other]


class TestInMemoryPendingCalls(PendingCallsContract):
    @pytest.fixture
    def store(self) -> Iterator[EventStore]:
        yield InMemoryEventStore()

    async def test_expiry_follows_the_injected_wall_clock(self) -> None:
        now = [PAST]
        store = InMemoryEventStore(wall_clock=lambda: now[0])
        tasks = Tasks(store)
        task_id = await tasks.paused([PAST + 10])
        assert await store.claim_expired_calls() == []
        now[0] = PAST + 10
        assert [c.subtask_id for c in await store.claim_expired_calls(lease=5)] == [
            f"{task_id}:1:0"
        ]
        now[0] = PAST + 14.9
        assert await store.claim_expired_calls() == []
        now[0] = PAST + 15
        assert len(await store.claim_expired_calls()) == 1


class TestPostgresPendingCalls(PendingCallsContract):
    @pytest_asyncio.fixture
    async def store(self, database_url: str) -> AsyncIterator[EventStore]:
        store = PostgresEventStore.from_url(database_url, pool_size=10)
        yield store
        await store.close()

    async def test_a_pause_and_a_claim_in_one_statement_leave_the_claimed_call_out(
        self, store: PostgresEventStore, tasks: Tasks
    ) -> None:
        """The trigger sees a whole statement, and applies its events in append order, as the
        store in memory does: the claim after the pause removes the claimed call."""
        task_id = tasks.new_id()
        await tasks.append(
            task_id,
            [
                TaskStarted(agent="boss", input=None),
                pause(task_id, 1, [PAST, PAST]),
                SubtaskClaimed(subtask_id=f"{task_id}:1:0", pause=1),
                ResultRecorded(subtask_id=f"{task_id}:1:0", pause=1, outcome="ok"),
            ],
            "run",
        )
        assert list(await store.pending_call_deadlines(task_id)) == [f"{task_id}:1:1"]

    async def test_migration_0008_downgrades_to_0007_and_upgrades_again(
        self, services: Services
    ) -> None:
        """Down, the trigger of 0002 lists a pause's waits without kinds; up again, the rows
        kept meanwhile are calls (what a wait stored before kinds is), and the next pauses list
        their kinds and names again. A database of the test's own: it migrates."""
        url = fresh_database_url(services.admin_database_url)
        config = Config()
        config.set_main_option("script_location", migrations.SCRIPT_LOCATION)
        config.attributes["database_url"] = url
        paused: list[str] = []

        async def pause_one_then_read_the_rows(columns: str) -> set[tuple[Any, ...]]:
            """Pause a task on a call, a signal and a timer through a store opened now (after
            the last migration); the table's rows."""
            store = PostgresEventStore.from_url(url, pool_size=2)
            try:
                paused.append(await Tasks(store).paused_on_waits([FUTURE] * 3))
                async with store.engine.connect() as connection:
                    rows = await connection.execute(text(f"SELECT {columns} FROM pending_calls"))
                    return {tuple(row) for row in rows}
            finally:
                await store.close()

        await migrations.upgrade(url)
        try:
            rows = await pause_one_then_read_the_rows("subtask_id, kind, name")
            assert (f"{paused[0]}:1:1", "signal", "approval") in rows
            await asyncio.to_thread(command.downgrade, config, "0007")
            rows = await pause_one_then_read_the_rows("subtask_id")
            assert rows == {(f"{t}:1:{i}",) for t in paused for i in range(3)}
            await migrations.upgrade(url)
            rows = await pause_one_then_read_the_rows("subtask_id, kind, name")
            first, second, third = paused
            assert rows == {
                *((f"{t}:1:{i}", "call", None) for t in (first, second) for i in range(3)),
                (f"{third}:1:0", "call", None),
                (f"{third}:1:1", "signal", "approval"),
                (f"{third}:1:2", "timer", None),
            }
        finally:
            await migrations.drop_database(url)

    async def test_the_table_keeps_each_waits_kind_and_signal_name(
        self, store: PostgresEventStore, tasks: Tasks
    ) -> None:
        """Migration 0008's columns; a wait recorded as before has kind ``call``, no name."""
        task_id = await tasks.paused_on_waits([FUTURE] * 3)
        older = await tasks.paused([FUTURE])
        async with store.engine.connect() as connection:
            rows = await connection.execute(
                text(
                    "SELECT subtask_id, agent, kind, name FROM pending_calls "
                    "WHERE task_id = ANY(:tasks)"
                ),
                {"tasks": [task_id, older]},
            )
            found = {tuple(row) for row in rows}
        assert found == {
            (f"{task_id}:1:0", "peer", "call", None),
            (f"{task_id}:1:1", "", "signal", "approval"),
            (f"{task_id}:1:2", "", "timer", None),
            (f"{older}:1:0", "peer", "call", None),
        }
