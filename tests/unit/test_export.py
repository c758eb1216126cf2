"""``waystation.projections.export`` and ``waystation.projections.exported``: lines, redaction,
reading back, offline verification, paging the log.

Also the parts of ``waystation.projections.audit`` and ``waystation.projections.history`` that
export and point-in-time reading rest on: verifying part of a stream, redacted events, unreadable
schema versions, ``state_as_of`` and ``states_after``.
Streams come from ``tests.unit.test_audit.build`` (the real hash chain) or from the real
in-memory store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest

from waystation.events import (
    EventMetadata,
    EventStore,
    NewEvent,
    PendingCall,
    RecordedEvent,
    ResultRecorded,
    SubtaskClaimed,
    TaskPaused,
    TaskResumed,
    TaskStarted,
    canonical,
    event_id,
)
from waystation.events.codec import GENESIS_HASH
from waystation.events.memory import InMemoryEventStore
from waystation.events.model import SignalReceived
from waystation.events.store import Position
from waystation.projections.audit import verify_stream
from waystation.projections.export import Selection, export_log, redact, to_line, to_record
from waystation.projections.exported import (
    ExportedEvent,
    ExportFormatError,
    from_record,
    read_export,
    verify_export,
)
from waystation.projections.history import state_as_of, states_after, timeline

from .test_audit import START, TASK, build, fanout, kinds

SECRET = {"token": "s3cr3t", "scopes": ["read"]}


def sha(value: Any) -> str:
    return "sha256:" + hashlib.sha256(canonical(value)).hexdigest()


def with_secrets() -> list[RecordedEvent]:
    """A fan-out whose input and first checkpoint carry a security context."""
    events = fanout()
    events[0] = TaskStarted(
        agent="orchestrator", input={"n": 1, "security_context": SECRET}, reply_to="client"
    )
    first: TaskPaused = events[1]  # type: ignore[assignment]
    events[1] = first.model_copy(
        update={
            "state_delta": {"asked": 3, "security_context": SECRET},
            "calls": (
                first.calls[0].model_copy(update={"input": {"security_context": "peer"}}),
                *first.calls[1:],
            ),
        }
    )
    return build(events)


def round_trip(stream: Sequence[RecordedEvent], **options: Any) -> list[ExportedEvent]:
    return list(read_export(to_line(event, **options) for event in stream))


# ---- lines ---------------------------------------------------------------------------------------


def test_a_line_holds_every_column_of_the_event() -> None:
    event = build(fanout())[1]
    assert orjson.loads(to_line(event)) == {
        "stream_id": TASK,
        "stream_version": 2,
        "event_id": str(event.event_id),
        "event_type": "TaskPaused",
        "schema_version": 1,
        "data": event.data,
        "metadata": {"worker_id": "w1"},
        "prev_hash": event.prev_hash.hex(),
        "hash": event.hash.hex(),
        "global_position": 2,
        "tx_id": 2,
        "recorded_at": "2026-01-01T12:00:00.010000+00:00",
        "redacted": [],
    }
    assert to_line(event).endswith(b"}\n") and to_line(event).count(b"\n") == 1


def test_a_line_reads_back_as_the_same_event() -> None:
    stream = build(fanout())
    assert [item.event for item in round_trip(stream)] == stream
    assert all(item.redacted == () for item in round_trip(stream))


# ---- redaction -----------------------------------------------------------------------------------


def test_security_contexts_are_replaced_by_their_hash_and_their_paths_listed() -> None:
    started, paused = with_secrets()[:2]
    record = to_record(started)
    assert record["data"]["input"] == {"n": 1, "security_context": {"redacted": sha(SECRET)}}
    assert record["redacted"] == ["data.input.security_context"]
    record = to_record(paused)
    assert record["data"]["state_delta"] == {
        "asked": 3,
        "security_context": {"redacted": sha(SECRET)},
    }
    assert record["data"]["calls"][0]["input"] == {"security_context": {"redacted": sha("peer")}}
    assert record["redacted"] == [  # in key order, whatever order the backend returned
        "data.calls[0].input.security_context",
        "data.state_delta.security_context",
    ]
    assert b"s3cr3t" not in to_line(started) + to_line(paused)


def test_a_signals_payload_is_redacted_where_it_is_recorded_and_where_a_wait_took_it() -> None:
    """A signal's payload is kept twice: on its ``SignalReceived`` and as the value of the
    result of the wait that took it; both are redacted like any other payload, the export still
    verifies offline, and the signal's invariants are still checked on the redacted events."""
    payload = {"approved": True, "security_context": SECRET}
    wait = PendingCall(
        subtask_id=f"{TASK}:1:0",
        agent="",
        input=None,
        deadline_at=1_000_300.0,
        kind="signal",
        name="approval",
    )
    stream = build(
        [
            TaskStarted(agent="boss", input=None),
            TaskPaused(pause=1, state_delta={}, calls=(wait,)),
            SignalReceived(signal_id="s1", name="approval", payload=payload, sender="alice"),
            SubtaskClaimed(subtask_id=wait.subtask_id, pause=1, message_id="s1"),
            ResultRecorded(subtask_id=wait.subtask_id, pause=1, outcome="ok", value=payload),
            TaskResumed(pause=1),
        ]
    )
    received, result = to_record(stream[2]), to_record(stream[4])
    assert received["data"]["payload"] == {
        "approved": True,
        "security_context": {"redacted": sha(SECRET)},
    }
    assert received["redacted"] == ["data.payload.security_context"]
    assert result["redacted"] == ["data.value.security_context"]
    assert b"s3cr3t" not in b"".join(to_line(e) for e in stream)

    exported = round_trip(stream)
    assert verify_export(exported).ok
    twice = round_trip([*stream[:3], stream[2], *stream[3:]])
    assert [p.kind for p in verify_export(twice).problems if p.kind == "double-signal"] == [
        "double-signal"
    ]


