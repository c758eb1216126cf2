"""The public test kit, ``waystation.testing.InMemoryPool``: the examples in docs/agents.md that use
it run as written, and the kit's client, ``join`` and errors behave as documented."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from waystation import App, Call, Complete, Pause, Permanent, TaskContext
from waystation.projections.audit import verify_stream
from waystation.testing import InMemoryPool

DOCS = Path(__file__).resolve().parents[2] / "docs" / "agents.md"


def _the_docs_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    return [b for b in blocks if "from waystation.testing import InMemoryPool" in b]


def _the_docs_examples() -> list[str]:
    """The examples that are tests (the script aside)."""
    return [b for b in _the_docs_blocks() if "asyncio.run(" not in b]


def test_the_docs_script_runs_as_written_from_any_directory(tmp_path: Path) -> None:
    """The script of "Trying handlers without services", as a newcomer runs it: a file of its
    own, in a directory of its own, run by the venv's Python; it prints what its comment says."""
    (script,) = [b for b in _the_docs_blocks() if "asyncio.run(" in b]
    name = re.match(r"# (\S+\.py)\n", script)
    assert name, "the script's first line names its file"
    (tmp_path / name.group(1)).write_text(script)
    run = subprocess.run(
        [sys.executable, name.group(1)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    shown = re.search(r"print\(.*\)  # (.+)\n", script)
    assert shown, "the script says what it prints"
    assert run.stdout.strip() == shown.group(1)


def test_the_docs_have_their_examples_of_the_kit() -> None:
    """The test kit's own example, the human approval's, the first quotes' and the
    interceptors' (a block that stopped importing the kit would silently stop being run)."""
    examples = _the_docs_examples()
    assert len(examples) == 4
    assert 'Signal("approval"' in examples[1]
    assert "until=FirstK(2)" in examples[2] and "Sleep(" in examples[2]
    assert "class Timing(Interceptor)" in examples[3]


@pytest.mark.parametrize(
    "index", [0, 1, 2, 3], ids=["test-kit", "approvals", "timers-first-k", "interceptors"]
)
async def test_the_docs_example_runs_as_written(index: int) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(_the_docs_examples()[index], str(DOCS), "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_")]
    assert tests, "the example defines no test"
    for test in tests:
        assert inspect.iscoroutinefunction(test)
        await test()


def _app() -> tuple[App, asyncio.Event]:
    app = App()
    release = asyncio.Event()

    @app.agent("parent")
    async def parent(task: TaskContext) -> Any:
        if task.pause == 0:
            return Pause([Call("child", {"x": x}) for x in task.input["xs"]])
        return Complete(sorted(r.value for r in task.results))

    @app.agent("child")
    async def child(task: TaskContext) -> Any:
        return Complete(task.input["x"] * 10)

    @app.agent("broken")
    async def broken(task: TaskContext) -> Any:
        raise Permanent("this input can never work")

    @app.agent("slow")
    async def slow(task: TaskContext) -> Any:
        await release.wait()
        return Complete("released")

    return app, release


async def test_calls_across_workers_are_answered_and_recorded_in_the_log() -> None:
    app, _ = _app()
    async with InMemoryPool(app, workers=3) as pool:
        ids = [await pool.submit("parent", {"xs": [n, n + 1]}) for n in range(10)]
        answers = [await pool.result(task_id) for task_id in ids]
        assert [a.result for a in answers] == [[10 * n, 10 * (n + 1)] for n in range(10)]
        await pool.join()
        # every parent paused once, so its stream is in the log, finished
        stream = await pool.store.read_stream(ids[0])
        assert [e.event_type for e in stream][-1] == "TaskCompleted"
        assert len(pool.workers) == 3


async def test_a_failure_is_answered_as_an_error_and_dead_lettered_with_its_reason() -> None:
    app, _ = _app()
    async with InMemoryPool(app) as pool:
        answer = await pool.call("broken", {})
        assert not answer.ok and answer.status == "error"
        assert "can never work" in str(answer.error)
        await pool.join()
        (letter,) = pool.dead_letters()
        assert letter.header_view()["x-waystation-reason"] == "handler-failed"


async def test_join_and_result_time_out_saying_what_is_under_way() -> None:
    app, release = _app()
    async with InMemoryPool(app) as pool:
        task_id = await pool.submit("slow", {})
        with pytest.raises(TimeoutError, match="1 unsettled deliveries"):
            await pool.join(timeout=0.5)
        with pytest.raises(TimeoutError, match=f"no answer to task {task_id!r}"):
            await pool.result(task_id, timeout=0.2)
        release.set()
        assert (await pool.result(task_id)).result == "released"
        await pool.join()


async def test_a_task_for_an_agent_the_app_does_not_have_is_refused_before_it_is_sent() -> None:
    app, _ = _app()
    async with InMemoryPool(app) as pool:
        with pytest.raises(ValueError, match=r"no agent 'parnet' \(its agents: broken, child"):
            await pool.submit("parnet", {})
    with pytest.raises(ValueError, match="cannot have -1 workers"):
        InMemoryPool(app, workers=-1)


async def test_a_killed_worker_leaves_its_paused_and_held_tasks_to_the_others() -> None:
    """``kill`` is a SIGKILL mid-run: the tasks the dead worker paused are resumed and completed
    by the others, the deliveries it held come again, and the log still verifies."""
    app = App()
    release = asyncio.Event()

    @app.agent("parent")
    async def parent(task: TaskContext) -> Any:
        if task.pause == 0:
            return Pause(
                [Call("child", {"x": x}) for x in range(task.input["n"], task.input["n"] + 2)]
            )
        return Complete(sum(r.value for r in task.results))

    @app.agent("child")
    async def child(task: TaskContext) -> Any:
        await release.wait()
        return Complete(task.input["x"] * 10)

    async with InMemoryPool(app, workers=2) as pool:
        ids = [await pool.submit("parent", {"n": n}) for n in range(20)]
        doomed = pool.workers[0]

        async def paused_by_doomed() -> list[str]:
            paused = []
            for task_id in ids:
                events = await pool.store.read_stream(task_id)
                if any(e.metadata.get("worker_id") == doomed.settings.worker_id for e in events):
                    paused.append(task_id)
            return paused

        deadline = asyncio.get_running_loop().time() + 30
        while True:  # until it has paused some parents and children are held in handlers
            if await paused_by_doomed() and pool.broker.unsettled() > 0:
                break
            assert asyncio.get_running_loop().time() < deadline, "nothing paused by the doomed"
            await asyncio.sleep(0.01)
        orphans = await paused_by_doomed()
        pool.kill(doomed)
        assert doomed not in pool.workers
        await pool.add_worker("replacement")
        release.set()
        answers = [await pool.result(task_id) for task_id in ids]
        assert [a.result for a in answers] == [20 * n + 10 for n in range(20)]
        await pool.join()
        for task_id in orphans:
            events = await pool.store.read_stream(task_id)
            (completed,) = [e for e in events if e.event_type == "TaskCompleted"]
            assert completed.metadata["worker_id"] != doomed.settings.worker_id
        streams = {e.stream_id for e in await pool.store.read_all(limit=100_000)}
        for stream_id in streams:
            assert verify_stream(await pool.store.read_stream(stream_id)) == []
        with pytest.raises(ValueError, match="not a live worker"):
            pool.kill(doomed)
