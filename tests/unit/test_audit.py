"""``waystation.projections.audit``: verify_stream finds each kind of problem;
``waystation.projections.history``: timeline reads a stream.

Streams are built with the real hash chain (``waystation.events.chain.recorded_events``), so an
invariant broken on purpose shows as exactly that problem and nothing else; structural damage (a
hash, a link, a version) is done afterwards, as a tampering would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from waystation.events import (
    DomainEvent,
    EventMetadata,
    NewEvent,
    PendingCall,
    RecordedEvent,
    ReplyIgnored,
    ResultRecorded,
    SubtaskClaimed,
    TaskCompleted,
    TaskPaused,
    TaskResumed,
    TaskStarted,
    event_id,
)
from waystation.events.chain import recorded_events
from waystation.events.codec import GENESIS_HASH
from waystation.events.memory import InMemoryEventStore
from waystation.projections.audit import Problem, read_streams, verify_stream
from waystation.projections.history import pauses, timeline

TASK = "t"
START = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def build(
    domain_events: Sequence[DomainEvent], *, stream_id: str = TASK, step_ms: float = 10
) -> list[RecordedEvent]:
    """The stream of these events as the log would hold it, with a correct hash chain."""
    new = [
        NewEvent.of(
            event_id(stream_id, "test", index), event, EventMetadata(worker_id=f"w{index % 2}")
        )
        for index, event in enumerate(domain_events)
    ]
    return [
        dataclasses.replace(
            event,
            tx_id=event.stream_version,
            recorded_at=START + timedelta(milliseconds=step_ms * (event.stream_version - 1)),
        )
        for event in recorded_events(stream_id, 0, new, GENESIS_HASH, first_position=1)
    ]


def paused(k: int = 3, pause: int = 1) -> TaskPaused:
    return TaskPaused(
        pause=pause,
        state_delta={"asked": k},
        calls=tuple(
            PendingCall(
                subtask_id=f"{TASK}:{pause}:{i}",
                agent="researcher",
                input={"i": i},
                deadline_at=1_000_300.0,
                dispatched_at=1_000_000.0,
            )
            for i in range(k)
        ),
    )


def replies(k: int = 3, pause: int = 1) -> list[DomainEvent]:
    events: list[DomainEvent] = []
    for i in range(k):
        subtask = f"{TASK}:{pause}:{i}"
        events.append(SubtaskClaimed(subtask_id=subtask, pause=pause, message_id=f"m{i}"))
        events.append(ResultRecorded(subtask_id=subtask, pause=pause, outcome="ok", value=i))
    return events


def fanout() -> list[DomainEvent]:
    return [
        TaskStarted(agent="orchestrator", input={"n": 1, "k": 3}, reply_to="client"),
        paused(),
        *replies(),
        TaskResumed(pause=1),
        TaskCompleted(result={"total": 6}),
    ]


def kinds(problems: list[Problem]) -> list[tuple[int, str]]:
    return [(p.stream_version, p.kind) for p in problems]


def test_a_clean_fanout_stream_verifies() -> None:
    stream = build(fanout())
    assert verify_stream(stream) == []
    assert verify_stream([]) == []


def test_audit_events_after_a_terminal_one_are_allowed() -> None:
    late = ReplyIgnored(subtask_id=f"{TASK}:1:0", reason="late", outcome="ok")
    assert verify_stream(build([*fanout(), late])) == []


def test_a_changed_payload_breaks_that_events_hash() -> None:
    stream = build(fanout())
    assert stream[7].event_type == "ResultRecorded"
    stream[7] = dataclasses.replace(stream[7], data={**stream[7].data, "value": 99})
    problems = verify_stream(stream)
    assert kinds(problems) == [(8, "hash-mismatch")]
    assert "t v8: hash-mismatch" in str(problems[0]) and problems[0].stream_id == TASK


def test_a_changed_metadata_breaks_the_hash_too() -> None:
    stream = build(fanout())
    stream[0] = dataclasses.replace(stream[0], metadata={"worker_id": "mallory"})
    assert kinds(verify_stream(stream)) == [(1, "hash-mismatch")]


def test_a_broken_link_is_found() -> None:
    stream = build(fanout())
    stream[4] = dataclasses.replace(stream[4], prev_hash=bytes(range(32)))
    # the event's own hash was computed over the real prev_hash, so it no longer matches either
    assert kinds(verify_stream(stream)) == [(5, "broken-link"), (5, "hash-mismatch")]


def test_a_removed_event_shows_as_a_gap_and_a_broken_link() -> None:
    stream = build(fanout())
    del stream[3]  # the result of t:1:0, so the resume also comes before every result
    assert kinds(verify_stream(stream)) == [
        (5, "version-gap"),
        (5, "broken-link"),
        (9, "early-resume"),
    ]


def test_a_first_event_not_at_version_one_is_a_gap() -> None:
    stream = build(fanout())
    stream[0] = dataclasses.replace(stream[0], stream_version=0)
    assert (0, "version-gap") in kinds(verify_stream(stream))


def test_a_second_claim_of_a_subtask_is_found() -> None:
    events = fanout()
    events.insert(4, SubtaskClaimed(subtask_id=f"{TASK}:1:0", pause=1, message_id="other"))
    problems = verify_stream(build(events))
    assert kinds(problems) == [(5, "double-claim")]
    assert f"{TASK}:1:0" in problems[0].message


def test_a_second_resume_of_a_pause_is_found() -> None:
    events = fanout()
    events.insert(-1, TaskResumed(pause=1))
    assert kinds(verify_stream(build(events))) == [(10, "double-resume")]


def test_a_resume_before_every_result_is_found() -> None:
    events = [
        TaskStarted(agent="orchestrator", input=None),
        paused(),
        *replies(2),
        TaskResumed(pause=1),
    ]
    problems = verify_stream(build(events))
    assert kinds(problems) == [(7, "early-resume")]
    assert f"{TASK}:1:2" in problems[0].message


def test_a_resume_of_a_pause_that_never_happened_is_found() -> None:
    events = [TaskStarted(agent="orchestrator", input=None), TaskResumed(pause=1)]
    assert kinds(verify_stream(build(events))) == [(2, "early-resume")]


def test_an_event_after_a_terminal_one_is_found() -> None:
    events = [*fanout(), TaskCompleted(result="again")]
    problems = verify_stream(build(events))
    assert kinds(problems) == [(11, "after-terminal")]
    assert "TaskCompleted at v10" in problems[0].message


def test_a_result_without_its_claim_is_found() -> None:
    events = fanout()
    del events[2]  # the first SubtaskClaimed
    assert kinds(verify_stream(build(events))) == [(3, "result-without-claim")]


def test_unreadable_data_is_reported_not_raised() -> None:
    stream = build(fanout())
    stream[1] = dataclasses.replace(stream[1], data={"pause": "not a number"})
    # the pause cannot be read, so its resume has no pause to resume either
    assert kinds(verify_stream(stream)) == [
        (2, "hash-mismatch"),
        (2, "unreadable"),
        (9, "early-resume"),
    ]


def test_timeline_of_a_fanout_reads_like_a_story() -> None:
    stream = build(fanout(), step_ms=21)
    entries = timeline(stream)
    assert [e.version for e in entries] == list(range(1, 11))
    assert [e.event_type for e in entries] == [e.event_type for e in stream]
    assert [e.actor for e in entries[:2]] == ["w0", "w1"]
    assert entries[0].recorded_at == START
    summaries = [e.summary for e in entries]
    assert summaries[0] == 'started orchestrator with input {"k":3,"n":1}'
    assert summaries[1] == "paused #1 calling researcher ×3 (deadline in 300 s)"
    assert summaries[2] == f"claimed {TASK}:1:0"
    assert summaries[3] == f"result ok for {TASK}:1:0"
    # paused at v2, resumed at v9: 7 steps of 21 ms
    assert summaries[8] == "resumed from pause #1 after 0.147 s"
    assert summaries[9] == "completed"
    assert entries[1].pause_seconds == entries[8].pause_seconds == 0.147
    assert all(e.pause_seconds is None for e in entries if e.version not in (2, 9))
    (span,) = pauses(stream)
    assert (span.pause, span.paused_version, span.resumed_version, span.seconds) == (
        1,
        2,
        9,
        0.147,
    )


def test_timeline_names_timeouts_ignored_replies_and_open_pauses() -> None:
    events: list[DomainEvent] = [
        TaskStarted(agent="orchestrator", input=None),
        paused(k=1),
        SubtaskClaimed(subtask_id=f"{TASK}:1:0", pause=1),
        ResultRecorded(subtask_id=f"{TASK}:1:0", pause=1, outcome="timeout"),
        TaskResumed(pause=1),
        paused(k=2, pause=2),
        ReplyIgnored(subtask_id=f"{TASK}:1:0", reason="late", outcome="ok"),
    ]
    stream = build(events)
    summaries = [e.summary for e in timeline(stream)]
    assert summaries[2] == f"claimed {TASK}:1:0 (no reply message: its deadline passed)"
    assert summaries[3] == f"result timeout for {TASK}:1:0"
    assert summaries[5] == "paused #2 calling researcher ×2 (deadline in 300 s)"
    assert summaries[6] == f"ignored late ok reply for {TASK}:1:0"
    assert [s.seconds for s in pauses(stream)] == [0.03, None]


async def test_read_streams_gives_each_stream_of_the_log_whole_and_in_version_order() -> None:
    store = InMemoryEventStore()
    heads = {"a": GENESIS_HASH, "b": GENESIS_HASH}
    versions = {"a": 0, "b": 0}
    # interleaved commits, so a page of the log holds parts of both streams
    for index, stream_id in enumerate(["a", "b", "a", "a", "b"]):
        new = NewEvent.of(
            event_id(stream_id, "test", index), TaskStarted(agent="x", input=index), EventMetadata()
        )
        appended = await store.append(
            stream_id, versions[stream_id], [new], prev_hash=heads[stream_id]
        )
        heads[stream_id], versions[stream_id] = appended.last_hash, appended.version

    streams = await read_streams(store, page_size=2)

    assert {s: [e.stream_version for e in events] for s, events in streams.items()} == {
        "a": [1, 2, 3],
        "b": [1, 2],
    }
    assert all(verify_stream(events) == [] for events in streams.values())
    assert [e.stream_version for e in (await read_streams(store, "b"))["b"]] == [1, 2]
    assert await read_streams(store, "not-in-the-log") == {"not-in-the-log": []}
