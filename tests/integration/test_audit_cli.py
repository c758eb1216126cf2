"""``waystation verify``, ``history`` and ``state`` as a user runs them, against a real log
(and ``tasks`` on a stream of signals and timers).

Both tests use a database of their own (the session's database is shared, and a tampered stream
in it would fail every later whole-log verify).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import orjson
import pytest
from sqlalchemy import text

from waystation.client import Client
from waystation.events import (
    Call,
    DomainEvent,
    EventMetadata,
    NewEvent,
    Pause,
    ResultRecorded,
    SubtaskClaimed,
    TaskResumed,
    TaskStarted,
    TaskState,
    decide_outcome,
    decide_reply,
    event_id,
    fold,
)
from waystation.events.postgres import PostgresEventStore
from waystation.events.task import FirstK, Signal, Sleep, decide_signal
from waystation.example import app, expected_total
from waystation.projections.postgres import PROJECTIONS, catch_up, create_engine
from waystation.settings import Settings

from ..support import running_worker
from .test_cli import run_cli


async def run_tasks(settings: Settings, store: PostgresEventStore, *inputs: int) -> list[str]:
    """Run example orchestrator tasks (n, k=3) through an in-process worker; their ids."""
    ids = []
    async with (
        running_worker(app, settings, store),
        Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
    ):
        for n in inputs:
            result = await client.call("orchestrator", {"n": n, "k": 3}, timeout=20)
            assert result.ok and result.result == {"n": n, "total": expected_total(n, 3)}
            ids.append(result.task_id)
    return ids


async def tamper(store: PostgresEventStore, stream_id: str, *, version: int) -> None:
    """Change the value of the result at ``version`` of ``stream_id`` in place, as a superuser
    could, stepping around the append-only trigger; its hash stays as it was."""
    async with store.engine.begin() as connection:
        await connection.execute(
            text("ALTER TABLE events DISABLE TRIGGER events_no_update_or_delete")
        )
        changed = await connection.execute(
            text(
                "UPDATE events SET data = jsonb_set(data, '{value}', '12345') "
                "WHERE stream_id = :s AND stream_version = :v"
            ),
            {"s": stream_id, "v": version},
        )
        assert changed.rowcount == 1
        await connection.execute(
            text("ALTER TABLE events ENABLE TRIGGER events_no_update_or_delete")
        )


async def cli(settings: Settings, *args: str) -> tuple[int, str, str]:
    done = await asyncio.to_thread(run_cli, settings, *args)
    return done.returncode, done.stdout, done.stderr


async def test_verify_and_history_of_real_tasks(
    own_log: tuple[Settings, PostgresEventStore],
) -> None:
    settings, store = own_log
    first, second = await run_tasks(settings, store, 2, 5)

    code, out, err = await cli(settings, "verify", first)
    assert code == 0, out + err
    assert out.strip() == "1 streams, 10 events verified, no problems"

    code, out, err = await cli(settings, "verify")
    assert code == 0, out + err
    assert out.strip() == "2 streams, 20 events verified, no problems"

    code, out, err = await cli(settings, "verify", "--json")
    assert code == 0, out + err
    assert orjson.loads(out) == {"ok": True, "streams": 2, "events": 20, "problems": []}

    code, out, err = await cli(settings, "history", second)
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0] == f"task {second}: 10 events, trace {second}"  # its own, by default
    assert "TaskPaused" in out and "TaskResumed" in out
    deadline = f"deadline in {settings.default_call_timeout:g} s"
    assert f"paused #1 calling researcher ×3 ({deadline})" in out
    assert f"claimed {second}:1:0" in out and f"result ok for {second}:1:0" in out
    assert "resumed from pause #1 after " in out
    assert lines[-1].startswith("pause #1: v2 → v9, ") and lines[-1].endswith(" s")
    assert settings.worker_id in out, "each event names the worker that wrote it"

    code, out, err = await cli(settings, "history", second, "--json")
    assert code == 0, out + err
    shown = orjson.loads(out)
    assert shown["task_id"] == second
    assert [e["version"] for e in shown["events"]] == list(range(1, 11))
    assert [e["event_type"] for e in shown["events"]] == [
        e.event_type for e in await store.read_stream(second)
    ]
    (pause,) = shown["pauses"]
    assert (pause["pause"], pause["paused_version"], pause["resumed_version"]) == (1, 2, 9)
    # the time between the pause and its resume as the database recorded them
    log = await store.read_stream(second)
    paused_at, resumed_at = log[1].recorded_at, log[8].recorded_at
    assert paused_at is not None and resumed_at is not None
    assert pause["seconds"] == pytest.approx((resumed_at - paused_at).total_seconds())
    assert pause["seconds"] > 0
    assert shown["events"][8]["pause_seconds"] == pause["seconds"]

    for args in (("history", "no-such-task"), ("verify", "no-such-task")):
        code, out, err = await cli(settings, *args)
        assert code == 2, out + err
        assert "not in the event log" in err


async def test_verify_names_the_stream_and_version_of_a_tampered_event(
    own_log: tuple[Settings, PostgresEventStore],
) -> None:
    settings, store = own_log
    tampered, untouched = await run_tasks(settings, store, 3, 4)
    await tamper(store, tampered, version=6)
    assert [e.event_type for e in await store.read_stream(tampered)][5] == "ResultRecorded"

    code, out, err = await cli(settings, "verify", tampered)
    assert code == 1, out + err
    assert f"stream {tampered} version 6: hash-mismatch" in out
    assert out.splitlines()[-1] == "1 streams, 10 events verified, 1 problem(s)"

    code, out, err = await cli(settings, "verify", untouched)
    assert code == 0, out + err

    code, out, err = await cli(settings, "verify", "--json")
    assert code == 1, out + err
    report = orjson.loads(out)
    assert report["ok"] is False and (report["streams"], report["events"]) == (2, 20)
    (problem,) = report["problems"]
    assert (problem["stream_id"], problem["stream_version"], problem["kind"]) == (
        tampered,
        6,
        "hash-mismatch",
    )


class _Stream:
    """One task's stream, decided by the task's own decide functions and appended to the real
    log as a worker appends (at the version read), so that each step (a duplicate signal, a late
    reply, an invalid payload) comes exactly when the test says."""

    def __init__(self, store: PostgresEventStore, task_id: str) -> None:
        self.store = store
        self.task_id = task_id
        self.steps = 0

    async def state(self) -> TaskState:
        return fold(self.task_id, await self.store.read_stream(self.task_id))

    async def append(self, events: list[DomainEvent]) -> None:
        state = await self.state()
        key = f"step-{self.steps}"
        self.steps += 1
        metadata = EventMetadata(worker_id="writer-1", causation_id=key)
        new = [
            NewEvent.of(event_id(self.task_id, key, i), e, metadata) for i, e in enumerate(events)
        ]
        await self.store.append(self.task_id, state.version, new, prev_hash=state.last_hash)


async def test_history_state_tasks_and_verify_of_signals_timers_and_a_first_k_pause(
    own_log: tuple[Settings, PostgresEventStore],
) -> None:
    """A drafter pauses on a researcher, an approval and a timer and resumes on the first of
    them: a person's approval (its sender on the event), which gives up the other two; a late
    reply is ignored, a duplicate approval changes nothing. It then waits for `publish` or a
    timer, and gets an invalid `publish`, refused. Each command says so, and verify passes."""
    settings, store = own_log
    now = time.time()
    drafter = _Stream(store, f"drafter-{uuid.uuid4()}")
    start = TaskStarted(agent="drafter", input={"doc": 1}, reply_to="client")
    first = Pause(
        [Call("researcher", {"q": 1}, timeout=600), Signal("approval", timeout=3600), Sleep(900)],
        until=FirstK(1),
    )
    await drafter.append(
        decide_outcome(
            await drafter.state(),
            first,
            now=now,
            default_timeout=30,
            start=start,
            agent_version="2.1.0",
        )
    )
    task_id = drafter.task_id
    call, approval, timer = (f"{task_id}:1:{i}" for i in range(3))
    approve = {"approved": True}
    await drafter.append(
        decide_signal(await drafter.state(), "approval", approve, signal_id="sig-1", sender="alice")
    )
    assert (
        decide_signal(await drafter.state(), "approval", approve, signal_id="sig-1", sender="alice")
        == []
    ), "a duplicate is recorded nowhere"
    await drafter.append(
        decide_reply(await drafter.state(), call, outcome="ok", value=1, message_id="late")
    )
    second = Pause([Signal("publish", timeout=600), Sleep(60)])
    await drafter.append(
        decide_outcome(
            await drafter.state(), second, now=now, default_timeout=30, agent_version="2.1.0"
        )
    )
    await drafter.append(
        decide_signal(
            await drafter.state(),
            "publish",
            {"when": "never"},
            signal_id="sig-2",
            sender="bob",
            invalid="when: not a date",
        )
    )

    code, out, err = await cli(settings, "verify", task_id)
    assert code == 0, out + err

    code, out, err = await cli(settings, "history", task_id)
    assert code == 0, out + err
    assert (
        "paused #1 calling researcher (deadline in 600 s), waiting for signal approval "
        "(up to 3600 s), a timer of 900 s, resuming on the first 1 of 3, agent version 2.1.0"
    ) in out
    assert f'signal approval (sig-1) from alice {{"approved":true}}: taken by {approval}' in out
    assert f"claimed {approval} with signal sig-1" in out
    [resumed] = [line for line in out.splitlines() if "resumed from pause #1 after " in line]
    assert resumed.endswith(f" s, giving up {call}, {timer}"), resumed
    assert f"ignored late ok reply for {call}" in out
    assert "refused signal publish (sig-2) from bob: invalid (when: not a date)" in out
    assert out.splitlines()[-2].endswith(", agent version 2.1.0")
    assert out.splitlines()[-1] == "pause #2: v8 → -, still waiting, agent version 2.1.0"

    code, out, err = await cli(settings, "history", task_id, "--json")
    shown = orjson.loads(out)
    assert [e["sender"] for e in shown["events"] if e["sender"]] == ["alice", "bob"]
    assert [p["agent_version"] for p in shown["pauses"]] == ["2.1.0", "2.1.0"]

    code, out, err = await cli(settings, "state", task_id)
    assert code == 0, out + err
    assert "outstanding  2 wait(s): 1 signal, 1 timer" in out
    assert f"  {task_id}:2:0  signal publish  deadline " in out
    assert f"  {task_id}:2:1  timer  fires " in out
    assert "version      2.1.0 (the agent's, on its latest pause)" in out

    code, out, err = await cli(
        settings,
        "state",
        task_id,
        "--at-position",
        str((await store.read_stream(task_id))[5].global_position),
    )
    assert f'  {approval}  signal approval  ok  {{"approved":true}}  from alice' in out
    assert f"given up     {call}, {timer}" in out

    engine = create_engine(settings.database_url)
    try:
        async with engine.connect() as connection:
            await catch_up(connection, PROJECTIONS["paused_tasks"])
    finally:
        await engine.dispose()
    code, out, err = await cli(settings, "tasks", "--signal", "publish")
    assert code == 0, out + err
    [row] = out.splitlines()[1:]
    assert row.startswith(task_id) and row.endswith("paused   signal publish, timer"), row
    code, out, err = await cli(settings, "tasks", "--signal", "approval", "--json")
    assert orjson.loads(out) == []


async def test_verify_finds_a_signal_taken_by_two_waits_in_the_log(
    own_log: tuple[Settings, PostgresEventStore],
) -> None:
    """A stream whose hash chain is intact but that breaks an invariant of signals, as a
    defective writer would append it: verify names the stream, the version and the signal."""
    settings, store = own_log
    stream = _Stream(store, f"twice-{uuid.uuid4()}")
    start = TaskStarted(agent="drafter", input=None)
    pause = Pause([Signal("approval"), Signal("approval")])
    await stream.append(
        decide_outcome(
            await stream.state(), pause, now=time.time(), default_timeout=30, start=start
        )
    )
    state = await stream.state()
    taken = decide_signal(state, "approval", True, signal_id="sig-1", sender="alice")
    other = f"{stream.task_id}:1:1"
    await stream.append(
        [
            *taken,
            SubtaskClaimed(subtask_id=other, pause=1, message_id="sig-1"),
            ResultRecorded(subtask_id=other, pause=1, outcome="ok", value=True),
            TaskResumed(pause=1),
        ]
    )

    code, out, err = await cli(settings, "verify", stream.task_id)
    assert code == 1, out + err
    assert (
        f"stream {stream.task_id} version 6: signal-reused: signal sig-1 claims {other}, but "
        f"{stream.task_id}:1:0 took it"
    ) in out
