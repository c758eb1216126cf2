"""What the tests of the simulation's invariants share: real runs, found by what they show, and
their observation with one thing changed, as a defect would leave it."""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from scripts.lab.simulation.scenario import Scenario
from scripts.lab.simulation.world import Observed, run
from waystation.events import RecordedEvent

__all__ = ["changed", "events_of", "first_run", "has", "run_of", "streams_of"]


@functools.cache
def run_of(seed: int) -> Observed:
    """The run of ``seed`` (each run once per test session)."""
    return run(Scenario.generate(seed))


def first_run(wanted: Callable[[Observed], bool], seeds: Iterable[int]) -> Observed:
    """The run of the first of ``seeds`` that shows what a test needs."""
    for seed in seeds:
        observed = run_of(seed)
        if wanted(observed):
            return observed
    raise AssertionError("no seed shows it: widen the seeds")


def streams_of(observed: Observed) -> dict[str, list[RecordedEvent]]:
    streams: dict[str, list[RecordedEvent]] = defaultdict(list)
    for event in observed.log:
        streams[event.stream_id].append(event)
    return streams


def events_of(observed: Observed, event_type: str) -> list[RecordedEvent]:
    return [e for e in observed.log if e.event_type == event_type]


def changed(
    observed: Observed, event: RecordedEvent, data: dict[str, Any] | None = None
) -> Observed:
    """``observed`` with ``event``'s data changed (None: without ``event``)."""
    log = [
        e if e is not event else dataclasses.replace(e, data={**e.data, **data})
        for e in observed.log
        if e is not event or data is not None
    ]
    return dataclasses.replace(observed, log=log)


def has(found: list[str], *parts: str) -> bool:
    """Whether a line of ``found`` holds every one of ``parts``."""
    return any(all(part in line for part in parts) for line in found)
