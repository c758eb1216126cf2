"""A pool in one process, for tests: Waystation's real worker on the in-memory broker, log and
pool slots, with a client. No RabbitMQ or PostgreSQL is needed::

    from waystation.testing import InMemoryPool

    async def test_the_orchestrator_sums_its_researchers() -> None:
        async with InMemoryPool(app, workers=2) as pool:
            result = await pool.call("orchestrator", {"question": "why", "k": 3})
            assert result.ok and result.result["total"] == 6
            await pool.join()  # until nothing is left to do: no message, delivery or outbox row

The workers are :class:`~waystation.Worker` s, the same code a deployment runs; the broker and
the log are the in-memory backends that pass the same contract suites as RabbitMQ and
PostgreSQL. Tasks are published as any publisher would (plain messages of the wire format), and
their answers collected on the pool's own reply queue; :meth:`InMemoryPool.kill` kills a worker
mid-run as SIGKILL would. Every failure to finish in time raises
:class:`TimeoutError` naming what was still under way.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from waystation.agent import App
from waystation.brokers.memory import InMemoryBroker, InMemoryConnection, StoredMessage
from waystation.brokers.port import Delivery
from waystation.client import TaskResult, cancel_outcome
from waystation.events import OutboxMessage
from waystation.events.codec import dumps, loads
from waystation.events.memory import InMemoryEventStore
from waystation.protocol.wire import (
    CONTENT_TYPE,
    HEADER_ACTOR,
    TYPE_CANCEL,
    TYPE_SIGNAL,
    TYPE_TASK,
    Names,
)
from waystation.runtime.verdicts import crash_limit
from waystation.runtime.worker import Worker
from waystation.settings import Settings
from waystation.slots.memory import MemorySlotLeases

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

__all__ = ["InMemoryPool"]

DEFAULTS: dict[str, Any] = {
    "queue_prefix": "test.",
    "broker_policy": "none",
    "outbox_delay": 1.0,
    "outbox_poll_interval": 0.1,
    "sweep_interval": 0.1,
    "shutdown_grace": 2.0,
    "metrics_port": 0,
}
"""Settings of the pool's workers unless given: no metrics port, short polling intervals."""

_RESULTS = "results"
_POLL = 0.01


