"""An app whose pool limit cannot work: importing it fails with a clear error."""

from __future__ import annotations

from waystation import App, TaskContext
from waystation.events import Complete, Outcome

app = App()


@app.agent("nope", concurrency=3, rate="ten a second")
async def nope(task: TaskContext) -> Outcome:
    return Complete({})
