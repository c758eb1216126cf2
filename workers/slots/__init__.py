"""The slot port: where the pool keeps the slots of its agents' limits
(``waystation.runtime.limits``).

An agent's ``concurrency`` of N is N slots of kind ``runs``; its ``rate`` of N starts per period
is N slots of kind ``starts``. A run may start only once it holds one free slot of each of its
agent's limits; a slot is free when its time is up (``expires_at`` has passed). A backend
(:class:`~waystation.slots.postgres.PostgresSlotLeases`, the pool's one, in the event log's
database; :class:`~waystation.slots.memory.MemorySlotLeases`, one process's, for tests and the
simulation) keeps the slots; the clock that says when a slot's time is up is the backend's own
(PostgreSQL's ``now()``), so the workers' clocks need not agree.

Contract (the shared suite in ``tests/contract/test_slot_leases.py`` runs it against every
backend):

* ``prepare(deployment, agent, limits)`` makes sure the agent's slots exist, free when new
  (idempotent; slots prepared before stay as they are). Slots never prepared are never free.
* ``take(deployment, agent, limits, lease=…, holder=…, task_id=…)`` takes one free slot of each
  limit for ``lease`` (an id the caller made up, unique), all or none, atomically against every
  other ``take`` of the pool: a slot is never held by two leases at once. Each slot taken is
  held for its limit's ``hold`` seconds. None when taken; a :class:`Refusal` naming the limits
  without a free slot otherwise (then nothing is taken).
* ``renew(leases, hold)`` holds the ``runs`` slots of these leases for ``hold`` seconds from now,
  and returns the leases it renewed: a lease not returned was lost (its time ran out and another
  lease took its slot), or was given back. A slot whose time ran out but that nobody took yet is
  renewed: no other run held it meanwhile.
* ``give_back(leases)`` frees the ``runs`` slots of these leases at once. ``starts`` slots are
  never given back nor renewed: a start stays counted for its whole period.

Errors are the event log's (``waystation.events.errors``): ``StoreUnavailable`` when trying again
may work.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Kind", "Limit", "Refusal", "SlotLeases"]

Kind = Literal["runs", "starts"]
"""``runs``: a concurrency slot, held while its run lasts. ``starts``: a rate slot, held for the
rate's period from the start of a run."""


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit of an agent: ``size`` slots of ``kind``, each held ``hold`` seconds when taken."""

    kind: Kind
    size: int
    hold: float


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why ``take`` took nothing: the limits whose slots were all held (``full``), and, when a
    ``starts`` limit was full, the seconds until its first slot frees (``free_in``; a ``runs``
    slot frees when its run ends, which nobody can tell in advance)."""

    full: tuple[Kind, ...]
    free_in: float | None = None


class SlotLeases(abc.ABC):
    """The pool's slots: taken, renewed and given back by leases."""

    @abc.abstractmethod
    async def prepare(self, deployment: str, agent: str, limits: Sequence[Limit]) -> None:
        """Make sure the agent's slots of these limits exist (idempotent)."""

    @abc.abstractmethod
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
        """Take a free slot of each limit for ``lease``, all or none (see the module)."""

    @abc.abstractmethod
    async def renew(self, leases: Collection[str], hold: float) -> set[str]:
        """Hold these leases' ``runs`` slots ``hold`` seconds more; the leases renewed."""

    @abc.abstractmethod
    async def give_back(self, leases: Collection[str]) -> None:
        """Free these leases' ``runs`` slots now."""
