"""Signals through the real worker on the test kit: a paused task waits for a named message from
outside, which is taken once, kept when it comes early, refused when nothing can take it
(issue 31, item 1). The same flows on RabbitMQ and PostgreSQL: tests/integration/test_signals.py.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

from waystation import App, Complete, Outcome, Pause, Signal, TaskContext
from waystation.client import SignalNotApplied
from waystation.events import (
    GENESIS_HASH,
    NewEvent,
    SignalReceived,
    SignalRefused,
    SubtaskClaimed,
    TaskPaused,
    TaskResumed,
    TaskState,
    decide_cancel,
    event_id,
    fold,
    parse,
)
from waystation.testing import InMemoryPool

pytestmark = pytest.mark.timeout(60)


class Approval(BaseModel):
    approved: bool
    note: str = ""


def drafting_app() -> App:
    app = App(version="2026.11")

    @app.agent("drafter", signals={"approval": Approval})
    async def drafter(task: TaskContext) -> Outcome:
        if not task.resumed:
            return Pause([Signal("approval", timeout=3600)], update={"draft": "hello"})
        answer = task.results[0]
        return Complete({"answer": answer.value, "by": answer.sender, "kind": answer.kind})

    @app.agent("twice")
    async def twice(task: TaskContext) -> Outcome:
        if task.pause == 0:
            return Pause([Signal("first")])
        if task.pause == 1:
            return Pause([Signal("second")], update={"first": task.results[0].value})
        return Complete([task.state["first"], task.results[0].value])

    @app.agent("quick")
    async def quick(task: TaskContext) -> Outcome:
        return Complete("done without pausing")

    return app


async def paused(pool: InMemoryPool, task_id: str, pause: int = 1) -> None:
    """Wait until the log shows the task's ``pause``-th pause."""
    async with asyncio.timeout(30):
        while True:
            state = fold(task_id, await pool.store.read_stream(task_id))
            if state.status == "paused" and state.pause >= pause:
                return
            await asyncio.sleep(0.01)


async def events_of(pool: InMemoryPool, task_id: str) -> list[object]:
    return [parse(e) for e in await pool.store.read_stream(task_id)]


async def test_a_signal_resumes_the_task_once_with_its_payload_and_sender() -> None:
    async with InMemoryPool(drafting_app()) as pool:
        task_id = await pool.submit("drafter", {})
        await paused(pool, task_id)
        # 1 fits the bool field; the model's JSON form is recorded, as the handler reads it
        status = await pool.signal(
            task_id, "approval", {"approved": 1}, agent="drafter", signal_id="s-1", sender="ann"
        )
        assert status == "taken"
        result = await pool.result(task_id)
        assert result.result == {
            "answer": {"approved": True, "note": ""},
            "by": "ann",
            "kind": "signal",
        }
        # the same signal again is recognised by its id: recorded once, applied once
        again = await pool.signal(
            task_id, "approval", {"approved": False}, agent="drafter", signal_id="s-1"
        )
        assert again == "duplicate"
        events = await events_of(pool, task_id)
    received = [e for e in events if isinstance(e, SignalReceived)]
    assert [(e.signal_id, e.sender, e.payload) for e in received] == [
        ("s-1", "ann", {"approved": True, "note": ""})
    ]
    claims = [e for e in events if isinstance(e, SubtaskClaimed)]
    assert [c.message_id for c in claims] == ["s-1"]
    pause = next(e for e in events if isinstance(e, TaskPaused))
    assert pause.agent_version == "2026.11"
    assert pause.calls[0].kind == "signal"
    assert pause.calls[0].signal_schema == Approval.model_json_schema()


async def test_a_payload_that_does_not_fit_is_refused_naming_the_field_and_the_wait_goes_on() -> (
    None
):
    async with InMemoryPool(drafting_app()) as pool:
        task_id = await pool.submit("drafter", {})
        await paused(pool, task_id)
        with pytest.raises(SignalNotApplied) as refused:
            await pool.signal(task_id, "approval", {"approved": "perhaps"}, agent="drafter")
        assert refused.value.status == "invalid"
        assert "approved" in refused.value.message
        state = fold(task_id, await pool.store.read_stream(task_id))
        assert state.status == "paused" and len(state.outstanding) == 1
        assert await pool.signal(task_id, "approval", {"approved": False}, agent="drafter") == (
            "taken"
        )
        result = await pool.result(task_id)
        assert result.result["answer"] == {"approved": False, "note": ""}
        events = await events_of(pool, task_id)
    refusals = [e for e in events if isinstance(e, SignalRefused)]
    assert [r.reason for r in refusals] == ["invalid"]


async def test_a_signal_sent_before_its_wait_is_kept_and_taken_by_the_next_wait() -> None:
    async with InMemoryPool(drafting_app()) as pool:
        task_id = await pool.submit("twice", {})
        await paused(pool, task_id)
        assert await pool.signal(task_id, "second", "b", agent="twice") == "kept"
        assert await pool.signal(task_id, "first", "a", agent="twice") == "taken"
        result = await pool.result(task_id)
        assert result.result == ["a", "b"]
        events = await events_of(pool, task_id)
    # the second pause took the kept signal in its own append, and resumed at once
    second = next(i for i, e in enumerate(events) if isinstance(e, TaskPaused) and e.pause == 2)
    assert isinstance(events[second + 1], SubtaskClaimed)
    assert isinstance(events[second + 3], TaskResumed)


