"""The composition root of a production worker: which adapters serve the ports.

:class:`~waystation.runtime.worker.Worker` is given its broker, log, slots and metrics and builds
nothing it could be given; this is the one place that picks RabbitMQ for the broker and the
log's PostgreSQL database for the pool's slots (``waystation worker`` runs what it builds).
Tests, the simulation and ``waystation.testing`` give the worker the in-memory ports instead.
"""

from __future__ import annotations

from typing import Any

from waystation.agent import App
from waystation.brokers.amqp.broker import AmqpBroker
from waystation.events.postgres import PostgresEventStore
from waystation.runtime.worker import Worker
from waystation.settings import Settings
from waystation.slots.postgres import PostgresSlotLeases

__all__ = ["amqp_broker", "production_worker"]


def amqp_broker(settings: Settings) -> AmqpBroker:
    """The broker port on RabbitMQ, as ``settings`` describe it."""
    return AmqpBroker(
        settings.amqp_url,
        connection_name=f"waystation worker {settings.worker_id}",
        delivery_limit=settings.delivery_limit,
        policy=settings.broker_policy,
        management_url=settings.management_url,
        fast_frames=settings.fast_frames,
    )


def production_worker(
    app: App, settings: Settings, store: PostgresEventStore, **options: Any
) -> Worker:
    """A worker on RabbitMQ whose log is in PostgreSQL, with the pool's slots in the log's
    database (every worker of a pool shares them). ``options`` go to :class:`Worker`, and may
    give another ``broker`` or ``slots``."""
    options.setdefault("broker", amqp_broker(settings))
    options.setdefault("slots", PostgresSlotLeases(store.engine))
    return Worker(app, settings, store, **options)
