"""Per-agent policies: how often a failing handler is tried, how long to wait between tries, and
how long one run may take. Declared where the agent is declared::

    @app.agent("search", retries=3, backoff=Backoff(initial=1.0, factor=2.0, maximum=30.0),
               time_limit=20.0)
    async def search(task: TaskContext) -> Outcome: ...

A handler that raises is tried again after its backoff delay; the delay is spent in the broker
(a wait queue whose messages return to the agent's queue when their time is up), never in a
worker: no consumer slot and no memory is held while a retry waits. Attempts are counted by
Waystation itself (``x-waystation-attempts``), so their meaning does not change with the broker's
version. A handler that raises :class:`Permanent` is not tried again. A run longer than
``time_limit`` is cancelled and counts as a failed attempt. When the attempts run out the task is
recorded as failed, its publisher gets an error result and its message is dead-lettered, as
before.

Two policies limit an agent across the whole pool, however many workers serve it::

    @app.agent("quote", concurrency=2, rate=Rate(10, per=60))    # or rate="10/m"
    async def quote(task: TaskContext) -> Outcome: ...

``concurrency`` is the most runs of the agent's handler at once in the pool, ``rate`` the most
starts of a run in any window of ``per`` seconds (a first run, a retry or a resumed run each
start one). Neither is counted per worker: both are slots in PostgreSQL, taken before a run
starts (``waystation.runtime.limits``). A task that finds no free slot is not held by the worker: it
waits in the broker, as a retry does, and tries again; waiting is not a failed attempt. Both are off
by default, and an agent without them costs nothing more.

One policy keeps what an agent's tasks end with::

    @app.agent("convert", keep_results=True)
    async def convert(task: TaskContext) -> Outcome: ...

A task that completes without calling peers records nothing by default (G10): its publisher gets
its result, and nobody can ask for it later. With ``keep_results`` every outcome of the agent is
recorded in the log (one append per task, as ``WAYSTATION_AUDIT_ALL_TASKS`` does for every agent),
so ``waystation result TASK_ID`` and ``Client.result(task_id, agent=...)`` find it after its
publisher left; a resend of its id is answered from the log instead of running again.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

__all__ = [
    "MAX_DELAY",
    "MAX_SLOTS",
    "WAIT_STEPS_MS",
    "Backoff",
    "Permanent",
    "PolicyError",
    "Rate",
    "TimeLimitExceeded",
    "delay_step",
    "wait_step",
]


class PolicyError(ValueError):
    """A policy that cannot work, found when the agent is declared."""


class Permanent(Exception):
    """Raised by a handler: this error will not go away by trying again. The task fails at once
    (no retry), with this error as its failure."""


class TimeLimitExceeded(Exception):
    """A run took longer than its agent's ``time_limit``; it was cancelled and counts as a failed
    attempt."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """The delay before retry ``n`` (1 for the first retry): ``initial * factor ** (n - 1)``,
    at most ``maximum``, then spread by up to ``jitter`` of itself either way (0.1: ±10%)."""

    initial: float = 0.2
    factor: float = 2.0
    maximum: float = 5.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        for name in ("initial", "factor", "maximum", "jitter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PolicyError(f"backoff {name} must be a number, not {value!r}")
            if not math.isfinite(value):
                raise PolicyError(f"backoff {name} must be finite, not {value!r}")
        if self.initial < 0:
            raise PolicyError(f"backoff initial must be 0 or more seconds, not {self.initial}")
        if self.factor < 1:
            raise PolicyError(f"backoff factor must be at least 1, not {self.factor}")
        if self.maximum < self.initial:
            raise PolicyError(
                f"backoff maximum ({self.maximum}) must be at least its initial ({self.initial})"
            )
        if self.maximum > 24 * 3600:
            raise PolicyError(f"backoff maximum must be a day or less, not {self.maximum} s")
        if not 0 <= self.jitter <= 1:
            raise PolicyError(f"backoff jitter must be between 0 and 1, not {self.jitter}")

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        base = min(self.maximum, self.initial * self.factor ** max(0, retry - 1))
        if self.jitter and base:
            base *= 1 + (rng or random).uniform(-self.jitter, self.jitter)
        return max(0.0, base)

    def to_json(self) -> dict[str, float]:
        return {
            "initial": self.initial,
            "factor": self.factor,
            "maximum": self.maximum,
            "jitter": self.jitter,
        }


WAIT_STEPS_MS: tuple[int, ...] = tuple(
    sorted({int(m * 10**k) for k in range(2, 8) for m in (1, 1.5, 2, 3, 5, 7)} - {0})
)
"""The delays a retry can wait, in milliseconds: 100 ms to 70,000 s, 6 steps a decade. Each is
one wait queue of the broker; a backoff delay is rounded up to the next step, so a retry never
comes back sooner than its policy says (and at most 50% later)."""


def wait_step(seconds: float) -> int:
    """The wait step (ms) a delay of ``seconds`` is spent in: the smallest step not shorter."""
    wanted = math.ceil(seconds * 1000)
    for step in WAIT_STEPS_MS:
        if step >= wanted:
            return step
    return WAIT_STEPS_MS[-1]


MAX_DELAY = WAIT_STEPS_MS[-1] / 1000
"""The longest delay a submitted task can wait in the broker (the last wait step), seconds."""


def delay_step(seconds: float) -> int:
    """The wait step (ms) a task submitted with a delay of ``seconds`` waits in (0: none, it is
    published straight to its queue). Raises ``ValueError`` for a delay that cannot be one."""
    if not _finite(seconds) or not 0 <= seconds <= MAX_DELAY:
        raise ValueError(
            f"delay must be a number of seconds from 0 to {MAX_DELAY:g}, not {seconds!r}"
        )
    return wait_step(seconds) if seconds > 0 else 0


def _whole(value: object, low: int, high: int) -> bool:
    """``value`` is a whole number (not a bool) from ``low`` to ``high``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _finite(value: object) -> bool:
    """``value`` is a finite number (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_retries(retries: int | None) -> None:
    if retries is not None and not _whole(retries, 0, 100):
        raise PolicyError(f"retries must be a whole number from 0 to 100, not {retries!r}")


def check_time_limit(time_limit: float | None) -> None:
    if time_limit is None:
        return
    if not _finite(time_limit) or time_limit <= 0:
        raise PolicyError(f"time_limit must be a positive number of seconds, not {time_limit!r}")


MAX_SLOTS = 10_000
"""The largest ``concurrency``, and the most starts a ``rate`` allows per period: each is a row
of the slot table (``waystation.runtime.limits``)."""

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE = re.compile(r"\s*(\d+)\s*/\s*(\d*\.?\d*)\s*([smhd])\s*")


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``count`` starts of a run in any window of ``per`` seconds, across the pool.

    ``Rate(10, per=60)`` is also written ``"10/m"`` (units ``s``, ``m``, ``h``, ``d``; a number
    before the unit multiplies it: ``"3/2s"``). A burst of ``count`` starts is allowed at once;
    the next waits until the first of them is ``per`` seconds old (a sliding window, not a
    refilling bucket)."""

    count: int
    per: float = 1.0

    def __post_init__(self) -> None:
        count, per = self.count, self.per
        if not _whole(count, 1, MAX_SLOTS):
            raise PolicyError(
                f"rate count must be a whole number from 1 to {MAX_SLOTS}, not {count!r}"
            )
        if not _finite(per) or not 0 < per <= 86400:
            raise PolicyError(f"rate per must be more than 0 and at most a day (s), not {per!r}")

    @classmethod
    def parse(cls, text: str) -> Rate:
        """``"10/s"``, ``"100/m"``, ``"1000/h"``, ``"5000/d"``, ``"3/2s"``: starts per period."""
        found = _RATE.fullmatch(text)
        if found is None:
            raise PolicyError(
                f"rate must be a Rate or a string like '10/s', '100/m' or '3/2s', not {text!r}"
            )
        count, multiple, unit = found.groups()
        try:
            times = float(multiple) if multiple else 1.0
        except ValueError:
            raise PolicyError(f"rate {text!r}: {multiple!r} is not a number") from None
        return cls(int(count), times * _UNITS[unit])

    def __str__(self) -> str:
        for unit, seconds in _UNITS.items():
            if self.per == seconds:
                return f"{self.count}/{unit}"
        return f"{self.count}/{self.per:g}s"

    def to_json(self) -> dict[str, float]:
        return {"count": self.count, "per": self.per}


def as_rate(rate: Rate | str | None) -> Rate | None:
    """The agent's ``rate`` as declared: a :class:`Rate`, its string form, or None (no limit)."""
    if rate is None or isinstance(rate, Rate):
        return rate
    if isinstance(rate, str):
        return Rate.parse(rate)
    raise PolicyError(f"rate must be a Rate or a string like '10/s', not {rate!r}")


def check_keep_results(keep_results: bool) -> None:
    if not isinstance(keep_results, bool):
        raise PolicyError(f"keep_results must be True or False, not {keep_results!r}")


def check_concurrency(concurrency: int | None) -> None:
    if concurrency is not None and not _whole(concurrency, 1, MAX_SLOTS):
        raise PolicyError(
            f"concurrency must be a whole number from 1 to {MAX_SLOTS}, not {concurrency!r}"
        )
