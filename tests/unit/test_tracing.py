"""Trace context on the wire (``traceparent`` on every message a worker publishes) and the spans
of ``waystation.observability.tracing``, with the SDK's in-memory exporter in this process."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from waystation.events import (
    CancelledCall,
    PendingCall,
    ResultRecorded,
    SubtaskClaimed,
    TaskCompleted,
    TaskPaused,
    TaskResumed,
    TaskStarted,
    TaskState,
)
from waystation.observability import tracing
from waystation.observability.tracing import (
    call_key,
    end_key,
    pause_key,
    provider,
    reply_key,
    resume_key,
    span_hex,
    trace_hex,
    traceparent,
)
from waystation.protocol.wire import (
    HEADER_TRACE,
    HEADER_TRACEPARENT,
    Names,
    ResultEnvelope,
    implied_messages,
    result_message,
    trace_id_of,
)

from ..support import otel_capability, require

NAMES = Names("t.")
HEX_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _state(trace_id: str | None = "trace-1", **changes: Any) -> TaskState:
    base: dict[str, Any] = {
        "task_id": "task-1",
        "version": 2,
        "status": "running",
        "agent": "boss",
        "reply_to": "client.replies",
        "correlation_id": "c-1",
        "trace_id": trace_id,
        "root_id": "task-1",
    }
    return TaskState(**{**base, **changes})


def _paused(pause: int = 1, k: int = 2) -> TaskPaused:
    calls = tuple(
        PendingCall(subtask_id=f"task-1:{pause}:{i}", agent="peer", input={"i": i}, deadline_at=9e9)
        for i in range(k)
    )
    return TaskPaused(pause=pause, state_delta={}, calls=calls)


def test_trace_ids_map_onto_w3c_trace_ids() -> None:
    assert trace_hex(HEX_TRACE) == HEX_TRACE
    assert trace_hex(HEX_TRACE.upper()) == HEX_TRACE
    hashed = trace_hex("some-task-id")
    assert len(hashed) == 32 and int(hashed, 16) and hashed == trace_hex("some-task-id")
    assert trace_hex("0" * 32) != "0" * 32
    parent = traceparent("some-task-id", end_key("t"))
    assert parent == f"00-{hashed}-{span_hex('some-task-id', end_key('t'))}-01"
    # a consumer that reads only the traceparent finds the same trace
    assert trace_id_of({HEADER_TRACEPARENT: traceparent(HEX_TRACE, "x")}, "d") == HEX_TRACE


def test_every_message_an_append_implies_names_the_step_that_sent_it() -> None:
    state = _state()
    requests = implied_messages(NAMES, state, [_paused()])
    assert [m.properties["headers"][HEADER_TRACEPARENT] for m in requests] == [
        traceparent("trace-1", call_key(f"task-1:1:{i}")) for i in range(2)
    ]
    paused = _state(status="paused", pause=1, calls=_paused().calls)
    last = [
        SubtaskClaimed(subtask_id="task-1:1:1", pause=1, message_id="m"),
        ResultRecorded(subtask_id="task-1:1:1", pause=1, outcome="ok", value=1),
        TaskResumed(pause=1),
    ]
    (resume,) = implied_messages(NAMES, paused, last)
    assert resume.properties["headers"][HEADER_TRACEPARENT] == traceparent(
        "trace-1", resume_key("task-1", 1)
    )
    (result,) = implied_messages(NAMES, paused, [*last, TaskCompleted(result=3)])
    assert result.properties["headers"][HEADER_TRACEPARENT] == traceparent(
        "trace-1", end_key("task-1")
    )
    timeout = ResultRecorded(subtask_id="task-1:1:0", pause=1, outcome="timeout")
    (cancel,) = implied_messages(NAMES, paused, [timeout])
    assert cancel.properties["headers"][HEADER_TRACEPARENT] == traceparent(
        "trace-1", reply_key("task-1:1:0")
    )


def test_a_result_answered_without_the_log_names_the_completion() -> None:
    envelope = ResultEnvelope("ok", result=1, task_id="task-1")
    message = result_message("task-1", "r", None, envelope, {HEADER_TRACE: "trace-1"})
    assert message.properties["headers"][HEADER_TRACEPARENT] == traceparent(
        "trace-1", end_key("task-1")
    )
    # no trace, no traceparent (what a task cancelled before it started answers)
    assert HEADER_TRACEPARENT not in result_message("t", "r", None, envelope).properties["headers"]


def test_hooks_are_no_ops_when_tracing_is_off() -> None:
    assert not tracing.active()
    assert tracing.run("t", "a", 0, None) is tracing.consuming({}) is tracing.spans._NULL
    tracing.recorded(_state(), [_paused()])  # nothing to do, nothing raised


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    require(otel_capability(), "the spans")
    impl = provider._build(["waystation-test"], install=False)
    monkeypatch.setattr(provider, "current", impl)
    yield impl.memory
    impl.provider.shutdown()


def _spans(memory: Any) -> dict[str, Any]:
    return {span.name: span for span in memory.get_finished_spans()}


def test_a_first_run_hangs_from_the_publishers_span_and_its_pause_from_the_run(
    memory: Any,
) -> None:
    state = _state(trace_id=HEX_TRACE)
    given = {HEADER_TRACEPARENT: f"00-{HEX_TRACE}-00f067aa0ba902b7-01"}
    with tracing.consuming(given):
        with tracing.run("task-1", "boss", 0, HEX_TRACE):
            pass
        tracing.recorded(state, [TaskStarted(agent="boss", input=None), _paused()])
    spans = _spans(memory)
    run, pause = spans["run boss"], spans["pause boss"]
    assert f"{run.context.trace_id:032x}" == HEX_TRACE
    assert run.parent.span_id == 0x00F067AA0BA902B7
    assert pause.parent.span_id == run.context.span_id
    assert pause.context.span_id == int(span_hex(HEX_TRACE, pause_key("task-1", 1)), 16)
    calls = [s for s in memory.get_finished_spans() if s.name == "call peer"]
    assert [c.context.span_id for c in calls] == [
        int(span_hex(HEX_TRACE, call_key(f"task-1:1:{i}")), 16) for i in range(2)
    ]
    assert all(c.parent.span_id == pause.context.span_id for c in calls)


def test_a_task_without_a_trace_of_its_own_is_a_root_in_its_tasks_trace(memory: Any) -> None:
    state = _state(trace_id="task-1")
    with tracing.consuming({}), tracing.run("task-1", "boss", 0, "task-1"):
        pass
    (run,) = memory.get_finished_spans()
    assert run.parent is None
    assert f"{run.context.trace_id:032x}" == trace_hex("task-1")
    assert state.trace_id == "task-1"


def test_a_resume_in_place_links_reply_resume_run_and_completion(memory: Any) -> None:
    state = _state(status="paused", pause=1, calls=_paused().calls)
    peer_done = span_hex("trace-1", end_key("task-1:1:1"))
    with tracing.consuming({HEADER_TRACEPARENT: traceparent("trace-1", end_key("task-1:1:1"))}):
        with tracing.run("task-1", "boss", 1, "trace-1"):
            pass
        tracing.recorded(
            state,
            [
                SubtaskClaimed(subtask_id="task-1:1:1", pause=1, message_id="m"),
                ResultRecorded(subtask_id="task-1:1:1", pause=1, outcome="ok", value=1),
                TaskResumed(pause=1),
                TaskCompleted(result=2),
            ],
        )
    spans = _spans(memory)
    reply, resume = spans["reply ok"], spans["resume boss"]
    run, done = spans["run boss"], spans["complete boss"]
    assert reply.parent.span_id == int(peer_done, 16)
    assert [link.context.span_id for link in reply.links] == [
        int(span_hex("trace-1", call_key("task-1:1:1")), 16)
    ]
    assert resume.parent.span_id == reply.context.span_id
    assert run.parent.span_id == resume.context.span_id
    assert done.parent.span_id == run.context.span_id
    assert done.context.span_id == int(span_hex("trace-1", end_key("task-1")), 16)


def test_a_pause_s_timer_and_signal_are_waits_not_calls_and_a_first_k_resume_counts_its_give_ups(
    memory: Any,
) -> None:
    """Only a peer call is a ``call`` span: a timer or a signal waits for no agent (its span is
    no ``call `` with an empty peer), and a timer fires with no sender to hang from."""
    waits = (
        PendingCall(subtask_id="task-1:1:0", agent="peer", input=None, deadline_at=9e9),
        PendingCall(subtask_id="task-1:1:1", agent="", input=None, deadline_at=9e9, kind="timer"),
        PendingCall(
            subtask_id="task-1:1:2",
            agent="",
            input=None,
            deadline_at=9e9,
            kind="signal",
            name="approve",
        ),
    )
    paused = TaskPaused(pause=1, state_delta={}, calls=waits, until=1)
    tracing.recorded(_state(), [paused])
    tracing.recorded(
        _state(status="paused", pause=1, calls=waits, until=1),
        [
            SubtaskClaimed(subtask_id="task-1:1:1", pause=1),
            ResultRecorded(subtask_id="task-1:1:1", pause=1, outcome="ok"),
            TaskResumed(
                pause=1,
                abandoned=(
                    CancelledCall(subtask_id="task-1:1:0", agent="peer"),
                    CancelledCall(subtask_id="task-1:1:2", agent=""),
                ),
            ),
        ],
    )
    spans = _spans(memory)
    assert set(spans) == {
        "pause boss",
        "call peer",
        "wait timer",
        "wait signal approve",
        "timer fired",
        "resume boss",
    }
    pause = spans["pause boss"].attributes
    assert (pause["waystation.calls"], pause["waystation.waits"]) == (1, 3)
    assert pause["waystation.first_k"] == 1
    assert spans["wait signal approve"].attributes["waystation.signal"] == "approve"
    assert "waystation.peer" not in spans["wait timer"].attributes
    timer, fired = spans["wait timer"], spans["timer fired"]
    assert timer.context.span_id == int(span_hex("trace-1", call_key("task-1:1:1")), 16)
    assert fired.parent.span_id == timer.context.span_id
    assert spans["resume boss"].attributes["waystation.abandoned"] == 2


def test_a_handler_that_raises_marks_its_run_failed(memory: Any) -> None:
    with pytest.raises(ValueError), tracing.consuming({}), tracing.run("t", "a", 0, "t"):
        raise ValueError("boom")
    (run,) = memory.get_finished_spans()
    assert run.status.status_code.name == "ERROR"
    assert [event.name for event in run.events] == ["exception"]


def test_without_the_extra_tracing_stays_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # as if opentelemetry were not installed: the worker runs on, without spans
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setattr(provider, "_configured", False)
    monkeypatch.setattr(provider, "current", None)
    assert tracing.configure() is False
    assert not tracing.active()
    assert tracing.configure() is False  # once per process


def test_tracing_is_off_unless_an_exporter_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    for variables in ({}, {"OTEL_TRACES_EXPORTER": "none"}, {"OTEL_SDK_DISABLED": "true"}):
        monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
        for name, value in {"OTEL_TRACES_EXPORTER": "console", **variables}.items():
            monkeypatch.setenv(name, value)
        if not variables:
            monkeypatch.delenv("OTEL_TRACES_EXPORTER")
        monkeypatch.setattr(provider, "_configured", False)
        monkeypatch.setattr(provider, "current", None)
        assert tracing.configure() is False, variables


# ---- which provider the spans go to -------------------------------------------------------------


@pytest.fixture
def unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenTelemetry's global provider and Waystation's choice as if nothing had set them yet
    (both are once per process: restored after the test)."""
    require(otel_capability(), "the providers")
    from opentelemetry import trace
    from opentelemetry.util._once import Once

    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    monkeypatch.setattr(provider, "current", None)
    monkeypatch.setattr(provider, "_configured", False)
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_PYTHON_TRACER_PROVIDER"):
        monkeypatch.delenv(name, raising=False)


