"""Limits of an agent across the whole pool: ``concurrency`` and ``rate`` (``waystation.policies``).

**Slots.** An agent's ``concurrency`` of N is N slots of kind ``runs``, its ``rate`` of N per
period N slots of kind ``starts``, kept where every worker sees them: in PostgreSQL, table
``pool_slots`` (the port ``waystation.slots``; in memory for tests and the simulation). Before a
run of the handler starts (a task's first run, a retry, a resumed run), its worker takes one
free slot of each of the agent's limits, all or none, in one statement that no other worker's
can interleave with (``FOR UPDATE SKIP LOCKED``). A run without its slots does not start.

* A ``runs`` slot is held while the run lasts: its worker renews it every third of
  ``WAYSTATION_SLOT_LEASE_SECONDS`` (30 s), and gives it back when the handler returns, raises
  or is cut by its time limit. So at most N runs hold one at once.
* A ``starts`` slot is held for the rate's period from the start, then frees by itself. N slots
  each held ``per`` seconds means no window of ``per`` seconds holds more than N starts (two
  starts on one slot are at least ``per`` apart). A burst of N may start at once.

**A dead holder's slots come back.** A worker that dies (SIGKILL, its host lost) renews nothing
more: each ``runs`` slot it held is free again at most ``WAYSTATION_SLOT_LEASE_SECONDS`` after
its last renewal, so at most that long after it died (so does a slot whose take committed but
whose answer was lost with the connection). A worker that stops in order gives its slots back at
once. The database's clock decides, so the workers' clocks need not agree.

**Waiting is in the broker, and is not an attempt.** A task that finds a limit full is not held
in the worker: its message goes back to its queue through a wait queue (the same
``<prefix>retry-wait.<ms>ms`` queues a retry's backoff uses), carrying ``x-waystation-waits``,
and the delivery is acked only once the broker has confirmed the copy (when the copy cannot be
published the delivery is requeued: nothing is lost). Its ``x-waystation-attempts`` goes on
unchanged, so waiting burns none of its retries (a delivery the broker took back from a dead
worker is counted in it, as a retry's copy counts it, so that a message that kills its workers
still reaches its limit). The wait: until the first ``starts`` slot frees, for a full rate;
0.1 s doubling with each wait up to ``WAYSTATION_LIMIT_WAIT_MAX`` (2 s) for a full concurrency,
which frees when a run ends; each spread at random so that waiting tasks do not all come back
at once, and rounded up to a wait queue's step.

**No task lost, none recorded twice.** A worker that dies between the broker's confirm of the
copy and the ack of the original leaves two messages of one task. Like a retry's copy, a waiting
copy is taken as possibly handled before (``waystation.runtime.verdicts.sent_again``): the task is
looked up in the log before it runs, and its completion is recorded, so only one outcome stands and
its publisher gets one answer (the handler may run twice in that window, as after any crash: G1).

**Cost.** An agent without limits pays nothing: not one statement. A limited one pays a
statement to take its slots (and once per worker one to create them), one to give a ``runs``
slot back, and while it runs a renewal every third of the lease time, one statement for all the
slots a worker holds. A task that waited is read from the log before it runs and recorded when
it completes. Its resumes travel as messages (none runs in place), so that they wait like the
rest.

**Where the limit can be passed.** A holder that cannot renew for a whole lease time (its
database unreachable, its event loop stalled) loses its slot while its run goes on: the run is
not stopped, the loss is logged and counted (``waystation_slot_leases_lost_total``), and the
pool may run one more than its limit until that run ends. A plain ``def`` handler cut by its
time limit runs on in its thread after its slot is given back. Workers that declare different
limits for one agent (a rolling change) each use their own number of slots until they all agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from dataclasses import dataclass

from waystation.agent import AgentSpec
from waystation.observability.observer import Observer
from waystation.slots import Limit, Refusal, SlotLeases

__all__ = ["FIRST_WAIT", "UNLIMITED", "Admission", "PoolLimits", "Wait"]

log = logging.getLogger(__name__)

FIRST_WAIT = 0.1
"""Seconds of a task's first wait for a concurrency slot; each wait after doubles it."""


@dataclass(frozen=True, slots=True)
class Admission:
    """A run allowed to start, and the lease of the slots it took (None: its agent has no
    limits)."""

    lease: str | None = None
    runs: bool = False
    """It holds a ``runs`` slot, to renew while it runs and give back at its end."""


UNLIMITED = Admission()


