"""scripts/chaos's pure parts: the fault plan, the special tasks and the hostile messages, and
the checks of results, dead letters and of the log (some shared with the tests:
scripts/lab/harness/checks.py), each shown to catch what it is there to catch (no services)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pamqp.header
import pytest

from scripts.lab.harness.checks import LogRow, log_figures, result_figures
from waystation.brokers.amqp.deadletters import DeadLetter
from waystation.brokers.metadata import HEADER_UNDECODABLE, guard_content_header
from waystation.events.codec import dumps, loads

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from _chaos.answers import answer_figures, letter_task_id  # noqa: E402
from _chaos.collector import counter_values  # noqa: E402
from _chaos.hostile import (  # noqa: E402
    HOSTILE_KINDS,
    HostileSent,
    hostile_figures,
    hostile_message,
    hostile_plan,
    hostile_tag,
)
from _chaos.plan import TaskMix, expected_answer, plan_faults, plan_tasks  # noqa: E402

K, ROUNDS = 3, 2


def test_the_fault_plan_is_a_function_of_its_seed_and_spreads_the_faults_over_the_span() -> None:
    plan = plan_faults(1000, kills=20, closes=3, pg_restarts=1, seed=7)
    assert plan == plan_faults(1000, kills=20, closes=3, pg_restarts=1, seed=7)
    assert plan != plan_faults(1000, kills=20, closes=3, pg_restarts=1, seed=8)
    kinds = [fault.kind for fault in plan]
    assert (kinds.count("kill"), kinds.count("close"), kinds.count("pg-restart")) == (20, 3, 1)
    width = 1000 / 24
    for index, fault in enumerate(plan):
        # one fault per slice of the span, in order
        assert index * width <= fault.after_results < (index + 1) * width + 1
        assert 0 <= fault.delay <= 1


def _result(task_id: str, n: int, total: int, status: str = "ok") -> bytes:
    return dumps(
        {"error": None, "result": {"n": n, "total": total}, "status": status, "task_id": task_id}
    )


EXPECTED = {f"t{n}": {"n": n, "total": 10 * n} for n in range(4)}


def test_the_result_figures_count_what_is_missing_wrong_and_repeated() -> None:
    messages = [
        ("t0", _result("t0", 0, 0), False),
        ("t0", _result("t0", 0, 0), True),  # the broker delivered it again
        ("t1", _result("t1", 1, 10), False),
        ("t1", _result("t1", 1, 10), False),  # a worker published it twice
        ("t2", _result("t2", 2, 20), False),
        ("t2", _result("t2", 2, 21), False),  # a second, different result
        ("stranger", _result("stranger", 9, 9), False),
    ]
    figures = result_figures(EXPECTED, messages)
    assert figures.missing == ["t3"]
    assert figures.wrong == ["t2"]
    assert (figures.duplicates, figures.duplicates_redelivered) == (3, 1)
    assert figures.duplicates_published == 2
    assert figures.unexpected == 1
    assert (figures.messages, figures.answered) == (7, 3)


def test_a_wrong_first_result_or_an_error_is_wrong() -> None:
    figures = result_figures(
        {"t0": {"n": 0, "total": 5}, "t1": {"n": 1, "total": 5}},
        [("t0", _result("t0", 0, 4), False), ("t1", _result("t1", 1, 5, "error"), False)],
    )
    assert figures.wrong == ["t0", "t1"]


def _stream(task_id: str) -> list[LogRow]:
    """The events of a task that went right: 2 pauses of 3 calls each, completed once."""
    rows: list[LogRow] = [(task_id, "TaskStarted", None, None, None)]
    for pause in range(1, ROUNDS + 1):
        rows.append((task_id, "TaskPaused", None, pause, None))
        for i in range(K):
            subtask = f"{task_id}:{pause}:{i}"
            rows += [
                (task_id, "SubtaskClaimed", subtask, pause, None),
                (task_id, "ResultRecorded", subtask, pause, None),
            ]
        rows.append((task_id, "TaskResumed", None, pause, None))
    return [*rows, (task_id, "TaskCompleted", None, None, None)]


def test_a_log_that_went_right_has_no_problem() -> None:
    rows = _stream("a") + _stream("b")
    rows.insert(5, ("a", "ReplyIgnored", "a:1:0", 1, "duplicate"))
    figures = log_figures(["a", "b"], rows, K, ROUNDS)
    assert figures.problems() == 0
    assert figures.reply_ignored == {"duplicate": 1}
    assert figures.events["TaskCompleted"] == 2


def test_the_log_figures_catch_each_way_a_stream_can_go_wrong() -> None:
    twice_completed = [*_stream("done-twice"), ("done-twice", "TaskCompleted", None, None, None)]
    resumed_twice = _stream("resumed-twice")
    resumed_twice.insert(10, ("resumed-twice", "TaskResumed", None, 1, None))
    claimed_twice = _stream("claimed-twice")
    claimed_twice.insert(4, ("claimed-twice", "SubtaskClaimed", "claimed-twice:1:0", 1, None))
    never_claimed = [r for r in _stream("unclaimed") if r[2] != "unclaimed:2:1"]
    stuck = _stream("stuck")[:-1]
    rows = [
        *twice_completed,
        *resumed_twice,
        *claimed_twice,
        *never_claimed,
        *stuck,
        ("stranger", "TaskStarted", None, None, None),
        # a researcher's task redelivered after its worker died records its completion
        ("stuck:1:0", "TaskStarted", None, None, None),
        ("stuck:1:0", "TaskCompleted", None, None, None),
        # ...but a sub-task's stream that is anything else is not expected
        ("stuck:1:1", "TaskStarted", None, None, None),
    ]
    tasks = ["done-twice", "resumed-twice", "claimed-twice", "unclaimed", "stuck", "lost"]
    figures = log_figures(tasks, rows, K, ROUNDS)
    assert figures.not_completed_once == ["done-twice", "stuck", "lost"]
    assert figures.pauses_resumed_twice == ["resumed-twice pause 1: 2 TaskResumed"]
    assert figures.claims_not_once[:2] == ["claimed-twice:1:0: 2 claims", "unclaimed:2:1: 0 claims"]
    # the task with no stream at all: none of its 6 sub-tasks claimed
    assert len(figures.claims_not_once) == 2 + K * ROUNDS
    assert figures.unexpected_streams == ["stranger", "stuck:1:1"]


def test_a_task_expected_to_fail_must_end_in_one_failure_and_no_completion() -> None:
    failed = [*_stream("over")[:-1], ("over", "TaskFailed", None, None, None)]
    completed_instead = _stream("completed")
    both = [*_stream("both")[:-1], ("both", "TaskFailed", None, None, None)]
    both.insert(-1, ("both", "TaskCompleted", None, None, None))
    figures = log_figures(
        ["over", "completed", "both", "plain"],
        [*failed, *completed_instead, *both, *_stream("plain")],
        K,
        ROUNDS,
        failed=["over", "completed", "both"],
    )
    assert figures.not_completed_once == ["completed", "both"]
    # and a plain task that failed is caught as before
    assert log_figures(["over"], failed, K, ROUNDS).not_completed_once == ["over"]


# ---- when the broker says no ------------------------------------------------------------------


def test_the_special_tasks_are_a_function_of_the_seed_and_leave_the_held_back_tail_plain() -> None:
    mix = TaskMix(full_share=0.03, never_drained=0.34, oversized_share=0.01, over_broker=True)
    kinds = plan_tasks(5000, 60, mix, seed=7)
    assert kinds == plan_tasks(5000, 60, mix, seed=7)
    assert kinds != plan_tasks(5000, 60, mix, seed=8)
    counts = Counter(kinds)
    assert counts["full-never"] + counts["full-drained"] == 150
    assert counts["full-never"] == 51
    assert (counts["over-worker"], counts["over-broker"]) == (25, 25)
    assert set(kinds[-60:]) == {"normal"}
    # a few of each even in a small run; none when the share is zero
    small = Counter(plan_tasks(50, 10, TaskMix(0.12, 0.34, 0.08, True), seed=1))
    assert (small["full-drained"], small["full-never"]) == (4, 2)
    assert (small["over-worker"], small["over-broker"]) == (2, 2)
    assert set(plan_tasks(50, 10, TaskMix(), seed=1)) == {"normal"}
    # without a broker limit every oversized task is over the workers'
    alone = Counter(plan_tasks(100, 10, TaskMix(oversized_share=0.05), seed=1))
    assert (alone["over-worker"], alone["over-broker"]) == (5, 0)
    with pytest.raises(ValueError):
        plan_tasks(10, 9, TaskMix(full_share=0.5), seed=1)


def _letter(
    reason: str, body: bytes = b"", correlation_id: str | None = None, message_id: str | None = None
) -> DeadLetter:
    return DeadLetter(message_id, correlation_id, None, reason, "", None, body)


def test_a_dead_letter_names_its_task_by_its_body_correlation_or_message_id_or_call() -> None:
    tasks = {"t1", "t2", "t3", "t4"}
    assert letter_task_id(_letter("refused", _result("t1", 1, 10)), tasks) == "t1"
    assert letter_task_id(_letter("too-large", correlation_id="t2"), tasks) == "t2"
    assert letter_task_id(_letter("too-large", message_id="t3:result"), tasks) == "t3"
    resume = dumps({"task_id": "t4", "pause": 2})
    assert letter_task_id(_letter("handler-failed", resume), tasks) == "t4"
    assert letter_task_id(_letter("x", correlation_id="t4:2:1"), tasks) == "t4"
    assert letter_task_id(_letter("x", b"{nope", correlation_id="stranger"), tasks) is None


def _error(task_id: str, kind: str, message: str = "") -> bytes:
    return dumps(
        {"status": "error", "error": {"type": kind, "message": message}, "task_id": task_id}
    )


def test_each_kind_of_task_is_answered_as_it_expects_and_every_dead_letter_is_explained() -> None:
    expected = {
        "plain": expected_answer("normal", {"n": 1, "total": 10}),
        "drained": expected_answer("full-drained", {"n": 2, "total": 20}),
        "never": expected_answer("full-never", {"n": 3, "total": 30}),
        "worker": expected_answer("over-worker", {"n": 4, "total": 40}),
        "broker": expected_answer("over-broker", {"n": 5, "total": 50}),
    }
    messages = [
        ("plain", _result("plain", 1, 10), False),
        ("drained", _result("drained", 2, 20), False),
        ("worker", _error("worker", "MessageTooLarge"), False),
        ("broker", _error("broker", "undeliverable-result", "first"), False),
        # a copy of the error that says another thing of the broker is the same answer
        ("broker", _error("broker", "undeliverable-result", "second"), False),
    ]
    letters = [
        _letter("refused", _result("never", 3, 30), correlation_id="never"),
        _letter("too-large", correlation_id="broker", message_id="broker:result"),
        _letter("too-large", correlation_id="broker", message_id="broker:result"),
        _letter("handler-failed", dumps({"task_id": "worker", "pause": 2})),
    ]
    figures = answer_figures(expected, messages, letters)
    assert (figures.missing, figures.wrong, figures.unexplained_letters) == ([], [], [])
    assert (figures.answered, figures.by_result, figures.by_letter) == (5, 4, 1)
    assert figures.by_kind["full-never"] == {"tasks": 1, "answered": 1, "by_dead_letter": 1}
    assert figures.duplicates == 1 and figures.letters == 4


def test_the_answer_figures_catch_each_way_a_task_can_be_answered_wrong() -> None:
    expected = {
        "lost": expected_answer("normal", {"n": 1, "total": 10}),
        "error-instead": expected_answer("full-drained", {"n": 2, "total": 20}),
        "never-got-result": expected_answer("full-never", {"n": 3, "total": 30}),
        "never-lost": expected_answer("full-never", {"n": 4, "total": 40}),
        "never-wrong-body": expected_answer("full-never", {"n": 5, "total": 50}),
        "worker-ok": expected_answer("over-worker", {"n": 6, "total": 60}),
        "broker-other-error": expected_answer("over-broker", {"n": 7, "total": 70}),
        "plain-dead": expected_answer("normal", {"n": 8, "total": 80}),
    }
    messages = [
        ("error-instead", _error("error-instead", "MessageTooLarge"), False),
        ("never-got-result", _result("never-got-result", 3, 30), False),
        ("worker-ok", _result("worker-ok", 6, 60), False),
        ("broker-other-error", _error("broker-other-error", "MessageTooLarge"), False),
        ("plain-dead", _result("plain-dead", 8, 80), False),
    ]
    letters = [
        _letter("refused", _result("never-got-result", 3, 30)),
        _letter("refused", _result("never-wrong-body", 5, 51)),
        # a dead letter that no kind explains: a plain task's, a reason another kind's
        _letter("handler-failed", correlation_id="plain-dead"),
        _letter("too-large", correlation_id="worker-ok"),
        _letter("invalid-json", b"{", correlation_id="nobody"),
    ]
    figures = answer_figures(expected, messages, letters)
    assert figures.missing == ["lost", "never-lost"]
    assert figures.wrong == [
        "error-instead",
        "never-got-result",
        "never-wrong-body",
        "worker-ok",
        "broker-other-error",
    ]
    assert len(figures.unexplained_letters) == 3
    assert figures.unexplained_letters[0].startswith("plain-dead: handler-failed")


def test_each_hostile_kind_is_what_it_says_to_the_workers_guard() -> None:
    """A kind a worker is to dead-letter as undecodable is undecodable to its frame guard; the
    invalid-JSON one decodes (its header is only written back differently); every body carries
    its tag."""
    for kind, reason in HOSTILE_KINDS.items():
        properties, body = hostile_message(kind, "hostile-1-2", "chaos.answers")
        assert hostile_tag(body) == "hostile-1-2"
        payload = b"\x00\x3c\x00\x00" + len(body).to_bytes(8, "big") + properties
        guarded, _ = guard_content_header(payload)
        header = pamqp.header.ContentHeader()
        header.unmarshal(guarded)
        headers = header.properties.headers or {}
        if reason == "undecodable-metadata":
            assert HEADER_UNDECODABLE in headers, kind
            assert header.properties.reply_to == "chaos.answers", kind
        elif reason == "invalid-json":
            assert guarded is payload, kind
            with pytest.raises(ValueError):
                loads(body)
    assert Counter(hostile_plan(30, seed=4)) == dict.fromkeys(HOSTILE_KINDS, 3)
    assert hostile_plan(30, seed=4) == hostile_plan(30, seed=4)


def test_the_hostile_figures_account_for_every_message() -> None:
    sent = [
        HostileSent("hostile-1-0", "headers-nested-3000-deep", "q", "routed", 1),
        HostileSent("hostile-1-1", "long-string-not-utf8-invalid-body", "q", "routed", 1),
        HostileSent("hostile-1-2", "unknown-field-type-tag", "q", "refused", 1, ["541"]),
        HostileSent("hostile-1-3", "table-length-lies", "q", "routed", 1),  # taken after all
        HostileSent("hostile-1-4", "type-not-utf8", "q", "routed", 2),  # lost
        HostileSent("hostile-1-5", "message-id-not-utf8", "q", "routed", 1),  # wrong reason
        HostileSent("hostile-1-6", "correlation-id-not-utf8", "q", "refused", 1, ["541"]),
        HostileSent("hostile-1-7", "header-key-not-utf8", "q", "error", 10, ["closed"]),
    ]

    def letter(tag: str, reason: str) -> DeadLetter:
        return _letter(reason, dumps({"hostile": tag}))

    letters = [
        letter("hostile-1-0", "undecodable-metadata"),
        letter("hostile-1-0", "undecodable-metadata"),  # dead-lettered twice: one message
        _letter("invalid-json", b"{not json hostile-1-1"),
        letter("hostile-1-3", "undecodable-metadata"),
        letter("hostile-1-5", "invalid-json"),
    ]
    answers = [
        ("hostile-1-0", _error("hostile-1-0", "undecodable-metadata")),
        ("hostile-1-1", _error("hostile-1-1", "undecodable-metadata")),  # not its reason
        ("hostile-1-3", _result("hostile-1-3", 1, 1)),  # no error at all
    ]
    figures = hostile_figures(sent, letters, answers)
    assert (figures.sent, figures.routed, figures.refused_by_broker) == (8, 5, 2)
    assert figures.dead_lettered == 4 and figures.letters == 5
    assert figures.reasons == {"undecodable-metadata": 2, "invalid-json": 2}
    assert [m.split()[0] for m in figures.missing] == ["hostile-1-4"]
    assert [m.split()[0] for m in figures.wrong_reason] == [
        "hostile-1-5",
        "hostile-1-6",
        "hostile-1-7",
    ]
    assert [a.split(":")[0] for a in figures.wrong_answers] == ["hostile-1-1", "hostile-1-3"]


def test_a_counter_is_read_from_a_metrics_exposition_by_label() -> None:
    exposition = "\n".join(
        [
            "# HELP waystation_publish_refusals_total Publishes the broker refused.",
            "# TYPE waystation_publish_refusals_total counter",
            'waystation_publish_refusals_total{reason="refused"} 12.0',
            'waystation_publish_refusals_total{reason="too-large"} 1.0',
            'waystation_publish_refusals_created{reason="refused"} 1.7e+09',
            "waystation_outbox_relayed_total 3.0",
        ]
    )
    assert counter_values(exposition, "waystation_publish_refusals") == {
        "refused": 12.0,
        "too-large": 1.0,
    }
    assert counter_values(exposition, "waystation_outbox_relayed") == {"": 3.0}
    assert counter_values(exposition, "waystation_dead_letters") == {}
