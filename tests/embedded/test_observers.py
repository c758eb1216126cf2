"""The test kit tells the app's observers of failed runs, as a worker process does."""

from __future__ import annotations

import pytest

from waystation import App, Backoff, HandlerFailure, Outcome, TaskContext
from waystation.testing import InMemoryPool

pytestmark = pytest.mark.timeout(60)


async def test_the_in_memory_pool_tells_the_apps_observers_of_each_failed_run() -> None:
    told: list[HandlerFailure] = []

    class Keep:
        def on_failure(self, failure: HandlerFailure) -> None:
            told.append(failure)

    app = App(observers=[Keep()])

    @app.agent("flaky", retries=1, backoff=Backoff(initial=0.01, maximum=0.01))
    async def flaky(task: TaskContext) -> Outcome:
        raise ConnectionError("down")

    async with InMemoryPool(app) as pool:
        result = await pool.call("flaky", {})
    assert result.status == "error"
    assert [(f.agent, f.attempt, f.will_retry) for f in told] == [
        ("flaky", 1, True),
        ("flaky", 2, False),
    ]
    assert all(isinstance(f.error, ConnectionError) for f in told)
