"""The invariants of the broker saying no (``scripts.lab.simulation.refusals``) can fail:
each is fed a real run's observation with one thing changed, as a defect would leave it, and
says so; the unchanged runs pass. (The mutations ``relay-stalls-on-a-refusal``,
``copies-unsanitized`` and ``resume-in-place-ignores-the-policy`` catch their defects in
whole runs.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from scripts.lab.simulation import refusals
from scripts.lab.simulation.faults import Refused
from scripts.lab.simulation.reality import hostile_tag
from scripts.lab.simulation.world import Observed

from .support import first_run, streams_of

SEEDS = range(200)


def _first(wanted: Callable[[Observed], bool]) -> Observed:
    return first_run(wanted, SEEDS)


def _problems(observed: Observed) -> list[str]:
    return refusals.problems(observed, streams_of(observed))


def _with_chronicle(observed: Observed, **changes: object) -> Observed:
    return dataclasses.replace(
        observed, chronicle=dataclasses.replace(observed.chronicle, **changes)
    )


def test_the_runs_drawn_with_refusals_and_hostile_publishers_keep_them() -> None:
    refusing = _first(lambda o: bool(o.chronicle.refused))
    hostile = _first(lambda o: bool(o.hostile_sent))
    assert _problems(refusing) == [] and _problems(hostile) == []


def test_a_committed_request_published_late_is_a_stalled_relay() -> None:
    observed = _first(lambda o: any(e.event_type == "TaskPaused" for e in o.log))
    pause = next(e for e in observed.log if e.event_type == "TaskPaused")
    subtask = pause.data["calls"][0]["subtask_id"]
    late = [
        dataclasses.replace(s, at=s.at + refusals.RELAY_BOUND + 1)
        if s.message.message_id == subtask
        else s
        for s in observed.chronicle.sent
    ]
    assert any("a relay stalled" in p for p in _problems(_with_chronicle(observed, sent=late)))
    never = [s for s in observed.chronicle.sent if s.message.message_id != subtask]
    assert any("never published" in p for p in _problems(_with_chronicle(observed, sent=never)))


def test_a_refused_message_never_sent_again_nor_dead_lettered_is_lost() -> None:
    observed = _first(lambda o: any(e.event_type == "TaskPaused" for e in o.log))
    pause = next(e for e in observed.log if e.event_type == "TaskPaused")
    subtask = pause.data["calls"][0]["subtask_id"]
    request = next(s for s in observed.chronicle.sent if s.message.message_id == subtask)
    refused = Refused(0, request.worker, request.message, "the broker nacked it", request.at)
    without = [s for s in observed.chronicle.sent if s.message.message_id != subtask]
    lost = _with_chronicle(observed, sent=without, refused=[refused])
    assert any("neither published later nor dead-lettered" in p for p in _problems(lost))


def test_a_hostile_message_that_is_not_dead_lettered_is_lost() -> None:
    observed = _first(lambda o: bool(o.hostile_sent))
    letters = [m for m in observed.dead_letters if hostile_tag(m.body) is None]
    assert any(
        "was not dead-lettered" in p
        for p in _problems(dataclasses.replace(observed, dead_letters=letters))
    )
