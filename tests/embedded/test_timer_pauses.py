"""A handler that pauses on a timer beside a peer call under ``FirstK(1)``, as a user writes it,
on the real worker code over the in-memory services (``waystation.testing.InMemoryPool``): the
stream it writes is what ``verify`` and ``history`` read, and they find nothing wrong and say
the timer fired and the call was given up.
"""

from __future__ import annotations

import asyncio

from waystation import App, Call, Complete, Pause, TaskContext
from waystation.events.task import FirstK, Sleep
from waystation.projections.audit import verify_stream
from waystation.projections.history import timeline
from waystation.testing import InMemoryPool

app = App()


@app.agent("napper")
async def napper(task: TaskContext) -> Complete | Pause:
    if task.pause == 0:
        return Pause([Sleep(0.2), Call("slow", {"n": 1}, timeout=600)], until=FirstK(1))
    return Complete([[r.kind, r.outcome] for r in task.results])


@app.agent("slow")
async def slow(task: TaskContext) -> Complete:
    await asyncio.sleep(3600)  # never answers in time: the timer wins, the call is given up
    return Complete(None)


async def test_a_timer_beside_a_call_resumes_a_first_k_pause_and_gives_the_call_up() -> None:
    async with InMemoryPool(app, workers=1) as pool:
        result = await pool.call("napper", timeout=30)
        assert (result.status, result.result) == ("ok", [["timer", "ok"], ["call", "cancelled"]])
        stream = await pool.store.read_stream(result.task_id)
    assert verify_stream(stream) == []
    summaries = [entry.summary for entry in timeline(stream)]
    assert f"claimed {result.task_id}:1:0 (its timer fired)" in summaries
    assert any(s.endswith(f"giving up {result.task_id}:1:1") for s in summaries), summaries
