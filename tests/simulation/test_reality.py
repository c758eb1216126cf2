"""The invariants that hold the simulated world against the log (``scripts.lab.simulation.reality``)
can fail: each is fed a real run's observation with one thing changed, as a defect would leave
it, and says so; the unchanged runs pass. (The mutations catch them too, in whole runs.)"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from scripts.lab.simulation import reality
from scripts.lab.simulation.faults import Chronicle
from scripts.lab.simulation.scenario import Scenario
from scripts.lab.simulation.world import Observed, run
from waystation.brokers.memory import StoredMessage
from waystation.events import RecordedEvent
from waystation.protocol.wire import HEADER_QUEUE, HEADER_REASON

SEEDS = range(80)


@functools.cache
def _observed(seed: int) -> Observed:
    return run(Scenario.generate(seed))


def _first(wanted: Callable[[Observed], bool]) -> Observed:
    """The first run of ``SEEDS`` that shows what a test needs."""
    for seed in SEEDS:
        observed = _observed(seed)
        if wanted(observed):
            return observed
    raise AssertionError("no seed shows it: widen SEEDS")


def _problems(observed: Observed) -> list[str]:
    streams: dict[str, list[RecordedEvent]] = defaultdict(list)
    for event in observed.log:
        streams[event.stream_id].append(event)
    return reality.problems(observed, streams)


def _events(observed: Observed, event_type: str) -> list[RecordedEvent]:
    return [e for e in observed.log if e.event_type == event_type]


def _changed(
    observed: Observed, event: RecordedEvent, data: dict[str, Any] | None = None
) -> Observed:
    """``observed`` with ``event``'s data changed (None: without ``event``)."""
    log = [
        e if e is not event else dataclasses.replace(e, data={**e.data, **data})
        for e in observed.log
        if e is not event or data is not None
    ]
    return dataclasses.replace(observed, log=log)


def _chronicle(observed: Observed, **changes: Any) -> Observed:
    return dataclasses.replace(
        observed, chronicle=dataclasses.replace(observed.chronicle, **changes)
    )


def _has(found: list[str], *parts: str) -> bool:
    return any(all(part in line for part in parts) for line in found)


@pytest.mark.parametrize("seed", [0, 7, 51])
def test_a_run_as_it_happened_keeps_them(seed: int) -> None:
    assert _problems(_observed(seed)) == []


def test_a_reply_the_log_does_not_hold_is_found_and_a_claim_nobody_sent_too() -> None:
    observed = _first(lambda o: any(e.data.get("message_id") for e in _events(o, "SubtaskClaimed")))
    claim = next(e for e in _events(observed, "SubtaskClaimed") if e.data.get("message_id"))
    subtask, message_id = claim.data["subtask_id"], claim.data["message_id"]
    found = _problems(_changed(observed, claim, {"message_id": "forged"}))
    assert _has(found, f"reply {message_id} to {subtask}", "is not in the log")
    assert _has(found, f"{subtask}: the log records reply forged, which nobody sent")


def _dead_at_the_limit(observed: Observed, reply: StoredMessage, count: int) -> Observed:
    """``observed`` with a dead letter of ``reply``, as a worker makes one at the limit."""
    letter = StoredMessage(
        reply.body,
        dict(reply.properties),
        {
            "x-delivery-count": count,
            HEADER_REASON: "delivery-limit",
            HEADER_QUEUE: reply.routing_key,
        },
        reply.routing_key,
        enqueued_at=reply.enqueued_at,
    )
    return dataclasses.replace(
        observed,
        published=[*observed.published, letter],
        dead_letters=[*observed.dead_letters, letter],
    )


def test_a_reply_missing_from_the_log_is_excused_only_dead_lettered_past_the_crash_limit() -> None:
    observed = _first(lambda o: any(e.data.get("message_id") for e in _events(o, "SubtaskClaimed")))
    claim = next(e for e in _events(observed, "SubtaskClaimed") if e.data.get("message_id"))
    message_id = claim.data["message_id"]
    reply = next(m for m in observed.published if m.properties.get("message_id") == message_id)
    lost = _changed(observed, claim)
    limit = 2 * observed.scenario.delivery_limit
    past = _problems(_dead_at_the_limit(lost, reply, limit + 1))
    assert not _has(past, f"reply {message_id} to", "is not in the log")
    assert not _has(past, f"dead letter {message_id}")
    within = _problems(_dead_at_the_limit(lost, reply, limit))
    assert _has(within, f"dead letter {message_id}", f"delivery-limit, taken back {limit} times")


