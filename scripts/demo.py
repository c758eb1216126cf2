"""The demo: 3 workers, 500 fan-out tasks, one worker SIGKILLed mid-run, everything checked.

It makes its own database (``waystation_demo``, dropped first if a previous demo left it) and its
own queues (prefix ``demo.``), starts three worker processes of the example app and one
projection runner (``waystation projections run``), submits 500 ``orchestrator`` tasks (each
fans out to 3 ``researcher`` peers that work 30 ms), kills one worker with SIGKILL in the middle
of a burst of submissions and starts a replacement, and shows live progress: completed, paused
(waiting for peer replies, from the ``paused_tasks`` projection) and in flight. Then it checks:

* every result is correct and there is exactly one per task (none lost, none duplicated);
* the event log: per task exactly one TaskResumed, one TaskCompleted and 3 SubtaskClaimed, every
  stream's hash chain verifies, one stream per task and no other but those of researchers'
  tasks run again after the kill (just started and completed);
* ``waystation verify`` (the real command) finds no problem;
* the ``paused_tasks`` projection caught up, shows no task still paused, and
  ``waystation projections rebuild paused_tasks --check`` finds it identical to a rebuild;
* every process still running exits 0 on SIGTERM.

Each worker gets its own metrics port (``WAYSTATION_METRICS_PORT``); no check depends on it. On a
terminal the progress is a live bar; otherwise (CI, a pipe) a plain line about once a second.
Whatever happens (Ctrl-C included) it stops its processes, deletes its queues and drops its
database; it exits 0 only if everything held. ``--keep-logs`` keeps the process logs.

The phases live in ``scripts/_demo/``: setup (:mod:`_demo.setup`), drive (:mod:`_demo.drive`),
check (:mod:`_demo.check`) and report (:mod:`_demo.report`); this file runs them in order.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _demo import DATABASE, TASKS, WORK_MS, WORKERS, K
from _demo.check import check_all
from _demo.drive import drive
from _demo.report import summary_lines, summary_table
from _demo.setup import Demo

from scripts.lab.harness.guarded import run_guarded


async def run(demo: Demo) -> list[str]:
    """Everything; the list of failed checks (empty when all held)."""
    demo.console.print(
        f"Waystation demo: {WORKERS} workers, {TASKS} orchestrator tasks fanning out to {K} "
        f"researchers ({WORK_MS} ms of work each), one worker SIGKILLed mid-run.",
        markup=False,
    )
    await demo.prepare()
    failures: list[str] = []
    driven = await drive(demo, failures)
    checked = await check_all(demo, driven, failures)
    demo.summary = summary_lines(demo, driven, checked)
    return failures


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    demo = Demo()
    failures, error, interrupted = run_guarded(
        lambda: run(demo), demo.cleanup, demo.interrupt, name="demo"
    )
    elapsed = time.monotonic() - demo.started
    console = demo.console
    if interrupted:
        shutil.rmtree(demo.logs, ignore_errors=True)
        print(
            "demo: interrupted; processes stopped, queues deleted, database "
            + (f"{DATABASE} dropped" if not demo.cleanup_errors else "cleanup incomplete"),
            file=sys.stderr,
        )
        return 130
    failures = list(failures or []) + [f"cleanup: {e}" for e in demo.cleanup_errors]
    passed = error is None and not failures
    if demo.summary:
        console.print()
        console.print(summary_table(demo.summary, elapsed, passed))
    if error is not None:
        print(
            f"\ndemo: FAILED after {elapsed:.1f}s: {type(error).__name__}: {error}", file=sys.stderr
        )
        if not isinstance(error, (TimeoutError, RuntimeError)):
            traceback.print_exception(error)
        print(f"  process logs kept in {demo.logs}", file=sys.stderr)
        return 1
    if failures:
        print(f"\ndemo: FAILED after {elapsed:.1f}s:", file=sys.stderr)
        for failure in failures:
            print(f"  - {failure}", file=sys.stderr)
        print(f"  process logs kept in {demo.logs}", file=sys.stderr)
        return 1
    if "--keep-logs" in sys.argv[1:]:
        console.print(f"process logs kept in {demo.logs}", markup=False)
    else:
        shutil.rmtree(demo.logs, ignore_errors=True)
    console.print(
        f"\ndemo: everything held ({elapsed:.1f}s); processes stopped, queues deleted, "
        f"database {DATABASE} dropped.",
        markup=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
