"""Log lines carry the message's context; JSON for machines, text for people."""

from __future__ import annotations

import asyncio
import io
import logging

import orjson
import pytest

from waystation.logs import configure_logging, log_context
from waystation.protocol.wire import trace_id_of


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
    assert lines[1]["task_id"] == "t-1" and lines[1]["trace_id"] == "tr-9"
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
    assert line.endswith(" INFO waystation.test hello [task=t-1 subtask=t-1:1:0 trace=tr-9]")


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
        (
            {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
            "4bf92f3577b34da6a3ce929d0e0e4736",
        ),
        (
            {
                "x-waystation-trace-id": "ours-first",
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
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
