"""The slots in this process's memory: a real implementation of the port for fast tests and the
simulation. Every worker that shares one instance (on one event loop) is one pool; ``clock``
says when a slot's time is up (the simulation passes its virtual clock)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from waystation.slots import Kind, Limit, Refusal, SlotLeases

__all__ = ["MemorySlotLeases"]


@dataclass
class _Slot:
    lease: str | None = None
    holder: str | None = None
    task_id: str | None = None
    expires_at: float = float("-inf")


class MemorySlotLeases(SlotLeases):
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._slots: dict[tuple[str, str, Kind, int], _Slot] = {}

    async def prepare(self, deployment: str, agent: str, limits: Sequence[Limit]) -> None:
        for limit in limits:
            for slot in range(limit.size):
                self._slots.setdefault((deployment, agent, limit.kind, slot), _Slot())

    def _slots_of(self, deployment: str, agent: str, limit: Limit) -> list[tuple[int, _Slot]]:
        """The prepared slots of ``limit``, with their numbers (below its size)."""
        return [
            (number, slot)
            for number in range(limit.size)
            if (slot := self._slots.get((deployment, agent, limit.kind, number))) is not None
        ]

    def _free(self, deployment: str, agent: str, limit: Limit, now: float) -> _Slot | None:
        """The free slot of ``limit`` that has been free longest, then the lowest."""
        free = [
            (slot.expires_at, number, slot)
            for number, slot in self._slots_of(deployment, agent, limit)
            if slot.expires_at <= now
        ]
        return min(free, key=lambda found: found[:2])[2] if free else None

    def _free_in(
        self,
        deployment: str,
        agent: str,
        limits: Sequence[Limit],
        full: tuple[Kind, ...],
        now: float,
    ) -> float | None:
        """Seconds until the first held slot of a full ``starts`` limit frees."""
        ends = [
            slot.expires_at
            for limit in limits
            if limit.kind == "starts" and "starts" in full
            for _, slot in self._slots_of(deployment, agent, limit)
            if slot.expires_at > now
        ]
        return min(ends) - now if ends else None

    async def take(
        self,
        deployment: str,
        agent: str,
        limits: Sequence[Limit],
        *,
        lease: str,
        holder: str,
        task_id: str,
    ) -> Refusal | None:
        now = self._clock()
        found = [(limit, self._free(deployment, agent, limit, now)) for limit in limits]
        full = tuple(limit.kind for limit, slot in found if slot is None)
        if full:
            return Refusal(full, self._free_in(deployment, agent, limits, full, now))
        for limit, slot in found:
            assert slot is not None
            slot.lease, slot.holder, slot.task_id = lease, holder, task_id
            slot.expires_at = now + limit.hold
        return None

    def _runs_of(self, leases: Collection[str]) -> list[_Slot]:
        return [
            slot
            for (_, _, kind, _), slot in self._slots.items()
            if kind == "runs" and slot.lease is not None and slot.lease in leases
        ]

    async def renew(self, leases: Collection[str], hold: float) -> set[str]:
        now = self._clock()
        renewed: set[str] = set()
        for slot in self._runs_of(leases):
            assert slot.lease is not None
            slot.expires_at = now + hold
            renewed.add(slot.lease)
        return renewed

    async def give_back(self, leases: Collection[str]) -> None:
        for slot in self._runs_of(leases):
            slot.lease = slot.holder = slot.task_id = None
            slot.expires_at = float("-inf")
