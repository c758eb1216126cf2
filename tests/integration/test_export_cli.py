"""``waystation export``, ``verify --file`` and ``state`` as a user runs them, against a real log.

Real tasks of the example app run through an in-process worker on the real services, into a
database of the test's own (``own_log``); the commands run as subprocesses.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson

from waystation.client import Client
from waystation.events import canonical
from waystation.events.postgres import PostgresEventStore
from waystation.example import app, expected_total
from waystation.projections.export import to_line
from waystation.settings import Settings

from ..support import running_worker
from .test_audit_cli import cli

SECRET = {"user": "alice", "token": "tok-4f2a9c"}


async def run_orchestrators(
    settings: Settings, store: PostgresEventStore, *inputs: dict[str, Any]
) -> list[str]:
    """Run example orchestrator tasks one after another (each finished before the next starts)."""
    ids = []
    async with (
        running_worker(app, settings, store),
        Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        for spec in inputs:
            result = await client.call("orchestrator", spec, timeout=20)
            expected = {"n": spec["n"], "total": expected_total(spec["n"], spec["k"])}
            assert result.ok and result.result == expected
            ids.append(result.task_id)
    return ids


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def test_export_redacts_secrets_and_verifies_offline_until_a_value_is_altered(
    own_log: tuple[Settings, PostgresEventStore], tmp_path: Path
) -> None:
    settings, store = own_log
    plain, secret = await run_orchestrators(
        settings, store, {"n": 2, "k": 3}, {"n": 5, "k": 3, "security_context": SECRET}
    )
    export = tmp_path / "log.jsonl"

    code, out, err = await cli(settings, "export", "--output", str(export))
    assert code == 0, out + err
    assert out == ""
    assert err.strip() == f"exported 20 events of 2 streams to {export}, 1 with redacted values"
    assert not (tmp_path / "log.jsonl.partial").exists()
    written = lines_of(export)
    assert [(r["stream_id"], r["stream_version"]) for r in written] == [
        (task, version) for task in (plain, secret) for version in range(1, 11)
    ]
    started = written[10]
    assert started["event_type"] == "TaskStarted" and started["stream_id"] == secret
    marker = "sha256:" + hashlib.sha256(canonical(SECRET)).hexdigest()
    assert started["data"]["input"] == {"n": 5, "k": 3, "security_context": {"redacted": marker}}
    assert started["redacted"] == ["data.input.security_context"]
    assert [r["redacted"] for r in written if r is not started] == [[]] * 19
    assert SECRET["token"].encode() not in export.read_bytes()
    events = await store.read_all(limit=100)
    assert export.read_bytes() == b"".join(to_line(e) for e in events), "every column, as stored"
    assert set(written[0]) == {
        "stream_id",
        "stream_version",
        "event_id",
        "event_type",
        "schema_version",
        "data",
        "metadata",
        "prev_hash",
        "hash",
        "global_position",
        "tx_id",
        "recorded_at",
        "redacted",
    }

    code, out, err = await cli(settings, "verify", "--file", str(export))
    assert code == 0, out + err
    assert out.strip() == (
        "2 streams, 20 events verified, 1 redacted (content hash not checkable), no problems"
    )
    code, out, err = await cli(settings, "verify", "--file", str(export), "--json")
    assert code == 0, out + err
    assert orjson.loads(out) == {
        "file": str(export),
        "ok": True,
        "streams": 2,
        "events": 20,
        "redacted": 1,
        "notes": [],
        "problems": [],
    }

    # stdout, no redaction: the secret is there, and every content hash checks
    code, out, err = await cli(settings, "export", "--no-redact")
    assert code == 0, out + err
    assert SECRET["token"] in out and '"redacted":[]' in out and '"redacted":["' not in out
    unredacted = tmp_path / "unredacted.jsonl"
    unredacted.write_text(out)
    code, out, err = await cli(settings, "verify", "--file", str(unredacted))
    assert code == 0, out + err
    assert out.strip().endswith(
        "events verified, 0 redacted (content hash not checkable), no problems"
    )

    # an extra key on request
    code, out, err = await cli(settings, "export", "--task", plain, "--redact-key", "n")
    assert code == 0, out + err
    first = orjson.loads(out.splitlines()[0])
    assert first["redacted"] == ["data.input.n"]
    assert first["data"]["input"]["n"] == {"redacted": "sha256:" + hashlib.sha256(b"2").hexdigest()}

    # the offline tamper test: one value altered in the file
    lines = export.read_bytes().splitlines(keepends=True)
    result = orjson.loads(lines[15])
    assert (result["stream_id"], result["stream_version"]) == (secret, 6)
    assert result["event_type"] == "ResultRecorded"
    result["data"]["value"] = {"answer": 12345}
    lines[15] = orjson.dumps(result) + b"\n"
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_bytes(b"".join(lines))
    code, out, err = await cli(settings, "verify", "--file", str(tampered))
    assert code == 1, out + err
    assert out.splitlines()[0].startswith(f"stream {secret} version 6: hash-mismatch: ")
    assert out.splitlines()[-1] == (
        "2 streams, 20 events verified, 1 redacted (content hash not checkable), 1 problem(s)"
    )
    code, out, err = await cli(settings, "verify", plain, "--file", str(tampered))
    assert code == 0, out + err
    assert out.startswith("1 streams, 10 events verified, 0 redacted")

    # bad input: exit 2, naming the line
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b"".join(lines[:3]) + b"{not json\n")
    code, out, err = await cli(settings, "verify", "--file", str(broken))
    assert code == 2, out + err
    assert err.startswith(f"{broken} line 4: not JSON")
    code, out, err = await cli(settings, "verify", "--file", str(tmp_path / "missing.jsonl"))
    assert code == 2, out + err
    assert "does not exist" in err
    code, out, err = await cli(settings, "verify", "no-such-task", "--file", str(export))
    assert code == 2, out + err
    assert err.strip() == f"task 'no-such-task' is not in {export}"


async def test_ranges_of_the_log_and_the_state_of_a_task_as_of_the_past(
    own_log: tuple[Settings, PostgresEventStore], tmp_path: Path
) -> None:
    settings, store = own_log
    first, second = await run_orchestrators(settings, store, {"n": 3, "k": 3}, {"n": 4, "k": 3})
    stream = await store.read_stream(first)
    later = await store.read_stream(second)

    # a position range that starts in the middle of the first task
    after, upto = stream[4].global_position, later[1].global_position
    export = tmp_path / "range.jsonl"
    code, out, err = await cli(
        settings,
        "export",
        "--after-position",
        str(after),
        "--to-position",
        str(upto),
        "-o",
        str(export),
    )
    assert code == 0, out + err
    written = lines_of(export)
    assert [(r["stream_id"], r["stream_version"]) for r in written] == [
        *((first, version) for version in range(6, 11)),
        (second, 1),
        (second, 2),
    ]
    assert all(after < r["global_position"] <= upto for r in written)
    code, out, err = await cli(settings, "verify", "--file", str(export))
    assert code == 0, out + err
    assert out.splitlines()[0].startswith(
        f"note: stream {first} version 6: partial-stream: the file starts this stream at "
        "version 6 (versions 1-5 were not exported)"
    )
    assert out.splitlines()[-1] == (
        "2 streams, 7 events verified, 0 redacted (content hash not checkable), no problems"
    )
    code, out, err = await cli(settings, "verify", "--file", str(export), "--json")
    assert code == 0, out + err
    report = orjson.loads(out)
    assert report["ok"] is True
    assert [(n["stream_id"], n["stream_version"], n["kind"]) for n in report["notes"]] == [
        (first, 6, "partial-stream")
    ]

    # a time range: from the second task's start on, and up to the first task's end
    start_of_second = later[0].recorded_at
    end_of_first = stream[-1].recorded_at
    assert start_of_second is not None and end_of_first is not None
    assert end_of_first < start_of_second
    code, out, err = await cli(settings, "export", "--since", start_of_second.isoformat())
    assert code == 0, out + err
    assert {orjson.loads(line)["stream_id"] for line in out.splitlines()} == {second}
    assert len(out.splitlines()) == 10
    code, out, err = await cli(settings, "export", "--until", end_of_first.isoformat())
    assert code == 0, out + err
    assert [orjson.loads(line)["stream_id"] for line in out.splitlines()] == [first] * 10

    # by task, and a task that is not there
    code, out, err = await cli(settings, "export", "--task", second, "--task", first)
    assert code == 0, out + err
    assert [orjson.loads(line)["stream_id"] for line in out.splitlines()] == [second] * 10 + [
        first
    ] * 10
    missing = tmp_path / "missing.jsonl"
    code, out, err = await cli(
        settings, "export", "--task", first, "--task", "nope", "-o", str(missing)
    )
    assert code == 2, out + err
    assert err.strip() == "task 'nope' is not in the event log"
    assert not missing.exists() and not (tmp_path / "missing.jsonl.partial").exists()

    # the first task as of its checkpoint: paused, waiting for three researchers
    paused = stream[1]
    assert paused.event_type == "TaskPaused" and paused.recorded_at is not None
    code, out, err = await cli(
        settings, "state", first, "--at-position", str(paused.global_position)
    )
    assert code == 0, out + err
    shown = out.splitlines()
    assert shown[0] == (
        f"task {first} as of position {paused.global_position}: 2 of 10 events, the last v2 "
        f"TaskPaused at position {paused.global_position}, recorded "
        f"{paused.recorded_at.isoformat()}"
    )
    assert shown[1:6] == [
        "status       paused",
        "agent        orchestrator",
        "pause        #1",
        'state        {"round":1,"total":0}',
        "outstanding  3 wait(s): 3 calls",
    ]
    for index, line in enumerate(shown[6:9]):
        assert line.startswith(f"  {first}:1:{index}  call researcher  deadline 20"), line
    assert shown[9:] == ["results      0"]

    code, out, err = await cli(
        settings, "state", first, "--at-position", str(stream[5].global_position), "--json"
    )
    assert code == 0, out + err
    past = orjson.loads(out)
    assert (past["status"], past["pause"], past["version"], past["state"]) == (
        "paused",
        1,
        6,
        {"round": 1, "total": 0},
    )
    # two of the three researchers had answered by then, in whatever order they finished
    answered = {r["subtask_id"]: (r["outcome"], r["value"]) for r in past["results"]}
    outstanding = [c["subtask_id"] for c in past["outstanding"]]
    assert len(answered) == 2 and len(outstanding) == 1
    assert set(answered) | set(outstanding) == {f"{first}:1:{i}" for i in range(3)}
    for subtask, answer in answered.items():
        x = 3 + int(subtask.rsplit(":", 1)[1])  # n + i
        assert answer == ("ok", {"answer": x * x}), subtask
    assert past["last_event"] == {
        "version": 6,
        "event_type": "ResultRecorded",
        "global_position": stream[5].global_position,
        "recorded_at": stream[5].recorded_at.isoformat() if stream[5].recorded_at else None,
    }
    assert past["result"] is None

    # as of a time: the moment it paused; and now, completed
    code, out, err = await cli(
        settings, "state", first, "--at", paused.recorded_at.isoformat(), "--json"
    )
    assert code == 0, out + err
    assert (orjson.loads(out)["status"], orjson.loads(out)["version"]) == ("paused", 2)
    code, out, err = await cli(settings, "state", first, "--json")
    assert code == 0, out + err
    now = orjson.loads(out)
    assert (now["status"], now["version"], now["result"]) == (
        "completed",
        10,
        {"n": 3, "total": expected_total(3, 3)},
    )
    assert now["outstanding"] == [] and len(now["results"]) == 3

    # nothing at or before the point, or no such task: exit 2, saying so
    code, out, err = await cli(
        settings, "state", second, "--at-position", str(paused.global_position)
    )
    assert code == 2, out + err
    assert err.startswith(
        f"task {second!r} has no event at or before position {paused.global_position} "
        f"(its first is at position {later[0].global_position}, recorded "
    )
    code, out, err = await cli(settings, "state", "no-such-task")
    assert code == 2, out + err
    assert err.strip() == "task 'no-such-task' is not in the event log"
    code, out, err = await cli(settings, "state", first, "--at", "yesterday")
    assert code == 2, out + err
    assert "'yesterday' is not an ISO-8601 time" in err
