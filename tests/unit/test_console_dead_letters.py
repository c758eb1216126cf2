"""Which task a dead letter is about, read defensively from what a publisher sent."""

from __future__ import annotations

from typing import Any

from waystation.brokers.amqp.deadletters import DeadLetter
from waystation.console.pages.dead_letters import concerns, task_of


def _letter(
    body: bytes = b"", *, message_id: str | None = None, correlation_id: str | None = None
) -> DeadLetter:
    return DeadLetter(message_id, correlation_id, None, "x", "", "q", body)


def test_a_letter_names_its_body_s_task_else_its_correlation_id_else_its_message_id() -> None:
    cases: list[tuple[DeadLetter, Any, str | None]] = [
        (_letter(correlation_id="c", message_id="m"), {"task_id": "t"}, "t"),
        (_letter(correlation_id="c", message_id="m"), {"task_id": 7}, "c"),
        (_letter(correlation_id="c", message_id="m"), ["task_id"], "c"),
        (_letter(message_id="m"), {"task_id": ""}, "m"),
        (_letter(), None, None),
    ]
    for letter, body, expected in cases:
        assert task_of(letter, body) == expected, (letter, body)


def test_a_reply_is_about_the_task_that_made_the_call_too() -> None:
    reply = _letter(correlation_id="boss:2:0", message_id="r-1")
    task = task_of(reply, {"status": "ok"})
    assert task == "boss:2:0"
    for wanted in ("boss", "boss:2:0", "r-1"):
        assert concerns(reply, task, wanted), wanted
    assert not concerns(reply, task, "boss:2")
    assert not concerns(_letter(correlation_id="a:b:c"), None, "a")
