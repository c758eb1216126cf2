"""The invariants that hold the simulated world against the log (``scripts.lab.simulation.reality``)
can fail: each is fed a real run's observation with one thing changed, as a defect would leave
it, and says so; the unchanged runs pass. (The mutations catch them too, in whole runs.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from scripts.lab.simulation import reality
from scripts.lab.simulation.faults import Chronicle
from scripts.lab.simulation.world import Observed
from waystation.brokers.memory import StoredMessage
from waystation.protocol.wire import HEADER_QUEUE, HEADER_REASON

from .support import changed, events_of, first_run, has, run_of, streams_of

SEEDS = range(80)


def _first(wanted: Callable[[Observed], bool]) -> Observed:
    return first_run(wanted, SEEDS)


def _problems(observed: Observed) -> list[str]:
    return reality.problems(observed, streams_of(observed))


def _chronicle(observed: Observed, **changes: Any) -> Observed:
    return dataclasses.replace(
        observed, chronicle=dataclasses.replace(observed.chronicle, **changes)
    )


@pytest.mark.parametrize("seed", [0, 7, 51])
def test_a_run_as_it_happened_keeps_them(seed: int) -> None:
    assert _problems(run_of(seed)) == []


def test_a_reply_the_log_does_not_hold_is_found_and_a_claim_nobody_sent_too() -> None:
    observed = _first(
        lambda o: any(e.data.get("message_id") for e in events_of(o, "SubtaskClaimed"))
    )
    claim = next(e for e in events_of(observed, "SubtaskClaimed") if e.data.get("message_id"))
    subtask, message_id = claim.data["subtask_id"], claim.data["message_id"]
    found = _problems(changed(observed, claim, {"message_id": "forged"}))
    assert has(found, f"reply {message_id} to {subtask}", "is not in the log")
    assert has(found, f"{subtask}: the log records reply forged, which nobody sent")


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
    observed = _first(
        lambda o: any(e.data.get("message_id") for e in events_of(o, "SubtaskClaimed"))
    )
    claim = next(e for e in events_of(observed, "SubtaskClaimed") if e.data.get("message_id"))
    message_id = claim.data["message_id"]
    reply = next(m for m in observed.published if m.properties.get("message_id") == message_id)
    lost = changed(observed, claim)
    limit = 2 * observed.scenario.delivery_limit
    past = _problems(_dead_at_the_limit(lost, reply, limit + 1))
    assert not has(past, f"reply {message_id} to", "is not in the log")
    assert not has(past, f"dead letter {message_id}")
    within = _problems(_dead_at_the_limit(lost, reply, limit))
    assert has(within, f"dead letter {message_id}", f"delivery-limit, taken back {limit} times")


def test_a_peer_request_published_before_its_pause_committed_is_found() -> None:
    observed = _first(lambda o: bool(events_of(o, "TaskPaused")))
    pause = events_of(observed, "TaskPaused")[0]
    subtask = pause.data["calls"][0]["subtask_id"]
    commits = {**observed.chronicle.commits, pause.global_position: 10**9}
    found = _problems(_chronicle(observed, commits=commits))
    assert has(found, f"peer request {subtask} was published before its pause committed (G5)")


def test_a_call_that_never_reached_its_peer_is_found() -> None:
    observed = _first(lambda o: bool(events_of(o, "TaskPaused")))
    subtask = events_of(observed, "TaskPaused")[0].data["calls"][0]["subtask_id"]
    sent = [s for s in observed.chronicle.sent if s.message.message_id != subtask]
    found = _problems(_chronicle(observed, sent=sent))
    assert has(found, f"call {subtask} of a committed pause never reached its peer (G4)")


def test_a_cancel_naming_other_calls_than_the_outstanding_ones_is_found() -> None:
    observed = _first(lambda o: any(e.data["pending"] for e in events_of(o, "TaskCancelled")))
    cancel = next(e for e in events_of(observed, "TaskCancelled") if e.data["pending"])
    subtask = cancel.data["pending"][0]["subtask_id"]
    found = _problems(changed(observed, cancel, {"pending": []}))
    assert has(found, f"{cancel.stream_id}: its cancel names [], while ['{subtask}'")
    assert has(found, f"sent the cancel of {subtask}, and no committed cancel or timeout")


def test_a_call_cancelled_or_timed_out_whose_peer_was_never_told_is_found() -> None:
    observed = _first(
        lambda o: any(e.data["outcome"] == "timeout" for e in events_of(o, "ResultRecorded"))
    )
    timeout = next(
        e for e in events_of(observed, "ResultRecorded") if e.data["outcome"] == "timeout"
    )
    subtask = timeout.data["subtask_id"]
    sent = [s for s in observed.chronicle.sent if s.message.message_id != f"{subtask}:cancel"]
    found = _problems(_chronicle(observed, sent=sent))
    assert has(found, f"call {subtask} was cancelled or timed out, and its peer never told")


@pytest.mark.parametrize("reason", ["late", "duplicate"])
def test_an_ignored_reply_must_say_why_truly(reason: str) -> None:
    observed = _first(
        lambda o: any(e.data["reason"] == reason for e in events_of(o, "ReplyIgnored"))
    )
    ignored = next(e for e in events_of(observed, "ReplyIgnored") if e.data["reason"] == reason)
    other = {"late": "duplicate", "duplicate": "late"}[reason]
    found = _problems(changed(observed, ignored, {"reason": other}))
    assert has(found, f"ignored as {other}, not {reason}")
    found = _problems(changed(observed, ignored, {"reason": "unknown-call"}))
    assert has(found, "recorded for a call the log did not hold", "(G5)")


def test_a_dead_letter_or_a_call_error_the_scenario_cannot_produce_is_found() -> None:
    observed = _first(
        lambda o: (
            any(m.headers.get(HEADER_REASON) == "handler-failed" for m in o.dead_letters)
            and any(e.data["outcome"] == "error" for e in events_of(o, "ResultRecorded"))
        )
    )
    # a worker's own dead letter (a hostile message's may already be "invalid-json", and rightly)
    letter = next(
        m for m in observed.dead_letters if m.headers.get(HEADER_REASON) == "handler-failed"
    )
    forged = dataclasses.replace(letter, headers={**letter.headers, HEADER_REASON: "invalid-json"})
    letters = [forged if m is letter else m for m in observed.dead_letters]
    found = _problems(dataclasses.replace(observed, dead_letters=letters))
    assert has(found, "the reason 'invalid-json' is not one this scenario can produce")
    error = next(e for e in events_of(observed, "ResultRecorded") if e.data["outcome"] == "error")
    found = _problems(changed(observed, error, {"error": {"type": "unroutable"}}))
    assert has(found, f"{error.data['subtask_id']}: no peer here fails as")


def test_an_ack_before_the_effect_of_its_delivery_is_found_for_every_kind() -> None:
    kinds = {"reply", "task", "request", "resume", "cancel"}

    def acked_kinds(observed: Observed) -> set[str]:
        found = _problems(_chronicle(observed, acked=_acked_first(observed.chronicle)))
        return {kind for kind in kinds if has(found, f" acked {kind} ", "(G1)")}

    for seed in SEEDS:
        kinds -= acked_kinds(run_of(seed))
        if not kinds:
            return
    raise AssertionError(f"an early ack of a {kinds} went unnoticed")


def _acked_first(chronicle: Chronicle) -> list[Any]:
    """Every ack as if sent before anything else happened."""
    return [dataclasses.replace(acked, seq=0) for acked in chronicle.acked]
