"""Run the simulation: ``--seeds N [--from S]`` seeds in parallel, or one ``--seed S``.

A failing seed is shrunk and printed with the command that replays it; ``--trace`` prints a
replayed run step by step (every append, publish, ack, crash and fault, on the virtual clock,
with the workers' log lines). ``--mutation NAME`` puts one fixed defect back (see
scripts/lab/simulation/mutations.py) to check that the simulation catches it. Exit status: 0 when
every seed kept every invariant, 1 otherwise (with ``--mutation``: 0 when a seed failed).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.lab.simulation.mutations import MUTATIONS, mutated
from scripts.lab.simulation.runner import check, run_seeds, scenario_of
from scripts.lab.simulation.scenario import FAULT_KINDS
from scripts.lab.simulation.world import run


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seeds", type=int, default=10_000, help="how many seeds (default 10000)")
    parser.add_argument("--from", dest="start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seed", type=int, help="replay this one seed")
    parser.add_argument("--tasks", help="(with --seed) only these task ids, comma-separated")
    parser.add_argument(
        "--faults", help=f"(with --seed) only these kinds of fault, of: {', '.join(FAULT_KINDS)}"
    )
    parser.add_argument("--trace", action="store_true", help="(with --seed) print every step")
    parser.add_argument("--mutation", choices=sorted(MUTATIONS), help="put one defect back")
    parser.add_argument("--processes", type=int, default=os.cpu_count(), help="in parallel")
    options = parser.parse_args()
    if options.seed is not None:
        return replay(options)
    seeds = range(options.start, options.start + options.seeds)
    began = time.monotonic()
    failures = run_seeds(seeds, processes=options.processes, mutation=options.mutation)
    seconds = time.monotonic() - began
    for failure in failures:
        print(f"seed {failure.seed} failed:")
        for problem in failure.problems[:5]:
            print(f"    {problem}")
        print(f"  replay: {failure.command}")
    print(
        f"{len(seeds)} seeds ({seeds.start}..{seeds.stop - 1}) in {seconds:.1f}s: "
        f"{len(failures)} failed"
        + (f", with the mutation {options.mutation}" if options.mutation else "")
    )
    if options.mutation:
        return 0 if failures else 1
    return 1 if failures else 0


def replay(options: argparse.Namespace) -> int:
    tasks = options.tasks.split(",") if options.tasks else None
    faults = (
        [] if options.faults == "none" else options.faults.split(",") if options.faults else None
    )
    scenario = scenario_of(options.seed, tasks, faults)
    print(scenario)
    if options.trace:
        logging.basicConfig(
            level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout
        )
        with mutated(options.mutation):
            observed = run(scenario, trace=True)
        print("\n".join(observed.trace))
    problems = check(scenario, options.mutation)
    for problem in problems:
        print(f"PROBLEM {problem}")
    print(f"seed {options.seed}: {'failed' if problems else 'every invariant held'}")
    return 1 if problems and not options.mutation else 0


if __name__ == "__main__":
    sys.exit(main())
