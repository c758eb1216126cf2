"""Log lines carry the message's context; JSON for machines, text for people."""

from __future__ import annotations

import asyncio
import io
import logging
from typing import Any

import orjson
import pytest

from waystation import App, Call, Complete, Pause, TaskContext
from waystation.observability.logs import configure_logging, log_context
from waystation.observability.tracing import provider, trace_hex
from waystation.protocol.wire import trace_id_of
from waystation.testing import InMemoryPool

from ..support import otel_capability, require

W3C_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def restore_logging() -> object:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_json_lines_carry_the_context_of_the_block_they_are_logged_in(
    restore_logging: object,
) -> None:
    out = io.StringIO()
    configure_logging("INFO", "json", worker_id="w-1", stream=out)
    log = logging.getLogger("waystation.test")
    log.info("before")
    with log_context(task_id="t-1", trace_id="tr-9", subtask_id=None):
        log.warning("inside %s", "it")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    log.info("after")
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["before", "inside it", "failed", "after"]
    assert lines[0] == {
        "time": lines[0]["time"],
        "level": "INFO",
        "logger": "waystation.test",
        "message": "before",
        "worker_id": "w-1",
    }
    assert lines[1]["task_id"] == "t-1"
    assert lines[1]["trace_id"] == trace_hex("tr-9"), "the trace id the task's spans have"
    assert lines[1]["waystation_trace_id"] == "tr-9", "and the one it was given"
    assert "subtask_id" not in lines[1], "a None field is left out"
    assert "ValueError: boom" in lines[2]["exception"]
    assert "task_id" not in lines[3], "the context ends with its block"


async def test_concurrent_messages_do_not_share_a_context(restore_logging: object) -> None:
    out = io.StringIO()
    configure_logging("INFO", "json", stream=out)
    log = logging.getLogger("waystation.test")

    async def handle(task: str) -> None:
        with log_context(task_id=task):
            await asyncio.sleep(0.01)
            log.info("handled %s", task)

    await asyncio.gather(*(handle(f"t-{n}") for n in range(10)))
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 10
    assert all(line["message"] == f"handled {line['task_id']}" for line in lines)


def test_text_lines_show_the_context_after_the_message(restore_logging: object) -> None:
    out = io.StringIO()
    configure_logging("INFO", "text", worker_id="w-1", stream=out)
    with log_context(task_id="t-1", subtask_id="t-1:1:0", trace_id="tr-9"):
        logging.getLogger("waystation.test").info("hello")
    (line,) = out.getvalue().splitlines()
    assert line.endswith(
        f" INFO waystation.test hello [task=t-1 subtask=t-1:1:0 trace={trace_hex('tr-9')} "
        "waystation_trace=tr-9]"
    )


def test_a_w3c_trace_id_is_printed_as_it_is_and_once(restore_logging: object) -> None:
    out = io.StringIO()
    configure_logging("INFO", "json", stream=out)
    with log_context(task_id="t-1", trace_id=W3C_TRACE):
        logging.getLogger("waystation.test").info("hello")
    line = orjson.loads(out.getvalue())
    assert line["trace_id"] == W3C_TRACE
    assert "waystation_trace_id" not in line


def test_auto_is_text_in_a_terminal_and_json_elsewhere(restore_logging: object) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, pipe = Terminal(), io.StringIO()
    configure_logging("INFO", "auto", stream=terminal)
    logging.getLogger("waystation.test").info("to a person")
    configure_logging("INFO", "auto", stream=pipe)
    logging.getLogger("waystation.test").info("to a machine")
    assert " INFO waystation.test to a person" in terminal.getvalue()
    assert orjson.loads(pipe.getvalue())["message"] == "to a machine"


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"x-waystation-trace-id": "mine"}, "mine"),
        ({"x-waystation-trace-id": b"bytes"}, "bytes"),
        ({"traceparent": f"00-{W3C_TRACE}-00f067aa0ba902b7-01"}, W3C_TRACE),
        (
            {
                "x-waystation-trace-id": "ours-first",
                "traceparent": f"00-{W3C_TRACE}-00f067aa0ba902b7-01",
            },
            "ours-first",
        ),
        ({"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"}, "default"),
        ({"traceparent": "garbage"}, "default"),
        ({"x-waystation-trace-id": "  "}, "default"),
        ({"x-waystation-trace-id": 42}, "default"),
        ({}, "default"),
        (None, "default"),
    ],
)
def test_the_trace_id_of_a_message(headers: dict[str, object] | None, expected: str) -> None:
    assert trace_id_of(headers, "default") == expected


async def test_a_tasks_log_lines_print_the_trace_id_of_its_spans(
    restore_logging: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search of the logs by a span's trace id finds every line of its task, the handlers'
    own included, on whichever worker they were written."""
    require(otel_capability(), "the spans")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    monkeypatch.setattr(provider, "current", None)
    monkeypatch.setattr(provider, "_configured", False)
    exported = InMemorySpanExporter()
    spans_to = TracerProvider()
    spans_to.add_span_processor(SimpleSpanProcessor(exported))
    app = App()
    handler_log = logging.getLogger("the.app")

    @app.agent("parent")
    async def parent(task: TaskContext) -> Any:
        handler_log.info("parent run %d", task.pause)
        if task.pause == 0:
            return Pause([Call("child", x) for x in range(2)])
        return Complete(sum(r.value for r in task.results))

    @app.agent("child")
    async def child(task: TaskContext) -> Any:
        handler_log.info("child of %s", task.input)
        return Complete(task.input)

    out = io.StringIO()
    configure_logging("DEBUG", "json", stream=out)
    async with InMemoryPool(app, workers=2, tracer_provider=spans_to) as pool:
        task_id = await pool.submit("parent")
        assert (await pool.result(task_id)).result == 1
        await pool.join()
    spans_to.shutdown()
    trace_x = trace_hex(task_id)
    spans = exported.get_finished_spans()
    assert {s.name for s in spans} >= {"run parent", "run child", "complete parent"}
    assert {f"{s.context.trace_id:032x}" for s in spans} == {trace_x}
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    of_the_task = [line for line in lines if str(line.get("task_id", "")).startswith(task_id)]
    messages = {str(line["message"]) for line in of_the_task}
    assert {"parent run 0", "parent run 1", "child of 0", "child of 1"} <= messages
    assert {line.get("trace_id") for line in of_the_task} == {trace_x}, of_the_task
    assert {line.get("waystation_trace_id") for line in of_the_task} == {task_id}
