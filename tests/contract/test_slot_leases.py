"""The slot port's contract (``workers/slots/__init__.py``), run against every backend.

:class:`SlotLeasesContract` holds the suite; each backend's class provides ``backend``: its
slots, and how to let time pass (the in-memory one moves its clock; PostgreSQL's clock is the
database's, so there time really passes, a few tenths of a second). The PostgreSQL database is
shared by the whole test session: every test uses a deployment of its own.
"""

from __future__ import annotations

import abc
import asyncio
import uuid

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from scripts.lab.harness.database import columns_migrated_and_declared
from waystation.events import StoreUnavailable
from waystation.events.postgres import PostgresEventStore, create_engine
from waystation.slots import Limit, Refusal, SlotLeases
from waystation.slots.memory import MemorySlotLeases
from waystation.slots.postgres import PostgresSlotLeases, pool_slots_table

AGENT = "agent"
LONG = 600.0
"""A hold no test outlives."""
SHORT = 0.3
"""A hold a test waits out."""


def runs(size: int, hold: float = LONG) -> Limit:
    return Limit("runs", size, hold)


def starts(size: int, hold: float = LONG) -> Limit:
    return Limit("starts", size, hold)


class Backend(abc.ABC):
    slots: SlotLeases

    @abc.abstractmethod
    async def pass_time(self, seconds: float) -> None:
        """Let ``seconds`` pass on the backend's clock."""


class Pool:
    """One deployment's slots of one agent, as a test takes them."""

    def __init__(
        self, slots: SlotLeases, *limits: Limit, agent: str = AGENT, deployment: str | None = None
    ) -> None:
        self.slots = slots
        self.limits = limits
        self.agent = agent
        self.deployment = deployment or f"contract-{uuid.uuid4().hex[:8]}."

    async def prepare(self) -> Pool:
        await self.slots.prepare(self.deployment, self.agent, self.limits)
        return self

    async def take(self, lease: str, *limits: Limit) -> Refusal | None:
        return await self.slots.take(
            self.deployment,
            self.agent,
            limits or self.limits,
            lease=lease,
            holder="contract",
            task_id=f"task-{lease}",
        )


