"""The messages an append implies (G4), in particular with a resume run in place."""

from __future__ import annotations

from waystation.events import (
    PendingCall,
    ResultRecorded,
    SubtaskClaimed,
    TaskCompleted,
    TaskPaused,
    TaskResumed,
    TaskState,
)
from waystation.protocol.wire import TYPE_RESUME, TYPE_TASK, Names, implied_messages

NAMES = Names("t.")
STATE = TaskState(
    task_id="task-1",
    version=5,
    status="paused",
    agent="boss",
    reply_to="client.replies",
    correlation_id="c-1",
    pause=1,
)
LAST_REPLY = [
    SubtaskClaimed(subtask_id="task-1:1:0", pause=1, message_id="m"),
    ResultRecorded(subtask_id="task-1:1:0", pause=1, outcome="ok", value=1),
    TaskResumed(pause=1),
]


def test_the_last_reply_alone_implies_a_resume_message() -> None:
    messages = implied_messages(NAMES, STATE, LAST_REPLY)
    assert [(m.properties["type"], m.routing_key, m.message_id) for m in messages] == [
        (TYPE_RESUME, "t.boss", "task-1:resume:1")
    ]


def test_a_resume_run_in_place_that_completes_implies_only_the_result() -> None:
    messages = implied_messages(NAMES, STATE, [*LAST_REPLY, TaskCompleted(result=7)])
    assert [(m.routing_key, m.properties.get("correlation_id")) for m in messages] == [
        ("client.replies", "c-1")
    ]
    assert all(m.properties.get("type") != TYPE_RESUME for m in messages)


def test_a_resume_run_in_place_that_pauses_again_implies_only_its_requests() -> None:
    call = PendingCall(
        subtask_id="task-1:2:0", agent="helper", input={"x": 1}, deadline_at=9.0, dispatched_at=1.0
    )
    messages = implied_messages(
        NAMES, STATE, [*LAST_REPLY, TaskPaused(pause=2, state_delta={}, calls=(call,))]
    )
    assert [(m.properties["type"], m.routing_key, m.message_id) for m in messages] == [
        (TYPE_TASK, "t.helper", "task-1:2:0")
    ]


def test_the_agent_of_a_queue_is_the_inverse_of_its_names() -> None:
    sharded = Names("t.", reply_shards=2)
    for queue in (sharded.tasks("boss"), *sharded.reply_queues("boss")):
        assert NAMES.agent_of(queue) == "boss", queue
    assert NAMES.agent_of("t.with.dots.replies.7") == "with.dots"
    for queue in (
        NAMES.dead_letter_queue,
        NAMES.wait(500),
        "other.boss",  # another deployment's
        "amq.gen-abc",  # a publisher's reply queue
        "t.",
        "t..replies",
    ):
        assert NAMES.agent_of(queue) is None, queue
