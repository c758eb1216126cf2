"""The invariants of the waits beyond peer calls (``scripts.lab.simulation.waits``, issue 31) can
fail: each is fed a real run's observation with one thing changed, as a defect would leave it,
and says so; the unchanged runs pass. (The mutations ``signal-consumed-twice`` and
``timer-fires-twice`` catch defects in whole runs.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from scripts.lab.simulation import waits
from scripts.lab.simulation.scenario import Scenario
from scripts.lab.simulation.world import Observed
from waystation.events import RecordedEvent

from .support import changed, events_of, first_run, has, run_of, streams_of

SEEDS = range(300)


def _waits(seed: int) -> bool:
    """Whether ``seed`` draws a signal, a timer or a ``FirstK`` pause (the others are not run)."""
    return any(
        task.signals
        or any(k is not None for k in task.until)
        or _kinds(task.rounds) - {"oracle", "researcher"}
        for task in Scenario.generate(seed).tasks
    )


def _kinds(rounds: Any) -> set[str]:
    return {kind for waits_of_round in rounds for kind, _ in waits_of_round}


def _first(wanted: Callable[[Observed], bool]) -> Observed:
    """The first run of ``SEEDS`` with waits that shows what a test needs."""
    return first_run(wanted, (seed for seed in SEEDS if _waits(seed)))


def _problems(observed: Observed) -> list[str]:
    return waits.problems(observed, streams_of(observed))


def _waits_of(observed: Observed, kind: str) -> dict[str, dict[str, Any]]:
    """Every wait of ``kind`` of every pause, by its id."""
    return {
        wait["subtask_id"]: wait
        for pause in events_of(observed, "TaskPaused")
        for wait in pause.data["calls"]
        if wait.get("kind", "call") == kind
    }


def _claims_of(observed: Observed, kind: str) -> list[RecordedEvent]:
    of_kind = _waits_of(observed, kind)
    return [e for e in events_of(observed, "SubtaskClaimed") if e.data["subtask_id"] in of_kind]


def test_runs_with_signals_timers_and_first_k_pauses_keep_them() -> None:
    kinds = set()
    for seed in SEEDS[:60]:
        if _waits(seed):
            observed = run_of(seed)
            assert _problems(observed) == [], seed
            kinds |= {e.event_type for e in observed.log}
    # (so that they could fail: these runs hold what the checks look at)
    assert {"SignalReceived", "SignalRefused", "TaskResumed"} <= kinds


def test_a_signal_taken_by_two_waits_or_by_a_wait_on_another_name_is_found() -> None:
    observed = _first(lambda o: len({c.data["message_id"] for c in _claims_of(o, "signal")}) >= 2)
    first, second = _claims_of(observed, "signal")[:2]
    twice = changed(observed, second, {"message_id": first.data["message_id"]})
    found = _problems(twice)
    assert has(found, f"signal {first.data['message_id']} taken by 2 waits")
    assert not _problems(observed)


def test_a_claim_of_a_signal_wait_must_record_its_payload() -> None:
    observed = _first(lambda o: bool(_claims_of(o, "signal")))
    claim = _claims_of(observed, "signal")[0]
    result = next(
        e
        for e in events_of(observed, "ResultRecorded")
        if e.data["subtask_id"] == claim.data["subtask_id"]
    )
    found = _problems(changed(observed, result, {"value": {"n": -1}}))
    assert has(found, claim.data["subtask_id"], "records ok {'n': -1}")
    # and the run resumed with it was given what the log now does not hold
    assert has(found, "whose outcome the log holds was given")


def test_a_timer_fired_before_its_deadline_or_twice_is_found() -> None:
    observed = _first(lambda o: bool(_claims_of(o, "timer")))
    claim = _claims_of(observed, "timer")[0]
    wait = claim.data["subtask_id"]
    pause = next(
        e
        for e in events_of(observed, "TaskPaused")
        if any(c["subtask_id"] == wait for c in e.data["calls"])
    )
    assert claim.recorded_at is not None
    later = claim.recorded_at.timestamp() + 5
    calls = [
        {**c, "deadline_at": later} if c["subtask_id"] == wait else c for c in pause.data["calls"]
    ]
    found = _problems(changed(observed, pause, {"calls": calls}))
    assert has(found, f"timer wait {wait} claimed by its deadline", "before it")
    at = observed.log.index(claim)
    twice = dataclasses.replace(observed, log=[*observed.log[: at + 2], *observed.log[at:]])
    assert has(_problems(twice), f"timer wait {wait} claimed 2 times")


def test_a_first_k_resume_must_give_up_exactly_the_open_waits_and_wait_for_its_rule() -> None:
    observed = _first(lambda o: any(e.data.get("abandoned") for e in events_of(o, "TaskResumed")))
    resume = next(e for e in events_of(observed, "TaskResumed") if e.data.get("abandoned"))
    found = _problems(changed(observed, resume, {"abandoned": resume.data["abandoned"][1:]}))
    assert has(found, f"pause #{resume.data['pause']} resumed giving up")
    # the pause's rule asks for one more success than it had: it resumed too early
    pause = next(
        e
        for e in events_of(observed, "TaskPaused")
        if e.stream_id == resume.stream_id and e.data["pause"] == resume.data["pause"]
    )
    stricter = changed(observed, pause, {"until": len(pause.data["calls"])})
    assert has(_problems(stricter), f"pause #{resume.data['pause']} resumed before its rule")


def test_what_a_signals_sender_heard_must_agree_with_the_log() -> None:
    def taken(o: Observed) -> bool:
        return any(
            a.get("result", {}).get("status") == "taken"
            for answers in o.signal_answers.values()
            for a in answers
        )

    observed = _first(taken)
    signal_id = next(
        s
        for s, answers in observed.signal_answers.items()
        if any(a.get("result", {}).get("status") == "taken" for a in answers)
    )
    received = next(
        e for e in events_of(observed, "SignalReceived") if e.data["signal_id"] == signal_id
    )
    found = _problems(changed(observed, received))
    assert has(found, f"signal {signal_id}: its sender was told 'taken', and the log holds no")
    unanswered = dataclasses.replace(
        observed, signal_answers={**observed.signal_answers, signal_id: []}
    )
    assert has(_problems(unanswered), f"signal {signal_id}: sent, and its sender never heard")
    refused = {"status": "error", "error": {"type": "undeliverable", "message": "no"}}
    only_refused = dataclasses.replace(
        observed, signal_answers={**observed.signal_answers, signal_id: [refused]}
    )
    assert has(_problems(only_refused), f"signal {signal_id}: its sender heard only")


def test_a_pending_wait_of_a_finished_task_is_found() -> None:
    observed = _first(lambda o: bool(_claims_of(o, "timer")))
    wait = _claims_of(observed, "timer")[0].data["subtask_id"]
    task_id = wait.rsplit(":", 2)[0]
    left = dataclasses.replace(observed, pending={wait: task_id})
    assert has(_problems(left), f"{task_id}: its wait {wait} is still pending")


def test_a_kept_signal_must_be_one_no_wait_took() -> None:
    observed = _first(
        lambda o: any(
            e.data["signal_id"]
            not in {c.data.get("message_id") for c in events_of(o, "SubtaskClaimed")}
            for e in events_of(o, "SignalReceived")
        )
    )
    claims = {c.data.get("message_id") for c in events_of(observed, "SubtaskClaimed")}
    kept = next(
        e for e in events_of(observed, "SignalReceived") if e.data["signal_id"] not in claims
    )
    # a claim naming it, which the fold does not count: it still keeps the signal
    claim = next(e for e in events_of(observed, "SubtaskClaimed") if e.stream_id == kept.stream_id)
    found = _problems(changed(observed, claim, {"message_id": kept.data["signal_id"]}))
    assert has(found, f"{kept.stream_id}: keeps the signals")


def test_a_run_given_less_than_the_log_held_when_it_began_ran_on_a_stale_copy() -> None:
    observed = _first(lambda o: any(any(held) for runs in o.logged.values() for held in runs))
    key, runs = next((k, runs) for k, runs in observed.logged.items() if any(runs))
    index, held = next((i, held) for i, held in enumerate(runs) if held)
    wait, outcome, value = held[0]
    other = "timeout" if outcome != "timeout" else "ok"
    changed = [*runs[:index], ((wait, other, value), *held[1:]), *runs[index + 1 :]]
    stale = dataclasses.replace(observed, logged={**observed.logged, key: changed})
    assert has(_problems(stale), f"began when the log held {other} {value} for {wait}")