class InMemoryPool:
    """``workers`` workers of ``app`` on one in-memory broker, log and slot table, and a client.

    ``settings`` (or keyword overrides of :data:`DEFAULTS`, by setting name) configure every
    worker; the broker's delivery limit follows them, as the deployment's RabbitMQ policy
    would. ``tracer_provider`` is the OpenTelemetry provider the workers' spans go to
    (``Worker``'s). ``workers=0`` starts none: add them with :meth:`add_worker`. ``broker``: an
    in-memory broker of the caller's (one that counts deliveries as RabbitMQ 4.3 does, say)
    instead of the pool's own; ``store``: a log of the caller's (one on a clock of its own, say:
    its ``wall_clock`` is the database's, which says when a deadline or a timer is due). Use it
    as an ``async with`` block, or call :meth:`start` and :meth:`close`."""

    def __init__(
        self,
        app: App,
        *,
        workers: int = 1,
        settings: Settings | None = None,
        tracer_provider: TracerProvider | None = None,
        broker: InMemoryBroker | None = None,
        store: InMemoryEventStore | None = None,
        **overrides: Any,
    ) -> None:
        if workers < 0:
            raise ValueError(f"an in-memory pool cannot have {workers} workers")
        self.app = app
        self.tracer_provider = tracer_provider
        self.settings = settings or Settings(**{**DEFAULTS, **overrides})
        self.names = Names(self.settings.queue_prefix)
        # the broker's own backstop, as the deployment's RabbitMQ policy sets it
        limit = crash_limit(self.settings.delivery_limit) + 1
        self.broker = broker or InMemoryBroker(delivery_limit=limit)
        self.store = store or InMemoryEventStore()
        self.slots = MemorySlotLeases()
        self.workers: list[Worker] = []
        self._size = workers
        self._added = 0
        """Workers started so far, killed ones included (each default name is new)."""
        self._client: InMemoryConnection = self.broker.connection("client")
        self._reply_queue = f"{self.settings.queue_prefix}{_RESULTS}"
        self._results: dict[str, TaskResult] = {}
        self._arrived = asyncio.Event()

    async def __aenter__(self) -> InMemoryPool:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Declare the topology, start the workers, and listen for answers."""
        await self._client.connect()
        await self._client.declare(self.names, self.app.agents)
        self.broker.declare_queue(self._reply_queue)
        await self._client.consume(self._reply_queue, self._on_answer, prefetch=1000)
        for _ in range(self._size):
            await self.add_worker()

    async def add_worker(self, name: str | None = None) -> Worker:
        """Start one more worker in the pool (a deployment scaled out)."""
        self._added += 1
        name = name or f"worker-{self._added}"
        worker = Worker(
            self.app,
            self.settings.model_copy(update={"worker_id": name}),
            self.store,
            broker=self.broker.connection(name),
            slots=self.slots,
            tracer_provider=self.tracer_provider,
        )
        await worker.start()
        self.workers.append(worker)
        return worker

    async def close(self) -> None:
        """Stop the workers (each lets its runs finish within ``shutdown_grace``)."""
        for worker in self.workers:
            await worker.stop()
        self.workers.clear()
        await self._client.close()

    def kill(self, worker: Worker) -> None:
        """``worker`` dies as a process killed with SIGKILL would, mid-run: its connection drops
        for good, so every delivery it holds unsettled goes back to its queue for the others
        and its handlers are cancelled where they are; its outbox relay, deadline sweeper and
        claims stop, with nothing flushed, handed back or released (its claims on reply homes
        lapse as a dead process's do). What it committed stays in the log. It leaves
        ``workers``; :meth:`add_worker` starts a replacement."""
        if worker not in self.workers:
            raise ValueError(f"{worker.settings.worker_id} is not a live worker of this pool")
        self.workers.remove(worker)
        connection = worker.broker
        assert isinstance(connection, InMemoryConnection)
        connection.kill()
        for task in worker._background:
            task.cancel()
        worker.threads.shutdown(wait=False, cancel_futures=True)

    # ---- the client ----------------------------------------------------------------------------

    async def submit(self, agent: str, input: Any = None, *, task_id: str | None = None) -> str:
        """Publish a task to ``agent``, as any publisher would; its task id."""
        if agent not in self.app.agents:
            known = ", ".join(sorted(self.app.agents)) or "none"
            raise ValueError(f"the app has no agent {agent!r} (its agents: {known})")
        task_id = task_id or str(uuid.uuid4())
        await self._client.publish(
            OutboxMessage(
                message_id=task_id,
                routing_key=self.names.tasks(agent),
                body=dumps(input),
                properties={
                    "type": TYPE_TASK,
                    "correlation_id": task_id,
                    "reply_to": self._reply_queue,
                    "content_type": CONTENT_TYPE,
                },
            )
        )
        return task_id

    async def result(self, task_id: str, timeout: float = 30.0) -> TaskResult:
        """The answer to the task ``task_id``, waiting for it at most ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                while task_id not in self._results:
                    self._arrived.clear()
                    await self._arrived.wait()
        except TimeoutError:
            raise TimeoutError(
                f"no answer to task {task_id!r} within {timeout}s; {self._under_way()}"
            ) from None
        return self._results[task_id]

    async def call(self, agent: str, input: Any = None, *, timeout: float = 30.0) -> TaskResult:
        """Submit a task and wait for its answer."""
        return await self.result(await self.submit(agent, input), timeout)

    async def signal(
        self,
        task_id: str,
        name: str,
        payload: Any = None,
        *,
        agent: str,
        signal_id: str | None = None,
        sender: str | None = None,
        actor: str | None = None,
        timeout: float = 30.0,
    ) -> str:
        """Send the signal ``name`` to ``task_id`` (a task of ``agent``) as any publisher would,
        as the AMQP user ``sender``, naming ``actor`` (sent as given, as a publisher in any
        language might: the worker cleans it), and return what became of it (``taken``,
        ``kept``, ``duplicate``); :class:`~waystation.client.SignalNotApplied` when it was not
        applied. ``Client.signal``'s twin."""
        from waystation.client import signal_outcome

        signal_id = signal_id or f"signal:{uuid.uuid4()}"
        body = {"task_id": task_id, "name": name, "payload": payload}
        answer = await self._request(
            agent, TYPE_SIGNAL, signal_id, body, timeout, user_id=sender, actor=actor
        )
        return signal_outcome(task_id, name, answer)

    async def cancel(
        self,
        agent: str,
        task_id: str,
        *,
        reason: str | None = None,
        actor: str | None = None,
        timeout: float = 30.0,
    ) -> str:
        """Cancel ``task_id`` (a task of ``agent``) as any publisher would, naming ``actor`` (sent
        as given: the worker cleans it), and return its status afterwards: ``cancelled``, or the
        one it had reached. ``Client.cancel``'s twin."""
        request_id = f"{TYPE_CANCEL}:{task_id}:{uuid.uuid4()}"
        body = {"task_id": task_id, "reason": reason}
        answer = await self._request(agent, TYPE_CANCEL, request_id, body, timeout, actor=actor)
        return cancel_outcome(task_id, answer)

    async def _request(
        self,
        agent: str,
        kind: str,
        message_id: str,
        body: Any,
        timeout: float,
        *,
        user_id: str | None = None,
        actor: str | None = None,
    ) -> TaskResult:
        """Publish a ``kind`` message about a task to ``agent``'s queue and wait for the
        worker's answer (forgotten once read)."""
        properties: dict[str, Any] = {
            "type": kind,
            "correlation_id": message_id,
            "reply_to": self._reply_queue,
            "content_type": CONTENT_TYPE,
        }
        if user_id is not None:
            properties["user_id"] = user_id
        if actor is not None:
            properties["headers"] = {HEADER_ACTOR: actor}
        await self._client.publish(
            OutboxMessage(
                message_id=message_id,
                routing_key=self.names.tasks(agent),
                body=dumps(body),
                properties=properties,
            )
        )
        answer = await self.result(message_id, timeout)
        del self._results[message_id]
        return answer

    async def _on_answer(self, delivery: Delivery) -> None:
        task_id = delivery.correlation_id or ""
        try:
            body = loads(delivery.body)
            answer = TaskResult(task_id, body["status"], body.get("result"), body.get("error"))
        except Exception:
            answer = TaskResult(task_id, "error", error={"type": "MalformedResult"})
        self._results.setdefault(task_id, answer)
        self._arrived.set()
        await self._client.ack(delivery)

    # ---- what is left ------------------------------------------------------------------------

    async def join(self, timeout: float = 30.0) -> None:
        """Wait until the pool has nothing left to do: no message ready for a consumer, none
        delivered and unsettled, none waiting to arrive (a retry's backoff), no outbox row.
        A task paused on a call whose reply cannot come (a deadline ahead) is idle."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        quiet = 0
        while quiet < 2:  # idle on two looks in a row, a turn of the loop apart
            quiet = quiet + 1 if await self._idle() else 0
            if loop.time() > deadline:
                raise TimeoutError(f"the pool was not idle within {timeout}s; {self._under_way()}")
            await asyncio.sleep(_POLL)

    async def _idle(self) -> bool:
        ready = any(q.ready and q.consumers for q in self.broker.queues.values())
        return (
            not ready
            and self.broker.unsettled() == 0
            and self.broker.waiting == 0
            and await self.store.outbox_size() == 0
        )

    def _under_way(self) -> str:
        ready = {
            name: len(q.ready) for name, q in self.broker.queues.items() if q.ready and q.consumers
        }
        return (
            f"under way: {self.broker.unsettled()} unsettled deliveries, "
            f"{self.broker.waiting} messages waiting to arrive, ready messages {ready or 'none'}"
        )

    def dead_letters(self) -> list[StoredMessage]:
        """The messages dead-lettered so far, oldest first (their headers say why:
        ``x-waystation-reason``)."""
        return self.broker.messages(self.names.dead_letter_queue)