def test_extra_keys_are_redacted_on_request_and_nothing_without_keys() -> None:
    started = with_secrets()[0]
    record = to_record(started, redact_keys={"security_context", "n"})
    assert record["data"]["input"] == {
        "n": {"redacted": sha(1)},
        "security_context": {"redacted": sha(SECRET)},
    }
    assert record["redacted"] == ["data.input.n", "data.input.security_context"]
    assert to_record(started, redact_keys=())["data"] == started.data
    assert to_record(started, redact_keys=())["redacted"] == []


def test_redaction_reaches_metadata_and_names_odd_keys_unambiguously() -> None:
    value: dict[str, Any] = {"a.b": {"security_context": 1}, "list": [[{"security_context": 2}]]}
    redacted, paths = redact(value, {"security_context"}, "metadata")
    assert paths == ['metadata["a.b"].security_context', "metadata.list[0][0].security_context"]
    assert redacted["list"][0][0] == {"security_context": {"redacted": sha(2)}}
    assert value["list"][0][0] == {"security_context": 2}, "the event itself is not changed"


# ---- verifying an export -------------------------------------------------------------------------


def test_a_clean_export_verifies_and_counts_its_redacted_events() -> None:
    report = verify_export(round_trip(with_secrets()))
    assert report.to_json() == {
        "ok": True,
        "streams": 1,
        "events": 10,
        "redacted": 2,
        "notes": [],
        "problems": [],
    }
    unredacted = verify_export(round_trip(with_secrets(), redact_keys=()))
    assert (unredacted.ok, unredacted.redacted) == (True, 0)


def test_an_altered_value_is_found_at_its_stream_and_version() -> None:
    lines = [to_line(event) for event in build(fanout())]
    lines[5] = lines[5].replace(b'"value":1', b'"value":7')
    report = verify_export(read_export(lines))
    assert [(p.stream_id, p.stream_version, p.kind) for p in report.problems] == [
        (TASK, 6, "hash-mismatch")
    ]


def test_a_redacted_event_keeps_its_links_checked() -> None:
    exported = round_trip(with_secrets())
    forged = bytes(range(32))
    exported[1] = dataclasses.replace(
        exported[1], event=dataclasses.replace(exported[1].event, hash=forged)
    )
    # its own content hash cannot be checked, but the next event no longer links to it
    assert kinds(verify_export(exported).problems) == [(3, "broken-link")]


def test_claiming_a_redaction_without_a_marker_is_a_problem() -> None:
    exported = round_trip(build(fanout()))
    item = exported[5]
    tampered = dataclasses.replace(item.event, data={**item.event.data, "value": 7})
    exported[5] = ExportedEvent(tampered, redacted=("data.value",))
    report = verify_export(exported)
    assert kinds(report.problems) == [(6, "bad-redaction")]
    assert report.problems[0].message == (
        "data.value is listed as redacted but holds no redaction marker"
    )


