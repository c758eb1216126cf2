"""The chaos run's app (``scripts/chaos``, ``--app tests.apps.chaos:app``): the example app's
``orchestrator`` and ``researcher`` (``waystation.example``), unchanged, except that an
orchestrator whose input has ``"pad": N`` completes with ``"pad": "x" * N`` added to its result.

The run uses it to make results larger than a message may be: over the workers'
``WAYSTATION_MAX_MESSAGE_BYTES`` (the task fails at once, ``MessageTooLarge``) or over the
broker's ``max_message_size`` (the result is dead-lettered as ``too-large`` and its publisher
gets an ``undeliverable-result`` error). Without ``pad`` it is the example app.
"""

from __future__ import annotations

from waystation import App, TaskContext
from waystation.events import Complete, Outcome
from waystation.example import orchestrator as example_orchestrator
from waystation.example import researcher

app = App()
app.agent("researcher")(researcher)


@app.agent("orchestrator")
async def orchestrator(task: TaskContext) -> Outcome:
    outcome = await example_orchestrator(task)
    pad = int(task.input.get("pad", 0))
    if pad > 0 and isinstance(outcome, Complete):
        return Complete({**outcome.result, "pad": "x" * pad})
    return outcome
