"""Running many seeds, in parallel processes; shrinking a failing scenario; replaying one.

A seed fails when :func:`~.invariants.problems` finds anything (or the run
raises). A failure is shrunk (tasks dropped one by one, fault kinds turned off one by one, as long
as it still fails) and reported with the command that replays it with a step-by-step trace.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest

from waystation.events.codec import dumps

from .invariants import problems
from .mutations import MUTATIONS, mutated
from .scenario import FAULT_KINDS, Scenario
from .world import Observed, run

__all__ = [
    "HEAD_START",
    "Failure",
    "HeadStart",
    "SeedPool",
    "check",
    "default_seeds",
    "history",
    "replay_command",
    "run_seeds",
    "shrink",
]


@dataclass(frozen=True)
class Failure:
    seed: int
    problems: tuple[str, ...]
    command: str
    """The command that replays the (shrunk) failing scenario with a trace."""


def history(observed: Observed) -> bytes:
    """Everything a run left behind, byte for byte: the log (every field of every event, the
    time it was recorded included) and every message the broker took, in order."""
    lines = [
        dumps(
            [
                e.stream_id,
                e.stream_version,
                str(e.event_id),
                e.event_type,
                e.schema_version,
                e.data,
                e.metadata,
                e.prev_hash.hex(),
                e.hash.hex(),
                e.global_position,
                e.recorded_at.isoformat() if e.recorded_at else None,
            ]
        )
        for e in observed.log
    ]
    lines += [
        dumps([m.routing_key, m.properties, m.headers, m.body.decode(), m.enqueued_at, m.fate])
        for m in observed.published
    ]
    return b"\n".join(lines)


def check(scenario: Scenario, mutation: str | None = None) -> list[str]:
    """The invariants ``scenario`` breaks (empty: it held)."""
    with mutated(mutation):
        try:
            return problems(run(scenario))
        except Exception:
            return [f"the run raised: {traceback.format_exc(limit=8)}"]


def shrink(scenario: Scenario, mutation: str | None = None) -> Scenario:
    """A smaller scenario that still fails: fewer tasks, fewer kinds of fault."""
    current = scenario
    for task in scenario.tasks:
        if len(current.tasks) <= 1:
            break
        smaller = current.only_tasks({t.task_id for t in current.tasks} - {task.task_id})
        if check(smaller, mutation):
            current = smaller
    for kind in FAULT_KINDS:
        if kind in current.faults:
            smaller = current.without(kind)
            if check(smaller, mutation):
                current = smaller
    return current


def replay_command(scenario: Scenario, mutation: str | None = None) -> str:
    parts = [f"scripts/simulate --seed {scenario.seed}"]
    full = Scenario.generate(scenario.seed)
    if scenario.tasks != full.tasks:
        parts.append(f"--tasks {','.join(t.task_id for t in scenario.tasks)}")
    if scenario.faults != full.faults:
        parts.append(f"--faults {','.join(sorted(scenario.faults)) or 'none'}")
    if mutation:
        parts.append(f"--mutation {mutation}")
    parts.append("--trace")
    return " ".join(parts)


def scenario_of(seed: int, tasks: Sequence[str] | None, faults: Sequence[str] | None) -> Scenario:
    scenario = Scenario.generate(seed)
    if tasks is not None:
        scenario = scenario.only_tasks(set(tasks))
    if faults is not None:
        scenario = replace(scenario, faults=frozenset(faults) & frozenset(FAULT_KINDS))
    return scenario


_stop: Any = None
"""In a pool's process: the event set once any process found a failure (``stop_at_first``)."""


def _start_process(event: Any, niceness: int = 0) -> None:
    """A pool process's start: the stop event it shares (None: it never stops early) and how
    much lower than its parent it runs (``os.nice``)."""
    global _stop
    _stop = event
    if niceness:
        os.nice(niceness)


def _run_range(
    seeds: Sequence[int], mutation: str | None, stop_at_first: bool, shrinking: bool = True
) -> list[Failure]:
    failures = []
    for seed in seeds:
        if stop_at_first and _stop is not None and _stop.is_set():
            break  # another process found one: the caller wants only the first
        scenario = Scenario.generate(seed)
        found = check(scenario, mutation)
        if found:
            if stop_at_first and _stop is not None:
                _stop.set()
            small = shrink(scenario, mutation) if shrinking else scenario
            again = check(small, mutation) if shrinking else found
            failures.append(Failure(seed, tuple(again or found), replay_command(small, mutation)))
            if stop_at_first:
                break
    return failures


