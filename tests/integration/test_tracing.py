"""OpenTelemetry: one trace per root task across worker processes and across the pause.

Two worker processes of the example app export their spans with the SDK's in-memory exporter
(``OTEL_TRACES_EXPORTER=waystation-test``) and write them to a file when they stop. Fan-out/fan-in
tasks go through both; every span of a task must then be in the task's one trace, and the parent
links must run task run -> pause -> call -> peer run -> peer completion -> reply recorded ->
resume -> resumed run -> completion, whichever process recorded each step.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from scripts.lab.harness.clients import RecordingClient
from scripts.lab.harness.processes import WorkerProcess, stop_all, worker_logs
from waystation.observability.tracing import TEST_SPANS_FILE, trace_hex
from waystation.protocol.wire import CONTENT_TYPE, HEADER_TRACEPARENT, TYPE_TASK, Names
from waystation.settings import Settings

from ..support import Services, eventually, otel_capability, require, start_example_workers

pytestmark = [pytest.mark.integration, pytest.mark.slow]

K = 4
Span = dict[str, Any]


def render(spans: list[Span]) -> str:
    """The spans of one trace as an indented tree (children by start time), for
    docs/observability.md."""
    children: dict[str | None, list[Span]] = {}
    ids = {s["span_id"] for s in spans}
    for span in spans:
        parent = span["parent_id"] if span["parent_id"] in ids else None
        children.setdefault(parent, []).append(span)
    origin = min(s["start_ns"] for s in spans)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: (s["start_ns"], s["name"])):
            start = (span["start_ns"] - origin) / 1e6
            took = (span["end_ns"] - span["start_ns"]) / 1e6
            lines.append(
                f"{'  ' * depth}{span['name']:<{40 - 2 * depth}} {span['service']:<9} "
                f"+{start:7.1f} ms {took:7.1f} ms  {span['span_id']}"
            )
            walk(span["span_id"], depth + 1)

    walk(None, 0)
    return "\n".join(lines)


def _one(spans: list[Span], name: str, **attributes: Any) -> Span:
    found = [
        s
        for s in spans
        if s["name"] == name
        and all(s["attributes"].get(f"waystation.{k}") == v for k, v in attributes.items())
    ]
    assert len(found) == 1, (name, attributes, found)
    return found[0]


def check_trace(spans: list[Span], task_id: str, trace_x: str, root_parent: str | None) -> None:
    """Every parent link of one fan-out/fan-in task of the example app."""
    by_id = {s["span_id"]: s for s in spans}
    assert len(by_id) == len(spans), "a span id appears twice"
    assert {s["trace_id"] for s in spans} == {trace_x}
    first = _one(spans, "run orchestrator", task_id=task_id, pause=0)
    assert first["parent_id"] == root_parent
    pause = _one(spans, "pause orchestrator", task_id=task_id)
    assert pause["parent_id"] == first["span_id"]
    calls = [s for s in spans if s["name"] == "call researcher"]
    assert len(calls) == K and all(c["parent_id"] == pause["span_id"] for c in calls)
    replies = []
    for call in calls:
        subtask = call["attributes"]["waystation.subtask_id"]
        peer = _one(spans, "run researcher", task_id=subtask)
        assert peer["parent_id"] == call["span_id"]
        done = _one(spans, "complete researcher", task_id=subtask)
        assert done["parent_id"] == peer["span_id"]
        reply = _one(spans, "reply ok", subtask_id=subtask)
        assert reply["parent_id"] == done["span_id"]
        assert reply["links"] == [call["span_id"]]
        replies.append(reply)
    resume = _one(spans, "resume orchestrator", task_id=task_id)
    assert resume["parent_id"] in {r["span_id"] for r in replies}
    assert resume["links"] == [pause["span_id"]]
    completion = _one(spans, "complete orchestrator", task_id=task_id)
    resumed = by_id[completion["parent_id"]]
    assert resumed["name"] == "run orchestrator"
    assert resumed["attributes"]["waystation.pause"] == 1
    assert resumed["parent_id"] == resume["span_id"]
    # every span hangs from the trace's root (a resumed run whose append lost a race to another
    # worker, and ran again, hangs from the same resume)
    for span in spans:
        if span is not first:
            assert span["parent_id"] in by_id, span


@pytest.mark.timeout(180)
async def test_one_trace_per_task_across_two_workers_and_the_pause(
    settings: Settings, services: Services, tmp_path: Path
) -> None:
    require(otel_capability(), "tracing")
    files = [tmp_path / f"spans-{i}.json" for i in range(2)]
    workers = [
        WorkerProcess.with_settings(
            settings,
            tmp_path / f"worker-{i}.log",
            env={
                "OTEL_TRACES_EXPORTER": "waystation-test",
                "OTEL_SERVICE_NAME": f"worker-{i}",
                TEST_SPANS_FILE: str(files[i]),
            },
        )
        for i in range(2)
    ]
    logs = worker_logs(workers)
    names = Names(settings.queue_prefix)
    plain = [f"plain-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
    given = f"traced-{uuid.uuid4().hex[:8]}"
    publisher_trace, publisher_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    try:
        await start_example_workers(settings, workers)
        async with RecordingClient(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
            for task_id in plain:
                # 50 ms per call, so that both workers take some of each task's calls
                await client.submit(
                    "orchestrator", {"n": 1, "k": K, "work_ms": 50}, task_id=task_id
                )
            # a publisher with its own trace: its traceparent is the parent of the task's run
            assert client._reply_queue is not None
            connection = await aio_pika.connect(settings.amqp_url)
            async with connection:
                channel = await connection.channel()
                await channel.default_exchange.publish(
                    aio_pika.Message(
                        json.dumps({"n": 2, "k": K, "work_ms": 50}).encode(),
                        message_id=given,
                        correlation_id=given,
                        reply_to=client._reply_queue.name,
                        type=TYPE_TASK,
                        content_type=CONTENT_TYPE,
                        headers={HEADER_TRACEPARENT: f"00-{publisher_trace}-{publisher_span}-01"},
                    ),
                    routing_key=names.tasks("orchestrator"),
                )
            await eventually(
                lambda: all(client.bodies(t) for t in [*plain, given]), 60, "every result"
            )
            # every peer's answer came through the log before the results: wait for nothing more
        codes = await asyncio.to_thread(stop_all, workers)
        assert codes == {w.name: 0 for w in workers}, logs()
    finally:
        stop_all(workers)
    spans: list[Span] = []
    for file in files:
        assert file.exists(), f"{file} was not written\n{logs()}"
        spans.extend(json.loads(file.read_text()))
    by_trace: dict[str, list[Span]] = {}
    for span in spans:
        by_trace.setdefault(span["trace_id"], []).append(span)
    expected = {trace_hex(t): t for t in plain} | {publisher_trace: given}
    assert set(by_trace) == set(expected), sorted(by_trace)
    for trace_x, task_id in expected.items():
        root = publisher_span if task_id == given else None
        check_trace(by_trace[trace_x], task_id, trace_x, root)
    # across processes: both workers recorded spans, and some trace has spans of both
    assert len({s["pid"] for s in spans}) == 2
    assert any(len({s["pid"] for s in t}) == 2 for t in by_trace.values())
    counts = Counter(s["service"] for s in spans)
    print(f"\nspans per worker: {dict(counts)}")
    print(f"trace of {plain[0]} ({trace_hex(plain[0])}):\n{render(by_trace[trace_hex(plain[0])])}")
