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
    figures ``rss_start_mb`` and ``rss_end_mb``). Half-way (the first sample with at least half
    the parents of the end) tells a cache that fills and stays from a leak: a leak grows in the
    second half too (``rss_second_half_growth_mb``)."""
    start = next(s for s in samples if s.get("label") == "start")
    end = next(s for s in reversed(samples) if s.get("label") == "end")
    half = (start["parents_completed"] + end["parents_completed"]) / 2
    middle = next(s for s in samples if s["parents_completed"] >= half)
    workers: dict[str, dict[str, float | None]] = {}
    for name in start["rss_mb"]:
        values = [s["rss_mb"][name] for s in samples if s["rss_mb"].get(name) is not None]
        first, mid, last = start["rss_mb"][name], middle["rss_mb"][name], end["rss_mb"][name]
        workers[name] = {
            "start_mb": first,
            "mid_mb": mid,
            "end_mb": last,
            "peak_mb": max(values) if values else None,
            "growth_mb": None if first is None or last is None else last - first,
            "second_half_growth_mb": None if mid is None or last is None else last - mid,
        }

    def largest(key: str) -> float | None:
        values = [w[key] for w in workers.values() if w[key] is not None]
        return max(v for v in values if v is not None) if values else None

    return {
        "rss_start_mb": largest("start_mb"),
        "rss_mid_mb": largest("mid_mb"),
        "rss_end_mb": largest("end_mb"),
        "rss_growth_mb": largest("growth_mb"),
        "rss_second_half_growth_mb": largest("second_half_growth_mb"),
        "mid_parents_completed": middle["parents_completed"],
        "per_worker": workers,
    }
