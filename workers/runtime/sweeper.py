"""The deadline sweeper: every worker records a timeout for each wait past its deadline (G6).

A wait is a peer call, a signal or a timer (``waystation.events.model.PendingCall``); a timer's
deadline is the moment it fires, and ``decide_timeout`` records it as its ok result, so timers of
any length cost a row in the pending-calls projection and nothing else.

Each sweep leases expired pending calls of this deployment with ``FOR UPDATE SKIP LOCKED`` (so
two sweepers never take the same call at once) and records each timeout through the same
read-decide-append path as a reply: whichever of the two is appended first claims the call, and
the version check makes the other one harmless.

Each timeout is recorded in a task of its own: one that waits (its stream is locked by a
resumed handler running in place on this worker, or the log is slow) holds up no other, and the
next sweep does not wait for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from waystation.events import EventStore, ExpiredCall, decide_timeout
from waystation.observability.logs import log_context
from waystation.observability.observer import Observer
from waystation.runtime.publishing import PublishStep
from waystation.runtime.recorder import Cause, Recorder, UnreadableStream

__all__ = ["DeadlineSweeper"]

log = logging.getLogger(__name__)

SWEEP_BATCH = 100
SWEEP_LEASE = 10.0


class DeadlineSweeper:
    def __init__(
        self,
        store: EventStore,
        recorder: Recorder,
        publishing: PublishStep,
        observer: Observer,
        *,
        deployment: str,
        interval: float,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.recorder = recorder
        self.publishing = publishing
        self.observer = observer
        self.deployment = deployment
        self.interval = interval
        self.clock = clock
        self._recording: dict[str, asyncio.Task[None]] = {}
        """Timeouts being recorded, by sub-task (insertion-ordered, so stopping is too)."""

    async def run(self) -> None:
        try:
            while True:
                try:
                    expired = await self.store.claim_expired_calls(
                        limit=SWEEP_BATCH, lease=SWEEP_LEASE, deployment=self.deployment
                    )
                    for call in expired:
                        if call.subtask_id not in self._recording:
                            self._start(call)
                except asyncio.CancelledError:
                    raise
                except Exception as error:
                    log.warning("deadline sweep: %s", error)
                await asyncio.sleep(self.interval)
        finally:
            for task in list(self._recording.values()):
                task.cancel()

    def _start(self, call: ExpiredCall) -> None:
        task = asyncio.get_running_loop().create_task(self._record(call))
        self._recording[call.subtask_id] = task
        task.add_done_callback(lambda _: self._recording.pop(call.subtask_id, None))

    async def _record(self, call: ExpiredCall) -> None:
        try:
            await self.record_timeout(call)
        except UnreadableStream as error:
            # its lease runs out and a (newer) worker's sweep takes it again
            log.warning("deadline sweep: %s", error)
            self.observer.unreadable()
        except Exception as error:
            log.warning("deadline sweep of %s: %s", call.subtask_id, error)

    async def record_timeout(self, call: ExpiredCall) -> None:
        with log_context(task_id=call.task_id, subtask_id=call.subtask_id):
            with self.publishing.collecting() as committed:
                applied = await self.recorder.append_decision(
                    call.task_id,
                    # on the database's clock, which decided the call expired: a worker whose own
                    # clock is behind would otherwise find it not expired, and its lease would hold
                    # the call back from every other sweeper
                    lambda state: decide_timeout(
                        state, call.subtask_id, now=call.now or self.clock()
                    ),
                    key=lambda _: f"timeout:{call.subtask_id}",
                    cause=Cause(message_id=f"deadline:{call.subtask_id}"),
                    step="timeout",
                )
            await self.publishing.publish(committed)
            if not applied.events:
                return
            if call.kind == "timer":
                log.info("timer %s fired", call.subtask_id)
            elif call.kind == "signal":
                log.info("wait %s for a signal timed out", call.subtask_id)
            else:
                log.info("call %s to %s timed out", call.subtask_id, call.agent)
                self.observer.timeout(call.agent)
