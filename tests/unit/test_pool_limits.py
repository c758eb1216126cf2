"""Pool limits: ``concurrency`` and ``rate`` checked where the agent is declared
(``waystation.policies``), how long a refused run's task waits and what its waiting copy carries
(``waystation.runtime.limits``, ``waystation.runtime.settle``), and one worker's leases over the
in-memory slots."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from waystation import App, PolicyError, Rate, TaskContext
from waystation.brokers.port import Delivery
from waystation.events import Complete, OutboxMessage, Outcome
from waystation.observability.observer import Observer
from waystation.policies import MAX_SLOTS
from waystation.protocol.wire import HEADER_ATTEMPTS, HEADER_USER, HEADER_WAITS, Names
from waystation.runtime.limits import FIRST_WAIT, UNLIMITED, Admission, PoolLimits, Wait
from waystation.runtime.settle import Settler
from waystation.runtime.verdicts import sent_again, wait, waits_of
from waystation.slots import Refusal
from waystation.slots.memory import MemorySlotLeases


async def handler(task: TaskContext) -> Outcome:
    return Complete({})


def declare(**policies: Any) -> App:
    app = App()
    app.agent("a", **policies)(handler)
    return app


# ---- declared ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "count", "per"),
    [
        ("10/s", 10, 1.0),
        ("100/m", 100, 60.0),
        ("1000/h", 1000, 3600.0),
        ("5000/d", 5000, 86400.0),
        ("3/2s", 3, 2.0),
        (" 7 / 1.5m ", 7, 90.0),
    ],
)
def test_a_rate_is_written_as_starts_per_period(text: str, count: int, per: float) -> None:
    assert Rate.parse(text) == Rate(count, per)
    assert declare(rate=text).agents["a"].rate == Rate(count, per)


def test_a_rate_reads_back_as_it_is_written() -> None:
    assert [str(Rate(10, 60)), str(Rate(3, 2)), str(Rate(1, 0.5)), str(Rate(5))] == [
        "10/m",
        "3/2s",
        "1/0.5s",
        "5/s",
    ]


@pytest.mark.parametrize(
    ("rate", "why"),
    [
        ("10", "like '10/s'"),
        ("ten/s", "like '10/s'"),
        ("10/x", "like '10/s'"),
        ("10/./s", "like '10/s'"),
        ("0/s", "from 1 to 10000, not 0"),
        ("10/0s", "more than 0 and at most a day"),
        ("1/2d", "more than 0 and at most a day"),
        (10, "a Rate or a string"),
    ],
)
def test_a_rate_that_cannot_work_is_refused_at_declare(rate: Any, why: str) -> None:
    with pytest.raises(PolicyError, match=why.replace("(", r"\(")):
        declare(rate=rate)


@pytest.mark.parametrize(
    ("count", "per"),
    [(True, 1.0), (1.5, 1.0), (MAX_SLOTS + 1, 1.0), (1, math.inf), (1, -1.0), (1, "1")],
)
def test_a_rate_object_checks_its_fields(count: Any, per: Any) -> None:
    with pytest.raises(PolicyError, match=r"rate (count|per) must be"):
        Rate(count, per)


@pytest.mark.parametrize("concurrency", [0, -1, 1.5, True, "2", MAX_SLOTS + 1])
def test_a_concurrency_that_cannot_work_is_refused_at_declare(concurrency: Any) -> None:
    with pytest.raises(PolicyError, match=f"from 1 to {MAX_SLOTS}, not"):
        declare(concurrency=concurrency)


def test_no_limit_is_the_default_and_the_policy_lists_both() -> None:
    plain = declare().agents["a"]
    assert not plain.limited
    assert plain.policy(5)["concurrency"] is None and plain.policy(5)["rate"] is None
    limited = declare(concurrency=MAX_SLOTS, rate=Rate(2, per=0.5)).agents["a"]
    assert limited.limited
    assert limited.policy(5)["concurrency"] == MAX_SLOTS
    assert limited.policy(5)["rate"] == {"count": 2, "per": 0.5}


# ---- waiting -------------------------------------------------------------------------------------


def limits(slots: MemorySlotLeases | None = None, **options: Any) -> PoolLimits:
    return PoolLimits(
        slots or MemorySlotLeases(),
        Observer(),
        deployment="unit.",
        worker_id="w",
        lease_seconds=options.pop("lease_seconds", 30.0),
        wait_max=options.pop("wait_max", 2.0),
        rng=random.Random(7),
    )


def test_a_full_concurrency_waits_longer_each_time_up_to_the_maximum() -> None:
    pool = limits(wait_max=1.0)
    for waits in range(12):
        spread = min(1.0, FIRST_WAIT * 2**waits)
        for _ in range(20):
            assert spread / 2 <= pool.wait_seconds(Refusal(("runs",)), waits) <= spread


def test_a_full_rate_waits_until_its_first_slot_frees() -> None:
    pool = limits()
    for waits in range(5):
        spread = min(2.0, FIRST_WAIT * 2**waits)
        seconds = pool.wait_seconds(Refusal(("starts",), free_in=1.5), waits)
        assert 1.5 <= seconds <= 1.5 + spread / 2
    # both full: the longer of the two
    assert pool.wait_seconds(Refusal(("runs", "starts"), free_in=9.0), 0) >= 9.0
    # a rate whose slots were all being taken by others at that instant: as a concurrency
    assert pool.wait_seconds(Refusal(("starts",), free_in=None), 0) <= FIRST_WAIT


@dataclass
class SentBack:
    """The broker calls a settler makes, and nothing else."""

    later: list[tuple[OutboxMessage, float]] = field(default_factory=list)
    acked: list[Delivery] = field(default_factory=list)

    async def publish_later(self, message: OutboxMessage, delay: float) -> None:
        self.later.append((message, delay))

    async def ack(self, delivery: Delivery) -> None:
        self.acked.append(delivery)


async def test_a_waiting_copy_counts_its_waits_and_keeps_its_attempts() -> None:
    broker = SentBack()
    settler = Settler(broker, Names("unit."), Observer(), "w")  # type: ignore[arg-type]
    first = Delivery("unit.a", b"{}", message_id="t", headers={"x-delivery-count": 0})
    assert not sent_again(first)
    await settler.settle(first, wait(0, 0.4))
    [(copy, delay)] = broker.later
    headers = copy.properties["headers"]
    assert delay == 0.4 and broker.acked == [first]
    # no attempt counted (waiting is not one); the copy names its publisher's user, none here
    assert headers == {HEADER_WAITS: 1, HEADER_USER: ""}
    again = Delivery("unit.a", b"{}", message_id="t", headers={**headers, HEADER_ATTEMPTS: 2})
    assert sent_again(again) and waits_of(again) == 1
    await settler.settle(again, wait(2, 0.8))
    assert broker.later[1][0].properties["headers"] == {
        HEADER_WAITS: 2,
        HEADER_ATTEMPTS: 2,
        HEADER_USER: "",
    }


# ---- one worker's leases -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_an_agent_without_limits_takes_no_slot() -> None:
    pool = limits()
    assert await pool.admit(declare().agents["a"], "t", 0) is UNLIMITED
    assert pool.limits_of(declare().agents["a"]) == ()


async def test_a_run_takes_its_slot_and_gives_it_back_when_it_ends() -> None:
    pool = limits()
    spec = declare(concurrency=1).agents["a"]
    first = await pool.admit(spec, "t1", 0)
    assert isinstance(first, Admission) and first.runs
    refused = await pool.admit(spec, "t2", 0)
    assert isinstance(refused, Wait) and refused.limit == "concurrency"
    await pool.release(first)
    assert isinstance(await pool.admit(spec, "t2", 0), Admission)


async def test_a_rate_slot_is_not_given_back() -> None:
    pool = limits()
    spec = declare(rate=Rate(1, per=60)).agents["a"]
    first = await pool.admit(spec, "t1", 0)
    assert isinstance(first, Admission) and not first.runs
    await pool.release(first)
    refused = await pool.admit(spec, "t2", 0)
    assert isinstance(refused, Wait) and refused.limit == "rate"
    assert 60 * 0.9 < refused.seconds < 62


async def test_a_lease_not_renewed_in_time_is_lost_and_counted() -> None:
    clock = Clock()
    slots = MemorySlotLeases(clock)
    pool, other = limits(slots, lease_seconds=3.0), limits(slots, lease_seconds=3.0)
    spec = declare(concurrency=1).agents["a"]
    held = await pool.admit(spec, "t1", 0)
    assert isinstance(held, Admission)
    clock.now += 2.0
    await pool.renew()  # in time: held 3 s more
    clock.now += 2.0
    assert isinstance(await other.admit(spec, "t2", 0), Wait)
    clock.now += 1.5  # past the lease: the other worker takes the slot
    taken = await other.admit(spec, "t2", 0)
    assert isinstance(taken, Admission)
    await pool.renew()
    assert pool.observer.stats.counters["slot_leases_lost"] == 1
    await pool.release(held)  # a lost lease frees nothing of the new holder's
    assert isinstance(await pool.admit(spec, "t3", 0), Wait)
    await other.stop()  # a worker that stops gives its slots back
    assert isinstance(await pool.admit(spec, "t3", 0), Admission)
