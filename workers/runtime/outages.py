"""Waiting out an outage of a service the pipeline needs: the event log or the broker.

The recorder retries one read or append (``Recorder._through_outages``) and the worker a whole
flow (``Worker._retrying``); both wait the same way, with this.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from waystation.observability.observer import Observer

__all__ = ["Outages"]

log = logging.getLogger(__name__)

Service = Literal["database", "broker"]
_NAMES: dict[Service, str] = {"database": "event log", "broker": "broker"}


class Outages:
    """Waits that double from ``first`` to ``longest`` seconds, each logged as a warning and
    counted as an outage of its service."""

    def __init__(self, observer: Observer, *, first: float = 0.1, longest: float = 5.0) -> None:
        self.observer = observer
        self.delay = first
        self.longest = longest

    async def wait(self, service: Service, error: Exception) -> None:
        log.warning("%s unavailable (%s); retrying in %.1fs", _NAMES[service], error, self.delay)
        self.observer.outage(service)
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.longest)
