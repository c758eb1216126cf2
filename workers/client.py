"""A publisher client: submit tasks over AMQP and await their results.

It speaks the plain wire format of ``waystation.protocol.wire``, the same any other language would:
it publishes to the agent's queue with a ``message_id`` (the task id), a ``correlation_id`` and a
``reply_to`` queue of its own (``<prefix>client.<uuid>``, which survives a dropped connection),
and matches results by correlation id. Results are delivered at
least once; the client keeps the first per task and counts the rest in ``duplicates``.

Its memory stays bounded however long it runs: it keeps the most recent ``keep_results`` results
(10,000 by default; an older one is forgotten, so ask for a result before that many others have
arrived, and a repeat of a forgotten one counts as new), and forgets a task it was waiting for
once every ``result()`` call waiting for it has timed out or been cancelled.

A task can be submitted to run later: ``submit(..., delay=seconds)`` publishes it through the
wait queue the retries use (``<prefix>retry-wait.<ms>ms``, ``waystation.policies``), whose message
expires after its step and goes on to the agent's queue; the delay waits in the broker, rounded up
to the next wait step.

A task it did not submit (or whose result it lost) can be asked for too: ``result(task_id,
agent=...)`` and ``lookup(agent, task_id)`` send a ``query`` message, which a worker answers from
the log (``waystation.runtime.flows.query``); the client itself has no database.

A paused task can be sent a signal: ``signal(task_id, name, payload, agent=...)``
(``waystation.runtime.flows.signal``), answered with what became of it. A cancel or a signal may
name who acts (``actor="console:alice"``), which the log records on the events it causes.

Over 400 lines on purpose: every request the client makes (submit, result, cancel, query,
signal) shares its one connection, its reply queue and the results it keeps; split, each part
would reach into the others' state.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from aiormq.abc import FieldValue

from waystation.brokers.amqp.topology import wait_queue_arguments
from waystation.brokers.amqp.transport import guarded_connection
from waystation.events.codec import dumps, loads
from waystation.policies import delay_step
from waystation.protocol.actors import clean_actor
from waystation.protocol.wire import (
    CONTENT_TYPE,
    HEADER_ACTOR,
    HEADER_TRACE,
    TYPE_CANCEL,
    TYPE_QUERY,
    TYPE_SIGNAL,
    TYPE_TASK,
    Names,
)

__all__ = ["Client", "NoQueue", "SignalNotApplied", "TaskLookup", "TaskResult"]

REPLY_QUEUE_EXPIRES_MS = 30 * 60 * 1000
KEEP_RESULTS = 10_000
"""How many results a client keeps by default (the most recent)."""


class NoQueue(LookupError):
    """No queue takes tasks for ``agent``: no worker serving it has declared it (under this
    client's queue prefix). Raised by a delayed submit, which asks before it publishes, since
    the wait queue would take the task and later drop it; a plain submit's task comes back from
    the broker instead, as aio-pika's ``PublishError`` (``NO_ROUTE``)."""

    def __init__(self, agent: str, queue: str) -> None:
        super().__init__(f"no queue {queue!r}: no worker serves agent {agent!r} (start one first)")
        self.agent = agent
        self.queue = queue


class SignalNotApplied(Exception):
    """A worker recorded a signal but did not apply it, or could not record it: ``status`` says
    why (``undeliverable``: the task has finished, or the log has no record of it, or it keeps
    too many signals; ``invalid``: the payload does not fit the agent's model of the signal, the
    wait goes on; ``wrong-agent``: the task belongs to another agent), ``message`` how."""

    def __init__(self, task_id: str, name: str, status: str, message: str) -> None:
        super().__init__(f"signal {name!r} for task {task_id}: {status}: {message}")
        self.task_id = task_id
        self.name = name
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class TaskResult:
    task_id: str
    status: str
    """``ok``, ``error`` or ``cancelled``."""
    result: Any = None
    error: Any = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def signal_outcome(task_id: str, name: str, answer: TaskResult) -> str:
    """What became of a signal, from the worker's answer: ``taken``, ``kept`` or
    ``duplicate``; :class:`SignalNotApplied` when it was not applied."""
    if answer.ok and isinstance(answer.result, dict):
        return str(answer.result.get("status"))
    error = answer.error if isinstance(answer.error, dict) else {}
    raise SignalNotApplied(
        task_id, name, str(error.get("type", "error")), str(error.get("message", ""))
    )


def cancel_outcome(task_id: str, answer: TaskResult) -> str:
    """A cancelled task's status, from the worker's answer to the cancel."""
    if not answer.ok or not isinstance(answer.result, dict):
        raise RuntimeError(f"cancel of {task_id} failed: {answer.error}")
    return str(answer.result.get("status"))


def actor_headers(actor: str | None) -> dict[str, FieldValue] | None:
    """The headers naming ``actor`` on a cancel or a signal (``x-waystation-actor``), cleaned
    as the worker cleans it (``waystation.protocol.actors.clean_actor``: what is sent is what the
    log records); None without one.

    Per call rather than per client: one client serves every person of a console, each cancel
    or signal naming whoever clicked, and an actor means something on those two requests only
    (a task's events are its worker's doing)."""
    cleaned = clean_actor(actor)
    return {HEADER_ACTOR: cleaned} if cleaned is not None else None


def new_signal_id() -> str:
    """A new signal's id; a sender that keeps it can send the signal again harmlessly."""
    return f"signal:{uuid.uuid4()}"


@dataclass(frozen=True, slots=True)
class TaskLookup:
    """What the log records about a task, as a worker answered a query."""

    task_id: str
    status: str
    """``completed``, ``failed``, ``cancelled``, ``paused``, ``resumed``, or ``unknown``: not in
    the log (not run yet, or completed without calling peers, which records nothing unless its
    agent keeps its results: G10)."""
    result: TaskResult | None = None
    """The recorded outcome once the task has finished."""


class Client:
    """``async with Client(amqp_url) as client: result = await client.call("agent", input)``."""

    def __init__(
        self,
        amqp_url: str,
        *,
        queue_prefix: str = "waystation.",
        keep_results: int = KEEP_RESULTS,
    ) -> None:
        if keep_results < 1:
            raise ValueError("keep_results must be at least 1")
        self.amqp_url = amqp_url
        self.names = Names(queue_prefix)
        self.duplicates = 0
        """Result messages that repeated a result still kept."""
        self.results_received = 0
        """Results received, each task counted once (while its result is kept), ever: unlike
        ``len(results)``, it does not stop growing at ``keep_results``."""
        self.keep_results = keep_results
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._reply_queue: AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self._results: OrderedDict[str, TaskResult] = OrderedDict()
        """The most recent ``keep_results`` results, oldest first."""
        self._waiters: dict[str, asyncio.Future[TaskResult]] = {}
        self._waiting: dict[str, int] = {}
        """How many ``result()`` calls wait on each waiter."""
        self._wait_exchanges: dict[int, AbstractExchange] = {}
        """The wait queues' exchanges declared so far, by step (ms)."""

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        # its frames read defensively: a result with metadata that cannot be decoded costs
        # that result, not the connection (waystation.brokers.amqp.transport)
        self._connection = await guarded_connection(
            self.amqp_url, client_properties={"connection_name": "waystation client"}
        )
        self._channel = await self._connection.channel(
            publisher_confirms=True, on_return_raises=True
        )
        # Not exclusive: an exclusive queue dies with its connection, and every result published
        # while the client reconnects would be unroutable and lost. This one outlives a dropped
        # connection, is consumed again when the robust connection is restored, and is deleted
        # by the broker after REPLY_QUEUE_EXPIRES_MS without a consumer (or by close()).
        self._reply_queue = await self._channel.declare_queue(
            f"{self.names.prefix}client.{uuid.uuid4()}",
            durable=True,
            arguments={"x-expires": REPLY_QUEUE_EXPIRES_MS},
        )
        self._consumer_tag = await self._reply_queue.consume(self._receive)

    async def close(self) -> None:
        if self._connection is not None:
            if self._reply_queue is not None:
                with contextlib.suppress(Exception):
                    # cancel first: deleting a queue under its consumer makes the broker cancel
                    # it, which aiormq logs as a warning
                    if self._consumer_tag is not None:
                        await self._reply_queue.cancel(self._consumer_tag)
                    await self._reply_queue.delete(if_unused=False, if_empty=False)
            await self._connection.close()
            self._connection = None

    async def _receive(self, message: AbstractIncomingMessage) -> None:
        try:
            await self._on_result(message)
        finally:
            await message.ack()  # only once recorded: a result in flight at a drop is redelivered

    @property
    def results(self) -> dict[str, TaskResult]:
        """The results received so far (the most recent ``keep_results``), by task id, in
        arrival order."""
        return dict(self._results)

    async def submit(
        self,
        agent: str,
        input: Any = None,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        delay: float = 0,
    ) -> str:
        """Publish a task to ``agent``; returns its task id once the broker has confirmed it.

        ``delay``: seconds before it reaches the agent's queue (0 to ``MAX_DELAY``, about 19
        hours; rounded up to the next wait step, never shorter, at most half as long again),
        spent in the broker's wait queue, not in this client: it may close at once. A delay
        that is negative, not finite or longer raises ``ValueError``; an agent whose queue does
        not exist,
        ``NoQueue``, a ``LookupError`` (a delayed task to no queue would never reach a worker)."""
        step = delay_step(delay)
        task_id = task_id or str(uuid.uuid4())
        headers: dict[str, FieldValue] | None = {HEADER_TRACE: trace_id} if trace_id else None
        await self._publish(agent, TYPE_TASK, task_id, dumps(input), headers, wait_ms=step)
        return task_id

    async def _wait_exchange(self, agent: str, step: int) -> AbstractExchange:
        """The exchange of the wait queue of ``step`` ms, declared as the workers declare it (a
        fanout to a queue whose messages expire after the step and go on to their routing key's
        queue), once ``agent``'s queue is known to exist."""
        assert self._connection is not None and self._channel is not None
        queue = self.names.tasks(agent)
        # a channel of its own: a passive declare of a missing queue closes its channel
        async with self._connection.channel() as probe:
            try:
                await probe.declare_queue(queue, passive=True)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                raise NoQueue(agent, queue) from None
        exchange = self._wait_exchanges.get(step)
        if exchange is None:
            name = self.names.wait(step)
            exchange = await self._channel.declare_exchange(
                name, aio_pika.ExchangeType.FANOUT, durable=True
            )
            waits = await self._channel.declare_queue(
                name, durable=True, arguments=wait_queue_arguments(step)
            )
            await waits.bind(exchange)
            self._wait_exchanges[step] = exchange
        return exchange

    async def _publish(
        self,
        agent: str,
        kind: str,
        message_id: str,
        body: bytes,
        headers: dict[str, FieldValue] | None = None,
        *,
        wait_ms: int = 0,
        user_id: str | None = None,
    ) -> None:
        """Publish a persistent, mandatory ``kind`` message to ``agent``'s queue (through the
        wait queue of ``wait_ms``, if not 0), its answer due on this client's reply queue under
        ``message_id``; returns once the broker confirmed. ``user_id``: the AMQP user it names
        (the broker refuses any but the connection's)."""
        if self._channel is None or self._reply_queue is None:
            raise RuntimeError("the client is not connected")
        exchange = (
            await self._wait_exchange(agent, wait_ms) if wait_ms else self._channel.default_exchange
        )
        await exchange.publish(
            aio_pika.Message(
                body,
                message_id=message_id,
                correlation_id=message_id,
                reply_to=self._reply_queue.name,
                type=kind,
                content_type=CONTENT_TYPE,
                headers=headers,
                user_id=user_id,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=self.names.tasks(agent),
            mandatory=True,
        )

    async def _request(
        self,
        kind: str,
        agent: str,
        body: dict[str, Any],
        timeout: float | None,
        headers: dict[str, FieldValue] | None = None,
    ) -> TaskResult:
        """Publish a ``kind`` request about ``body["task_id"]`` to ``agent``'s queue and wait for
        the worker's answer on this client's reply queue."""
        request_id = f"{kind}:{body['task_id']}:{uuid.uuid4()}"
        await self._publish(agent, kind, request_id, dumps(body), headers)
        try:
            return await self._wait(request_id, timeout)
        finally:
            self._results.pop(request_id, None)

    async def cancel(
        self,
        agent: str,
        task_id: str,
        *,
        reason: str | None = None,
        actor: str | None = None,
        timeout: float | None = 30.0,
    ) -> str:
        """Cancel ``task_id`` (a task of ``agent``) and return its status afterwards:
        ``cancelled``, or the status it had already reached (``completed``, ``failed``).

        The task's own publisher receives a ``cancelled`` result, and every peer call it was
        waiting for is cancelled too. ``actor``: who cancels (``console:alice``), recorded on
        the ``TaskCancelled`` (:func:`actor_headers`).
        """
        answer = await self._request(
            TYPE_CANCEL,
            agent,
            {"task_id": task_id, "reason": reason},
            timeout,
            actor_headers(actor),
        )
        return cancel_outcome(task_id, answer)

    async def signal(
        self,
        task_id: str,
        name: str,
        payload: Any = None,
        *,
        agent: str,
        signal_id: str | None = None,
        actor: str | None = None,
        timeout: float | None = 30.0,
    ) -> str:
        """Send the signal ``name`` with ``payload`` to ``task_id``, a task of ``agent``, and
        return what became of it: ``taken`` (a wait of the task took it), ``kept`` (no wait on
        that name yet: the next one takes it) or ``duplicate`` (a signal with this id was
        recorded already). Raises :class:`SignalNotApplied` when it was not applied.

        ``signal_id``: the signal's id (a new one by default); sending again with the same id
        is harmless, so a sender that does not know whether its signal arrived sends it again.
        The sender recorded is this connection's user; ``actor`` (``console:alice``), who acts
        through it, is recorded beside it (:func:`actor_headers`). ``timeout``: how long to wait
        for the worker's answer (``TimeoutError``)."""
        signal_id = signal_id or new_signal_id()
        body = {"task_id": task_id, "name": name, "payload": payload}
        await self._publish(
            agent,
            TYPE_SIGNAL,
            signal_id,
            dumps(body),
            actor_headers(actor),
            user_id=self._user(),
        )
        try:
            answer = await self._wait(signal_id, timeout)
        finally:
            self._results.pop(signal_id, None)
        return signal_outcome(task_id, name, answer)

    def _user(self) -> str:
        """The AMQP user this client connected as (aiormq logs in as ``guest`` when the URL
        names none): the sender a signal names, which RabbitMQ checks."""
        assert self._connection is not None, "the client is not connected"
        return self._connection.url.user or "guest"

    async def lookup(self, agent: str, task_id: str, *, timeout: float | None = 30.0) -> TaskLookup:
        """Ask what the log records about ``task_id``: a ``query`` message to ``agent``'s queue
        (any agent of the deployment will do: every worker reads the same log)."""
        answer = await self._request(TYPE_QUERY, agent, {"task_id": task_id}, timeout)
        if not answer.ok or not isinstance(answer.result, dict):
            raise RuntimeError(f"query of {task_id} failed: {answer.error}")
        outcome = answer.result.get("outcome")
        result = (
            TaskResult(task_id, outcome["status"], outcome.get("result"), outcome.get("error"))
            if isinstance(outcome, dict) and isinstance(outcome.get("status"), str)
            else None
        )
        return TaskLookup(task_id, str(answer.result.get("status")), result)

    async def result(
        self,
        task_id: str,
        timeout: float | None = None,
        *,
        agent: str | None = None,
        poll: float = 0.5,
    ) -> TaskResult:
        """Wait for the result of ``task_id`` (``TimeoutError`` after ``timeout`` seconds).

        Any number of calls may wait for one task at once; each gets the result. When the last
        of them gives up, the client stops waiting for the task (a result arriving later is
        still kept, for a later call to find).

        Without ``agent`` only a result sent to this client counts: a task it submitted. With
        ``agent`` (the task's, or any agent of the deployment) it also asks the log, every
        ``poll`` seconds (doubling up to 5) until the task has finished: the way to find the
        result of a task another publisher submitted, or of one submitted by a client that did
        not wait for it. ``agent`` names the queue the query goes to (this client has no
        database; every worker reads the same log). A task that completed without calling peers
        is not in the log (G10, unless its agent was declared with ``keep_results=True``, or
        ``WAYSTATION_AUDIT_ALL_TASKS``): only ``timeout`` ends that wait.
        """
        if agent is None or task_id in self._results:
            return await self._wait(task_id, timeout)
        received = asyncio.ensure_future(self._wait(task_id, None))
        asked = asyncio.ensure_future(self._ask_log(agent, task_id, poll))
        try:
            done, _ = await asyncio.wait(
                {received, asked}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                raise TimeoutError(f"no result of {task_id} within {timeout}s")
            return done.pop().result()
        finally:
            for waiting in (received, asked):
                waiting.cancel()
            await asyncio.gather(received, asked, return_exceptions=True)

    async def _ask_log(self, agent: str, task_id: str, poll: float) -> TaskResult:
        delay = poll
        while True:
            found = await self.lookup(agent, task_id, timeout=None)
            if found.result is not None:
                self._keep(found.result)
                return found.result
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _wait(self, task_id: str, timeout: float | None) -> TaskResult:
        if task_id in self._results:
            return self._results[task_id]
        waiter = self._waiters.get(task_id)
        if waiter is None:
            waiter = self._waiters[task_id] = asyncio.get_running_loop().create_future()
        self._waiting[task_id] = self._waiting.get(task_id, 0) + 1
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        finally:
            left = self._waiting.pop(task_id) - 1
            if left:
                self._waiting[task_id] = left
            elif self._waiters.get(task_id) is waiter:
                del self._waiters[task_id]

    async def call(
        self, agent: str, input: Any = None, *, timeout: float | None = None
    ) -> TaskResult:
        """Submit and wait."""
        return await self.result(await self.submit(agent, input), timeout)

    async def _on_result(self, message: AbstractIncomingMessage) -> None:
        task_id = message.correlation_id
        if not task_id:
            return
        try:
            body = loads(message.body)
            result = TaskResult(task_id, body["status"], body.get("result"), body.get("error"))
        except Exception:
            result = TaskResult(task_id, "error", error={"type": "MalformedResult"})
        if task_id in self._results:
            self.duplicates += 1
            return
        self._keep(result)

    def _keep(self, result: TaskResult) -> None:
        """Keep a result (the oldest kept is forgotten past ``keep_results``) and hand it to
        whoever waits for it."""
        task_id = result.task_id
        if task_id in self._results:
            return
        self._results[task_id] = result
        self.results_received += 1
        while len(self._results) > self.keep_results:
            self._results.popitem(last=False)
        waiter = self._waiters.pop(task_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(result)
