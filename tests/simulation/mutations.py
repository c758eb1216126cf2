"""Each defect of issue 11 put back, one at a time, to check that the simulation catches it.

A mutation undoes one fix by patching the code that made it (nothing else changes), for as long
as the ``mutated`` block runs. ``scripts/simulate --mutation NAME`` runs seeds with it; the test
``test_the_simulation_catches_each_defect_put_back`` requires every one to be caught.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import events.task
import workers.flows.base
import workers.recorder
import workers.settle
import workers.sweeper
from events import ExpiredCall, OutboxMessage, decide_timeout
from workers.broker import Delivery
from workers.recorder import Cause
from workers.settle import Settled, requeue

__all__ = ["MUTATIONS", "mutated"]

Patch = tuple[Any, str, Any]


def _old_attempt_of(delivery: Delivery) -> int:
    """Before defect i was fixed: the broker's ``x-delivery-count`` alone."""
    count = delivery.headers.get("x-delivery-count", 0)
    return count + 1 if isinstance(count, int) and count >= 0 else 1


def _old_retry(failed_runs: int) -> Settled:
    return requeue()


async def _answer_by_plain_publish(self: workers.settle.Settler, message: OutboxMessage) -> None:
    await self.broker.publish(message)


async def _tell_nobody(*_: Any) -> None:
    return None


async def _no_retry_through_outages(
    self: workers.recorder.Recorder, operation: Callable[[], Awaitable[Any]]
) -> Any:
    return await operation()


async def _sequential_sweep(self: workers.sweeper.DeadlineSweeper) -> None:
    """The sweeper before defect k was fixed: one timeout after the other, each waiting for
    its stream's lock."""
    while True:
        try:
            expired = await self.store.claim_expired_calls(
                limit=workers.sweeper.SWEEP_BATCH,
                lease=workers.sweeper.SWEEP_LEASE,
                deployment=self.deployment,
            )
            for call in expired:
                await self.record_timeout(call)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            logging.getLogger(__name__).warning("deadline sweep: %s", error)
        await asyncio.sleep(self.interval)


async def _timeout_on_the_workers_clock(
    self: workers.sweeper.DeadlineSweeper, call: ExpiredCall
) -> None:
    """Before defect k was fixed: the timeout decided on the sweeping worker's own clock."""
    await self.recorder.append_decision(
        call.task_id,
        lambda state: decide_timeout(state, call.subtask_id, now=self.clock()),
        key=lambda _: f"timeout:{call.subtask_id}",
        cause=Cause(message_id=f"deadline:{call.subtask_id}"),
        step="timeout",
    )


MUTATIONS: dict[str, list[Patch]] = {
    # a: an outcome the log cannot store reached the commit
    "a-unstorable-outcome": [(events.task, "_require_storable", lambda value, what: None)],
    # b: a cancel before a task's first run was recorded left its publisher unanswered
    "b-cancel-before-first-run": [
        (workers.flows.base.Flows, "answer_cancelled_before_start", _tell_nobody)
    ],
    # e: a handler ran in place on a stale copy of its stream
    "e-stale-cache": [(workers.recorder, "resumes", lambda events: False)],
    # f: an answer to a queue that is gone failed the flow, which re-ran the handler
    "f-unroutable-answer": [(workers.settle.Settler, "answer", _answer_by_plain_publish)],
    # i: attempts counted by the broker's x-delivery-count, retries by requeueing
    "i-broker-counting": [
        (workers.flows.base, "retry", _old_retry),
        (workers.flows.base, "attempt_of", _old_attempt_of),
        (workers.settle, "attempt_of", _old_attempt_of),
    ],
    # k: an outage of the log re-ran the whole flow, its handler included
    "k-outage-reruns-handler": [
        (workers.recorder.Recorder, "_through_outages", _no_retry_through_outages)
    ],
    # k: a timeout decided on the worker's clock, which may be behind the database's
    "k-worker-clock-timeouts": [
        (workers.sweeper.DeadlineSweeper, "record_timeout", _timeout_on_the_workers_clock)
    ],
    # k: the sweeper waited on each stream's lock in turn
    "k-sequential-sweeper": [(workers.sweeper.DeadlineSweeper, "run", _sequential_sweep)],
}


@contextlib.contextmanager
def mutated(name: str | None) -> Iterator[None]:
    """Apply mutation ``name`` (None: none) for the duration of the block."""
    if name is None:
        yield
        return
    saved = [
        (owner, attribute, getattr(owner, attribute)) for owner, attribute, _ in MUTATIONS[name]
    ]
    for owner, attribute, replacement in MUTATIONS[name]:
        setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        for owner, attribute, original in saved:
            setattr(owner, attribute, original)