def test_a_stream_exported_from_mid_stream_is_a_note_not_a_tampering() -> None:
    stream = build(fanout())
    report = verify_export(round_trip(stream[4:]))
    assert report.ok and report.events == 6
    (note,) = report.notes
    assert (note.stream_id, note.stream_version, note.kind) == (TASK, 5, "partial-stream")
    assert note.message.startswith("the file starts this stream at version 5 (versions 1-4 ")


def test_a_partial_stream_still_has_its_own_chain_and_invariants_checked() -> None:
    stream = build(fanout())
    tail = stream[4:]
    del tail[2]  # v7, the last SubtaskClaimed
    assert kinds(verify_stream(tail, partial=True)) == [(8, "version-gap"), (8, "broken-link")]
    # a pause seen whole is checked whole, even in part of a stream
    assert kinds(verify_stream(stream[1:], partial=True)) == []
    without_claim = [e for e in stream[1:] if e.stream_version != 3]
    assert ("result-without-claim" in [k for _, k in kinds(verify_stream(without_claim))]) and (
        (4, "result-without-claim") in kinds(verify_stream(without_claim, partial=True))
    )


def test_lines_are_grouped_by_stream_and_ordered_by_version() -> None:
    one, two = build(fanout(), stream_id="one"), build(fanout(), stream_id="two")
    lines = [to_line(e) for pair in zip(reversed(one), two, strict=True) for e in pair]
    report = verify_export(read_export(lines))
    assert (report.ok, report.streams, report.events) == (True, 2, 20)


def test_a_line_that_is_not_an_event_is_named_by_number() -> None:
    good = to_line(build(fanout())[0])
    with pytest.raises(ExportFormatError, match=r"^line 3: not JSON"):
        list(read_export([good, b"\n", b"{oops\n"]))
    record = orjson.loads(good)
    changes: list[tuple[dict[str, Any], str]] = [
        ({"prev_hash": "zz"}, "'prev_hash' is not hex: 'zz'"),
        ({"hash": "00"}, "'hash' is 1 bytes, not 32"),
        ({"stream_version": "1"}, "'stream_version' is '1', not an integer"),
        ({"stream_version": True}, "'stream_version' is True, not an integer"),
        ({"event_id": "x"}, "'event_id' is not a UUID: 'x'"),
        ({"recorded_at": "yesterday"}, "'recorded_at' is not ISO-8601: 'yesterday'"),
        ({"redacted": "data"}, "'redacted' is 'data', not a list of paths"),
    ]
    for change, message in changes:
        with pytest.raises(ExportFormatError) as raised:
            list(read_export([good, orjson.dumps({**record, **change})]))
        assert (raised.value.line, raised.value.message) == (2, message)
    del record["data"]
    with pytest.raises(ExportFormatError, match=r"^line 1: no 'data'$"):
        list(read_export([orjson.dumps(record)]))
    with pytest.raises(ExportFormatError, match="not a JSON object but list"):
        from_record([1])


# ---- unreadable schema versions in an audit ------------------------------------------------------


async def test_an_event_of_a_newer_schema_version_is_reported_not_skipped() -> None:
    store = InMemoryEventStore()
    newer = NewEvent(
        event_id(TASK, "t", 1),
        "TaskResumed",
        {"pause": 1, "why": "new field"},
        {},
        schema_version=3,  # TaskResumed is at 2
    )
    started = NewEvent.of(event_id(TASK, "t", 0), fanout()[0], EventMetadata())
    await store.append(TASK, 0, [started, newer], prev_hash=GENESIS_HASH)
    stream = await store.read_stream(TASK)
    (problem,) = verify_stream(stream)
    assert (problem.stream_version, problem.kind) == (2, "unsupported-version")
    assert problem.message == (
        "TaskResumed schema v3 cannot be read by this code (newer-version); "
        "its invariants were not checked"
    )
    assert timeline(stream)[1].summary == (
        "TaskResumed of schema v3, which this code cannot read (newer-version)"
    )


# ---- exporting from a store ----------------------------------------------------------------------


