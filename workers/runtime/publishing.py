"""The publish step: what an append committed goes to the broker once the flow that appended
returns, before its delivery is settled.

An append writes the messages its events imply as outbox rows in the same statement (G4), so the
moment they are committed nothing can lose them; sending them is the pipeline's next step, not
the recorder's. The recorder hands what each append committed to the :class:`Committed` of the
work it belongs to (a delivery, a timeout the sweeper records, an undeliverable row's
consequences), and whoever runs that work sends it with :meth:`PublishStep.publish`:

    with publishing.collecting() as committed:
        verdict = await flow()            # decide, append (maybe more than once)
    await publishing.publish(committed)   # send what committed, without waiting for confirms
    await settler.settle(delivery, verdict)

Sends do not wait for the broker's confirms: the outbox rows already hold the messages, and a
worker that dies before sending leaves them to every worker's relay (``outbox_delay``).
Appending outside a collecting scope is a programming error, raised before anything is written.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Sequence
from dataclasses import dataclass, field

from waystation.events import OutboxMessage
from waystation.runtime.faults import FaultPlan
from waystation.runtime.outbox import OutboxPublisher

__all__ = ["Committed", "PublishStep", "committed_here"]


@dataclass(frozen=True, slots=True)
class _Append:
    step: str
    decisions: int
    """How many decisions it recorded (the fault plan's points count decisions)."""
    outbox_ids: Sequence[int]
    messages: Sequence[OutboxMessage]


@dataclass(slots=True, eq=False)
class Committed:
    """What one piece of work's appends committed, in order, not sent yet."""

    appends: list[_Append] = field(default_factory=list)

    def add(
        self,
        step: str,
        decisions: int,
        outbox_ids: Sequence[int],
        messages: Sequence[OutboxMessage],
    ) -> None:
        self.appends.append(_Append(step, decisions, outbox_ids, messages))


_current: contextvars.ContextVar[Committed | None] = contextvars.ContextVar(
    "waystation_committed", default=None
)


def committed_here() -> Committed:
    """Where the append about to be made hands what it commits: the collecting scope of the
    work it belongs to. Raises before anything is written when there is none."""
    found = _current.get()
    if found is None:
        raise RuntimeError(
            "an append outside PublishStep.collecting(): its messages would wait for the relay"
        )
    return found


class _Collecting:
    """:meth:`PublishStep.collecting`'s scope (a class, not a generator: it is entered once per
    delivery)."""

    __slots__ = ("committed", "token")

    def __init__(self) -> None:
        self.committed = Committed()

    def __enter__(self) -> Committed:
        self.token = _current.set(self.committed)
        return self.committed

    def __exit__(self, *_: object) -> None:
        _current.reset(self.token)


class PublishStep:
    """Sends what a piece of work committed, through this worker's outbox publisher."""

    def __init__(self, outbox: OutboxPublisher, faults: FaultPlan) -> None:
        self.outbox = outbox
        self.faults = faults

    def collecting(self) -> _Collecting:
        """A scope (``with``) whose appends hand their committed messages to the
        :class:`Committed` it yields. A flow that raises leaves them to the relay (they are
        committed)."""
        return _Collecting()

    async def publish(self, committed: Committed) -> None:
        """Send the committed messages (the caller may skip the call when ``committed.appends``
        is empty: there is nothing to do) (their confirms arrive while the delivery is settled and
        the next one handled), then pass the fault plan's ``{step}.published`` points."""
        sent = False
        for append in committed.appends:
            if append.messages:
                self.outbox.send_committed(append.outbox_ids, append.messages)
                sent = True
        if sent:
            await asyncio.sleep(0)  # let them hand their frames to the connection first
        for append in committed.appends:
            for _ in range(append.decisions):
                self.faults.hit(f"{append.step}.published")
