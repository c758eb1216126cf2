"""The metadata a worker records with its events (``Recorder.metadata``).

It is built as a plain dict on the hot path; it must be exactly what ``EventMetadata`` would
store: the same fields, None left out, JSON values.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from waystation.events import EventMetadata, NewEvent, TaskResumed, TaskState
from waystation.protocol.wire import Names
from waystation.runtime.faults import FaultPlan
from waystation.runtime.recorder import Cause, Recorder


def recorder() -> Recorder:
    parts: Any = None  # metadata needs neither the store nor the observer
    return Recorder(
        parts,
        Names(prefix="meta."),
        parts,
        worker_id="w-1",
        clock=lambda: 1234.5,
        outbox_delay=1.0,
        faults=FaultPlan(),
    )


@pytest.mark.parametrize(
    ("state", "cause"),
    [
        (TaskState(task_id="t-1"), Cause()),
        (TaskState(task_id="t-1", root_id="r-1", trace_id="0af7"), Cause("m-1", "guest")),
        (TaskState(task_id="t-2", trace_id="0af7"), Cause(message_id="m-2")),
        (TaskState(task_id="t-3"), Cause("m-3", "guest", actor="console:alice")),
    ],
)
def test_metadata_is_what_the_model_would_store(state: TaskState, cause: Cause) -> None:
    made = recorder().metadata(state, cause)
    model = EventMetadata(**made)
    assert made == model.model_dump(mode="json", exclude_none=True)
    assert set(made) <= set(EventMetadata.model_fields)
    assert None not in made.values()
    assert made["correlation_id"] == (state.root_id or state.task_id)
    assert made["deployment"] == "meta." and made["worker_id"] == "w-1"
    assert made["occurred_at"] == 1234.5
    assert ("amqp_user" in made) == (cause.amqp_user is not None)
    assert made.get("actor") == cause.actor  # a cancel's or a signal's only; absent otherwise
    # an event appended with it carries its own copy, equal to the model's dump
    first = NewEvent.of(uuid.uuid4(), TaskResumed(pause=1), made)
    assert first.metadata == NewEvent.of(first.event_id, TaskResumed(pause=1), model).metadata
    assert first.metadata is not made
