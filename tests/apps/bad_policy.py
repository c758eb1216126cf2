"""An app whose policy cannot work: importing it fails with a clear error."""

from __future__ import annotations

from waystation import App, Backoff, TaskContext
from waystation.events import Complete, Outcome

app = App()


@app.agent("nope", backoff=Backoff(initial=5.0, maximum=1.0))
async def nope(task: TaskContext) -> Outcome:
    return Complete({})
