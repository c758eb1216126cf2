"""Resident memory of the worker processes over a long run (the ``memory`` mode).

:class:`RssSampler` reads each worker's VmRSS from /proc/<pid>/status: once when the measured
phase starts (after the warm-up: ``start``), every ``every`` seconds while it runs, and once
when the last parent's result is in (``end``, before the workers are stopped). Each sample has
the seconds since the start, the parents completed so far and every worker's MiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from . import rss_mb
from .drive import Progress

__all__ = ["RssSampler", "rss_summary"]


class RssSampler:
    def __init__(self, pids: Mapping[str, int], progress: Progress, every: float) -> None:
        self.pids = dict(pids)
        self.progress = progress
        self.every = every
        self.samples: list[dict[str, Any]] = []
        self._started = time.monotonic()

    def take(self, label: str | None = None) -> dict[str, Any]:
        sample = {
            "seconds": round(time.monotonic() - self._started, 2),
            "parents_completed": self.progress.completed,
            "rss_mb": {name: rss_mb(pid) for name, pid in self.pids.items()},
        }
        if label:
            sample["label"] = label
        self.samples.append(sample)
        return sample

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RssSampler]:
        """``start`` sample, periodic samples while the body runs, ``end`` sample after it."""
        self._started = time.monotonic()
        self.take("start")

        async def periodic() -> None:
            while True:
                await asyncio.sleep(self.every)
                self.take()

        task = asyncio.create_task(periodic())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.take("end")


def rss_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Start, end and peak of each worker, and of the largest worker at start and end (the
    figures ``rss_start_mb`` and ``rss_end_mb``)."""
    start = next(s for s in samples if s.get("label") == "start")
    end = next(s for s in reversed(samples) if s.get("label") == "end")
    workers: dict[str, dict[str, float | None]] = {}
    for name in start["rss_mb"]:
        values = [s["rss_mb"][name] for s in samples if s["rss_mb"].get(name) is not None]
        first, last = start["rss_mb"][name], end["rss_mb"][name]
        workers[name] = {
            "start_mb": first,
            "end_mb": last,
            "peak_mb": max(values) if values else None,
            "growth_mb": None if first is None or last is None else last - first,
        }
    starts = [w["start_mb"] for w in workers.values() if w["start_mb"] is not None]
    ends = [w["end_mb"] for w in workers.values() if w["end_mb"] is not None]
    growths = [w["growth_mb"] for w in workers.values() if w["growth_mb"] is not None]
    return {
        "rss_start_mb": max(starts) if starts else None,
        "rss_end_mb": max(ends) if ends else None,
        "rss_growth_mb": max(growths) if growths else None,
        "per_worker": workers,
    }