@dataclass(frozen=True, slots=True)
class Wait:
    """A run that may not start yet: its task waits ``seconds`` in the broker."""

    seconds: float
    limit: str
    """The limit that was full: ``concurrency`` or ``rate`` (``concurrency`` when both were)."""


class PoolLimits:
    """One worker's part in the pool's limits: takes slots for runs, renews those it holds and
    gives them back (see the module)."""

    def __init__(
        self,
        slots: SlotLeases,
        observer: Observer,
        *,
        deployment: str,
        worker_id: str,
        lease_seconds: float,
        wait_max: float,
        rng: random.Random | None = None,
    ) -> None:
        self.slots = slots
        self.observer = observer
        self.deployment = deployment
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.wait_max = wait_max
        self.rng = rng or random.Random()
        self._prepared: set[str] = set()
        self._held: set[str] = set()
        """Leases of ``runs`` slots this worker holds now."""

    def limits_of(self, spec: AgentSpec) -> tuple[Limit, ...]:
        limits = []
        if spec.concurrency is not None:
            limits.append(Limit("runs", spec.concurrency, self.lease_seconds))
        if spec.rate is not None:
            limits.append(Limit("starts", spec.rate.count, spec.rate.per))
        return tuple(limits)

    async def admit(self, spec: AgentSpec, task_id: str, waits: int) -> Admission | Wait:
        """Take a slot of each of ``spec``'s limits for a run of ``task_id``, or say how long
        its task waits first (``waits``: how often it waited already)."""
        limits = self.limits_of(spec)
        if not limits:
            return UNLIMITED
        if spec.name not in self._prepared:
            await self.slots.prepare(self.deployment, spec.name, limits)
            self._prepared.add(spec.name)
        lease = uuid.uuid4().hex
        refusal = await self.slots.take(
            self.deployment,
            spec.name,
            limits,
            lease=lease,
            holder=self.worker_id,
            task_id=task_id,
        )
        if refusal is None:
            runs = spec.concurrency is not None
            if runs:
                self._held.add(lease)
            return Admission(lease, runs)
        return Wait(
            self.wait_seconds(refusal, waits),
            "concurrency" if "runs" in refusal.full else "rate",
        )

    def wait_seconds(self, refusal: Refusal, waits: int) -> float:
        """How long a task refused its slots waits: until a full rate's first slot frees, and
        for a full concurrency ``FIRST_WAIT`` doubled with each wait before, at most
        ``wait_max``; spread at random over up to half of that."""
        spread = min(self.wait_max, FIRST_WAIT * 2 ** min(waits, 30))
        seconds = 0.0
        if "runs" in refusal.full or refusal.free_in is None:
            seconds = self.rng.uniform(spread / 2, spread)
        if refusal.free_in is not None:
            seconds = max(seconds, refusal.free_in + self.rng.uniform(0, spread / 2))
        return seconds

    async def release(self, admission: Admission) -> None:
        """Give back the ``runs`` slot of a run that ended. When that fails, the slot frees by
        itself within the lease time (it is renewed no more)."""
        if not admission.runs or admission.lease is None:
            return
        self._held.discard(admission.lease)
        try:
            await asyncio.shield(self.slots.give_back([admission.lease]))
        except Exception as error:
            log.warning(
                "could not give back a concurrency slot (%s); it frees itself within %gs",
                error,
                self.lease_seconds,
            )

    async def keep_leases(self) -> None:
        """Renew the slots of this worker's runs every third of the lease time, until cancelled."""
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            await self.renew()

    async def renew(self) -> None:
        """Renew the slots of this worker's runs once. A lease not renewed is lost: its run goes
        on beyond the limit (see the module); a renewal that fails is tried at the next turn."""
        held = set(self._held)
        if not held:
            return
        try:
            renewed = await self.slots.renew(held, self.lease_seconds)
        except Exception as error:
            log.warning("could not renew %d concurrency slots: %s", len(held), error)
            return
        lost = (held & self._held) - renewed  # (not those given back meanwhile)
        if lost:
            self._held -= lost
            log.error(
                "%d concurrency slots were lost (not renewed within %gs); their runs go on "
                "beyond the limit",
                len(lost),
                self.lease_seconds,
            )
            self.observer.leases_lost(len(lost))

    async def stop(self) -> None:
        """Give back every slot still held (of runs that outlived the shutdown grace: their
        messages go back to the queue)."""
        held, self._held = set(self._held), set()
        if held:
            with contextlib.suppress(Exception):
                await self.slots.give_back(held)