def _chunks(seeds: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for start in range(0, len(seeds), size):
        yield seeds[start : start + size]


class SeedPool:
    """Processes that run seeds, kept for many runs: each run of :meth:`run` is what
    :func:`run_seeds` does with a pool of its own, without starting its processes again (a
    spawned process imports the whole worker and the simulation, ~1.5 s of CPU: the 26 mutation
    tests, one run each, share one pool).

    A run that stops at its first failure stops the processes at their next seed and waits for
    them; the next run starts with the stop cleared. A mutation is applied only for the seeds
    of its run (:func:`~.mutations.mutated` puts the code back after each), so a run on a pool
    that ran others sees exactly what it would on a fresh one.
    """

    def __init__(self, processes: int | None = None) -> None:
        # spawn, not fork: the caller may be running an event loop (pytest's) in this process
        context = multiprocessing.get_context("spawn")
        self.processes = processes or os.cpu_count() or 1
        self._stop = context.Event()
        self._executor = concurrent.futures.ProcessPoolExecutor(
            self.processes, mp_context=context, initializer=_start_process, initargs=(self._stop,)
        )

    def run(
        self,
        seeds: Sequence[int],
        mutation: str | None = None,
        stop_at_first: bool = False,
        shrinking: bool = True,
    ) -> list[Failure]:
        self._stop.clear()
        # small chunks, so that a process that drew slow seeds does not hold up the rest; when
        # only the first failure is wanted, smaller still, so that seeds are tried in about their
        # order (a defect that shows at seed 900 is found after ~900 seeds, not after whole chunks)
        size = 25 if stop_at_first else max(1, -(-len(seeds) // (self.processes * 8)))
        futures = [
            self._executor.submit(_run_range, chunk, mutation, stop_at_first, shrinking)
            for chunk in _chunks(seeds, size)
        ]
        failures: list[Failure] = []
        try:
            for future in concurrent.futures.as_completed(futures):
                failures.extend(future.result())
                if stop_at_first and failures:
                    break
        finally:
            # the processes stop at their next seed (the one that found it set the stop);
            # chunks not started are dropped
            self._stop.set()
            for future in futures:
                future.cancel()
            concurrent.futures.wait(futures)
        return sorted(failures, key=lambda f: f.seed)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SeedPool:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def run_seeds(
    seeds: Sequence[int],
    *,
    processes: int | None = None,
    mutation: str | None = None,
    stop_at_first: bool = False,
    shrinking: bool = True,
    pool: SeedPool | None = None,
) -> list[Failure]:
    """Run every seed; the failures, each shrunk (unless not ``shrinking``: a caller that only
    asks whether a seed fails) and with its replay command. On ``pool``'s processes when given,
    else on ``processes`` of their own (in this process when one, or for under 50 seeds)."""
    if mutation is not None and mutation not in MUTATIONS:
        raise ValueError(f"no mutation {mutation!r}; there are {', '.join(MUTATIONS)}")
    if pool is not None:
        return pool.run(seeds, mutation, stop_at_first, shrinking)
    processes = processes or os.cpu_count() or 1
    if processes == 1 or len(seeds) < 50:
        return _run_range(seeds, mutation, stop_at_first, shrinking)
    with SeedPool(processes) as own:
        return own.run(seeds, mutation, stop_at_first, shrinking)


def default_seeds() -> range:
    """The seeds of the default test run: 0 to ``WAYSTATION_SIM_SEEDS`` (10,000)."""
    return range(int(os.environ.get("WAYSTATION_SIM_SEEDS", "10000")))


class HeadStart:
    """``seeds`` run in the background while other work goes on (the rest of a test session), in
    one process at a low priority (``nice`` 10: it takes the CPU the other work leaves idle and
    yields it when that work wants it), in chunks of ``chunk`` seeds.

    :meth:`finish` then runs the chunks not started yet with every process, waits for the ones
    under way, and returns the failures of every seed, exactly as :func:`run_seeds` would.
    """

    def __init__(
        self, seeds: Sequence[int], *, chunk: int = 100, mutation: str | None = None
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._mutation = mutation
        self._chunks = list(_chunks(seeds, chunk))
        self._pool = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=context, initializer=_start_process, initargs=(None, 10)
        )
        self._futures = [self._pool.submit(_run_range, c, mutation, False) for c in self._chunks]

    @property
    def done(self) -> int:
        """How many chunks are done so far."""
        return sum(future.done() for future in self._futures)

    def finish(
        self, *, processes: int | None = None, pool: SeedPool | None = None
    ) -> list[Failure]:
        """(``pool``, ``processes``: as :func:`run_seeds` takes them.)"""
        left = [chunk for chunk, f in zip(self._chunks, self._futures, strict=True) if f.cancel()]
        failures = run_seeds(
            [seed for chunk in left for seed in chunk],
            processes=processes,
            mutation=self._mutation,
            pool=pool,
        )
        for future in self._futures:
            if not future.cancelled():
                failures.extend(future.result())
        self.close()
        return sorted(failures, key=lambda f: f.seed)

    def close(self) -> None:
        """Stop: chunks not started are dropped, the one under way is waited for."""
        self._pool.shutdown(wait=True, cancel_futures=True)


HEAD_START = pytest.StashKey[HeadStart]()
"""Where a test session keeps the head start of the default seeds (``tests/conftest.py``)."""
