"""Upcasting: old schema versions read as the current shape; what cannot be read is kept.

A test event type of its own (``Greeting``, at schema version 3) and a registry of its own, so the
real event types and the built-in registry stay untouched.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, ClassVar

import pytest

from waystation.events import (
    DomainEvent,
    RecordedEvent,
    TaskPaused,
    TaskStarted,
    UnknownEvent,
    UpcastError,
    Upcasters,
    fold,
    parse,
)
from waystation.events.model import event_types
from waystation.events.upcasting import BUILTIN


class Greeting(DomainEvent):
    """v1: ``{"text"}``; v2: ``{"words": [...]}``; v3: ``{"words": [...], "loud": bool}``."""

    event_type: ClassVar[str] = "Greeting"
    schema_version: ClassVar[int] = 3
    words: tuple[str, ...]
    loud: bool


TYPES: dict[str, type[DomainEvent]] = {"Greeting": Greeting}


def registry() -> Upcasters:
    upcasters = Upcasters()

    @upcasters.register("Greeting", from_version=1)
    def split_the_text(data: dict[str, Any]) -> dict[str, Any]:
        return {"words": data["text"].split()}

    @upcasters.register("Greeting", from_version=2)
    def not_loud_by_default(data: dict[str, Any]) -> dict[str, Any]:
        data["loud"] = False  # mutates its argument on purpose: the stored data must not change
        return data

    return upcasters


def recorded(event_type: str, data: dict[str, Any], schema_version: int) -> RecordedEvent:
    return RecordedEvent(
        stream_id="t",
        stream_version=1,
        event_id=uuid.uuid4(),
        event_type=event_type,
        data=data,
        metadata={},
        schema_version=schema_version,
        prev_hash=bytes(32),
        hash=bytes(32),
    )


def test_an_event_of_the_previous_version_reads_as_the_current_shape() -> None:
    event = recorded("Greeting", {"words": ["hello", "there"]}, 2)
    assert parse(event, types=TYPES, upcasters=registry()) == Greeting(
        words=("hello", "there"), loud=False
    )


def test_a_chain_of_steps_runs_in_order_and_leaves_the_stored_data_alone() -> None:
    event = recorded("Greeting", {"text": "hello old world"}, 1)
    assert parse(event, types=TYPES, upcasters=registry()) == Greeting(
        words=("hello", "old", "world"), loud=False
    )
    assert event.data == {"text": "hello old world"}, "the hash covers the stored data"


def test_an_event_at_the_current_version_is_validated_as_stored() -> None:
    event = recorded("Greeting", {"words": ["hi"], "loud": True}, 3)
    assert parse(event, types=TYPES, upcasters=Upcasters()) == Greeting(words=("hi",), loud=True)


def test_a_missing_step_keeps_the_event_as_unknown_with_its_data_and_reason() -> None:
    only_the_second_step = Upcasters()
    only_the_second_step.add("Greeting", 2, lambda data: {**data, "loud": False})
    event = recorded("Greeting", {"text": "hello"}, 1)
    assert parse(event, types=TYPES, upcasters=only_the_second_step) == UnknownEvent(
        type_name="Greeting", data={"text": "hello"}, reason="missing-upcaster", stored_version=1
    )
    with pytest.raises(UpcastError) as raised:
        only_the_second_step.upcast("Greeting", {"text": "hello"}, stored=1, current=3)
    assert (raised.value.reason, raised.value.missing_from) == ("missing-upcaster", 1)
    assert str(raised.value) == "Greeting schema v1 cannot reach v3: no upcaster from v1"


def test_a_version_newer_than_the_code_knows_is_kept_as_unknown() -> None:
    event = recorded("Greeting", {"words": ["hi"], "loud": True, "emoji": "wave"}, 4)
    parsed = parse(event, types=TYPES, upcasters=registry())
    assert parsed == UnknownEvent(
        type_name="Greeting",
        data={"words": ["hi"], "loud": True, "emoji": "wave"},
        reason="newer-version",
        stored_version=4,
    )
    with pytest.raises(UpcastError, match=r"^Greeting schema v4 is newer than this code knows"):
        registry().upcast("Greeting", event.data, stored=4, current=3)


def test_a_built_in_event_from_a_newer_writer_does_not_crash_fold() -> None:
    started = recorded("TaskStarted", TaskStarted(agent="a", input=1).model_dump(mode="json"), 1)
    newer = dataclasses.replace(
        recorded("TaskPaused", {"pause": 1, "state_delta": {}, "calls": [], "new": 1}, 3),
        stream_version=2,
    )
    assert TaskPaused.schema_version == 2
    assert parse(newer) == UnknownEvent(
        type_name="TaskPaused", data=newer.data, reason="newer-version", stored_version=3
    )
    state = fold("t", [started, newer])
    assert (state.status, state.version, state.agent) == ("new", 2, "a")


def test_unknown_event_types_are_kept_with_their_data() -> None:
    event = recorded("FromTheFuture", {"a": [1, {"b": None}]}, 9)
    assert parse(event, types=TYPES, upcasters=registry()) == UnknownEvent(
        type_name="FromTheFuture", data={"a": [1, {"b": None}]}
    )
    assert parse(event) == UnknownEvent(type_name="FromTheFuture", data={"a": [1, {"b": None}]})


def test_a_step_is_registered_once_and_versions_start_at_one() -> None:
    upcasters = registry()
    with pytest.raises(ValueError, match="from v1 is registered"):
        upcasters.add("Greeting", 1, lambda data: data)
    with pytest.raises(ValueError, match="start at 1"):
        upcasters.add("Greeting", 0, lambda data: data)
    assert sorted(upcasters.steps()) == [("Greeting", 1), ("Greeting", 2)]


def test_an_upcaster_must_return_a_dict() -> None:
    upcasters = Upcasters()
    upcasters.add("Greeting", 2, lambda data: [data])  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="upcaster of Greeting from v2 returned list"):
        parse(recorded("Greeting", {"words": []}, 2), types=TYPES, upcasters=upcasters)


def test_every_built_in_type_can_be_read_from_version_1() -> None:
    """Bumping a built-in ``schema_version`` needs the upcasters from every older version."""
    for name, cls in event_types().items():
        missing = [v for v in range(1, cls.schema_version) if (name, v) not in BUILTIN.steps()]
        assert not missing, f"{name} v{cls.schema_version} has no upcaster from v{missing}"


def test_parse_keeps_its_result_only_for_the_built_in_types_and_upcasters() -> None:
    """A recorded event keeps what ``parse`` made of it with the built-in types and upcasters
    (workers fold the same events many times); a parse with other types or upcasters is not
    kept, and a copy with other data is parsed anew."""
    event = recorded("TaskPaused", {"pause": 1, "state_delta": {}, "calls": []}, 1)
    first = parse(event)
    assert isinstance(first, TaskPaused) and first.pause == 1
    assert parse(event) is first
    as_greeting = parse(event, types={"TaskPaused": Greeting}, upcasters=Upcasters())
    assert isinstance(as_greeting, UnknownEvent)  # v1 of a v3 type, no upcaster: not readable
    assert parse(event) is first
    changed = dataclasses.replace(event, data={"pause": 2, "state_delta": {}, "calls": []})
    assert isinstance(parse(changed), TaskPaused) and parse(changed).pause == 2  # type: ignore[union-attr]
    assert event == dataclasses.replace(event)  # what parse kept takes no part in equality
    assert "TaskPaused(" not in repr(event)