def test_a_peer_request_published_before_its_pause_committed_is_found() -> None:
    observed = _first(lambda o: bool(_events(o, "TaskPaused")))
    pause = _events(observed, "TaskPaused")[0]
    subtask = pause.data["calls"][0]["subtask_id"]
    commits = {**observed.chronicle.commits, pause.global_position: 10**9}
    found = _problems(_chronicle(observed, commits=commits))
    assert _has(found, f"peer request {subtask} was published before its pause committed (G5)")


def test_a_call_that_never_reached_its_peer_is_found() -> None:
    observed = _first(lambda o: bool(_events(o, "TaskPaused")))
    subtask = _events(observed, "TaskPaused")[0].data["calls"][0]["subtask_id"]
    sent = [s for s in observed.chronicle.sent if s.message.message_id != subtask]
    found = _problems(_chronicle(observed, sent=sent))
    assert _has(found, f"call {subtask} of a committed pause never reached its peer (G4)")


def test_a_cancel_naming_other_calls_than_the_outstanding_ones_is_found() -> None:
    observed = _first(lambda o: any(e.data["pending"] for e in _events(o, "TaskCancelled")))
    cancel = next(e for e in _events(observed, "TaskCancelled") if e.data["pending"])
    subtask = cancel.data["pending"][0]["subtask_id"]
    found = _problems(_changed(observed, cancel, {"pending": []}))
    assert _has(found, f"{cancel.stream_id}: its cancel names [], while ['{subtask}'")
    assert _has(found, f"sent the cancel of {subtask}, and no committed cancel or timeout")


def test_a_call_cancelled_or_timed_out_whose_peer_was_never_told_is_found() -> None:
    observed = _first(
        lambda o: any(e.data["outcome"] == "timeout" for e in _events(o, "ResultRecorded"))
    )
    timeout = next(e for e in _events(observed, "ResultRecorded") if e.data["outcome"] == "timeout")
    subtask = timeout.data["subtask_id"]
    sent = [s for s in observed.chronicle.sent if s.message.message_id != f"{subtask}:cancel"]
    found = _problems(_chronicle(observed, sent=sent))
    assert _has(found, f"call {subtask} was cancelled or timed out, and its peer never told")


@pytest.mark.parametrize("reason", ["late", "duplicate"])
def test_an_ignored_reply_must_say_why_truly(reason: str) -> None:
    observed = _first(lambda o: any(e.data["reason"] == reason for e in _events(o, "ReplyIgnored")))
    ignored = next(e for e in _events(observed, "ReplyIgnored") if e.data["reason"] == reason)
    other = {"late": "duplicate", "duplicate": "late"}[reason]
    found = _problems(_changed(observed, ignored, {"reason": other}))
    assert _has(found, f"ignored as {other}, not {reason}")
    found = _problems(_changed(observed, ignored, {"reason": "unknown-call"}))
    assert _has(found, "recorded for a call the log did not hold", "(G5)")


def test_a_dead_letter_or_a_call_error_the_scenario_cannot_produce_is_found() -> None:
    observed = _first(
        lambda o: (
            any(m.headers.get(HEADER_REASON) == "handler-failed" for m in o.dead_letters)
            and any(e.data["outcome"] == "error" for e in _events(o, "ResultRecorded"))
        )
    )
    # a worker's own dead letter (a hostile message's may already be "invalid-json", and rightly)
    letter = next(
        m for m in observed.dead_letters if m.headers.get(HEADER_REASON) == "handler-failed"
    )
    forged = dataclasses.replace(letter, headers={**letter.headers, HEADER_REASON: "invalid-json"})
    letters = [forged if m is letter else m for m in observed.dead_letters]
    found = _problems(dataclasses.replace(observed, dead_letters=letters))
    assert _has(found, "the reason 'invalid-json' is not one this scenario can produce")
    error = next(e for e in _events(observed, "ResultRecorded") if e.data["outcome"] == "error")
    found = _problems(_changed(observed, error, {"error": {"type": "unroutable"}}))
    assert _has(found, f"{error.data['subtask_id']}: no peer here fails as")


def test_an_ack_before_the_effect_of_its_delivery_is_found_for_every_kind() -> None:
    kinds = {"reply", "task", "request", "resume", "cancel"}

    def acked_kinds(observed: Observed) -> set[str]:
        found = _problems(_chronicle(observed, acked=_acked_first(observed.chronicle)))
        return {kind for kind in kinds if _has(found, f" acked {kind} ", "(G1)")}

    for seed in SEEDS:
        kinds -= acked_kinds(_observed(seed))
        if not kinds:
            return
    raise AssertionError(f"an early ack of a {kinds} went unnoticed")


def _acked_first(chronicle: Chronicle) -> list[Any]:
    """Every ack as if sent before anything else happened."""
    return [dataclasses.replace(acked, seq=0) for acked in chronicle.acked]
