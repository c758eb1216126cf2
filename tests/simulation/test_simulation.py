"""The deterministic simulation of the real worker (issue 11, section 3).

* Ten thousand seeds (``WAYSTATION_SIM_SEEDS``) in parallel processes: every invariant of
  ``scripts.lab.simulation.invariants`` holds in every run. In a whole test session they start at
  collection, in one background process at a low priority, and this test runs what is left.
  A failure prints the command that replays its (shrunk) scenario step by step.
* The same seed gives the same history, byte for byte.
* Each defect of section 4 that the simulation covers, put back
  (``scripts.lab.simulation.mutations``), and each defect the world-against-log invariants exist
  for (``scripts.lab.simulation.reality``) is caught within a bounded number of seeds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from scripts.lab.simulation.loop import BUSY, EPOCH, Stalled, VirtualLoop
from scripts.lab.simulation.mutations import MUTATIONS
from scripts.lab.simulation.runner import (
    HEAD_START,
    HeadStart,
    SeedPool,
    check,
    default_seeds,
    history,
    run_seeds,
)
from scripts.lab.simulation.scenario import Scenario
from scripts.lab.simulation.world import run

SEEDS = len(default_seeds())
MUTATION_SEEDS = 6000
"""Seeds a mutation may take to be caught (the slowest, sequential-sweeper, needs a slow
handler run in place across another task's deadline on the same worker: ~1 seed in 1,000)."""


@pytest.fixture(scope="module")
def seed_pool() -> Iterator[SeedPool]:
    """One process per CPU for every test here that runs seeds in parallel: each would otherwise
    start its own (26 mutations, ~1.5 s of CPU to start each pool's processes)."""
    with SeedPool() as pool:
        yield pool


@pytest.mark.timeout(1500)
def test_every_invariant_holds_over_ten_thousand_seeds(
    request: pytest.FixtureRequest, seed_pool: SeedPool
) -> None:
    """(In a whole test session the seeds start in the background at collection, see
    ``tests/conftest.py``; what has not run by now runs here, with every process.)"""
    head_start = request.config.stash.get(HEAD_START, None)
    failures = (
        head_start.finish(pool=seed_pool)
        if head_start is not None
        else run_seeds(default_seeds(), pool=seed_pool)
    )
    report = "\n".join(
        f"seed {f.seed}: {'; '.join(f.problems[:3])}\n    replay: {f.command}"
        for f in failures[:10]
    )
    assert not failures, f"{len(failures)} of {SEEDS} seeds failed:\n{report}"


def test_a_head_start_reports_the_failures_of_seeds_run_in_the_background_and_after() -> None:
    """(so that the test above, which takes the background's results, could fail)"""
    head_start = HeadStart(range(30), chunk=5, mutation="unstorable-outcome")
    # wait until the background process ran some chunks itself, so that both halves count
    deadline = time.monotonic() + 300
    while head_start.done < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    failed = {failure.seed for failure in head_start.finish()}
    expected = {s for s in range(30) if check(Scenario.generate(s), "unstorable-outcome")}
    assert expected and min(expected) < 5 and max(expected) >= 10  # in both halves
    assert failed == expected


def test_a_pool_runs_every_seed_again_after_a_run_that_stopped_at_its_first_failure() -> None:
    """(so that the mutation tests may share one pool: a run that stopped its processes early,
    or had a mutation applied, leaves the next run on the pool unaffected)"""
    seeds = range(60)
    expected = {s for s in seeds if check(Scenario.generate(s), "unstorable-outcome")}
    assert expected and min(expected) < 25 and max(expected) >= 50
    with SeedPool(2) as pool:
        first = run_seeds(
            seeds, mutation="unstorable-outcome", stop_at_first=True, shrinking=False, pool=pool
        )
        assert first and {f.seed for f in first} < expected  # it stopped early
        again = run_seeds(seeds, mutation="unstorable-outcome", shrinking=False, pool=pool)
        assert {f.seed for f in again} == expected
        assert run_seeds(seeds, pool=pool) == []  # the mutation was taken back


@pytest.mark.parametrize("seed", [7, 51, 1060])
def test_the_same_seed_gives_the_same_history(seed: int) -> None:
    first = run(Scenario.generate(seed))
    second = run(Scenario.generate(seed))
    assert first.log, "the run recorded nothing"
    assert history(first) == history(second)
    assert first.results == second.results


def test_different_seeds_give_different_histories() -> None:
    """(so that the test above could fail: a run that ignored its seed would pass it)"""
    assert history(run(Scenario.generate(7))) != history(run(Scenario.generate(8)))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_simulation_catches_each_defect_put_back(mutation: str, seed_pool: SeedPool) -> None:
    # not shrunk: that is for a person replaying it (scripts/simulate --mutation shrinks)
    failures = run_seeds(
        range(MUTATION_SEEDS),
        mutation=mutation,
        stop_at_first=True,
        shrinking=False,
        pool=seed_pool,
    )
    assert failures, f"{mutation}: no seed of {MUTATION_SEEDS} failed with the defect put back"


def test_a_run_that_can_never_move_on_is_stalled_not_hung() -> None:
    """Nothing ready and no timer, or callbacks that make each other ready forever (a message
    handed back and delivered again at once): both end the run as stalled."""
    loop = VirtualLoop()
    try:
        with pytest.raises(Stalled, match="no timer"):
            loop.run_until_complete(loop.create_future())

        async def spin() -> None:
            for _ in range(10 * BUSY):
                await asyncio.sleep(0.0001)  # the clock moves, a little

        with pytest.raises(Stalled, match=f"spinning: {BUSY:,} steps"):
            loop.run_until_complete(spin())
        assert loop.time() - EPOCH < 30  # long before any run's horizon
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.close()
