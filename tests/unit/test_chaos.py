"""scripts/chaos's pure parts: the fault plan, and the checks of results and of the log it
shares with the tests (tests/harness/checks.py), each shown to catch what it is there to catch
(no services)."""

from __future__ import annotations

import sys
from pathlib import Path

from events.codec import dumps

from ..harness.checks import LogRow, log_figures, result_figures

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from _bench.chaos import plan_faults  # noqa: E402

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