async def interleaved_log(*stream_ids: str) -> InMemoryEventStore:
    """A fan-out per stream, appended one event per transaction, taking turns."""
    store = InMemoryEventStore()
    heads = dict.fromkeys(stream_ids, GENESIS_HASH)
    for index, event in enumerate(fanout()):
        for stream_id in stream_ids:
            new = NewEvent.of(event_id(stream_id, "t", index), event, EventMetadata())
            result = await store.append(stream_id, index, [new], prev_hash=heads[stream_id])
            heads[stream_id] = result.last_hash
    return store


async def exported(store: EventStore, **options: Any) -> tuple[list[bytes], Any]:
    lines: list[bytes] = []
    summary = await export_log(store, lines.append, **options)
    return lines, summary


async def test_the_whole_log_is_exported_page_by_page_in_commit_order() -> None:
    store = await interleaved_log("a", "b")
    lines, summary = await exported(store, page_size=3)
    assert (summary.events, summary.streams, summary.redacted) == (20, 2, 0)
    assert lines == [to_line(e) for e in await store.read_all(limit=100)]
    assert verify_export(read_export(lines)).ok


async def test_tasks_are_exported_stream_by_stream_and_a_missing_one_writes_nothing() -> None:
    store = await interleaved_log("a", "b", "c")
    lines, summary = await exported(store, tasks=["c", "a", "c"])
    assert [orjson.loads(line)["stream_id"] for line in lines] == ["c"] * 10 + ["a"] * 10
    assert (summary.events, summary.streams) == (20, 2)
    lines, summary = await exported(store, tasks=["a", "nope"])
    assert (lines, summary.missing_tasks) == ([], ("nope",))


async def test_a_position_range_exports_exactly_the_events_inside_it() -> None:
    store = await interleaved_log("a", "b")
    lines, summary = await exported(
        store, selection=Selection(after_position=4, to_position=9), page_size=4
    )
    assert [orjson.loads(line)["global_position"] for line in lines] == [5, 6, 7, 8, 9]
    assert (summary.events, summary.streams) == (5, 2)
    report = verify_export(read_export(lines))
    assert report.ok
    assert [(n.stream_id, n.stream_version) for n in report.notes] == [("a", 3), ("b", 3)]