async def test_a_signal_for_a_task_the_log_does_not_hold_is_undeliverable() -> None:
    async with InMemoryPool(drafting_app()) as pool:
        with pytest.raises(SignalNotApplied) as unknown:
            await pool.signal("no-such-task", "approval", {}, agent="drafter")
        assert unknown.value.status == "undeliverable"
        # G10: a task that finished without pausing left nothing in the log to signal
        task_id = await pool.submit("quick", {})
        assert (await pool.result(task_id)).ok
        with pytest.raises(SignalNotApplied) as unpaused:
            await pool.signal(task_id, "approval", {}, agent="quick")
        assert unpaused.value.status == "undeliverable"
        assert "has not paused yet" in unpaused.value.message
        assert await pool.store.read_stream(task_id) == []


async def test_a_signal_for_a_finished_task_is_refused_and_recorded() -> None:
    async with InMemoryPool(drafting_app()) as pool:
        task_id = await pool.submit("drafter", {})
        await paused(pool, task_id)
        await pool.signal(task_id, "approval", {"approved": True}, agent="drafter")
        await pool.result(task_id)
        with pytest.raises(SignalNotApplied) as late:
            await pool.signal(task_id, "approval", {"approved": True}, agent="drafter")
        assert late.value.status == "undeliverable"
        assert "completed" in late.value.message
        with pytest.raises(SignalNotApplied) as elsewhere:
            await pool.signal(task_id, "approval", {"approved": True}, agent="twice")
        assert elsewhere.value.status == "wrong-agent"
        events = await events_of(pool, task_id)
    assert [e.reason for e in events if isinstance(e, SignalRefused)] == ["finished"]


async def test_a_copy_of_a_refused_signal_hears_the_same_refusal() -> None:
    """A signal sent again under its id (its sender did not hear, or the broker redelivered it)
    after it was refused is answered as the first copy was, never with a status the wire
    format does not have (it was ``refused``). (Found by the simulation, issue 31 item 6.)"""
    async with InMemoryPool(drafting_app()) as pool:
        task_id = await pool.submit("drafter", {})
        await paused(pool, task_id)
        for _ in range(2):
            with pytest.raises(SignalNotApplied) as invalid:
                await pool.signal(
                    task_id, "approval", {"approved": "perhaps"}, agent="drafter", signal_id="s-1"
                )
            assert invalid.value.status == "invalid"
            assert "approved" in invalid.value.message
        await pool.signal(task_id, "approval", {"approved": True}, agent="drafter")
        await pool.result(task_id)
        for _ in range(2):
            with pytest.raises(SignalNotApplied) as late:
                await pool.signal(
                    task_id, "approval", {"approved": True}, agent="drafter", signal_id="s-2"
                )
            assert late.value.status == "undeliverable"
            assert "completed" in late.value.message
        events = await events_of(pool, task_id)
    assert [(e.signal_id, e.reason) for e in events if isinstance(e, SignalRefused)] == [
        ("s-1", "invalid"),
        ("s-2", "finished"),
    ]


async def test_a_signal_for_a_task_cancelled_before_its_first_run_is_refused_as_finished() -> None:
    """A task cancelled before its first run recorded anything has a stream of its cancel alone,
    which names no agent: a signal for it is refused (the task has finished) and recorded, not
    answered ``wrong-agent`` naming agent None. (Found by the simulation, issue 31 item 6.)"""
    async with InMemoryPool(drafting_app()) as pool:
        # the log as the cancel flow leaves it for a task it found no stream of
        task_id = "cancelled-first"
        (cancelled,) = decide_cancel(TaskState(task_id), "changed my mind")
        await pool.store.append(
            task_id,
            0,
            [NewEvent.of(event_id(task_id, f"cancel:{task_id}", 0), cancelled, {})],
            prev_hash=GENESIS_HASH,
        )
        with pytest.raises(SignalNotApplied) as late:
            await pool.signal(task_id, "approval", {"approved": True}, agent="drafter")
        assert late.value.status == "undeliverable"
        assert "cancelled" in late.value.message
        events = await events_of(pool, task_id)
    assert [e.reason for e in events if isinstance(e, SignalRefused)] == ["finished"]


async def test_a_signal_model_given_on_the_wait_alone_fails_the_task_saying_how_to_declare_it() -> (
    None
):
    app = App()

    @app.agent("undeclared")
    async def undeclared(task: TaskContext) -> Outcome:
        return Pause([Signal("approval", schema=Approval)])

    async with InMemoryPool(app) as pool:
        result = await pool.call("undeclared", {})
    assert result.status == "error"
    assert "signals={'approval': Approval}" in str(result.error)


async def test_a_resume_under_another_version_of_the_agent_is_logged_with_both(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def app_of(version: str) -> App:
        app = App(version=version)

        @app.agent("drafter")
        async def drafter(task: TaskContext) -> Outcome:
            if not task.resumed:
                return Pause([Signal("approval")])
            return Complete(task.results[0].value)

        return app

    async with InMemoryPool(app_of("1.0")) as pool:
        task_id = await pool.submit("drafter", {})
        await paused(pool, task_id)
        # the deployment rolls out 2.0 while the task waits
        pool.kill(pool.workers[0])
        pool.app = app_of("2.0")
        await pool.add_worker()
        with caplog.at_level("WARNING", logger="waystation.runtime.flows.base"):
            await pool.signal(task_id, "approval", "yes", agent="drafter")
            assert (await pool.result(task_id)).result == "yes"
    assert any(
        "paused under version 1.0 of agent 'drafter' resumes under version 2.0" in r.getMessage()
        for r in caplog.records
    )
