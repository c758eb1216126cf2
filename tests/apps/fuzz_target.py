"""The frame fuzzer's target (``--app tests.apps.fuzz_target:app``; ``scripts/lab/fuzz``).

``echo`` completes at once with the fuzz id of its input (``{"fuzz": "<id>"}``) and appends
``<id> <pid>`` to ``$FUZZ_RUNS`` (a file) on every run, so that the fuzzer can see that a
message's handler ran. With ``"raise_once": true`` in its input, its first run raises, so the
worker retries it: a copy of the message goes back to the queue at once (no backoff), hostile
headers and all, and the second run completes.
"""

from __future__ import annotations

import os

from waystation import App, Backoff, TaskContext
from waystation.events import Complete, Outcome

app = App()


def _runs_before(fuzz_id: str) -> int:
    path = os.environ["FUZZ_RUNS"]
    if not os.path.exists(path):
        return 0
    with open(path) as runs:
        return sum(1 for line in runs if line.split()[:1] == [fuzz_id])


def _record(fuzz_id: str) -> None:
    with open(os.environ["FUZZ_RUNS"], "a") as runs:  # one short line per write: appended whole
        runs.write(f"{fuzz_id} {os.getpid()}\n")


@app.agent("echo", retries=1, backoff=Backoff(initial=0.0))
async def echo(task: TaskContext) -> Outcome:
    given = task.input if isinstance(task.input, dict) else {}
    fuzz_id = str(given.get("fuzz", "-")).replace(" ", "_").replace("\n", "_")
    earlier = _runs_before(fuzz_id)
    _record(fuzz_id)
    if given.get("raise_once") and earlier == 0:
        raise RuntimeError(f"{fuzz_id}: the first run raises, as its input asks")
    return Complete({"ran": fuzz_id})
