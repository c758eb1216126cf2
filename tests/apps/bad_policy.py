"""An app whose policy cannot work: importing it fails with a clear error."""

from __future__ import annotations

from events import Complete, Outcome
from workers import App, Backoff, TaskContext

app = App()


@app.agent("nope", backoff=Backoff(initial=5.0, maximum=1.0))
async def nope(task: TaskContext) -> Outcome:
    return Complete({})
