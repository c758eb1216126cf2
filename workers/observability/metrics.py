"""Prometheus metrics and the health endpoint of a worker (or a projection runner).

``Metrics`` holds one registry per process part, so two workers in one test process never share
counters. ``HttpServer`` serves it on the process's own event loop (aiohttp), so ``/healthz``
answers from the live connections, not from a thread's guess:

* ``GET /metrics``: the Prometheus text format. Gauges that live in the database (the outbox
  backlog, the projections' lag) are read at scrape time, with a time limit.
* ``GET /healthz``: 200 and a JSON body when the process can do its job (broker connected and
  consuming, database answering), 503 with the reason otherwise (starting, stopping, an outage).
  Its ``horizon`` names the transaction holding back readers of the log (projections): pid,
  database, state, age; null when none does, absent when the database could not be asked.

Several processes on one host each get a port of their own: unless ``WAYSTATION_METRICS_PORT``
names one, the endpoint takes the first free port from 9464 (``DEFAULT_PORTS``) and logs it.

The metric names and what each means are listed in docs/observability.md.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from waystation.events.codec import dumps

if TYPE_CHECKING:
    from aiohttp import web
    from sqlalchemy.ext.asyncio import AsyncEngine

    from waystation.events.postgres import HorizonHolder, PostgresEventStore

__all__ = ["DEFAULT_PORTS", "Health", "HttpServer", "Metrics", "MetricsPortUnavailable"]

DEFAULT_PORTS = range(9464, 9564)
"""Where the endpoint listens when no port is set: the first of these that is free."""

log = logging.getLogger(__name__)

_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Buckets for the checkpoint (targets: p50 < 2 ms, p99 < 10 ms)."""
_SLOW = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Every metric a worker exports. Cheap to create; pass one to ``Worker`` to read it."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # no ``*_created`` series: they double the output and no dashboard here reads them
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.messages = Counter(
            "waystation_messages",
            "Messages consumed, by agent, kind (task, resume, cancel, result, progress) and "
            "outcome (ack, requeue, dead-letter).",
            ["agent", "kind", "outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "waystation_messages_in_flight", "Messages being handled right now.", registry=r
        )
        self.events_appended = Counter(
            "waystation_events_appended",
            "Events this worker appended to the log, by event type.",
            ["event_type"],
            registry=r,
        )
        self.version_conflicts = Counter(
            "waystation_version_conflicts",
            "Appends that found the stream moved on (another writer won; re-read and decided "
            "again).",
            registry=r,
        )
        self.duplicates = Counter(
            "waystation_duplicates_recognised",
            "Redeliveries and re-runs recognised as already recorded (nothing appended twice).",
            registry=r,
        )
        self.checkpoint = Histogram(
            "waystation_checkpoint_seconds",
            "From the handler returning a pause to the broker ack of its message (the "
            "checkpoint commit in between).",
            buckets=_FAST,
            registry=r,
        )
        self.resume = Histogram(
            "waystation_resume_latency_seconds",
            "From recording the reply that completed a pause to committing what the resumed "
            "handler decided (worker clocks).",
            buckets=_SLOW,
            registry=r,
        )
        self.tasks_finished = Counter(
            "waystation_tasks_finished",
            "Tasks this worker finished, by agent and status (completed, failed, cancelled).",
            ["agent", "status"],
            registry=r,
        )
        self.timeouts = Counter(
            "waystation_call_timeouts",
            "Peer calls this worker recorded as timed out (deadline passed), by callee agent.",
            ["agent"],
            registry=r,
        )
        self.dead_letters = Counter(
            "waystation_dead_letters",
            "Messages this worker dead-lettered, by reason.",
            ["reason"],
            registry=r,
        )
        self.results_undelivered = Counter(
            "waystation_results_undelivered",
            "Results not delivered because their publisher's reply queue was gone (it did not "
            "wait for them; not a dead letter), by agent.",
            ["agent"],
            registry=r,
        )
        self.publish_refusals = Counter(
            "waystation_publish_refusals",
            "Publishes of committed messages the broker refused (they are tried again with "
            "backoff), by reason.",
            ["reason"],
            registry=r,
        )
        self.outbox_relayed = Counter(
            "waystation_outbox_relayed",
            "Messages the outbox relay published for a writer that did not.",
            registry=r,
        )
        self.unreadable = Counter(
            "waystation_unreadable_streams",
            "Messages requeued because their task's stream holds events this worker cannot "
            "read (an unknown type or a newer schema version: a newer worker wrote them).",
            registry=r,
        )
        self.outages = Counter(
            "waystation_outage_retries",
            "Retries of a message because a service was unavailable (database or broker).",
            ["service"],
            registry=r,
        )
        self.limit_waits = Counter(
            "waystation_limit_waits",
            "Runs that found their agent's concurrency or rate full across the pool: their task "
            "waited in the broker, by agent and limit (concurrency, rate).",
            ["agent", "limit"],
            registry=r,
        )
        self.leases_lost = Counter(
            "waystation_slot_leases_lost",
            "Concurrency slots this worker held that ran out before it renewed them (their runs "
            "went on beyond the limit).",
            registry=r,
        )
        self.outbox_backlog = Gauge(
            "waystation_outbox_backlog",
            "Outbox rows not yet published and forgotten (read at scrape time).",
            registry=r,
        )
        self.outbox_oldest = Gauge(
            "waystation_outbox_oldest_seconds",
            "Age of the oldest outbox row not yet published and forgotten; 0 when there is "
            "none (read at scrape time).",
            registry=r,
        )
        self.projection_lag_events = Gauge(
            "waystation_projection_lag_events",
            "Events a projection has not applied yet (read at scrape time).",
            ["projection"],
            registry=r,
        )
        self.projection_lag_seconds = Gauge(
            "waystation_projection_lag_seconds",
            "Age of the oldest event a projection has not applied (read at scrape time).",
            ["projection"],
            registry=r,
        )
        self.healthy = Gauge(
            "waystation_healthy",
            "1 when /healthz would answer 200 (read at scrape time), else 0.",
            registry=r,
        )
        self.scrape_errors = Counter(
            "waystation_scrape_errors",
            "Scrapes whose database gauges could not be read (they keep their last value).",
            registry=r,
        )


class MetricsPortUnavailable(OSError):
    """The metrics endpoint cannot listen where it was told to, or on any port it may choose."""


def _refusal(host: str, port: int, error: OSError, *, chosen: bool) -> str:
    """What an operator reads when ``port`` cannot be listened on: the one set, or one the
    endpoint chose that fails for a reason other than being taken (the host, say)."""
    if chosen:
        return (
            f"cannot serve metrics on {host}:{port} ({error.strerror}); check "
            "WAYSTATION_METRICS_HOST, or set WAYSTATION_METRICS_PORT=0 to turn the endpoint off"
        )
    return (
        f"cannot serve metrics on {host}:{port} ({error.strerror}): it is "
        f"WAYSTATION_METRICS_PORT={port}; set another free port, leave it unset to take the "
        f"first free one from {DEFAULT_PORTS.start}, or set 0 to turn the endpoint off"
    )


@dataclass(frozen=True, slots=True)
class Health:
    healthy: bool
    detail: dict[str, Any]


class HttpServer:
    """``/metrics`` and ``/healthz`` on ``host:port``; port 0 disables it (nothing listens), None
    takes the first free port of ``DEFAULT_PORTS`` (``port`` is then the one taken)."""

    def __init__(
        self,
        metrics: Metrics,
        health: Callable[[], Awaitable[Health]],
        *,
        host: str,
        port: int | None,
        refresh: Callable[[], Awaitable[None]] | None = None,
        refresh_timeout: float = 2.0,
        horizon: Callable[[], Awaitable[HorizonHolder | None]] | None = None,
    ) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self._health = health
        self._horizon = horizon
        self._refresh = refresh
        self._refresh_timeout = refresh_timeout
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        if self.port == 0:
            return
        from aiohttp import web  # here: a process that serves no metrics never imports it

        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        chosen = self.port is None
        candidates: Sequence[int] = DEFAULT_PORTS if self.port is None else (self.port,)
        for port in candidates:
            site = web.TCPSite(self._runner, self.host, port)
            try:
                await site.start()
            except OSError as error:
                await site.stop()
                if chosen and error.errno == errno.EADDRINUSE:
                    continue  # another process of this host has it: the next one
                await self._give_up()
                raise MetricsPortUnavailable(
                    error.errno, _refusal(self.host, port, error, chosen=chosen)
                ) from error
            break
        else:
            await self._give_up()
            raise MetricsPortUnavailable(
                errno.EADDRINUSE,
                f"cannot serve metrics on {self.host}: every port from {DEFAULT_PORTS.start} to "
                f"{DEFAULT_PORTS.stop - 1} is taken; set WAYSTATION_METRICS_PORT to a free port, "
                "or 0 to turn the endpoint off",
            )
        self.port = port
        first = DEFAULT_PORTS.start
        log.info(
            "metrics on http://%s:%d/metrics, health on /healthz%s",
            self.host,
            port,
            f" (the first free port from {first}: WAYSTATION_METRICS_PORT is unset)"
            if chosen
            else "",
            extra={"fields": {"metrics_port": port}},
        )

    async def _give_up(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()
        self._runner = None

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, _: web.Request) -> web.Response:
        self.metrics.healthy.set(1 if (await self._check_health()).healthy else 0)
        if self._refresh is not None:
            try:
                await asyncio.wait_for(self._refresh(), self._refresh_timeout)
            except Exception as error:  # a scrape must answer even when the database is down
                self.metrics.scrape_errors.inc()
                log.debug("scrape: database gauges not refreshed: %r", error)
        from aiohttp import web

        body = generate_latest(self.metrics.registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _check_health(self) -> Health:
        try:
            return await asyncio.wait_for(self._health(), self._refresh_timeout + 1)
        except Exception as error:
            return Health(False, {"error": repr(error)})

    async def _healthz(self, _: web.Request) -> web.Response:
        from aiohttp import web

        health = await self._check_health()
        detail = dict(health.detail)
        if self._horizon is not None:
            try:
                holder = await asyncio.wait_for(self._horizon(), self._refresh_timeout)
                detail["horizon"] = holder.to_json() if holder is not None else None
            except Exception as error:  # the database is down: the detail above says so
                log.debug("healthz: horizon not read: %r", error)
        return web.Response(
            body=dumps({"status": "ok" if health.healthy else "unavailable", **detail}),
            status=200 if health.healthy else 503,
            content_type="application/json",
        )


async def database_gauges(
    metrics: Metrics, store: PostgresEventStore, *, deployment: str | None = None
) -> None:
    """Read the outbox backlog and its oldest row's age (of ``deployment``: the rows its relays
    may publish) and the projections' lag into their gauges."""
    metrics.outbox_backlog.set(await store.outbox_size(deployment=deployment))
    metrics.outbox_oldest.set(await store.outbox_oldest(deployment=deployment) or 0.0)
    await projection_gauges(metrics, store.engine)


async def projection_gauges(metrics: Metrics, engine: AsyncEngine) -> None:
    from waystation.projections.postgres import projection_status

    for status in await projection_status(engine):
        metrics.projection_lag_events.labels(status.name).set(status.behind)
        metrics.projection_lag_seconds.labels(status.name).set(status.lag_seconds)
