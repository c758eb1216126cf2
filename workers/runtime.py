"""The worker: consumes an app's queues, records every outcome, then settles the message.

Every message goes through the same four steps (DESIGN.md §5): **decide** (pure, in
``events.task``), **append** (one statement: the events and the outbox rows they imply),
**publish** (the implied messages; their confirms arrive in the background, since the outbox
already holds them), then **settle**. Handlers never ack;
``_settle`` is the one place that acks, requeues or dead-letters, and it runs only after the
outcome is durable (G1). Peer requests exist only as outbox rows of a committed pause until they
are published, so no reply can overtake its checkpoint (G5); a worker that dies after the commit
leaves the rows to the relay of any other worker (G4).

Redeliveries are recognised, not re-applied: event ids derive from what caused them (the task,
the sub-task, the pause being resumed), so appending a re-run's events finds them already there
and writes nothing (``AppendResult.duplicate``).

What each queue takes (``workers.wire``):

* ``P<agent>``: ``task`` (run the handler), ``resume`` (run it again with the results),
  ``cancel`` (G7);
* ``P<agent>.replies``: ``result`` (a peer's reply), ``progress`` (a peer extends a deadline).

Every worker also sweeps calls past their deadline (G6) and relays unpublished outbox rows (G4).
A message that cannot be used is dead-lettered with its reason (G9, ``workers.intake``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue, AbstractRobustConnection

from events import (
    Complete,
    DomainEvent,
    EventMetadata,
    EventStore,
    ExpiredCall,
    InvalidTransition,
    NewEvent,
    OutboxEntry,
    OutboxMessage,
    Outcome,
    Pause,
    RecordedEvent,
    StoreUnavailable,
    SubtaskClaimed,
    TaskFailed,
    TaskResumed,
    TaskStarted,
    TaskState,
    VersionConflict,
    decide_cancel,
    decide_extension,
    decide_failure,
    decide_outcome,
    decide_reply,
    decide_timeout,
    event_id,
    fold,
    parse_subtask_id,
)
from events.chain import recorded_events
from events.codec import dumps, loads

from . import topology
from .agent import AgentSpec, App, TaskContext
from .faults import FaultPlan
from .intake import Rejection, inspect
from .logs import add_to_context, log_context
from .metrics import Health, Metrics
from .publisher import Publisher
from .settings import Settings
from .wire import (
    HEADER_DETAIL,
    HEADER_PRIOR_ATTEMPTS,
    HEADER_QUEUE,
    HEADER_REASON,
    HEADER_ROOT,
    HEADER_TRACE,
    TYPE_CANCEL,
    TYPE_PROGRESS,
    TYPE_RESULT,
    TYPE_RESUME,
    TYPE_TASK,
    Names,
    ResultEnvelope,
    implied_messages,
    result_message,
    trace_id_of,
)

__all__ = ["Worker", "WorkerStats"]

log = logging.getLogger(__name__)

MAX_CONFLICT_RETRIES = 50


class UnreadableStream(Exception):
    """A task's stream holds events this worker cannot read (a newer version wrote them)."""


class Disposition(enum.Enum):
    ACK = "ack"
    REQUEUE = "requeue"
    DEAD_LETTER = "dead-letter"


@dataclass
class WorkerStats:
    """Counters and the checkpoint latencies a benchmark reads."""

    counters: dict[str, int] = field(default_factory=dict)
    checkpoint_seconds: list[float] = field(default_factory=list)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def to_json(self) -> dict[str, Any]:
        return {"counters": self.counters, "checkpoint_seconds": self.checkpoint_seconds}


class _StreamLocks:
    """One lock per task stream within this worker.

    A parent's replies arrive together; without this, the ones this worker takes race each other
    to the same stream version and all but one conflict and re-read. With it they take turns,
    and conflicts remain only between workers (where the version check settles them).
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, stream_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(stream_id, (asyncio.Lock(), 0))
        self._locks[stream_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[stream_id]
            if users == 1:
                del self._locks[stream_id]
            else:
                self._locks[stream_id] = (lock, users - 1)


class _StreamCache:
    """The streams this worker appended to last, as they were after its append (bounded, LRU).

    The next decision on such a stream (a reply landing on the worker that paused the task, or
    on the one that recorded the previous reply) starts from this copy instead of reading the
    stream again. The copy may be stale, when another worker appended since: then the append,
    which checks the expected version and hash, fails with a conflict and the stream is read.
    An entry is taken out when used, so a failed attempt never sees it again.
    """

    def __init__(self, size: int = 1024) -> None:
        self._size = size
        self._streams: collections.OrderedDict[str, list[RecordedEvent]] = collections.OrderedDict()

    def put(self, stream_id: str, events: list[RecordedEvent], *, finished: bool) -> None:
        self._streams.pop(stream_id, None)
        if finished:
            return  # nothing more is decided on it but late replies, which read it
        self._streams[stream_id] = events
        if len(self._streams) > self._size:
            self._streams.popitem(last=False)

    def take(self, stream_id: str) -> list[RecordedEvent] | None:
        return self._streams.pop(stream_id, None)


@dataclass(frozen=True, slots=True)
class _Settled:
    disposition: Disposition
    checkpoint_started: float | None = None
    """perf_counter() when the handler returned a pause; the checkpoint ends at the ack."""
    rejection: Rejection | None = None
    """Why a dead letter is dead."""
    tell_publisher: bool = False
    """Send the rejection to the message's ``reply_to`` as an error result."""


def _ack(checkpoint_started: float | None = None) -> _Settled:
    return _Settled(Disposition.ACK, checkpoint_started)


def _dead(reason: str, detail: str, *, tell_publisher: bool = False) -> _Settled:
    return _Settled(Disposition.DEAD_LETTER, None, Rejection(reason, detail), tell_publisher)


