"""An asyncio event loop on a virtual clock, with a seeded scheduler.

Time does not pass while callbacks run: when nothing is ready, the loop jumps its clock to the
next timer instead of waiting for it, so an hour of deadlines, backoffs and sweeps takes as long
as the callbacks it runs. There is no I/O (the simulation's broker and store are in memory), so
the selector never has anything to report; a loop with nothing ready and no timer is stalled,
which :class:`Stalled` reports instead of hanging, as it does a loop that has run more steps than
any sound run takes (:data:`BUSY`).

The scheduler: every callback made ready with ``call_soon`` (a task's next step, a future's
done-callbacks) is put at a position of the ready queue drawn from the run's generator rather than
at its end. asyncio promises no order between different tasks' steps, so every order drawn is one
a real loop could produce under other timings; which one is drawn depends on the seed alone.
"""

from __future__ import annotations

import asyncio
import random
import selectors
from collections.abc import Mapping
from typing import Any

__all__ = ["BUSY", "EPOCH", "Stalled", "VirtualLoop"]

EPOCH = 1_700_000_000.0
"""Where the virtual clock starts (seconds since the Unix epoch, so deadlines look real)."""


class Stalled(RuntimeError):
    """Nothing is ready and nothing is scheduled, or the loop spins on and on: the
    simulated system can never move on again."""


BUSY = 200_000
"""Steps of the loop (each runs every ready callback) after which a run is stalled too: it is
spinning, some callbacks making each other ready forever or nearly (a message taken back and
delivered again at once, say), and would take hours of real time to reach its horizon. An
unchanged run of seeds 0-999 takes at most ~4,300 steps; a spinning one ~85,000 a second."""


class _NoIO(selectors.BaseSelector):
    """A selector with nothing to select: selecting advances the loop's virtual clock."""

    def __init__(self) -> None:
        self._map: dict[Any, selectors.SelectorKey] = {}
        self.loop: VirtualLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, id(fileobj), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        assert self.loop is not None
        if timeout is None:
            raise Stalled("no callback is ready and no timer is scheduled")
        self.loop.advance(timeout)
        self.loop.steps += 1
        if self.loop.steps == BUSY:
            raise Stalled(f"spinning: {BUSY:,} steps of the loop, and the run goes on")
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    """``loop.time()`` is virtual; ``rng`` orders the ready callbacks (None: plain FIFO)."""

    def __init__(self, rng: random.Random | None = None, *, start: float = EPOCH) -> None:
        selector = _NoIO()
        super().__init__(selector)
        selector.loop = self
        self._now = start
        self._rng = rng
        self.steps = 0
        """Steps of the loop so far (see :data:`BUSY`)."""
        # a timer runs once the clock is within this of it: at epoch magnitudes a float cannot
        # tell apart times closer than ~2e-7 s, so the default (1e-9) would never let one run
        self._clock_resolution = 1e-6

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds

    def call_soon(self, callback: Any, *args: Any, context: Any = None) -> asyncio.Handle:
        handle = super().call_soon(callback, *args, context=context)
        ready = getattr(self, "_ready", None)
        if self._rng is not None and ready is not None and len(ready) > 1:
            ready.pop()
            ready.insert(self._rng.randrange(len(ready) + 1), handle)
        return handle
