"""Reply routing's choices (``waystation.runtime.routing``): weights, homes claimed in the pool's
slots, and the priorities and ``reply_to`` that follow from them."""

from __future__ import annotations

import itertools

from waystation.protocol.wire import Names
from waystation.runtime.routing import WEIGHT_SPAN, ReplyRoutes, ranked, weight
from waystation.slots.memory import MemorySlotLeases

NAMES = Names("t.", reply_shards=4)


def test_weights_are_stable_spread_and_within_the_span() -> None:
    weights = [weight(f"w{n}", "boss", shard) for n in range(200) for shard in range(4)]
    assert weights == [weight(f"w{n}", "boss", shard) for n in range(200) for shard in range(4)]
    assert all(1 <= w <= WEIGHT_SPAN for w in weights)
    firsts = {ranked(f"w{n}", "boss", 4)[0] for n in range(200)}
    assert firsts == {0, 1, 2, 3}, "some shard is never anyone's first choice"
    assert sorted(ranked("w1", "boss", 4)) == [0, 1, 2, 3]


def _same_first_choice() -> tuple[str, str]:
    """Two worker ids that weigh the same shard most."""
    for a, b in itertools.combinations((f"w{n}" for n in range(100)), 2):
        if ranked(a, "boss", 4)[0] == ranked(b, "boss", 4)[0]:
            return a, b
    raise AssertionError("no two workers share a first choice")


async def test_two_workers_that_weigh_the_same_shard_most_claim_different_homes() -> None:
    slots = MemorySlotLeases()
    first, second = _same_first_choice()
    a = ReplyRoutes(NAMES, first, ["boss"], slots=slots)
    b = ReplyRoutes(NAMES, second, ["boss"], slots=slots)
    await a.claim_homes()
    await b.claim_homes()
    assert a.homes["boss"] == ranked(first, "boss", 4)[0]
    assert b.homes["boss"] == ranked(second, "boss", 4)[1]
    # each is the highest-priority consumer of its own home, whatever the other weighs there
    for mine, other in ((a, b), (b, a)):
        home = mine.homes["boss"]
        assert mine.priority("boss", home) > other.priority("boss", home)
        assert mine.reply_to("boss") == NAMES.reply_shard("boss", home)
    # once the first gives its claim back, a new worker may take that shard
    await a.give_back()
    c = ReplyRoutes(NAMES, first, ["boss"], slots=slots)
    await c.claim_homes()
    assert c.homes["boss"] == a.homes["boss"]


async def test_with_every_shard_claimed_a_worker_shares_the_shard_it_weighs_most() -> None:
    slots = MemorySlotLeases()
    holders = [ReplyRoutes(NAMES, f"w{n}", ["boss"], slots=slots) for n in range(4)]
    for holder in holders:
        await holder.claim_homes()
    assert sorted(h.homes["boss"] for h in holders) == [0, 1, 2, 3]
    late = ReplyRoutes(NAMES, "late", ["boss"], slots=slots)
    await late.claim_homes()
    assert late.homes["boss"] == ranked("late", "boss", 4)[0]
    assert not late.claimed


async def test_without_a_slot_table_the_home_is_the_shard_weighed_most() -> None:
    routes = ReplyRoutes(NAMES, "w1", ["boss", "helper"])
    await routes.claim_homes()
    assert routes.homes == {agent: ranked("w1", agent, 4)[0] for agent in ("boss", "helper")}
    assert routes.reply_to("other") == NAMES.replies("other"), "an agent it does not serve"


async def test_without_shards_requests_ask_for_the_shared_reply_queue() -> None:
    routes = ReplyRoutes(Names("t."), "w1", ["boss"], slots=MemorySlotLeases())
    await routes.claim_homes()
    assert routes.reply_to("boss") == "t.boss.replies"
    assert Names("t.").reply_queues("boss") == ["t.boss.replies"]
    assert NAMES.reply_queues("boss") == [
        "t.boss.replies",
        *(f"t.boss.replies.{n}" for n in range(4)),
    ]
