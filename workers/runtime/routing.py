"""Reply routing: a parent's replies come back to the worker that paused it.

Without routing, a parent's K replies land on whichever workers take them from the agent's
reply queue. Two workers recording replies of one task race to the same stream version: one
append fails with a version conflict, reads the stream again and retries; and a worker that did
not write the stream last has no copy of it (``waystation.runtime.recorder.StreamCache``), so it
reads it first. Routing makes the common case one worker per parent:

* Each agent has ``reply_shards`` shard queues ``P<agent>.replies.<n>`` (durable quorum queues,
  besides its shared ``P<agent>.replies``), and every worker serving the agent consumes all of
  them, with a consumer priority (``x-priority``) of its own on each.
* A worker's priority on a shard is its rendezvous weight there (a hash of the worker id, agent
  and shard, 1 to ``WEIGHT_SPAN``), plus ``WEIGHT_SPAN`` on its *home* shard. RabbitMQ delivers
  to the highest-priority consumer with room, so each shard goes to the one worker that calls it
  home, and a peer request carries ``reply_to`` = the home shard of the worker that paused the
  task: its replies come back to it, and it decides from its own copy of the stream, without
  conflicts.
* A worker claims its home in the pool's slot table (``waystation.slots``: one ``runs`` slot per
  shard, leased and renewed like a concurrency slot), so that two workers rarely call one shard
  home: it takes the free shard it weighs most. Without a free shard (more workers than shards),
  or without the slot table, its home is the shard it weighs most, shared with others.
* When a worker dies, its shard's replies go to the live worker that weighs that shard most
  (the next priority), with no one to decide it: nothing waits for a lease. Its home slot frees
  after the lease time, for a new worker to claim.

Routing only chooses *who* records a reply. Every guarantee rests, as before, on the append's
version check, the ack after the commit and the outbox: a reply recorded by another worker than
its home (a full prefetch, a dead or restarted worker, more workers than shards) costs a read or
a conflict, nothing more. ``reply_shards=0`` turns it off: requests carry the shared queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import uuid
from collections.abc import Iterable

from waystation.events import StoreUnavailable
from waystation.protocol.wire import Names
from waystation.slots import Limit, SlotLeases

__all__ = ["WEIGHT_SPAN", "ReplyRoutes", "home_key", "ranked", "weight"]

log = logging.getLogger(__name__)

WEIGHT_SPAN = 1_000_000
"""Rendezvous weights are 1..WEIGHT_SPAN; a home shard's priority is WEIGHT_SPAN more (so every
priority fits RabbitMQ's signed 32-bit ``x-priority``)."""


def weight(worker_id: str, agent: str, shard: int) -> int:
    """The worker's rendezvous weight on an agent's shard: stable, spread evenly."""
    digest = hashlib.blake2b(f"{worker_id}\0{agent}\0{shard}".encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "big") % WEIGHT_SPAN


def ranked(worker_id: str, agent: str, shards: int) -> list[int]:
    """The agent's shards, the one this worker weighs most first."""
    return sorted(range(shards), key=lambda shard: -weight(worker_id, agent, shard))


def home_key(agent: str, shard: int) -> str:
    """The slot-table key under which a worker claims ``shard`` of ``agent`` as its home."""
    return f"{agent}.replies.{shard}"


class ReplyRoutes:
    """One worker's homes and priorities, for the agents it serves."""

    def __init__(
        self,
        names: Names,
        worker_id: str,
        agents: Iterable[str],
        *,
        slots: SlotLeases | None = None,
        lease_seconds: float = 30.0,
    ) -> None:
        self.names = names
        self.worker_id = worker_id
        self.agents = list(agents)
        self.slots = slots
        self.lease_seconds = lease_seconds
        self.homes: dict[str, int] = {}
        self.claimed: dict[str, str] = {}
        """agent -> the lease of its claimed home slot."""

    @property
    def shards(self) -> int:
        return self.names.reply_shards

    async def claim_homes(self) -> None:
        """Choose each agent's home shard: the free one this worker weighs most, claimed in the
        slot table; without one (or without the table), the one it weighs most."""
        if not self.shards:
            return
        for agent in self.agents:
            order = ranked(self.worker_id, agent, self.shards)
            self.homes[agent] = order[0]
            if self.slots is None:
                continue
            try:
                claimed = await self._claim(agent, order)
            except StoreUnavailable as error:
                log.warning("cannot claim a reply shard for %s (%s); sharing one", agent, error)
                continue
            if claimed is None:
                log.info(
                    "every reply shard of %s is some worker's home; sharing shard %d",
                    agent,
                    order[0],
                )
            else:
                self.homes[agent] = claimed
        log.debug("reply homes: %s", self.homes)

    async def _claim(self, agent: str, order: list[int]) -> int | None:
        assert self.slots is not None
        limit = Limit("runs", 1, self.lease_seconds)
        deployment = self.names.prefix
        for shard in order:
            key = home_key(agent, shard)
            await self.slots.prepare(deployment, key, [limit])
            lease = f"home:{self.worker_id}:{uuid.uuid4().hex[:12]}"
            refusal = await self.slots.take(
                deployment, key, [limit], lease=lease, holder=self.worker_id, task_id=key
            )
            if refusal is None:
                self.claimed[agent] = lease
                return shard
        return None

    def priority(self, agent: str, shard: int) -> int:
        """This worker's consumer priority on ``shard`` of ``agent``."""
        home = WEIGHT_SPAN if self.homes.get(agent) == shard else 0
        return home + weight(self.worker_id, agent, shard)

    def reply_to(self, agent: str) -> str:
        """Where the replies to a pause of ``agent``'s task recorded here should go."""
        home = self.homes.get(agent)
        if home is None:
            return self.names.replies(agent)
        return self.names.reply_shard(agent, home)

    async def keep_claims(self) -> None:
        """Renew the home claims every third of the lease time, until cancelled. A claim lost
        (the database was out for a whole lease time) is only logged: the worker keeps its
        priorities, and another worker that claimed the shard meanwhile shares it."""
        if self.slots is None or not self.claimed:
            return
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            leases = set(self.claimed.values())
            try:
                renewed = await self.slots.renew(leases, self.lease_seconds)
            except StoreUnavailable as error:
                log.warning("cannot renew the reply-shard claims (%s)", error)
                continue
            for agent, lease in list(self.claimed.items()):
                if lease not in renewed:
                    log.warning("lost the claim on reply shard %d of %s", self.homes[agent], agent)
                    del self.claimed[agent]

    async def give_back(self) -> None:
        if self.slots is not None and self.claimed:
            with contextlib.suppress(Exception):
                await self.slots.give_back(set(self.claimed.values()))
            self.claimed.clear()
