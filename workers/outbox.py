"""Publishing what committed events imply (G4): right after the commit, and by the relay after.

A committed append's messages are outbox rows in the same transaction. The worker that committed
them publishes them at once (:meth:`OutboxPublisher.send_committed`) without waiting for their
confirms: the delivery that caused them is acked meanwhile, since the rows already hold them.
Confirmed rows are forgotten in batches. Rows whose writer died, or whose publish failed, become
visible to every worker's relay after ``outbox_delay`` and are published from there; messages
carry deterministic ids, so a receiver recognises the copy it may get twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from events import EventStore, OutboxEntry, OutboxMessage

from .broker import Broker, Unroutable
from .observer import Observer

__all__ = ["OutboxPublisher"]

log = logging.getLogger(__name__)

RELAY_BATCH = 100
RELAY_LEASE = 30.0
FORGET_INTERVAL = 0.2


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
        on_unroutable: Callable[[OutboxMessage], Awaitable[bool]] | None = None,
    ) -> None:
        self.broker = broker
        self.store = store
        self.observer = observer
        self.poll_interval = poll_interval
        self.deployment = deployment
        """The relay takes only rows its deployment (queue prefix) wrote (defect g)."""
        self.on_unroutable = on_unroutable
        """Acts on a committed message no queue takes; True once that is done (durably), and
        only then is its row forgotten (else the relay meets it again later)."""
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
        try:
            errors = await self.broker.publish_all(messages)
        except Exception as failure:  # the relay publishes them after outbox_delay
            log.warning("publishing after a commit failed (%s); the outbox relay will", failure)
            return
        for outbox_id, message, error in zip(outbox_ids, messages, errors, strict=True):
            if error is None:
                self._forget(outbox_id)
            elif isinstance(error, Unroutable):
                if await self._unroutable(message):
                    self._forget(outbox_id)
            else:
                log.warning(
                    "publishing %s failed (%s); the outbox relay will retry",
                    message.message_id,
                    error,
                )

    def _forget(self, outbox_id: int) -> None:
        self._published.append(outbox_id)
        self._have_published.set()

    async def _unroutable(self, message: OutboxMessage) -> bool:
        """No queue takes ``message``: publishing it again cannot help. Say so, and let the
        worker act; True once it has (the row may then be forgotten)."""
        log.error("message %s to %r is unroutable", message.message_id, message.routing_key)
        self.observer.count("unroutable")
        if self.on_unroutable is None:
            return True
        try:
            return await self.on_unroutable(message)
        except Exception as error:
            log.warning("message %s: could not act on it yet (%s)", message.message_id, error)
            return False

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
        unsent: list[OutboxEntry] = []  # publish failed; still leased to us: retry them here
        while True:
            try:
                entries = unsent or await self.store.claim_outbox(
                    limit=RELAY_BATCH, lease=RELAY_LEASE, deployment=self.deployment
                )
                unsent = []
                if entries:
                    errors = await self.broker.publish_all([e.message for e in entries])
                    done = []
                    for entry, error in zip(entries, errors, strict=True):
                        if error is None:
                            done.append(entry.id)
                        elif isinstance(error, Unroutable):
                            if await self._unroutable(entry.message):
                                done.append(entry.id)
                            # else: its lease runs out, and a relay meets it again
                        else:
                            unsent.append(entry)
                    if unsent:
                        log.warning("outbox relay: %d not published yet; retrying", len(unsent))
                    # forgotten like a commit's own rows: a delete that fails is tried again,
                    # instead of the rows going out once more when their lease ends
                    for outbox_id in done:
                        self._forget(outbox_id)
                    self.observer.relayed(len(done))
                    log.info("outbox relay published %d message(s)", len(done))
                    if len(entries) == RELAY_BATCH and not unsent:
                        continue
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("outbox relay: %s", error)
            await asyncio.sleep(self.poll_interval)

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
