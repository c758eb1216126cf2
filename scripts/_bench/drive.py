"""Keeping parents in flight: the load generator of both sides of the benchmark.

A side gives ``one()``, a coroutine function that submits one parent, waits for its result and
checks it (raising :class:`BenchFailure` when it is wrong or missing); the drivers keep
``in_flight`` of them running at once, each loop starting the next parent as soon as its last one
finished (a closed loop, so ``in_flight`` parents are always outstanding):

* :func:`drive_count` runs a fixed number of parents; elapsed is from the first submit to the
  last result (the throughput and single-parent sessions);
* :func:`drive_window` runs a continuous stream: once ``warmup`` parents have completed, a
  window of ``seconds`` opens; throughput is the parents that completed inside the window per
  second, latency that of the parents submitted inside it (the concurrency curve, where a fixed
  count would mix the ramp-up and the drain of 500 parents in flight into the figure).

:func:`measure` is a session's measuring phase with either driver, taking snapshots (of CPU
times) at its start and end.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from . import percentile

__all__ = [
    "BenchFailure",
    "Measured",
    "One",
    "Progress",
    "Window",
    "drive_count",
    "drive_window",
    "measure",
]

One = Callable[[], Awaitable[None]]


class BenchFailure(Exception):
    """The job itself went wrong (a wrong or missing result, a worker that died)."""


@dataclass
class Progress:
    """Parents completed so far by a driver (read by samplers while it runs)."""

    completed: int = 0


async def _in_flight(loop_once: Callable[[], Coroutine[Any, Any, None]], in_flight: int) -> None:
    """``in_flight`` concurrent loops; the first failure cancels the others and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(in_flight):
                group.create_task(loop_once())
    except* BenchFailure as failures:
        raise failures.exceptions[0] from None


async def drive_count(
    one: One,
    count: int,
    in_flight: int,
    *,
    stopping: Callable[[], bool] = lambda: False,
    progress: Progress | None = None,
) -> tuple[float, list[float]]:
    """Run ``count`` parents, ``in_flight`` at a time; (elapsed seconds, latencies in seconds)."""
    latencies: list[float] = []
    remaining = count
    progress = progress if progress is not None else Progress()

    async def loop() -> None:
        nonlocal remaining
        while remaining > 0 and not stopping():
            remaining -= 1
            started = time.perf_counter()
            await one()
            latencies.append(time.perf_counter() - started)
            progress.completed += 1

    started = time.perf_counter()
    await _in_flight(loop, min(in_flight, count))
    return time.perf_counter() - started, latencies


@dataclass
class Window:
    """What :func:`drive_window` measured."""

    seconds: float
    """Length of the window."""
    completed: int
    """Parents that completed inside the window."""
    latencies: list[float]
    """Submit-to-result seconds of the parents submitted inside the window."""
    warmup: int
    """Parents that completed before the window opened."""
    total: int
    """Every parent run, the drain after the window included."""
    records: list[tuple[float, float]] = field(default_factory=list, repr=False)

    @property
    def parents_per_s(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else 0.0


async def drive_window(
    one: One,
    in_flight: int,
    *,
    warmup: int,
    seconds: float,
    stopping: Callable[[], bool] = lambda: False,
    on_open: Callable[[], None] | None = None,
    on_close: Callable[[], None] | None = None,
) -> Window:
    """A continuous stream of parents ``in_flight`` at a time; the window opens after ``warmup``
    completions (``on_open`` is called then) and closes ``seconds`` later (``on_close``); no
    parent is started after it closes, the ones in flight finish (the drain)."""
    records: list[tuple[float, float]] = []
    opened = asyncio.Event()
    closed = asyncio.Event()
    bounds: dict[str, float] = {}

    def open_window() -> None:
        bounds["open"] = time.perf_counter()
        if on_open is not None:
            on_open()
        opened.set()

    async def loop() -> None:
        while not closed.is_set() and not stopping():
            started = time.perf_counter()
            await one()
            records.append((started, time.perf_counter()))
            if not opened.is_set() and len(records) >= warmup:
                open_window()

    async def timer() -> None:
        if warmup <= 0:
            open_window()
        await opened.wait()
        await asyncio.sleep(seconds)
        bounds["close"] = time.perf_counter()
        if on_close is not None:
            on_close()
        closed.set()

    timing = asyncio.create_task(timer())
    try:
        await _in_flight(loop, in_flight)
    finally:
        if not timing.done():  # stopped (or failed) before the window closed
            timing.cancel()
    if "close" not in bounds:
        raise BenchFailure("the run stopped before the measuring window closed")
    start, end = bounds["open"], bounds["close"]
    return Window(
        seconds=end - start,
        completed=sum(1 for _, done in records if start <= done <= end),
        latencies=[done - submitted for submitted, done in records if start <= submitted <= end],
        warmup=sum(1 for _, done in records if done < start),
        total=len(records),
        records=records,
    )


@dataclass
class Measured:
    """What :func:`measure` measured."""

    measured: int
    """Parents of the measured phase (for a window: completed inside it)."""
    total: int
    """Every parent run, warm-up (and drain) included."""
    warmup: int
    """Parents completed before the measured phase."""
    seconds: float
    latencies: list[float]
    parents_per_s: float
    before: Any
    """``snapshot()`` at the start of the measured phase."""
    after: Any
    """``snapshot()`` at its end."""

    def figures(self) -> dict[str, Any]:
        """The keys every session reports: parents, seconds, parents/s, latency in ms."""
        return {
            "parents_measured": self.measured,
            "parents_total": self.total,
            "elapsed_s": self.seconds,
            "parents_per_s": self.parents_per_s,
            "latency_p50_ms": _ms(percentile(self.latencies, 50)),
            "latency_p99_ms": _ms(percentile(self.latencies, 99)),
            "latency_max_ms": _ms(max(self.latencies)) if self.latencies else None,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


async def measure(
    one: One,
    in_flight: int,
    *,
    warmup: int,
    measured: int | None = None,
    seconds: float | None = None,
    snapshot: Callable[[], Any] = lambda: None,
    stopping: Callable[[], bool] = lambda: False,
    progress: Progress | None = None,
    observe: contextlib.AbstractAsyncContextManager[Any] | None = None,
) -> Measured:
    """``warmup`` parents, then ``measured`` parents (:func:`drive_count`); or, when
    ``measured`` is None, a window of ``seconds`` after ``warmup`` completions
    (:func:`drive_window`). ``observe`` (count mode) is entered around the measured phase."""
    if measured is not None:
        if warmup:
            await drive_count(one, warmup, in_flight, stopping=stopping)
        async with observe if observe is not None else contextlib.nullcontext():
            before = snapshot()
            elapsed, latencies = await drive_count(
                one, measured, in_flight, stopping=stopping, progress=progress
            )
            after = snapshot()
        return Measured(
            measured,
            warmup + measured,
            warmup,
            elapsed,
            latencies,
            measured / elapsed,
            before,
            after,
        )
    if seconds is None or observe is not None:
        raise ValueError("a window needs seconds, and takes no observer")
    snapshots: dict[str, Any] = {}
    window = await drive_window(
        one,
        in_flight,
        warmup=warmup,
        seconds=seconds,
        stopping=stopping,
        on_open=lambda: snapshots.__setitem__("before", snapshot()),
        on_close=lambda: snapshots.__setitem__("after", snapshot()),
    )
    return Measured(
        window.completed,
        window.total,
        window.warmup,
        window.seconds,
        window.latencies,
        window.parents_per_s,
        snapshots["before"],
        snapshots["after"],
    )