class CommitOrderLog(EventStore):
    """Serves fixed events in commit order and counts the pages asked for; reads only."""

    def __init__(self, events: list[RecordedEvent]) -> None:
        self.events = sorted(events, key=Position.of)
        self.pages = 0

    async def read_all(
        self, after: Position = Position(), limit: int = 1000
    ) -> list[RecordedEvent]:
        self.pages += 1
        return [e for e in self.events if Position.of(e) > after][:limit]

    async def read_stream(self, stream_id: str, *, after: int = 0) -> list[RecordedEvent]:
        return [e for e in self.events if e.stream_id == stream_id and e.stream_version > after]

    async def append(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def claim_outbox(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def delete_outbox(self, ids: Sequence[int]) -> None:
        raise NotImplementedError

    async def outbox_size(self, **kwargs: Any) -> int:
        raise NotImplementedError

    async def outbox_oldest(self, **kwargs: Any) -> float | None:
        raise NotImplementedError

    async def retry_outbox(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    async def replace_outbox(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    async def claim_expired_calls(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def pending_call_deadlines(self, task_id: str) -> dict[str, float]:
        raise NotImplementedError


def numbered(count: int, tx_of: dict[int, int] | None = None) -> list[RecordedEvent]:
    """Events at positions 1..count, each its own transaction unless ``tx_of`` says otherwise."""
    tx_of = tx_of or {}
    return [
        RecordedEvent(
            stream_id=f"s{position}",
            stream_version=1,
            event_id=uuid.uuid4(),
            event_type="Probe",
            data={},
            metadata={},
            schema_version=1,
            prev_hash=GENESIS_HASH,
            hash=GENESIS_HASH,
            global_position=position,
            tx_id=tx_of.get(position, position),
        )
        for position in range(1, count + 1)
    ]


async def test_a_range_export_stops_reading_once_well_past_its_last_position() -> None:
    log = CommitOrderLog(numbered(100))
    lines, _ = await exported(log, selection=Selection(to_position=10), page_size=5, stop_margin=3)
    assert [orjson.loads(line)["global_position"] for line in lines] == list(range(1, 11))
    assert log.pages == 3, "pages of 5: positions 1-15 hold 10 in range and the 3 beyond it"


async def test_a_range_export_keeps_an_event_that_commits_behind_a_later_position() -> None:
    # position 10's append took its transaction id after 11's and 12's: it sorts after them
    log = CommitOrderLog(numbered(30, tx_of={10: 12, 11: 10, 12: 11}))
    assert [e.global_position for e in log.events[8:12]] == [9, 11, 12, 10]
    lines, _ = await exported(log, selection=Selection(to_position=10), stop_margin=2)
    assert sorted(orjson.loads(line)["global_position"] for line in lines) == list(range(1, 11))


def test_a_time_range_is_inclusive_and_naive_times_are_utc() -> None:
    stream = build(fanout())  # recorded 10 ms apart from START
    selection = Selection(
        since=(START + timedelta(milliseconds=20)).replace(tzinfo=None),
        until=START + timedelta(milliseconds=40),
    )
    assert [e.stream_version for e in stream if selection.includes(e)] == [3, 4, 5]
    unrecorded = dataclasses.replace(stream[3], recorded_at=None)
    assert not selection.includes(unrecorded) and Selection().includes(unrecorded)


# ---- state as of a past point --------------------------------------------------------------------


def test_the_state_as_of_a_position_folds_only_the_events_up_to_it() -> None:
    stream = build(fanout())
    past = state_as_of(TASK, stream, position=5)
    state = past.state
    assert (state.status, state.pause, state.version, dict(state.state)) == (
        "paused",
        1,
        5,
        {"asked": 3},
    )
    assert [call.subtask_id for call in state.outstanding] == [f"{TASK}:1:2"]
    assert past.last_event is stream[4]
    shown = past.to_json()
    assert shown["as_of"] == {"position": 5, "at": None}
    assert shown["last_event"] == {
        "version": 5,
        "event_type": "SubtaskClaimed",
        "global_position": 5,
        "recorded_at": "2026-01-01T12:00:00.040000+00:00",
    }
    assert shown["outstanding"] == [
        {
            "subtask_id": f"{TASK}:1:2",
            "kind": "call",
            "agent": "researcher",
            "name": None,
            "deadline_at": 1_000_300.0,
            "input": {"i": 2},
        }
    ]
    assert shown["results"] == [
        {
            "subtask_id": f"{TASK}:1:0",
            "kind": "call",
            "agent": "researcher",
            "name": None,
            "sender": None,
            "outcome": "ok",
            "value": 0,
            "error": None,
        }
    ]
    assert (shown["first_k"], shown["agent_version"], shown["abandoned"]) == (None, None, [])
    assert shown["kept_signals"] == []
    assert (shown["status"], shown["agent"], shown["pause"], shown["version"]) == (
        "paused",
        "orchestrator",
        1,
        5,
    )
    assert (shown["state"], shown["result"], shown["error"]) == ({"asked": 3}, None, None)


def test_the_state_as_of_a_time_and_before_anything_happened() -> None:
    stream = build(fanout())
    past = state_as_of(TASK, stream, at=datetime(2026, 1, 1, 12, 0, 0, 20_000))
    assert (past.state.version, past.state.status, past.at) == (
        3,
        "paused",
        datetime(2026, 1, 1, 12, 0, 0, 20_000, tzinfo=UTC),
    )
    now = state_as_of(TASK, stream)
    assert (now.state.status, now.state.result, now.last_event) == (
        "completed",
        {"total": 6},
        stream[-1],
    )
    before = state_as_of(TASK, stream, at=START - timedelta(seconds=1))
    assert (before.last_event, before.state.exists, before.to_json()["last_event"]) == (
        None,
        False,
        None,
    )
    assert state_as_of(TASK, stream, position=0).last_event is None


def test_the_states_after_each_event_are_the_states_as_of_each_position() -> None:
    stream = build(fanout())
    folded = list(states_after(TASK, stream))
    assert len(folded) == len(stream)
    for event, past in zip(stream, folded, strict=True):
        expected = state_as_of(TASK, stream, position=event.global_position)
        assert past.last_event is event and past.position == event.global_position
        assert past.to_json() == expected.to_json()
        assert past.state == expected.state
    statuses = [past.state.status for past in folded]
    assert statuses == ["new", *["paused"] * 7, "resumed", "completed"]