def _app_provider() -> tuple[Any, Any]:
    """An application's own SDK provider, exporting to memory."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    own = TracerProvider()
    own.add_span_processor(SimpleSpanProcessor(exported))
    return own, exported


def test_an_application_that_set_its_own_provider_gets_waystations_spans_in_it(
    unset: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry import trace

    own, exported = _app_provider()
    trace.set_tracer_provider(own)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")  # would make a provider of Waystation's
    assert tracing.configure()
    assert trace.get_tracer_provider() is own, "the application's provider stays the global one"
    with tracing.consuming({}):
        with tracing.run("task-1", "boss", 0, "trace-1"):
            trace.get_tracer("app").start_span("the handler's own").end()
        tracing.recorded(_state(), [TaskStarted(agent="boss", input=None), _paused(k=1)])
    spans = _spans(exported)
    assert set(spans) == {"run boss", "the handler's own", "pause boss", "call peer"}
    assert {f"{s.context.trace_id:032x}" for s in spans.values()} == {trace_hex("trace-1")}
    assert spans["the handler's own"].parent.span_id == spans["run boss"].context.span_id
    # the step spans have their derived ids in the application's provider too
    assert spans["pause boss"].context.span_id == int(
        span_hex("trace-1", pause_key("task-1", 1)), 16
    )
    assert spans["call peer"].context.span_id == int(
        span_hex("trace-1", call_key("task-1:1:0")), 16
    )
    # the application's own spans keep its generator, and its provider stays open
    assert trace.get_tracer("app").id_generator is own.id_generator
    tracing.shutdown()
    trace.get_tracer("app").start_span("after the worker stopped").end()
    assert "after the worker stopped" in _spans(exported)
    own.shutdown()


def test_a_provider_given_to_the_worker_is_used_before_the_global_one(unset: None) -> None:
    from opentelemetry import trace

    global_one, in_global = _app_provider()
    given, in_given = _app_provider()
    trace.set_tracer_provider(global_one)
    assert tracing.configure(given)
    with tracing.consuming({}), tracing.run("task-1", "boss", 0, None):
        pass
    assert list(_spans(in_given)) == ["run boss"] and not in_global.get_finished_spans()
    assert tracing.configure(global_one), "once per process: the first choice stays"
    given.shutdown()
    global_one.shutdown()


def test_a_no_op_provider_set_by_the_application_keeps_tracing_off(unset: None) -> None:
    from opentelemetry import trace

    trace.set_tracer_provider(trace.NoOpTracerProvider())
    assert tracing.configure() is False
    assert not tracing.active()


def test_waystation_makes_its_own_provider_the_global_one_only_when_none_is_set(
    unset: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry import trace

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "waystation-test")
    assert tracing.configure()
    assert provider.current is not None and provider.current.owned
    assert trace.get_tracer_provider() is provider.current.provider
    provider.current.provider.shutdown()
