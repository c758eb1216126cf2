"""A pause may not leave the agent's state larger than ``max_state_bytes`` (issue 14, section 5).

The check is part of the decision (``waystation.events.task.decide_outcome``): the size is the
canonical JSON of the whole state once the pause's update is applied, so a delta that shrinks the
state passes and one that grows it past the limit fails, whatever the size of the delta itself.
"""

from __future__ import annotations

import pytest

from waystation.events import Call, Complete, Pause, TaskStarted, TaskState, decide_outcome
from waystation.events.codec import canonical
from waystation.events.task import InvalidTransition, StateTooLarge

NOW = 1_700_000_000.0


def started() -> TaskStarted:
    return TaskStarted(agent="a", input=None, reply_to=None, correlation_id=None)


def pause(update: dict[str, object]) -> Pause:
    return Pause([Call("peer", {})], update=update)


def test_a_pause_within_the_limit_is_recorded() -> None:
    update = {"notes": "x" * 100}
    size = len(canonical(update))
    events = decide_outcome(
        TaskState("t"),
        pause(update),
        now=NOW,
        default_timeout=1,
        start=started(),
        max_state_bytes=size,
    )
    assert [type(e).__name__ for e in events] == ["TaskStarted", "TaskPaused"]


def test_a_pause_past_the_limit_fails_naming_the_size_and_the_limit() -> None:
    update = {"notes": "x" * 100}
    size = len(canonical(update))
    with pytest.raises(StateTooLarge) as raised:
        decide_outcome(
            TaskState("t"),
            pause(update),
            now=NOW,
            default_timeout=1,
            start=started(),
            max_state_bytes=size - 1,
        )
    assert isinstance(raised.value, InvalidTransition)  # permanent: the flows never retry it
    message = str(raised.value)
    assert f"{size} bytes" in message
    assert f"the {size - 1} allowed" in message
    assert "WAYSTATION_MAX_STATE_BYTES" in message


def test_the_limit_is_on_the_whole_state_not_the_delta() -> None:
    # first pause: 60 bytes of state under a 100-byte limit
    first = decide_outcome(
        TaskState("t"),
        pause({"a": "x" * 50}),
        now=NOW,
        default_timeout=1,
        start=started(),
        max_state_bytes=100,
    )
    assert first
    state = TaskState("t", status="resumed", pause=1, state={"a": "x" * 50})
    # a small delta that pushes the whole state past the limit fails
    with pytest.raises(StateTooLarge):
        decide_outcome(
            state, pause({"b": "y" * 40}), now=NOW, default_timeout=1, max_state_bytes=100
        )
    # a delta that deletes a key and adds a smaller one passes
    events = decide_outcome(
        state,
        pause({"a": None, "b": "y" * 40}),
        now=NOW,
        default_timeout=1,
        max_state_bytes=100,
    )
    assert [type(e).__name__ for e in events] == ["TaskPaused"]


def test_without_a_limit_and_on_completion_nothing_is_checked() -> None:
    big = {"notes": "x" * 10_000}
    assert decide_outcome(TaskState("t"), pause(big), now=NOW, default_timeout=1, start=started())
    state = TaskState("t", status="resumed", pause=1, state=big)
    assert decide_outcome(state, Complete("r"), now=NOW, default_timeout=1, max_state_bytes=10), (
        "a completion writes no state, so it is not refused"
    )
