"""A flow's verdict on its delivery, and what a delivery's headers say of its past runs.

Flows never settle a delivery: each returns a :class:`Verdict` (``ack``, ``retry``, ``wait``,
``requeue``, ``dead``) that the worker hands to ``waystation.runtime.settle.Settler`` once the
delivery's effect is durable (G1). Attempts are counted by Waystation itself, in the copies a
worker sends back (``x-waystation-attempts``, ``x-waystation-waits``), plus the times the broker
took a delivery back unsettled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from waystation.brokers.port import Delivery
from waystation.protocol.intake import Rejection
from waystation.protocol.wire import HEADER_ATTEMPTS, HEADER_WAITS

__all__ = [
    "Disposition",
    "Verdict",
    "ack",
    "attempt_of",
    "crash_limit",
    "dead",
    "requeue",
    "retry",
    "sent_again",
    "wait",
    "waits_of",
]


class Disposition(enum.Enum):
    ACK = "ack"
    RETRY = "retry"
    WAIT = "wait"
    REQUEUE = "requeue"
    DEAD_LETTER = "dead-letter"


@dataclass(frozen=True, slots=True)
class Verdict:
    """A flow's verdict on its delivery: what should become of it once its outcome is durable
    (nothing is settled yet; ``Settler.settle`` carries it out)."""

    disposition: Disposition
    checkpoint_started: float | None = None
    """perf_counter() when the handler returned a pause; the checkpoint ends at the ack."""
    rejection: Rejection | None = None
    """Why a dead letter is dead."""
    tell_publisher: bool = False
    """Send the rejection to the delivery's ``reply_to`` as an error result."""
    failed_runs: int = 0
    """For a retry: the runs of its handler that have failed so far, this one included. For a
    wait: those before it (and the times the broker took it back unsettled)."""
    delay: float = 0.0
    """For a retry or a wait: seconds it waits in the broker before it is delivered again."""


def ack(checkpoint_started: float | None = None) -> Verdict:
    return Verdict(Disposition.ACK, checkpoint_started)


def requeue() -> Verdict:
    return Verdict(Disposition.REQUEUE)


def dead(reason: str, detail: str, *, tell_publisher: bool = False) -> Verdict:
    return Verdict(Disposition.DEAD_LETTER, None, Rejection(reason, detail), tell_publisher)


def retry(failed_runs: int, delay: float = 0.0) -> Verdict:
    return Verdict(Disposition.RETRY, failed_runs=failed_runs, delay=delay)


def wait(failed_runs: int, delay: float) -> Verdict:
    return Verdict(Disposition.WAIT, failed_runs=failed_runs, delay=delay)


def crash_limit(delivery_limit: int) -> int:
    """How many times a message may come back unsettled (its worker died, or its connection
    dropped, while holding it) before it is taken for a poison message and failed."""
    return 2 * delivery_limit


def attempt_of(delivery: Delivery) -> int:
    """Which attempt of its handler this delivery is: 1, plus the runs that failed before (which
    the worker that saw them fail wrote into ``x-waystation-attempts``), plus the times the broker
    took it back unsettled (a worker died holding it, or its connection dropped)."""
    failed = delivery.headers.get(HEADER_ATTEMPTS, 0)
    if not isinstance(failed, int) or isinstance(failed, bool) or not 0 <= failed < 1_000_000:
        failed = 0
    return 1 + failed + delivery.broker_count


def waits_of(delivery: Delivery) -> int:
    """How often this message already waited for a free slot (``x-waystation-waits``)."""
    waits = delivery.headers.get(HEADER_WAITS, 0)
    if not isinstance(waits, int) or isinstance(waits, bool) or not 0 <= waits < 1_000_000:
        return 0
    return waits


def sent_again(delivery: Delivery) -> bool:
    """Whether this message may have been handled before: the broker redelivered it, or it is a
    copy a worker sent back (a retry, or a wait for a slot). A worker that died after sending
    the copy but before acking the delivery leaves both, so only the log can tell."""
    return (
        delivery.redelivered
        or HEADER_ATTEMPTS in delivery.headers
        or HEADER_WAITS in delivery.headers
    )