@dataclass(frozen=True, slots=True)
class _Cause:
    """What made the worker append: recorded as the events' causation and actor."""

    message_id: str | None = None
    amqp_user: str | None = None

    @classmethod
    def of(cls, message: AbstractIncomingMessage) -> _Cause:
        return cls(message.message_id or message.correlation_id, message.user_id)


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as out:
        out.write(data)


def _copy_json(value: Any) -> Any:
    return loads(dumps(value))


def _error_of(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error)[:2000]}


def _resume_context(spec: AgentSpec, state: TaskState) -> TaskContext:
    """What the handler of a resumed task sees: its input, saved state and the pause's results."""
    return TaskContext(
        task_id=state.task_id,
        agent=spec.name,
        input=_copy_json(state.input),
        # a private copy: mutating it persists nothing and cannot disturb the delta
        state=MappingProxyType(_copy_json(dict(state.state))),
        pause=state.pause,
        results=tuple(state.results_of_pause()),
        trace_id=state.trace_id,
        root_task_id=state.root_id,
    )


def _attempt(message: AbstractIncomingMessage) -> int:
    """Which attempt this delivery is: quorum queues count redeliveries, and a resume message
    counts the runs that failed in place before it was sent."""
    headers = message.headers or {}
    count = headers.get("x-delivery-count", 0)
    prior = headers.get(HEADER_PRIOR_ATTEMPTS, 0) if message.type == TYPE_RESUME else 0
    attempt = count + 1 if isinstance(count, int) and count >= 0 else 1
    return attempt + (prior if isinstance(prior, int) and 0 <= prior < 100 else 0)


def _with_prior_attempts(message: OutboxMessage, attempts: int) -> OutboxMessage:
    if message.properties.get("type") != TYPE_RESUME:
        return message
    headers = {**(message.properties.get("headers") or {}), HEADER_PRIOR_ATTEMPTS: attempts}
    return replace(message, properties={**message.properties, "headers": headers})


