"""Cleaning the actor a cancel or a signal names (``waystation.protocol.actors``): the header is
hostile input that a console renders, so what the log records is text, printable, one line and
bounded, whatever came; and the client sends what the worker would record."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from waystation.client import actor_headers
from waystation.events import OutboxMessage
from waystation.protocol.actors import MAX_ACTOR, actor_of, clean_actor, with_actor
from waystation.protocol.wire import HEADER_ACTOR, TYPE_CANCEL, TYPE_TASK


@pytest.mark.parametrize(
    ("given_value", "recorded"),
    [
        ("console:alice", "console:alice"),
        ("  console:alice  ", "console:alice"),
        (b"console:bob", "console:bob"),
        (bytearray(b"cli:root"), "cli:root"),
        (b"\xffcli", "\ufffdcli"),  # undecodable bytes replaced, never an error
        ("console:\x1b[31mmallory", "console:[31mmallory"),
        ("a\r\nb\tc\u2028d", "a b c d"),  # line breaks and tabs: one space
        ("ad\u202emin", "admin"),  # a bidirectional override
        ("zero\u200bwidth\ufeff", "zerowidth"),
        ("nul\x00byte\x7f", "nulbyte"),
        ("\x1b\u202e \r\n", None),  # nothing left
        ("", None),
        (None, None),
        (42, None),
        (["console:alice"], None),
        ("x" * 1000, "x" * MAX_ACTOR),
        ("é" * 200, "é" * MAX_ACTOR),
    ],
)
def test_an_actor_is_cleaned_to_printable_bounded_text(given_value: Any, recorded: Any) -> None:
    assert clean_actor(given_value) == recorded
    assert actor_of({HEADER_ACTOR: given_value}) == recorded


@given(st.one_of(st.text(), st.binary(), st.integers(), st.none()))
def test_whatever_comes_the_actor_recorded_is_one_printable_line_of_at_most_max(value: Any) -> None:
    cleaned = clean_actor(value)
    if cleaned is not None:
        assert 0 < len(cleaned) <= MAX_ACTOR
        assert cleaned.isprintable() and cleaned == cleaned.strip()
        assert clean_actor(cleaned) == cleaned  # the client's cleaning and the worker's agree


def test_no_header_no_actor() -> None:
    assert actor_of(None) is None and actor_of({}) is None and actor_of({"other": "x"}) is None


def test_the_client_sends_the_actor_cleaned_and_no_header_without_one() -> None:
    assert actor_headers("console:alice\n") == {HEADER_ACTOR: "console:alice"}
    assert actor_headers(None) is None
    assert actor_headers("\x00") is None


def test_only_cancels_carry_the_actor_on() -> None:
    def message(kind: str) -> OutboxMessage:
        return OutboxMessage(
            message_id=kind,
            routing_key="q",
            body=b"{}",
            properties={"type": kind, "headers": {"a": 1}},
        )

    cancel, task = with_actor([message(TYPE_CANCEL), message(TYPE_TASK)], "console:alice")
    assert cancel.properties["headers"] == {"a": 1, HEADER_ACTOR: "console:alice"}
    assert task == message(TYPE_TASK)
