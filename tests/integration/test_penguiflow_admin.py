"""A real PenguiFlow flow saves its events through ``waystation.contrib.penguiflow``; PenguiFlow's
own admin CLI (``penguiflow-admin history`` and ``replay``) then reads them back from PostgreSQL in
another process, loading the adapter by its factory as a user would, and ``waystation verify``
checks the streams it wrote."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from ..support import penguiflow_capability, require

require(penguiflow_capability(), "the penguiflow-admin tests")

from penguiflow import Headers, Message, Node, NodePolicy, create  # noqa: E402

from waystation.contrib.penguiflow import create_store  # noqa: E402

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


async def run_flow(database_url: str, trace_id: str) -> Any:
    """Two nodes, one message: what PenguiFlow's runtime saves on its own (node_start, …)."""
    store = await create_store(database_url=database_url)

    async def plan(message: Message, _ctx: Any) -> Message:
        return message.model_copy(update={"payload": {"steps": message.payload["n"] * 2}})

    async def answer(message: Message, _ctx: Any) -> Message:
        return message.model_copy(update={"payload": {"answer": message.payload["steps"] + 1}})

    planner = Node(plan, name="plan", policy=NodePolicy(validate="none"))
    answerer = Node(answer, name="answer", policy=NodePolicy(validate="none"))
    flow = create(planner.to(answerer), answerer.to(), state_store=store)
    flow.run()
    try:
        await flow.emit(
            Message(payload={"n": 20}, headers=Headers(tenant="acme"), trace_id=trace_id)
        )
        result = await asyncio.wait_for(flow.fetch(), 60)
    finally:
        await flow.stop()
    assert store.errors == {}
    await store.close()
    return result


def admin(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WAYSTATION_DATABASE_URL": database_url}
    return subprocess.run(
        [
            str(BIN / "penguiflow-admin"),
            *args,
            "--state-store",
            "waystation.contrib.penguiflow:create_store",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_penguiflow_admin_reads_a_real_flows_history_from_the_log(
    database_url: str,
) -> None:
    trace_id = f"trace-{uuid.uuid4().hex[:12]}"
    result = await run_flow(database_url, trace_id)
    assert result.payload == {"answer": 41}

    history = await asyncio.to_thread(admin, database_url, "history", trace_id)
    assert history.returncode == 0, history.stderr
    lines = [json.loads(line) for line in history.stdout.splitlines()]
    assert [(e["event"], e["node_name"]) for e in lines] == [
        ("node_start", "plan"),
        ("node_success", "plan"),
        ("node_start", "answer"),
        ("node_success", "answer"),
    ]
    assert {e["trace_id"] for e in lines} == {trace_id}
    assert [e["ts"] for e in lines] == sorted(e["ts"] for e in lines)

    tail = await asyncio.to_thread(admin, database_url, "history", trace_id, "--tail", "1")
    assert [json.loads(line)["event"] for line in tail.stdout.splitlines()] == ["node_success"]

    replay = await asyncio.to_thread(admin, database_url, "replay", trace_id)
    assert replay.returncode == 0, replay.stderr
    header, *events = replay.stdout.splitlines()
    assert header == f"# replay trace={trace_id} events=4"
    assert [json.loads(line) for line in events] == lines

    unknown = await asyncio.to_thread(admin, database_url, "replay", "no-such-trace")
    assert (unknown.returncode, unknown.stdout.strip()) == (
        0,
        "# trace no-such-trace has no stored events",
    )

    env = {**os.environ, "WAYSTATION_DATABASE_URL": database_url}
    verify = await asyncio.to_thread(
        subprocess.run,
        [str(BIN / "waystation"), "verify", f"penguiflow:trace:{trace_id}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "1 streams, 4 events verified, no problems" in verify.stdout
