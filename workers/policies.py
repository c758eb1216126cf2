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
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["WAIT_STEPS_MS", "Backoff", "Permanent", "PolicyError", "TimeLimitExceeded", "wait_step"]


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


def check_retries(retries: int | None) -> None:
    if retries is None:
        return
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
        raise PolicyError(f"retries must be a whole number from 0 to 100, not {retries!r}")


def check_time_limit(time_limit: float | None) -> None:
    if time_limit is None:
        return
    if (
        isinstance(time_limit, bool)
        or not isinstance(time_limit, (int, float))
        or not math.isfinite(time_limit)
        or time_limit <= 0
    ):
        raise PolicyError(f"time_limit must be a positive number of seconds, not {time_limit!r}")