class SlotLeasesContract:
    """The suite; a backend's subclass provides ``backend``."""

    @pytest.fixture
    def backend(self) -> Backend:
        raise NotImplementedError("a backend's test class provides the backend")

    async def test_a_slot_of_each_limit_is_taken_until_none_is_free(self, backend: Backend) -> None:
        pool = await Pool(backend.slots, runs(2)).prepare()
        assert await pool.take("a") is None
        assert await pool.take("b") is None
        assert await pool.take("c") == Refusal(("runs",), None)

    async def test_slots_are_taken_all_or_none(self, backend: Backend) -> None:
        pool = await Pool(backend.slots, runs(1), starts(2)).prepare()
        assert await pool.take("a") is None
        # the concurrency is full: nothing is taken, its rate slot included
        assert await pool.take("b") == Refusal(("runs",), None)
        await backend.slots.give_back(["a"])
        assert await pool.take("c") is None  # the second rate slot: b took none
        await backend.slots.give_back(["c"])
        refused = await pool.take("d")
        assert refused is not None and refused.full == ("starts",)

    async def test_a_refused_rate_says_when_its_first_slot_frees(self, backend: Backend) -> None:
        pool = await Pool(backend.slots, starts(2, hold=60)).prepare()
        assert await pool.take("a") is None
        assert await pool.take("b") is None
        refused = await pool.take("c")
        assert refused is not None and refused.full == ("starts",)
        assert refused.free_in is not None and 50 < refused.free_in <= 60

    async def test_a_rate_slot_frees_itself_after_its_hold_and_is_never_given_back(
        self, backend: Backend
    ) -> None:
        pool = await Pool(backend.slots, starts(1, hold=SHORT)).prepare()
        assert await pool.take("a") is None
        await backend.slots.give_back(["a"])
        assert await pool.take("b") is not None  # still counted: a start is not undone
        assert await backend.slots.renew(["a"], LONG) == set()  # nor renewed
        await backend.pass_time(SHORT + 0.1)
        assert await pool.take("c") is None

    async def test_a_renewed_slot_stays_taken_and_an_expired_one_is_taken_by_another(
        self, backend: Backend
    ) -> None:
        pool = await Pool(backend.slots, runs(1, hold=SHORT)).prepare()
        assert await pool.take("a") is None
        assert await backend.slots.renew(["a"], LONG) == {"a"}
        await backend.pass_time(SHORT + 0.1)
        assert await pool.take("b") is not None  # renewed: still a's
        assert await backend.slots.renew(["a"], SHORT) == {"a"}
        await backend.pass_time(SHORT + 0.1)
        assert await pool.take("b") is None  # a's time ran out: b has it now
        # a's holder finds its lease lost, and can neither renew nor free b's slot
        assert await backend.slots.renew(["a"], LONG) == set()
        await backend.slots.give_back(["a"])
        assert await pool.take("c") is not None

    async def test_a_slot_run_out_but_not_taken_again_is_renewed(self, backend: Backend) -> None:
        pool = await Pool(backend.slots, runs(1, hold=SHORT)).prepare()
        assert await pool.take("a") is None
        await backend.pass_time(SHORT + 0.1)
        assert await backend.slots.renew(["a"], LONG) == {"a"}
        assert await pool.take("b") is not None

    async def test_a_given_back_slot_is_free_at_once(self, backend: Backend) -> None:
        pool = await Pool(backend.slots, runs(1)).prepare()
        assert await pool.take("a") is None
        await backend.slots.give_back(["a"])
        assert await backend.slots.renew(["a"], LONG) == set()
        assert await pool.take("b") is None

    async def test_slots_never_prepared_are_never_free_and_preparing_again_keeps_them(
        self, backend: Backend
    ) -> None:
        pool = Pool(backend.slots, runs(1))
        assert await pool.take("a") is not None
        await pool.prepare()
        assert await pool.take("a") is None
        await pool.prepare()  # idempotent: a keeps its slot
        assert await pool.take("b") is not None
        # a larger limit (a new version of the app) adds the slots it lacks
        await backend.slots.prepare(pool.deployment, AGENT, [runs(2)])
        assert await pool.take("b", runs(2)) is None
        assert await pool.take("c", runs(2)) is not None

    async def test_agents_and_deployments_have_slots_of_their_own(self, backend: Backend) -> None:
        first = await Pool(backend.slots, runs(1)).prepare()
        other_agent = Pool(backend.slots, runs(1), agent="other", deployment=first.deployment)
        await other_agent.prepare()
        other_deployment = await Pool(backend.slots, runs(1)).prepare()
        for pool, lease in ((first, "a"), (other_agent, "b"), (other_deployment, "c")):
            assert await pool.take(lease) is None

    async def test_takes_at_once_never_take_one_slot_twice(self, backend: Backend) -> None:
        pool = await Pool(backend.slots, runs(3), starts(5)).prepare()
        outcomes = await asyncio.gather(*(pool.take(f"l{n}") for n in range(20)))
        assert sum(outcome is None for outcome in outcomes) == 3
        held = {f"l{n}" for n, outcome in enumerate(outcomes) if outcome is None}
        assert await backend.slots.renew(held, LONG) == held


class MemoryBackend(Backend):
    def __init__(self) -> None:
        self.now = 1_000.0
        self.slots = MemorySlotLeases(clock=lambda: self.now)

    async def pass_time(self, seconds: float) -> None:
        self.now += seconds


class TestMemorySlotLeases(SlotLeasesContract):
    @pytest.fixture
    def backend(self) -> Backend:
        return MemoryBackend()


class PostgresBackend(Backend):
    def __init__(self, engine: AsyncEngine) -> None:
        self.slots = PostgresSlotLeases(engine)

    async def pass_time(self, seconds: float) -> None:
        await asyncio.sleep(seconds)  # the database's clock: time must really pass


@pytest.mark.integration
class TestPostgresSlotLeases(SlotLeasesContract):
    """On the event log's own engine, as a worker uses it."""

    @pytest.fixture
    def backend(self, store: PostgresEventStore) -> Backend:
        return PostgresBackend(store.engine)

    async def test_the_table_definition_matches_the_migration(
        self, store: PostgresEventStore
    ) -> None:
        migrated, declared = await columns_migrated_and_declared(store.engine, pool_slots_table)
        assert migrated == declared

    async def test_an_unreachable_database_is_store_unavailable(self) -> None:
        engine = create_engine("postgresql+asyncpg://postgres@127.0.0.1:1/nowhere", pool_size=1)
        try:
            slots = PostgresSlotLeases(engine)
            with pytest.raises(StoreUnavailable):
                await Pool(slots, runs(1)).prepare()
            with pytest.raises(StoreUnavailable):
                await Pool(slots, runs(1)).take("a")
        finally:
            await engine.dispose()
