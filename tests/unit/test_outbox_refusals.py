"""How long the outbox keeps trying a message the broker refuses: ``refused_retry_seconds`` of
refusals, counted from the first refusal, whatever the row's age when it was first refused."""

from __future__ import annotations

import uuid

from waystation.brokers.port import BrokerError, PublishRefused
from waystation.events import GENESIS_HASH, NewEvent, OutboxEntry, OutboxMessage
from waystation.events.memory import InMemoryEventStore
from waystation.observability.observer import Observer
from waystation.runtime.outbox import REFUSED_BACKOFF, OutboxPublisher, refused_for

REFUSED_RETRY = 60.0


async def _outbox() -> tuple[OutboxPublisher, InMemoryEventStore, list[str]]:
    store = InMemoryEventStore()
    given_up: list[str] = []

    async def give_up(message: OutboxMessage, error: BrokerError) -> None:
        given_up.append(message.message_id)

    outbox = OutboxPublisher(
        None,  # type: ignore[arg-type]  # (no publish here: only a publish's outcome)
        store,
        Observer(),
        poll_interval=0.05,
        on_undeliverable=give_up,
        refused_for=REFUSED_RETRY,
    )
    await store.append(
        "t",
        0,
        [NewEvent(uuid.uuid4(), "Probe", {}, {})],
        prev_hash=GENESIS_HASH,
        outbox=[OutboxMessage("m", "q", b"{}")],
        outbox_delay=0,
    )
    return outbox, store, given_up


def _row(refusals: int, age: float) -> OutboxEntry:
    return OutboxEntry(1, OutboxMessage("m", "q", b"{}"), refusals, age)


async def test_a_row_refused_for_the_first_time_is_tried_again_however_old_it_is() -> None:
    """A row that waited in the outbox past the window (its relay was down, or deleting it after
    its publish kept failing) and is then refused once is tried again, not given up on."""
    outbox, store, given_up = await _outbox()
    await outbox._after(
        [_row(0, age=10 * REFUSED_RETRY)], [PublishRefused("m", "nack")], relaying=True
    )
    assert given_up == []
    assert store._outbox[1].refusals == 1


async def test_a_row_refused_for_the_whole_window_is_given_up_on() -> None:
    outbox, _, given_up = await _outbox()
    refusals = next(n for n in range(1, 100) if refused_for(n) >= REFUSED_RETRY)
    await outbox._after([_row(refusals - 1, age=0.0)], [PublishRefused("m", "nack")], relaying=True)
    assert given_up == []  # one refusal short of the window
    await outbox._after([_row(refusals, age=0.0)], [PublishRefused("m", "nack")], relaying=True)
    assert given_up == ["m"]


def test_the_window_counts_the_backoff_after_each_refusal() -> None:
    assert refused_for(0) == 0.0
    assert refused_for(3) == sum(REFUSED_BACKOFF.delay(n) for n in (1, 2, 3)) == 1.0 + 2.0 + 4.0