class Worker:
    """One worker instance: every agent of ``app``, one competing consumer per queue."""

    def __init__(
        self,
        app: App,
        settings: Settings,
        store: EventStore,
        *,
        faults: FaultPlan | None = None,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
    ) -> None:
        self.app = app
        self.settings = settings
        self.store = store
        self.names = Names(settings.queue_prefix)
        self.stats = WorkerStats()
        self.metrics = metrics or Metrics()
        self._faults = faults or FaultPlan(settings.fault_point, settings.fault_after)
        self._clock = clock
        self._connection: AbstractRobustConnection | None = None
        self._publisher: Publisher | None = None
        self._consumers: list[tuple[AbstractQueue, str]] = []
        self._background: list[asyncio.Task[None]] = []
        self._spawned: set[asyncio.Task[Any]] = set()
        self._publishing: set[asyncio.Task[None]] = set()
        """Publishes of committed outbox rows awaiting their confirms."""
        self._published_outbox: list[int] = []
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self._streams = _StreamLocks()
        self._cache = _StreamCache()

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, declare the topology, start consuming, sweeping and relaying."""
        self._connection = await aio_pika.connect_robust(
            self.settings.amqp_url,
            client_properties={"connection_name": f"waystation worker {self.settings.worker_id}"},
        )
        publish_channel = await self._connection.channel(
            publisher_confirms=True, on_return_raises=True
        )
        self._publisher = Publisher(publish_channel)
        await topology.declare(publish_channel, self.names, self.app.agents)
        await topology.apply_policy(
            self.names,
            self.settings.delivery_limit,
            self.settings.broker_policy,
            vhost=topology.vhost_of(self.settings.amqp_url),
        )
        consume_channel = await self._connection.channel()
        await consume_channel.set_qos(prefetch_count=self.settings.concurrency)
        for name, spec in self.app.agents.items():
            for queue_name, kind in (
                (self.names.tasks(name), "tasks"),
                (self.names.replies(name), "replies"),
            ):
                queue = await consume_channel.get_queue(queue_name, ensure=True)

                async def on_message(
                    message: AbstractIncomingMessage, spec: AgentSpec = spec, kind: str = kind
                ) -> None:
                    await self._on_message(message, spec, kind)

                tag = await queue.consume(on_message)
                self._consumers.append((queue, tag))
        self._background = [
            asyncio.create_task(self._relay_outbox(), name="outbox-relay"),
            asyncio.create_task(self._forget_published(), name="outbox-forget"),
            asyncio.create_task(self._sweep(), name="deadline-sweeper"),
        ]
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
        for queue, tag in self._consumers:
            with contextlib.suppress(Exception):
                await queue.cancel(tag)
        self._consumers.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=self.settings.shutdown_grace)
        except TimeoutError:
            log.warning(
                "%d messages still in flight after the grace period; they will be redelivered",
                self._inflight,
            )
        if self._publishing:
            # their frames are sent; their confirms let the rows be forgotten now rather than
            # republished by another worker's relay
            await asyncio.wait(set(self._publishing), timeout=self.settings.shutdown_grace)
        for task in [*self._background, *self._spawned, *self._publishing]:
            task.cancel()
        for task in [*self._background, *self._spawned, *self._publishing]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await self._flush_published()
        if self._connection is not None:
            await self._connection.close()
        if self.settings.stats_file:
            await asyncio.to_thread(
                _write_file, self.settings.stats_file, dumps(self.stats.to_json())
            )

    async def health(self) -> Health:
        """Healthy when consuming with the broker connected and the database answering."""
        connection = self._connection
        broker = connection is not None and connection.connected.is_set()
        try:
            await self.store.outbox_size()
            database = True
        except Exception:
            database = False
        consuming = len(self._consumers)
        if self._stopping:
            state = "stopping"
        elif connection is None or not consuming:
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

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    # ---- the one place that settles a message ------------------------------------------------

    async def _on_message(
        self, message: AbstractIncomingMessage, spec: AgentSpec, kind: str
    ) -> None:
        self._inflight += 1
        self.metrics.in_flight.inc()
        self._idle.clear()
        started = time.perf_counter()
        try:
            with log_context(**_context_of(message, kind)):
                settled = await self._process(message, spec, kind)
                await asyncio.shield(self._settle(message, settled))
                label = _kind_label(message, kind)
                self.metrics.messages.labels(spec.name, label, settled.disposition.value).inc()
                log.debug(
                    "%s %s for %s: %s after %.1f ms",
                    label,
                    message.message_id,
                    spec.name,
                    settled.disposition.value,
                    (time.perf_counter() - started) * 1000,
                )
        finally:
            self._inflight -= 1
            self.metrics.in_flight.dec()
            if self._inflight == 0:
                self._idle.set()

    async def _process(
        self, message: AbstractIncomingMessage, spec: AgentSpec, kind: str
    ) -> _Settled:
        body = inspect(
            message,
            max_body=self.settings.max_message_bytes,
            max_headers=self.settings.max_header_bytes,
        )
        if isinstance(body, Rejection):
            return _Settled(Disposition.DEAD_LETTER, None, body, kind == "tasks")
        backoff = 0.1
        while True:
            try:
                return await self._dispatch(message, spec, kind, body)
            except StoreUnavailable as error:
                # not the message's fault: retry in place rather than burn its delivery limit
                if self._stopping:
                    return _Settled(Disposition.REQUEUE)
                log.warning("event log unavailable (%s); retrying in %.1fs", error, backoff)
                self.stats.count("store_unavailable")
                self.metrics.outages.labels("database").inc()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except (
                aiormq.exceptions.ChannelInvalidStateError,
                aiormq.exceptions.AMQPConnectionError,
                ConnectionError,
            ) as error:
                # the broker connection is being restored: not the message's fault either
                if self._stopping or message.channel.is_closed:
                    # its own delivery died with the channel: it is redelivered anyway
                    return _Settled(Disposition.REQUEUE)
                log.warning("broker unavailable (%s); retrying in %.1fs", error, backoff)
                self.stats.count("broker_unavailable")
                self.metrics.outages.labels("broker").inc()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except UnreadableStream as error:
                # a rolling upgrade: leave it to a worker that can read it. Each requeue counts
                # toward the queue's delivery limit, after which the broker dead-letters it
                # (replay it once every worker is upgraded)
                log.warning("%s; requeueing it for a newer worker", error)
                self.metrics.unreadable.inc()
                await asyncio.sleep(min(0.5 * _attempt(message), 5.0))
                return _Settled(Disposition.REQUEUE)
            except Exception:
                log.exception("handling %s %s failed; requeueing", kind, message.message_id)
                self.stats.count("processing_errors")
                await asyncio.sleep(min(0.1 * _attempt(message), 2.0))
                return _Settled(Disposition.REQUEUE)

    async def _dispatch(
        self, message: AbstractIncomingMessage, spec: AgentSpec, kind: str, body: Any
    ) -> _Settled:
        if kind == "replies":
            message_type = message.type or TYPE_RESULT
            if message_type == TYPE_RESULT:
                return await self._handle_reply(message, body)
            if message_type == TYPE_PROGRESS:
                return await self._handle_progress(message, body)
        else:
            message_type = message.type or TYPE_TASK
            if message_type == TYPE_TASK:
                return await self._handle_task(message, spec, body)
            if message_type == TYPE_RESUME:
                return await self._handle_resume(message, spec, body)
            if message_type == TYPE_CANCEL:
                return await self._handle_cancel(message, spec, body)
        # a publisher that set reply_to on the task queue asked for an answer (G9)
        return _dead(
            "unknown-message-type",
            f"type {message_type!r} on {kind} queue",
            tell_publisher=kind == "tasks",
        )

    async def _settle(self, message: AbstractIncomingMessage, settled: _Settled) -> None:
        try:
            if settled.disposition is Disposition.ACK:
                await message.ack()
            elif settled.disposition is Disposition.REQUEUE:
                await message.nack(requeue=True)
            elif not await self._dead_letter(message, settled):
                await message.nack(requeue=True)
                return
            else:
                await message.ack()
        except (
            aiormq.exceptions.AMQPError,
            aio_pika.exceptions.ChannelInvalidStateError,
            ConnectionError,
        ) as error:
            # the channel is gone: the broker redelivers, and the redelivery is recognised (G1)
            log.warning(
                "could not %s message %s: %s",
                settled.disposition.value,
                message.message_id,
                error,
            )
            return
        self.stats.count(f"settled_{settled.disposition.value}")
        if settled.checkpoint_started is not None:
            seconds = time.perf_counter() - settled.checkpoint_started
            self.stats.checkpoint_seconds.append(seconds)
            self.metrics.checkpoint.observe(seconds)

    async def _dead_letter(self, message: AbstractIncomingMessage, settled: _Settled) -> bool:
        """Publish ``message`` to the dead-letter exchange with its reason; False if that failed."""
        rejection = settled.rejection or Rejection("rejected", "")
        queue = message.routing_key or ""
        log.error(
            "dead-lettering message %s from %s: %s (%s)",
            message.message_id,
            queue,
            rejection.reason,
            rejection.detail,
        )
        self.stats.count(f"dead_letter.{rejection.reason}")
        self.metrics.dead_letters.labels(rejection.reason).inc()
        headers: dict[str, Any] = dict(message.headers or {})
        headers.update(
            {
                HEADER_REASON: rejection.reason,
                HEADER_DETAIL: rejection.detail[:1000],
                HEADER_QUEUE: queue,
                "x-waystation-worker": self.settings.worker_id,
            }
        )
        copy = OutboxMessage(
            message_id=message.message_id or "",
            routing_key=queue,
            body=message.body,
            properties={
                "type": message.type,
                "correlation_id": message.correlation_id,
                "reply_to": message.reply_to,
                "content_type": message.content_type,
                "headers": headers,
            },
            exchange=self.names.dead_letter_exchange,
        )
        publisher = self._require_publisher()
        try:
            await publisher.publish(copy)
        except Exception as error:
            log.warning("could not dead-letter %s (%s); requeueing it", message.message_id, error)
            return False
        if settled.tell_publisher and message.reply_to:
            task_id = message.message_id or str(uuid.uuid4())
            envelope = ResultEnvelope(
                "error", error={"type": rejection.reason, "message": rejection.detail}
            )
            with contextlib.suppress(Exception):
                await publisher.publish(
                    result_message(task_id, message.reply_to, message.correlation_id, envelope)
                )
        return True

    # ---- tasks: run, resume, fail, cancel ---------------------------------------------------

    async def _run_handler(self, spec: AgentSpec, context: TaskContext) -> Outcome:
        outcome = await spec.handler(context)
        if not isinstance(outcome, (Complete, Pause)):
            raise InvalidTransition(
                f"handler {spec.name!r} returned {type(outcome).__name__}, not Complete or Pause"
            )
        return outcome

    async def _handle_task(
        self, message: AbstractIncomingMessage, spec: AgentSpec, payload: Any
    ) -> _Settled:
        task_id = message.message_id
        if not task_id:
            return _dead(
                "missing-property", "a task needs a message_id (its task id)", tell_publisher=True
            )
        if message.redelivered and (await self._load(task_id)).exists:
            log.info("task %s redelivered after it was recorded; acking", task_id)
            self.stats.count("redelivered_recognised")
            self.metrics.duplicates.inc()
            return _ack()
        headers = message.headers or {}
        trace_id = trace_id_of(headers, task_id)
        root_id = str(headers.get(HEADER_ROOT) or task_id)
        state = TaskState(
            task_id=task_id,
            agent=spec.name,
            input=payload,
            reply_to=message.reply_to,
            correlation_id=message.correlation_id,
            trace_id=trace_id,
            root_id=root_id,
        )
        start = TaskStarted(
            agent=spec.name,
            input=payload,
            reply_to=message.reply_to,
            correlation_id=message.correlation_id,
        )
        context = TaskContext(
            task_id=task_id, agent=spec.name, input=payload, trace_id=trace_id, root_task_id=root_id
        )
        try:
            outcome = await self._run_handler(spec, context)
            returned_at = time.perf_counter()
            events = decide_outcome(
                state,
                outcome,
                now=self._clock(),
                default_timeout=self._default_timeout(spec),
                start=start,
                record_completion=self.settings.audit_all_tasks,
                max_timeout=self.settings.max_call_duration,
            )
        except Exception as error:
            return await self._handler_failed(message, state, error, start=start)
        if not events:
            # completed without peers: nothing to record (G10); the answer is the only effect
            assert isinstance(outcome, Complete)
            if message.reply_to:
                envelope = ResultEnvelope("ok", result=outcome.result, task_id=task_id)
                await self._require_publisher().publish(
                    result_message(
                        task_id,
                        message.reply_to,
                        message.correlation_id,
                        envelope,
                        {HEADER_ROOT: root_id, HEADER_TRACE: trace_id},
                    )
                )
            self.stats.count("tasks_completed_unrecorded")
            return _ack()
        try:
            await self._commit(state, events, "run", _Cause.of(message), step="pause", history=[])
        except VersionConflict:
            return await self._task_already_recorded(message, task_id)
        return _ack(returned_at if isinstance(outcome, Pause) else None)

    async def _task_already_recorded(
        self, message: AbstractIncomingMessage, task_id: str
    ) -> _Settled:
        """The task's stream exists: another delivery recorded it first, or it was cancelled."""
        state = await self._load(task_id)
        if state.status == "cancelled" and state.agent is None and message.reply_to:
            # cancelled before its first run was recorded: only this message knows its publisher
            envelope = ResultEnvelope("cancelled", error=state.error, task_id=task_id)
            await self._require_publisher().publish(
                result_message(task_id, message.reply_to, message.correlation_id, envelope)
            )
        log.info("task %s is already recorded (%s); acking", task_id, state.status)
        self.stats.count("duplicate_tasks")
        self.metrics.duplicates.inc()
        return _ack()

    async def _handle_resume(
        self, message: AbstractIncomingMessage, spec: AgentSpec, body: Any
    ) -> _Settled:
        try:
            task_id, pause = str(body["task_id"]), int(body["pause"])
        except (TypeError, KeyError, ValueError):
            return _dead("wrong-shape", 'a resume body is {"task_id": str, "pause": int}')
        state = await self._load(task_id)
        if state.status != "resumed" or state.pause != pause:
            log.info("resume of %s from pause %d: nothing to do (%s)", task_id, pause, state.status)
            self.stats.count("duplicate_resumes")
            self.metrics.duplicates.inc()
            return _ack()
        try:
            outcome = await self._run_handler(spec, _resume_context(spec, state))
        except Exception as error:
            return await self._handler_failed(message, state, error)
        returned_at = time.perf_counter()
        async with self._streams.hold(task_id):
            for _ in range(MAX_CONFLICT_RETRIES):
                try:
                    events = decide_outcome(
                        state,
                        outcome,
                        now=self._clock(),
                        default_timeout=self._default_timeout(spec),
                        max_timeout=self.settings.max_call_duration,
                    )
                except InvalidTransition as error:
                    break_error: Exception = error
                    break
                try:
                    await self._commit(
                        state, events, f"resume:{pause}", _Cause.of(message), step="resume"
                    )
                except VersionConflict:
                    # an audit event or a cancel landed meanwhile, or another instance ran it
                    self.stats.count("version_conflicts")
                    self.metrics.version_conflicts.inc()
                    state = await self._load(task_id)
                    if state.status != "resumed" or state.pause != pause:
                        return _ack()
                    continue
                if state.resumed_at is not None:
                    self.metrics.resume.observe(max(0.0, self._clock() - state.resumed_at))
                return _ack(returned_at if isinstance(outcome, Pause) else None)
            else:
                raise RuntimeError(f"resume of {task_id}: {MAX_CONFLICT_RETRIES} conflicts")
        return await self._handler_failed(message, state, break_error)

    async def _handler_failed(
        self,
        message: AbstractIncomingMessage,
        state: TaskState,
        error: Exception,
        *,
        start: TaskStarted | None = None,
    ) -> _Settled:
        """Retry by redelivery, or, on the last attempt (or for an invalid outcome), record the
        failure, answer the publisher with an error (through the outbox) and dead-letter."""
        attempt = _attempt(message)
        permanent = isinstance(error, InvalidTransition)
        if not permanent and attempt < self.settings.delivery_limit:
            log.warning(
                "task %s: handler raised %s (attempt %d of %d); retrying",
                state.task_id,
                _error_of(error),
                attempt,
                self.settings.delivery_limit,
            )
            self.stats.count("handler_retries")
            await asyncio.sleep(min(0.2 * 2 ** (attempt - 1), 5.0))
            return _Settled(Disposition.REQUEUE)
        failure = _error_of(error)
        log.error(
            "task %s failed for good after %d attempt(s): %s", state.task_id, attempt, failure
        )
        self.stats.count("tasks_failed")
        applied = await self._append_decision(
            state.task_id,
            lambda current: decide_failure(current, failure, start=start),
            key=lambda _: "failed",
            cause=_Cause.of(message),
            step="failure",
            describe_new=lambda _: state,
        )
        detail = f"{failure['type']}: {failure['message']}"
        # the error result goes out through the outbox with TaskFailed; tell directly otherwise
        return _dead("handler-failed", detail, tell_publisher=not applied.events)

    async def _handle_cancel(
        self, message: AbstractIncomingMessage, spec: AgentSpec, body: Any
    ) -> _Settled:
        if not isinstance(body, dict) or not isinstance(body.get("task_id"), str):
            return _dead(
                "wrong-shape",
                'a cancel body is {"task_id": str, "reason": str?}',
                tell_publisher=True,
            )
        task_id = body["task_id"]
        reason = body.get("reason") if isinstance(body.get("reason"), str) else None
        applied = await self._append_decision(
            task_id,
            lambda current: decide_cancel(current, reason),
            key=lambda _: "cancel",
            cause=_Cause.of(message),
            step="cancel",
            describe_new=lambda current: TaskState(task_id=task_id, agent=spec.name),
        )
        status = "cancelled" if applied.events else applied.state.status
        log.info("cancel of %s: %s", task_id, "cancelled" if applied.events else status)
        self.stats.count("cancels_applied" if applied.events else "cancels_ignored")
        if message.reply_to:
            envelope = ResultEnvelope("ok", result={"task_id": task_id, "status": status})
            await self._require_publisher().publish(
                result_message(
                    f"{task_id}:cancel", message.reply_to, message.correlation_id, envelope
                )
            )
        return _ack()

    # ---- replies, progress, deadlines --------------------------------------------------------

    @staticmethod
    def _subtask_of(message: AbstractIncomingMessage) -> tuple[str, str] | _Settled:
        subtask = message.correlation_id
        if not subtask:
            return _dead("missing-property", "a reply needs the correlation_id of its request")
        try:
            task_id, _, _ = parse_subtask_id(subtask)
        except ValueError:
            return _dead("malformed-correlation-id", f"{subtask!r} names no sub-task")
        return task_id, subtask

    async def _handle_reply(self, message: AbstractIncomingMessage, body: Any) -> _Settled:
        found = self._subtask_of(message)
        if isinstance(found, _Settled):
            return found
        task_id, subtask = found
        try:
            envelope = ResultEnvelope.from_json(body)
        except ValueError as problem:
            return _dead("wrong-shape", str(problem))
        outcome: Literal["ok", "error"] = "ok" if envelope.status == "ok" else "error"
        value = envelope.result if outcome == "ok" else None
        error = envelope.error if outcome == "ok" else envelope.error or {"type": envelope.status}

        def decide(state: TaskState) -> list[DomainEvent]:
            if not state.exists:
                return []
            return decide_reply(
                state,
                subtask,
                outcome=outcome,
                value=value,
                error=error,
                message_id=message.message_id,
            )

        def key(events: list[DomainEvent]) -> str:
            if isinstance(events[0], SubtaskClaimed):
                return f"reply:{subtask}"
            log.info("reply for %s not applied: %s", subtask, getattr(events[0], "reason", "?"))
            self.stats.count("replies_ignored")
            return f"ignored:{subtask}:{message.message_id or uuid.uuid4()}"

        cause = _Cause.of(message)

        async def resume_in_place(
            state: TaskState, recorded: list[RecordedEvent], events: list[DomainEvent]
        ) -> _Extension | None:
            return await self._resume_in_place(state, recorded, events, cause)

        applied = await self._append_decision(
            task_id, decide, key=key, cause=cause, step="reply", extend=resume_in_place
        )
        if not applied.state.exists:
            return _dead("unknown-task", f"no task {task_id!r} in the log")
        if not applied.events:
            self.stats.count("redelivered_recognised")
        return _ack(applied.checkpoint_started)

    async def _resume_in_place(
        self,
        state: TaskState,
        recorded: list[RecordedEvent],
        events: list[DomainEvent],
        cause: _Cause,
    ) -> _Extension | None:
        """Run the resumed handler now, on the instance that records the pause's last reply, so
        that its outcome joins the same append (DESIGN.md §8): no resume message, no second read,
        one transaction fewer. The reply stays unacked until that append commits, so a crash
        redelivers the reply and the whole step runs again (nothing was recorded).

        None leaves the decision as it was (``TaskResumed`` and a resume message, which any
        instance serving the agent takes): when resuming in place is off, or when this worker
        does not serve the task's agent. When the handler raises or returns something invalid,
        the decision stays too, and its resume message counts that failed run, so that retries
        and the final failure follow the resume path within the same delivery limit.
        """
        if not (self.settings.resume_in_place and events and isinstance(events[-1], TaskResumed)):
            return None
        spec = self.app.agents.get(state.agent or "")
        if spec is None:
            return None
        decided_at = self._clock()
        metadata = self._metadata(state, cause)
        own = [NewEvent.of(uuid.uuid4(), event, metadata) for event in events]
        resumed = fold(
            state.task_id,
            [*recorded, *recorded_events(state.task_id, state.version, own, state.last_hash)],
        )
        try:
            outcome = await self._run_handler(spec, _resume_context(spec, resumed))
            returned_at = time.perf_counter()
            self._faults.hit("resume.in-place")
            following = decide_outcome(
                resumed,
                outcome,
                now=self._clock(),
                default_timeout=self._default_timeout(spec),
                max_timeout=self.settings.max_call_duration,
            )
        except InvalidTransition as error:
            # an outcome that can never be recorded: retrying cannot help (as on the resume path)
            log.error(
                "task %s failed for good: its run resumed in place gave %s",
                state.task_id,
                _error_of(error),
            )
            return _Extension(
                [*events, *decide_failure(resumed, _error_of(error))],
                checkpoint_started=None,
                resumed_at=decided_at,
            )
        except Exception as error:
            log.warning(
                "task %s: the resumed handler raised %s; a resume message retries it",
                state.task_id,
                _error_of(error),
            )
            self.stats.count("resumes_handed_over")
            return _Extension(events, checkpoint_started=None, resumed_at=None, failed_runs=1)
        return _Extension(
            [*events, *following],
            checkpoint_started=returned_at if isinstance(outcome, Pause) else None,
            resumed_at=decided_at,
        )

    async def _handle_progress(self, message: AbstractIncomingMessage, body: Any) -> _Settled:
        found = self._subtask_of(message)
        if isinstance(found, _Settled):
            return found
        task_id, subtask = found
        extend_by = body.get("extend_by") if isinstance(body, dict) else None
        if not isinstance(extend_by, (int, float)) or isinstance(extend_by, bool) or extend_by <= 0:
            return _dead("wrong-shape", 'a progress body is {"extend_by": <seconds > 0>}')
        applied = await self._append_decision(
            task_id,
            lambda state: decide_extension(
                state,
                subtask,
                extend_by=float(extend_by),
                now=self._clock(),
                max_duration=self.settings.max_call_duration,
            ),
            key=lambda _: f"progress:{subtask}:{message.message_id or uuid.uuid4()}",
            cause=_Cause.of(message),
            step="progress",
        )
        if not applied.state.exists:
            return _dead("unknown-task", f"no task {task_id!r} in the log")
        self.stats.count("deadlines_extended" if applied.events else "progress_ignored")
        return _ack()

    async def _sweep(self) -> None:
        """Record a timeout for every call past its deadline (G6); every worker sweeps."""
        while True:
            try:
                expired = await self.store.claim_expired_calls(
                    limit=100, lease=30.0, deployment=self.names.prefix
                )
                for call in expired:
                    try:
                        await self._record_timeout(call)
                    except UnreadableStream as error:
                        # its lease runs out and a (newer) worker's sweep takes it again
                        log.warning("deadline sweep: %s", error)
                        self.metrics.unreadable.inc()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("deadline sweep: %s", error)
            await asyncio.sleep(self.settings.sweep_interval)

    async def _record_timeout(self, call: ExpiredCall) -> None:
        with log_context(task_id=call.task_id, subtask_id=call.subtask_id):
            applied = await self._append_decision(
                call.task_id,
                lambda state: decide_timeout(state, call.subtask_id, now=self._clock()),
                key=lambda _: f"timeout:{call.subtask_id}",
                cause=_Cause(message_id=f"deadline:{call.subtask_id}"),
                step="timeout",
            )
            if applied.events:
                log.info("call %s to %s timed out", call.subtask_id, call.agent)
                self.stats.count("timeouts")
                self.metrics.timeouts.labels(call.agent).inc()

    async def _record_unroutable(self, task_id: str, subtask: str, queue: str) -> None:
        """A peer request nobody can receive fails its call at once instead of at its deadline."""
        error = {"type": "unroutable", "message": f"no queue {queue!r} for this call"}
        await self._append_decision(
            task_id,
            lambda state: decide_reply(state, subtask, outcome="error", error=error),
            key=lambda _: f"reply:{subtask}",
            cause=_Cause(message_id=f"unroutable:{subtask}"),
            step="reply",
        )

    # ---- append, publish ---------------------------------------------------------------------

    async def _load(self, task_id: str) -> TaskState:
        return (await self._load_events(task_id))[0]

    async def _load_events(
        self, task_id: str, *, cached: bool = False
    ) -> tuple[TaskState, list[RecordedEvent]]:
        recorded = self._cache.take(task_id) if cached else None
        if recorded is None:
            recorded = await self.store.read_stream(task_id)
        else:
            self.stats.count("stream_cache_hits")
        state = fold(task_id, recorded)
        add_to_context(task_id=task_id, trace_id=state.trace_id)
        if state.unreadable:
            # deciding on part of the story could contradict what the unread events say
            raise UnreadableStream(f"task {task_id}: cannot read {', '.join(state.unreadable)}")
        return state, recorded

    def _default_timeout(self, spec: AgentSpec) -> float:
        return spec.default_timeout or self.settings.default_call_timeout

    async def _append_decision(
        self,
        task_id: str,
        decide: Callable[[TaskState], list[DomainEvent]],
        *,
        key: Callable[[list[DomainEvent]], str],
        cause: _Cause,
        step: str,
        describe_new: Callable[[TaskState], TaskState] | None = None,
        extend: Callable[
            [TaskState, list[RecordedEvent], list[DomainEvent]], Awaitable[_Extension | None]
        ]
        | None = None,
    ) -> _Applied:
        """Read, decide, append; on a conflict (or when the same decision was already recorded
        by someone else) read and decide again. Returns the state decided on and the events
        appended ([] when there was nothing to do).

        A decision is recorded under its causation key, so the same key gives the same event ids:
        when a fresh decision comes back with the key whose events were just found in the log,
        it is recorded already (a redelivered ignored reply, a progress report seen twice), and
        committing it again would only find them again, forever.

        ``extend`` may add to a decision before it is appended (the resumed run's outcome, see
        ``_resume_in_place``); it runs again with every re-decision."""
        async with self._streams.hold(task_id):
            found: str | None = None
            cached = True
            for _ in range(MAX_CONFLICT_RETRIES):
                # first from what this worker last wrote to the stream, if it is still cached:
                # a stale copy only costs a conflict, since the append checks the version
                state, history = await self._load_events(task_id, cached=cached)
                cached = False
                events = decide(state)
                if not events:
                    return _Applied(state, [])
                causation = key(events)
                if causation == found:
                    return _Applied(state, [])
                extension = await extend(state, history, events) if extend else None
                if extension is not None:
                    events = extension.events
                described = state if state.exists or describe_new is None else describe_new(state)
                try:
                    recorded = await self._commit(
                        described,
                        events,
                        causation,
                        cause,
                        step=step,
                        resume_attempts=extension.failed_runs if extension else 0,
                        history=history,
                    )
                except VersionConflict:
                    self.stats.count("version_conflicts")
                    self.metrics.version_conflicts.inc()
                    continue
                if recorded:
                    if extension is None or extension.resumed_at is None:
                        return _Applied(state, events)
                    self.stats.count("resumed_in_place")
                    if isinstance(events[-1], TaskFailed):
                        self.stats.count("tasks_failed")
                    log.debug("resumed in place from pause %d", state.pause)
                    self.metrics.resume.observe(max(0.0, self._clock() - extension.resumed_at))
                    return _Applied(state, events, extension.checkpoint_started)
                found = causation
        raise RuntimeError(f"{step} on {task_id}: gave up after {MAX_CONFLICT_RETRIES} conflicts")

    async def _commit(
        self,
        state: TaskState,
        events: Sequence[DomainEvent],
        causation_key: str,
        cause: _Cause,
        *,
        step: str,
        resume_attempts: int = 0,
        history: list[RecordedEvent] | None = None,
    ) -> bool:
        """Append and publish; False when the events were already recorded (nothing done).

        ``resume_attempts``: runs of the resumed handler that already failed in place; the resume
        message carries the count, so that the retries stay within the delivery limit.
        ``history``: the stream's events ``state`` was folded from; the stream as it is after
        this append is then cached for the next decision on it (``_StreamCache``)."""
        metadata = self._metadata(state, cause)
        new_events = [
            NewEvent.of(event_id(state.task_id, causation_key, index), event, metadata)
            for index, event in enumerate(events)
        ]
        messages = implied_messages(self.names, state, events)
        if resume_attempts:
            messages = [_with_prior_attempts(m, resume_attempts) for m in messages]
        result = await asyncio.shield(
            self.store.append(
                state.task_id,
                state.version,
                new_events,
                prev_hash=state.last_hash,
                outbox=messages,
                outbox_delay=self.settings.outbox_delay,
            )
        )
        if history is not None and not result.duplicate:
            self._cache.put(
                state.task_id,
                [*history, *result.recorded],
                finished=any(event.event_type in _FINISHED for event in events),
            )
        if result.duplicate:
            # recorded before (a redelivery or a re-run): its messages are the relay's to publish
            self.stats.count("duplicate_appends")
            self.metrics.duplicates.inc()
            return False
        self.stats.count("events_appended", len(new_events))
        for event in events:
            self.metrics.events_appended.labels(event.event_type).inc()
            if event.event_type in _FINISHED:
                self.metrics.tasks_finished.labels(
                    state.agent or "?", _FINISHED[event.event_type]
                ).inc()
        self._faults.hit(f"{step}.committed")
        if messages:
            # committed, so the outbox holds them (G4): send now, and let their confirms arrive
            # while this message is acked and the next one handled. Confirmed rows are forgotten;
            # the rest the relay publishes after outbox_delay.
            publishing = asyncio.create_task(
                self._publish_committed(state.task_id, result.outbox_ids, messages)
            )
            self._publishing.add(publishing)
            publishing.add_done_callback(self._publishing.discard)
            await asyncio.sleep(0)  # let it hand its frames to the connection first
        self._faults.hit(f"{step}.published")
        return True

    def _metadata(self, state: TaskState, cause: _Cause) -> EventMetadata:
        return EventMetadata(
            worker_id=self.settings.worker_id,
            amqp_user=cause.amqp_user,
            causation_id=cause.message_id,
            correlation_id=state.root_id or state.task_id,
            trace_id=state.trace_id,
            occurred_at=self._clock(),
            deployment=self.names.prefix,
        )

    async def _publish_committed(
        self, task_id: str, outbox_ids: Sequence[int], messages: Sequence[OutboxMessage]
    ) -> None:
        try:
            errors = await self._require_publisher().publish_all(messages)
        except Exception as failure:  # the relay publishes them after outbox_delay
            log.warning("publishing after a commit failed (%s); the outbox relay will", failure)
            return
        for outbox_id, message, error in zip(outbox_ids, messages, errors, strict=True):
            if error is None:
                self._published_outbox.append(outbox_id)
            elif isinstance(error, aiormq.exceptions.PublishError):
                self._unroutable(task_id, message)
                self._published_outbox.append(outbox_id)
            else:
                log.warning(
                    "publishing %s failed (%s); the outbox relay will retry",
                    message.message_id,
                    error,
                )

    def _unroutable(self, task_id: str, message: OutboxMessage) -> None:
        """No queue takes ``message``. Retrying cannot help: say so, and fail a peer call now."""
        log.error("message %s to %r is unroutable", message.message_id, message.routing_key)
        self.stats.count("unroutable")
        properties = message.properties
        subtask = properties.get("correlation_id")
        if properties.get("type") == TYPE_TASK and subtask == message.message_id and subtask:
            self._spawn(self._record_unroutable(task_id, subtask, message.routing_key))

    def _require_publisher(self) -> Publisher:
        if self._publisher is None:
            raise RuntimeError("the worker is not started")
        return self._publisher

    # ---- background: the outbox relay and forgetting published rows --------------------------

    async def _relay_outbox(self) -> None:
        """Publish outbox rows whose writer did not (it died, or its publish failed)."""
        unsent: list[OutboxEntry] = []  # publish failed; still leased to us: retry them here
        while True:
            try:
                entries = unsent or await self.store.claim_outbox(
                    limit=100, lease=30.0, deployment=self.names.prefix
                )
                unsent = []
                if entries:
                    errors = await self._require_publisher().publish_all(
                        [e.message for e in entries]
                    )
                    done = [
                        entry.id
                        for entry, error in zip(entries, errors, strict=True)
                        if error is None or isinstance(error, aiormq.exceptions.PublishError)
                    ]
                    unsent = [
                        entry
                        for entry, error in zip(entries, errors, strict=True)
                        if error is not None
                        and not isinstance(error, aiormq.exceptions.PublishError)
                    ]
                    if unsent:
                        log.warning("outbox relay: %d not published yet; retrying", len(unsent))
                    await self.store.delete_outbox(done)
                    self.stats.count("outbox_relayed", len(done))
                    self.metrics.outbox_relayed.inc(len(done))
                    log.info("outbox relay published %d message(s)", len(done))
                    if len(entries) == 100 and not unsent:
                        continue
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("outbox relay: %s", error)
            await asyncio.sleep(self.settings.outbox_poll_interval)

    async def _forget_published(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            try:
                await self._flush_published()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("could not forget published outbox rows yet: %s", error)

    async def _flush_published(self) -> None:
        ids, self._published_outbox = self._published_outbox, []
        try:
            await self.store.delete_outbox(ids)
        except BaseException:
            self._published_outbox.extend(ids)
            raise


_FINISHED = {"TaskCompleted": "completed", "TaskFailed": "failed", "TaskCancelled": "cancelled"}

_KINDS = {
    "tasks": frozenset({TYPE_TASK, TYPE_RESUME, TYPE_CANCEL}),
    "replies": frozenset({TYPE_RESULT, TYPE_PROGRESS}),
}


def _kind_label(message: AbstractIncomingMessage, kind: str) -> str:
    """The message's type as a metric label (``other`` for types nobody sends, so a stray
    publisher cannot grow the label set without bound)."""
    given = message.type or (TYPE_TASK if kind == "tasks" else TYPE_RESULT)
    return given if given in _KINDS[kind] else "other"


def _context_of(message: AbstractIncomingMessage, kind: str) -> dict[str, str | None]:
    """What a message says about its task before its body is read, for its log lines."""
    correlation = message.correlation_id
    subtask: str | None = None
    task: str | None = None
    if correlation:
        with contextlib.suppress(ValueError):
            task, _, _ = parse_subtask_id(correlation)
            subtask = correlation
    if kind == "tasks":
        # a task's id is its message id (a peer request's is its sub-task id); resume and
        # cancel name theirs in the body, and it joins the context when the stream is read
        task = message.message_id if (message.type or TYPE_TASK) == TYPE_TASK else None
    headers = message.headers or {}
    trace = trace_id_of(headers, "") or None
    return {"task_id": task, "subtask_id": subtask, "trace_id": trace}


@dataclass(frozen=True, slots=True)
class _Applied:
    state: TaskState
    """The state the decision was taken on."""
    events: list[DomainEvent]
    """What was appended; [] when there was nothing to do."""
    checkpoint_started: float | None = None
    """perf_counter() when a handler run in place returned a pause."""


@dataclass(frozen=True, slots=True)
class _Extension:
    """What an ``extend`` hook adds to a decision: the events to append instead, with when the
    handler that produced them returned a pause and when the resume was decided."""

    events: list[DomainEvent]
    checkpoint_started: float | None
    resumed_at: float | None
    """None when the run in place failed (the decision goes on by resume message)."""
    failed_runs: int = 0
