"""Publishing what committed events imply (G4): right after the commit, and by the relay after.

A committed append's messages are outbox rows in the same transaction. The worker that committed
them publishes them at once (:meth:`OutboxPublisher.send_committed`) without waiting for their
confirms: the delivery that caused them is acked meanwhile, since the rows already hold them.
Confirmed rows are forgotten in batches. Rows whose writer died, or whose publish failed, become
visible to every worker's relay after ``outbox_delay`` and are published from there; messages
carry deterministic ids, so a receiver recognises the copy it may get twice.

Each row's fate is its own (the broker can say no, ``waystation.brokers.port``): a row whose
connection went is tried again soon; one the broker refused (a full queue that rejects publishes) is
tried again with backoff, counting its refusals in the row; one that can never pass (no queue takes
it, it is too large, it cannot be encoded), or that was refused for ``refused_for`` seconds, is
handed to ``on_undeliverable`` (``waystation.runtime.flows.undeliverable``: dead-lettered with its
reason, its task answered; a result whose publisher's queue is gone only counted as undelivered)
and then forgotten. No row ever holds up another.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence

from waystation.brokers.port import Broker, BrokerError, PublishRefused, Unroutable, Unsendable
from waystation.events import EventStore, OutboxEntry, OutboxMessage
from waystation.observability.observer import Observer
from waystation.policies import Backoff
from waystation.runtime.settle import to_gone_publisher

__all__ = ["REFUSED_BACKOFF", "OutboxPublisher", "refused_for"]

log = logging.getLogger(__name__)

RELAY_BATCH = 100
RELAY_LEASE = 30.0
FORGET_INTERVAL = 0.2
REFUSED_BACKOFF = Backoff(initial=1.0, factor=2.0, maximum=60.0)
"""The wait before a refused row is tried again, by its number of refusals."""


def refused_for(refusals: int) -> float:
    """Seconds a row's ``refusals`` so far have made it wait (the backoff after each): how long
    the broker has refused it, counted from its first refusal, not from when it was written (a
    row that waited in the outbox for another reason and is then refused once is tried again)."""
    return sum(REFUSED_BACKOFF.delay(n) for n in range(1, refusals + 1))


Undeliverable = Callable[[OutboxMessage, BrokerError], Awaitable[OutboxMessage | None]]


class OutboxPublisher:
    """One worker's publisher of outbox rows: its own commits' at once, everyone's stragglers
    later (the relay)."""

    def __init__(
        self,
        broker: Broker,
        store: EventStore,
        observer: Observer,
        *,
        poll_interval: float,
        deployment: str | None = None,
        on_undeliverable: Undeliverable | None = None,
        refused_for: float = 600.0,
    ) -> None:
        self.broker = broker
        self.store = store
        self.observer = observer
        self.poll_interval = poll_interval
        self.deployment = deployment
        """The relay takes only rows its deployment (queue prefix) wrote."""
        self.on_undeliverable = on_undeliverable
        """Acts on a committed message the broker will not take (dead-letters it, answers its
        task); its row is forgotten once it returned, else a relay meets it again later. What it
        returns (a result's error answer) takes the message's place in the row, tried anew."""
        self.refused_for = refused_for
        """Seconds a row the broker keeps refusing is tried before it is undeliverable."""
        self._publishing: set[asyncio.Task[None]] = set()
        self._published: list[int] = []
        self._have_published = asyncio.Event()

    # ---- a commit's own messages ----------------------------------------------------------------

    def send_committed(self, outbox_ids: Sequence[int], messages: Sequence[OutboxMessage]) -> None:
        """Publish the messages of rows that just committed; confirmed rows are forgotten, the
        rest the relay publishes after ``outbox_delay``."""
        publishing = asyncio.get_running_loop().create_task(
            self._publish_committed(outbox_ids, messages)
        )
        self._publishing.add(publishing)
        publishing.add_done_callback(self._publishing.discard)

    async def _publish_committed(
        self, outbox_ids: Sequence[int], messages: Sequence[OutboxMessage]
    ) -> None:
        rows = [OutboxEntry(i, m) for i, m in zip(outbox_ids, messages, strict=True)]
        try:
            errors = await self.broker.publish_all(messages)
            await self._after(rows, errors, relaying=False)
        except Exception as failure:  # the relay publishes them after outbox_delay
            log.warning("publishing after a commit failed (%s); the outbox relay will", failure)

    @property
    def pending(self) -> int:
        """Publishes of committed rows still waiting for their confirms."""
        return len(self._publishing)

    async def stop(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for pending confirms, then forget what was confirmed."""
        if self._publishing:
            # their frames are sent; their confirms let the rows be forgotten now rather than
            # republished by another worker's relay
            await asyncio.wait(set(self._publishing), timeout=grace)
        for task in list(self._publishing):
            task.cancel()
        for task in list(self._publishing):
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        try:
            await self.flush_published()
        except Exception as error:
            log.warning("could not forget published outbox rows: %s", error)

    # ---- the relay, and forgetting published rows -------------------------------------------

    async def relay(self) -> None:
        """Publish outbox rows whose writer did not (it died, or its publish failed)."""
        while True:
            try:
                entries = await self.store.claim_outbox(
                    limit=RELAY_BATCH, lease=RELAY_LEASE, deployment=self.deployment
                )
                if entries:
                    errors = await self.broker.publish_all([e.message for e in entries])
                    published = await self._after(entries, errors, relaying=True)
                    self.observer.relayed(published)
                    if published:
                        log.info("outbox relay published %d message(s)", published)
                    if len(entries) == RELAY_BATCH:
                        continue
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("outbox relay: %s", error)
            await asyncio.sleep(self.poll_interval)

    async def _after(
        self, rows: Sequence[OutboxEntry], errors: Sequence[BrokerError | None], *, relaying: bool
    ) -> int:
        """Each row's fate once its publish is done (see the module); how many were published.
        ``relaying``: the rows are the relay's (leased); else a commit's own, which the relay
        takes after ``outbox_delay`` when they are not forgotten."""
        published = 0
        again: list[int] = []
        refused: defaultdict[tuple[float, str], list[int]] = defaultdict(list)
        for row, error in zip(rows, errors, strict=True):
            if error is None:
                published += 1
                self._forget(row.id)
            elif isinstance(error, (Unroutable, Unsendable)):
                await self._undeliverable(row, error)
            elif isinstance(error, PublishRefused):
                self.observer.refused(error.reason)
                if refused_for(row.refusals) >= self.refused_for:
                    await self._undeliverable(row, error)
                else:
                    delay = REFUSED_BACKOFF.delay(row.refusals + 1)
                    log.warning(
                        "outbox: the broker refused %s (%s); trying again in %.0fs",
                        row.message.message_id,
                        error.detail,
                        delay,
                    )
                    refused[(delay, error.detail[:300])].append(row.id)
            elif relaying:
                again.append(row.id)  # its connection went: soon, not after its lease
        for (delay, detail), ids in refused.items():
            await self.store.retry_outbox(ids, delay, refused=detail)
        if again:
            log.warning("outbox relay: %d not published yet; trying again", len(again))
            await self.store.retry_outbox(again, self.poll_interval)
        return published

    async def _undeliverable(self, row: OutboxEntry, error: BrokerError) -> None:
        """The broker will not take ``row``'s message: act on it, then forget the row (if acting
        failed, its lease runs out and a relay meets it again)."""
        message = row.message
        if to_gone_publisher(message, error):
            # a result whose publisher did not wait: on_undeliverable counts it, not a fault
            log.debug("result %s: its publisher's queue is gone", message.message_id)
        else:
            log.error(
                "message %s to %r is undeliverable: %s",
                message.message_id,
                message.routing_key,
                error,
            )
            if isinstance(error, Unroutable):
                self.observer.count("unroutable")
        instead: OutboxMessage | None = None
        if self.on_undeliverable is not None:
            try:
                instead = await self.on_undeliverable(message, error)
                if instead is not None:
                    await self.store.replace_outbox(row.id, instead)
                    await self.store.retry_outbox([row.id], 0)
            except Exception as failure:
                log.warning("message %s: could not act on it yet (%s)", message.message_id, failure)
                return
        if instead is None:
            self._forget(row.id)

    def _forget(self, outbox_id: int) -> None:
        self._published.append(outbox_id)
        self._have_published.set()

    async def forget_published(self) -> None:
        """Delete confirmed rows, a batch at a time (waking only when there are some)."""
        while True:
            await self._have_published.wait()
            await asyncio.sleep(FORGET_INTERVAL)  # let a batch gather
            self._have_published.clear()
            try:
                await self.flush_published()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("could not forget published outbox rows yet: %s", error)
                self._have_published.set()

    async def flush_published(self) -> None:
        if not self._published:
            return
        ids, self._published = self._published, []
        try:
            await self.store.delete_outbox(ids)
        except BaseException:
            self._published.extend(ids)
            raise
