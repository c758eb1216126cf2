"""Which deliveries of a task the log holds get its recorded outcome
(``waystation.runtime.flows.task``).

A finished task's resend is answered from the log; a redelivery or retry of the message whose
outcome was recorded, or a repeated call of another task, is not (the log's outbox answered it).
"""

from __future__ import annotations

import pytest

from waystation.brokers.port import Delivery
from waystation.events import TaskState
from waystation.events.codec import loads
from waystation.protocol.wire import HEADER_ATTEMPTS, HEADER_ROOT, HEADER_WAITS
from waystation.runtime.flows.task import _answer_from_log, recorded_outcome

FIRST = {"reply_to": "q.first", "correlation_id": "t"}


def finished(status: str = "completed", **fields: object) -> TaskState:
    values: dict[str, object] = {"version": 3, "status": status, **FIRST}
    values.update(fields)
    return TaskState("t", **values)  # type: ignore[arg-type]


def delivery(**fields: object) -> Delivery:
    return Delivery(queue="q", body=b"null", message_id="t", **fields)  # type: ignore[arg-type]


def test_a_resend_from_another_publisher_is_answered() -> None:
    assert _answer_from_log(delivery(reply_to="q.other", correlation_id="t"), finished())
    assert _answer_from_log(delivery(reply_to="q.first", correlation_id="c2"), finished())


def test_a_resend_from_the_same_publisher_is_answered_but_not_its_redelivery_or_retry() -> None:
    assert _answer_from_log(delivery(**FIRST), finished())
    assert not _answer_from_log(delivery(**FIRST, redelivered=True), finished())
    assert not _answer_from_log(delivery(**FIRST, headers={HEADER_ATTEMPTS: 1}), finished())
    # nor a copy that waited for a slot of the pool (its original may have been recorded)
    assert not _answer_from_log(delivery(**FIRST, headers={HEADER_WAITS: 1}), finished())


def test_a_repeated_call_of_another_task_is_not_answered() -> None:
    call = delivery(**FIRST, headers={HEADER_ROOT: "root"})
    assert not _answer_from_log(call, finished())
    assert _answer_from_log(delivery(reply_to="q.other", headers={HEADER_ROOT: "root"}), finished())


@pytest.mark.parametrize("status", ["paused", "resumed"])
def test_an_unfinished_task_or_a_delivery_without_reply_to_is_not_answered(status: str) -> None:
    assert not _answer_from_log(delivery(reply_to="q.other"), finished(status))
    assert not _answer_from_log(delivery(), finished())


def test_a_task_cancelled_before_it_started_is_answered_cancelled() -> None:
    state = TaskState("t", version=1, status="cancelled", error={"type": "cancelled"})
    assert _answer_from_log(delivery(**FIRST, redelivered=True), state)
    assert recorded_outcome(state).status == "cancelled"


def test_the_recorded_outcome_is_the_body_the_publisher_got() -> None:
    assert loads(recorded_outcome(finished(result=[1])).to_json()) == {
        "status": "ok",
        "result": [1],
        "task_id": "t",
    }
    failed = recorded_outcome(finished("failed", error={"type": "E", "message": "m"}))
    assert (failed.status, failed.error) == ("error", {"type": "E", "message": "m"})
