"""``waystation verify`` and ``waystation history`` as a user runs them, against a real log.

Both tests use a database of their own (the session's database is shared, and a tampered stream
in it would fail every later whole-log verify).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
import pytest_asyncio
from sqlalchemy import text

from scripts.lab.harness.database import fresh_database_url
from waystation import migrations
from waystation.client import Client
from waystation.events.postgres import PostgresEventStore
from waystation.example import app, expected_total
from waystation.settings import Settings

from ..support import Services, running_worker
from .test_cli import run_cli


@pytest_asyncio.fixture
async def own_log(
    services: Services, settings: Settings
) -> AsyncIterator[tuple[Settings, PostgresEventStore]]:
    """Settings and a store for a fresh database of this test's own, dropped afterwards."""
    url = fresh_database_url(services.admin_database_url)
    await migrations.upgrade(url)
    store = PostgresEventStore.from_url(url, pool_size=3)
    try:
        yield settings.model_copy(update={"database_url": url}), store
    finally:
        await store.close()
        await migrations.drop_database(url)


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
    async with store.engine.begin() as connection:
        # what a superuser could do: step around the append-only trigger
        await connection.execute(
            text("ALTER TABLE events DISABLE TRIGGER events_no_update_or_delete")
        )
        changed = await connection.execute(
            text(
                "UPDATE events SET data = jsonb_set(data, '{value}', '12345') "
                "WHERE stream_id = :s AND stream_version = 6"
            ),
            {"s": tampered},
        )
        assert changed.rowcount == 1
        await connection.execute(
            text("ALTER TABLE events ENABLE TRIGGER events_no_update_or_delete")
        )
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
