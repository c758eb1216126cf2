"""The worker: consumes an app's queues, records every outcome, then settles the message.

Every delivery goes through the same four steps (docs/internals.md): **decide** (pure, in
``waystation.events.task``), **append** (one statement: the events and the outbox rows they imply,
see ``waystation.runtime.recorder``), **publish** (what the appends committed, once the flow
returns: ``waystation.runtime.publishing``), then **settle** (``waystation.runtime.settle``, the
one place that acks, requeues or dead-letters, and only after the outcome is durable: G1). What
each message kind does is its flow (``waystation.runtime.flows``). Peer requests exist only as
outbox rows of a committed pause until they are published, so no reply can overtake its
checkpoint (G5); a worker that dies after the commit leaves the rows to the relay of any other
worker (G4).

Every worker also sweeps calls past their deadline (G6, ``waystation.runtime.sweeper``) and relays
unpublished outbox rows. A message that cannot be used is dead-lettered with its reason (G9,
``waystation.protocol.intake``). The broker is reached only through its port
(``waystation.brokers.port``). A run of an agent with pool limits (``concurrency``, ``rate``) first
takes its slots, and its task waits in the broker while they are full
(``waystation.runtime.limits``).

Why one module of some 430 lines: it is the worker's lifecycle and its delivery loop (start,
consume, inspect, dispatch, publish, settle, stop), which a reader follows in one place; every
step it calls lives in its own module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from waystation.agent import (
    AgentSpec,
    App,
    Interceptor,
    TaskObserver,
    checked_interceptors,
    checked_observers,
)
from waystation.brokers.amqp.topology import amqp_user_of
from waystation.brokers.port import Broker, BrokerError, BrokerUnavailable, Delivery
from waystation.events import EventStore, OutboxMessage, StoreUnavailable, parse_subtask_id
from waystation.events.codec import dumps
from waystation.observability import tracing
from waystation.observability.logs import log_context
from waystation.observability.metrics import Health, Metrics
from waystation.observability.observer import Observer, WorkerStats
from waystation.protocol.intake import Rejection, inspect
from waystation.protocol.wire import TYPE_RESULT, TYPE_RESUME, TYPE_TASK, Names, trace_id_of
from waystation.runtime.faults import FaultPlan
from waystation.runtime.flows import Steps, dispatch, kind_label
from waystation.runtime.flows.reply import handle_unstorable_reply
from waystation.runtime.flows.undeliverable import handle_undeliverable
from waystation.runtime.limits import PoolLimits
from waystation.runtime.outages import Outages
from waystation.runtime.outbox import OutboxPublisher
from waystation.runtime.publishing import PublishStep
from waystation.runtime.recorder import Recorder, UnreadableStream
from waystation.runtime.routing import ReplyRoutes
from waystation.runtime.settle import Settler
from waystation.runtime.sweeper import DeadlineSweeper
from waystation.runtime.verdicts import Disposition, Verdict, attempt_of, dead, requeue
from waystation.settings import Settings
from waystation.slots import SlotLeases

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

__all__ = ["Worker", "WorkerStats"]

log = logging.getLogger(__name__)


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as out:
        out.write(data)


class Worker:
    """One worker instance: every agent of ``app``, one competing consumer per queue.

    It is given the ports it works through and builds none of them
    (``waystation.runtime.compose`` builds a production one): ``store``, the event log;
    ``broker``, the broker; ``slots``, where the pool keeps the slots of its agents'
    ``concurrency`` and ``rate`` (``waystation.slots``), needed only when an agent declares one,
    and shared by every worker of the pool (without it no reply home is claimed);
    ``observer``, what the pipeline reports its counters and timings to (by default one on
    ``metrics``). ``tracer_provider`` is the application's OpenTelemetry provider for the spans
    of its tasks; by default the global one the application set, if any
    (``waystation.observability.tracing.provider``). ``interceptors`` wrap every handler run
    after the app's own (``App(interceptors=...)``, ``waystation.agent.Interceptor``), and
    ``observers`` are told of every failed handler run after the app's own
    (``App(observers=...)``, ``waystation.agent.TaskObserver``).
    """

    def __init__(
        self,
        app: App,
        settings: Settings,
        store: EventStore,
        *,
        broker: Broker,
        slots: SlotLeases | None = None,
        observer: Observer | None = None,
        metrics: Metrics | None = None,
        faults: FaultPlan | None = None,
        clock: Callable[[], float] = time.time,
        tracer_provider: TracerProvider | None = None,
        interceptors: Sequence[Interceptor] = (),
        observers: Sequence[TaskObserver] = (),
    ) -> None:
        self.app = app
        self.tracer_provider = tracer_provider
        self.settings = settings
        self.store = store
        self.names = Names(settings.queue_prefix, settings.reply_shards)
        self.broker = broker
        self.observer = observer or Observer(metrics)
        self.observer.watch(app.observers + checked_observers(observers))
        self.observer.in_flight(lambda: self._inflight)
        faults = faults or FaultPlan(settings.fault_point, settings.fault_after)
        self.outbox = OutboxPublisher(
            self.broker,
            store,
            self.observer,
            poll_interval=settings.outbox_poll_interval,
            deployment=self.names.prefix,
            on_undeliverable=self._undeliverable,
            refused_for=settings.refused_retry_seconds,
        )
        self.publishing = PublishStep(self.outbox, faults)
        self.routes = ReplyRoutes(
            self.names,
            settings.worker_id,
            app.agents,
            slots=slots,
            lease_seconds=settings.slot_lease_seconds,
        )
        self.recorder = Recorder(
            store,
            self.names,
            self.observer,
            worker_id=settings.worker_id,
            clock=clock,
            outbox_delay=settings.outbox_delay,
            faults=faults,
            stopping=lambda: self._stopping,
            cache_bytes=settings.stream_cache_bytes,
            cache_seconds=settings.stream_cache_seconds,
            gather_seconds=settings.reply_gather_ms / 1000,
            gather_limit=settings.concurrency,  # each queue's prefetch
            reply_to=self.routes.reply_to,
        )
        self.settler = Settler(
            self.broker,
            self.names,
            self.observer,
            settings.worker_id,
            amqp_user=amqp_user_of(settings.amqp_url),
            clock=clock,
        )
        self.limits = self._pool_limits(slots)
        # plain `def` handlers: at most as many at once as the worker takes messages per queue
        self.threads = ThreadPoolExecutor(
            max_workers=settings.concurrency, thread_name_prefix="waystation-handler"
        )
        self.steps = Steps(
            app,
            settings,
            self.names,
            self.broker,
            self.recorder,
            self.observer,
            clock,
            faults,
            self.settler,
            self.publishing,
            self.threads,
            self.limits,
            app.interceptors + checked_interceptors(interceptors),
        )
        self.sweeper = DeadlineSweeper(
            store,
            self.recorder,
            self.publishing,
            self.observer,
            deployment=self.names.prefix,
            interval=settings.sweep_interval,
            clock=clock,
        )
        self._background: list[asyncio.Task[None]] = []
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._started = False
        self._stopping = False

    def _pool_limits(self, slots: SlotLeases | None) -> PoolLimits | None:
        """The worker's part in the pool's limits; None when no agent of the app declares one
        (then no slot is ever taken: nothing is paid for them)."""
        if not any(spec.limited for spec in self.app.agents.values()):
            return None
        if slots is None:
            limited = sorted(n for n, spec in self.app.agents.items() if spec.limited)
            raise ValueError(
                f"agents {limited} declare a concurrency or a rate: pass the pool's slots "
                "(Worker(..., slots=...), shared by every worker of the pool)"
            )
        return PoolLimits(
            slots,
            self.observer,
            deployment=self.names.prefix,
            worker_id=self.settings.worker_id,
            lease_seconds=self.settings.slot_lease_seconds,
            wait_max=self.settings.limit_wait_max,
        )

    @property
    def stats(self) -> WorkerStats:
        return self.observer.stats

    @property
    def metrics(self) -> Metrics:
        return self.observer.metrics

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, declare the topology, start consuming, sweeping and relaying."""
        tracing.configure(self.tracer_provider)
        await self.broker.connect()
        await self.broker.declare(self.names, self.app.agents)
        await self.routes.claim_homes()
        for name, spec in self.app.agents.items():
            queues = [
                (self.names.tasks(name), "tasks", 0),
                (self.names.replies(name), "replies", 0),
            ]
            queues += [
                (self.names.reply_shard(name, shard), "replies", self.routes.priority(name, shard))
                for shard in range(self.names.reply_shards)
            ]
            for queue, kind, priority in queues:

                async def on_delivery(
                    delivery: Delivery, spec: AgentSpec = spec, kind: str = kind
                ) -> None:
                    await self._on_delivery(delivery, spec, kind)

                await self.broker.consume(
                    queue, on_delivery, prefetch=self.settings.concurrency, priority=priority
                )
        self._started = True
        loop = asyncio.get_running_loop()
        self._background = [
            loop.create_task(self.outbox.relay(), name="outbox-relay"),
            loop.create_task(self.outbox.forget_published(), name="outbox-forget"),
            loop.create_task(self.sweeper.run(), name="deadline-sweeper"),
            loop.create_task(self.routes.keep_claims(), name="reply-homes"),
        ]
        if any(spec.concurrency is not None for spec in self.app.agents.values()):
            assert self.limits is not None
            self._background.append(loop.create_task(self.limits.keep_leases(), name="leases"))
        log.info(
            "worker %s serving %s on %s",
            self.settings.worker_id,
            ", ".join(self.app.agents),
            self.names.prefix,
        )

    async def stop(self) -> None:
        """Stop consuming, let in-flight messages finish within the grace period, close.

        What is still in flight after the grace period is not acked and goes back to its queue
        when the connection closes.
        """
        self._stopping = True
        with contextlib.suppress(Exception):
            await self.broker.cancel_consumers()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=self.settings.shutdown_grace)
        except TimeoutError:
            log.warning(
                "%d messages still in flight after the grace period; they will be redelivered",
                self._inflight,
            )
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.outbox.stop(self.settings.shutdown_grace)
        await self.broker.close()
        await self.routes.give_back()
        if self.limits is not None:
            # runs past the grace period: their messages are back in the queue
            await self.limits.stop()
        # a plain handler still running after the grace period cannot be interrupted: its thread
        # finishes on its own, and its outcome is dropped (the message was not acked)
        self.threads.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(tracing.shutdown)
        if self.settings.stats_file:
            await asyncio.to_thread(
                _write_file, self.settings.stats_file, dumps(self.stats.to_json())
            )

    async def health(self) -> Health:
        """Healthy when consuming with the broker connected and the database answering."""
        broker = self.broker.connected
        try:
            await self.store.outbox_size()
            database = True
        except Exception:
            database = False
        consuming = self.broker.consumers
        if self._stopping:
            state = "stopping"
        elif not self._started or not consuming:
            state = "starting"
        else:
            state = "serving"
        return Health(
            state == "serving" and broker and database,
            {
                "worker_id": self.settings.worker_id,
                "state": state,
                "broker": broker,
                "database": database,
                "consumers": consuming,
                "in_flight": self._inflight,
            },
        )

    async def _undeliverable(
        self, message: OutboxMessage, error: BrokerError
    ) -> OutboxMessage | None:
        """A committed message the broker will not take
        (``waystation.runtime.flows.undeliverable``): its consequences are recorded, then sent."""
        with self.publishing.collecting() as committed:
            instead = await handle_undeliverable(self.steps, message, error)
        await self.publishing.publish(committed)
        return instead

    # ---- every delivery ----------------------------------------------------------------------

    async def _on_delivery(self, delivery: Delivery, spec: AgentSpec, kind: str) -> None:
        delivery = self.settler.received(delivery)
        self._inflight += 1
        self._idle.clear()
        started = time.perf_counter()
        try:
            with log_context(**_context_of(delivery, kind)), tracing.consuming(delivery.headers):
                with self.publishing.collecting() as committed:
                    settled = await self._process(delivery, spec, kind)
                if committed.appends:
                    await self.publishing.publish(committed)
                if settled.disposition is Disposition.ACK:
                    # not shielded (a task per delivery): this task is cancelled only when
                    # its channel closes, and then the broker takes the message back, acked
                    # or not. A send-back or a dead letter publishes a copy first: shielded,
                    # so that what it started finishes
                    await self.settler.settle(delivery, settled)
                else:
                    await asyncio.shield(self.settler.settle(delivery, settled))
                label = kind_label(delivery, kind)
                self.observer.handled(spec.name, label, settled.disposition.value)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug(
                        "%s %s for %s: %s after %.1f ms",
                        label,
                        delivery.message_id,
                        spec.name,
                        settled.disposition.value,
                        (time.perf_counter() - started) * 1000,
                    )
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def _process(self, delivery: Delivery, spec: AgentSpec, kind: str) -> Verdict:
        body = inspect(
            delivery,
            max_body=self.settings.max_message_bytes,
            max_headers=self.settings.max_header_bytes,
        )
        if isinstance(body, Rejection):
            if body.reason == "unstorable" and kind_label(delivery, kind) == TYPE_RESULT:
                why = body
                return await self._retrying(
                    lambda: handle_unstorable_reply(self.steps, delivery, why), delivery, kind
                )
            return Verdict(Disposition.DEAD_LETTER, None, body, kind == "tasks")
        if not _runs_a_handler(delivery, kind) and self.steps.out_of_attempts(delivery):
            # (a task or resume records its failure in its flow, its publisher answered)
            return dead(
                "delivery-limit",
                f"delivered {attempt_of(delivery)} times without being settled",
            )
        return await self._retrying(
            lambda: dispatch(self.steps, delivery, spec, kind, body), delivery, kind
        )

    async def _retrying(
        self, flow: Callable[[], Awaitable[Verdict]], delivery: Delivery, kind: str
    ) -> Verdict:
        """Run ``flow``; when a service it needs is out, wait and run it again (not the
        message's fault: retrying in place does not burn its delivery limit). A commit retries
        its own append (``Recorder.commit``), so a handler that already ran is not run again."""
        outages: Outages | None = None  # made at the first outage: most flows meet none
        while True:
            try:
                return await flow()
            except StoreUnavailable as error:
                if self._stopping:
                    return requeue()
                outages = outages or Outages(self.observer)
                await outages.wait("database", error)
            except BrokerUnavailable as error:
                # the broker connection is being restored
                if self._stopping or not self.broker.settleable(delivery):
                    # its own delivery died with the channel: it is redelivered anyway
                    return requeue()
                outages = outages or Outages(self.observer)
                await outages.wait("broker", error)
            except UnreadableStream as error:
                # a rolling upgrade: leave it to a worker that can read it. Each requeue counts
                # toward the delivery limit, after which it is dead-lettered (replay it once
                # every worker is upgraded)
                log.warning("%s; requeueing it for a newer worker", error)
                self.observer.unreadable()
                await asyncio.sleep(min(0.5 * attempt_of(delivery), 5.0))
                return requeue()
            except Exception:
                log.exception("handling %s %s failed; requeueing", kind, delivery.message_id)
                self.observer.count("processing_errors")
                await asyncio.sleep(min(0.1 * attempt_of(delivery), 2.0))
                return requeue()


def _runs_a_handler(delivery: Delivery, kind: str) -> bool:
    return kind == "tasks" and (delivery.type or TYPE_TASK) in (TYPE_TASK, TYPE_RESUME)


def _context_of(delivery: Delivery, kind: str) -> dict[str, str | None]:
    """What a delivery says about its task before its body is read, for its log lines."""
    correlation = delivery.correlation_id
    subtask: str | None = None
    task: str | None = None
    if correlation:
        with contextlib.suppress(ValueError):
            task, _, _ = parse_subtask_id(correlation)
            subtask = correlation
    if kind == "tasks":
        # a task's id is its message id (a peer request's is its sub-task id); resume and
        # cancel name theirs in the body, and it joins the context when the stream is read
        task = delivery.message_id if (delivery.type or TYPE_TASK) == TYPE_TASK else None
    # a new task without a trace of its own starts one under its id, as its flow decides: named
    # here, its handler's lines print the trace id of its spans too
    untraced = task if kind == "tasks" and task else ""
    trace = trace_id_of(delivery.headers, untraced) or None
    return {"task_id": task, "subtask_id": subtask, "trace_id": trace}
