"""The long-running processes: ``worker`` and ``projections run``.

Both run until SIGTERM or SIGINT, serve /metrics and /healthz (on the first free port from 9464
unless WAYSTATION_METRICS_PORT sets one), put the worker id on every log line, and end with a
clear line and exit 1 when the port set is taken (or every port they may choose is).
``projections run`` is registered under the ``projections`` group (see the package), but lives
here for that shared harness rather than with the one-shot ``projections`` commands in ``admin``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import click

from waystation import migrations
from waystation.cli.wiring import load_app, load_settings, run, until_started

if TYPE_CHECKING:
    from waystation.settings import Settings

__all__ = ["run_projections", "worker"]

log = logging.getLogger("waystation")


@click.command()
@click.option(
    "--app",
    "app_path",
    envvar="WAYSTATION_APP",
    help="The app to serve, as module:attribute (imported from the current directory first); "
    "required (env WAYSTATION_APP).",
)
@click.option("--concurrency", type=int, help="Messages handled at once per queue.")
def worker(app_path: str | None, concurrency: int | None) -> None:
    """Run a worker serving every agent of the app until SIGTERM or SIGINT.

    Migrates the database first (creating it if needed), declares the queues, and applies the
    delivery-limit policy. A broker or database not reachable yet is tried again, one line per
    attempt; a wrong password or a missing vhost ends it (exit 4 or 5). On a signal, in any
    phase, it stops consuming, lets in-flight messages reach their next commit within
    WAYSTATION_SHUTDOWN_GRACE seconds, and exits 0.
    """
    settings = load_settings(concurrency=concurrency)
    app = load_app(app_path)
    _log_as_worker(settings.worker_id)
    _run_service(_serve(app, settings))


@click.command(name="run")
def run_projections() -> None:
    """Keep every projection up to date until SIGTERM or SIGINT.

    Run it in as many instances as you like: per projection one instance is active (an
    advisory lock) and the others take over within WAYSTATION_PROJECTION_STANDBY_INTERVAL
    seconds when it goes. Migrates the database first.
    """
    settings = load_settings()
    _log_as_worker(settings.worker_id)
    _run_service(_run_projections(settings))


def _log_as_worker(worker_id: str) -> None:
    """Put the worker id on every log line of this process from now on."""
    from waystation.observability.logs import configure_logging

    options = click.get_current_context().find_root().obj or {}
    configure_logging(
        options.get("log_level", "INFO"), options.get("log_format", "auto"), worker_id=worker_id
    )


def _run_service(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run a long-lived process; a port it cannot listen on ends it with a clear line, exit 1,
    and a service it cannot use with its own line and code (``waystation.cli.exits``), logged
    like every other line of the process (JSON in a container)."""
    from waystation.cli.exits import Failure
    from waystation.observability.metrics import MetricsPortUnavailable

    try:
        run(coroutine)
    except MetricsPortUnavailable as error:
        log.error("%s", error.strerror)
        sys.exit(1)
    except Failure as failure:
        log.error("%s", failure.message)
        sys.exit(failure.exit_code)


GC_THRESHOLD = 50_000
"""Allocations between two collections of the youngest generation (Python's default: 700)."""


def _spare_the_collector() -> None:
    """Once a service has started: move what it has built so far (modules, pools, topology)
    out of the cycle collector's reach, and collect the youngest generation less often.

    The hot path makes many short-lived objects, nearly all freed by reference counting; with
    the defaults the collector ran every 700 allocations and now and then walked every object
    of the process: about 4% of a worker's CPU under load (a perf profile). Cyclic garbage
    still goes, only in bigger batches."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 20, 20)


def _stop_on_signal() -> asyncio.Event:
    """An event the first SIGTERM or SIGINT sets: the process stops in order, not mid-commit."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def _serve(app: Any, settings: Settings) -> None:
    from waystation.events.postgres import PostgresEventStore
    from waystation.observability.metrics import HttpServer, Metrics, database_gauges
    from waystation.runtime.compose import production_worker

    metrics = Metrics()
    stop = _stop_on_signal()  # first: a signal stops the worker while it connects too
    if not await until_started(stop, lambda: migrations.upgrade(settings.database_url)):
        return
    store = PostgresEventStore.from_url(settings.database_url, pool_size=settings.db_pool_size)
    instance = production_worker(app, settings, store, metrics=metrics)
    server = HttpServer(
        metrics,
        instance.health,
        host=settings.metrics_host,
        port=settings.metrics_port,
        refresh=lambda: database_gauges(metrics, store, deployment=settings.queue_prefix),
        horizon=store.horizon_holder,
    )

    async def start() -> None:
        from waystation.observability.logs import redact_url

        log.info("connecting to the broker at %s", redact_url(settings.amqp_url))
        try:
            await instance.start()
        except BaseException:
            await instance.broker.close()  # a half-open connection is not tried again
            raise

    try:
        await server.start()
        if await until_started(stop, start):
            _spare_the_collector()
            await stop.wait()
            log.info("stopping")
    finally:
        await instance.stop()
        await server.stop()
        await store.close()


async def _run_projections(settings: Settings) -> None:
    from waystation.events.postgres import horizon_holder
    from waystation.observability.metrics import Health, HttpServer, Metrics, projection_gauges
    from waystation.projections.postgres import PROJECTIONS, ProjectionRunner, create_engine

    stop = _stop_on_signal()  # first: a signal stops the runner while it connects too
    if not await until_started(stop, lambda: migrations.upgrade(settings.database_url)):
        return
    # each projection holds a connection while it runs; /healthz and /metrics need their own
    engine = create_engine(settings.database_url, pool_size=len(PROJECTIONS) + 2)
    runner = ProjectionRunner(
        engine,
        batch_size=settings.projection_batch_size,
        poll_interval=settings.projection_poll_interval,
        standby_interval=settings.projection_standby_interval,
    )
    metrics = Metrics()

    async def health() -> Health:
        from sqlalchemy import text

        async with engine.connect() as connection:
            await connection.execute(text("SELECT 1"))
        return Health(True, {"worker_id": settings.worker_id, "database": True})

    server = HttpServer(
        metrics,
        health,
        host=settings.metrics_host,
        port=settings.metrics_port,
        refresh=lambda: projection_gauges(metrics, engine),
        horizon=lambda: horizon_holder(engine),
    )
    await server.start()
    log.info("projection runner %s started", settings.worker_id)
    try:
        await runner.run(stop)
    finally:
        await server.stop()
        await engine.dispose()
    log.info("projection runner stopped")
