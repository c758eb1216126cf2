"""An app whose pool limit cannot work: importing it fails with a clear error."""

from __future__ import annotations

from events import Complete, Outcome
from workers import App, TaskContext

app = App()


@app.agent("nope", concurrency=3, rate="ten a second")
async def nope(task: TaskContext) -> Outcome:
    return Complete({})
