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
terminal the progress is a line redrawn in place; otherwise (CI, a pipe) a plain line about once
a second. Whatever happens (Ctrl-C included) it stops its processes, deletes its queues and drops
its database; it exits 0 only if everything held. ``--keep-logs`` keeps the process logs.

``--embedded``, or when RabbitMQ or PostgreSQL cannot be reached at the configured URLs (it says
so in one line): the same story in one process on the in-memory broker and log
(:mod:`_demo.embedded`, on the public test kit), saying what it simulates.

The phases live in ``scripts/_demo/``: setup (:mod:`_demo.setup`), drive (:mod:`_demo.drive`),
check (:mod:`_demo.check`) and report (:mod:`_demo.report`), the output in :mod:`_demo.output`;
this file runs them in order.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _demo import DATABASE, TASKS, WORK_MS, WORKERS, K, embedded
from _demo.check import check_all
from _demo.drive import drive
from _demo.output import Line, Output
from _demo.report import summary_lines
from _demo.setup import Demo
from pydantic import ValidationError
from sqlalchemy.engine import make_url

from scripts.lab.harness.guarded import run_guarded
from waystation.settings import Settings

PROBE_TIMEOUT = 3.0


async def run(demo: Demo) -> list[str]:
    """Everything; the list of failed checks (empty when all held)."""
    demo.out.print(
        f"Waystation demo: {WORKERS} workers, {TASKS} orchestrator tasks fanning out to {K} "
        f"researchers ({WORK_MS} ms of work each), one worker SIGKILLed mid-run."
    )
    await demo.prepare()
    failures: list[str] = []
    driven = await drive(demo, failures)
    checked = await check_all(demo, driven, failures)
    demo.summary = summary_lines(demo, driven, checked)
    return failures


def unreachable(settings: Settings) -> list[str]:
    """The services nothing answers for at the configured URLs (a TCP connection refused or
    timed out, a host that does not resolve), e.g. ``["RabbitMQ at 127.0.0.1:5672"]``."""
    amqp = urlparse(settings.amqp_url)
    database = make_url(settings.database_url)
    down = []
    for what, host, port in (
        ("RabbitMQ", amqp.hostname or "localhost", amqp.port or 5672),
        ("PostgreSQL", database.host or "localhost", database.port or 5432),
    ):
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT).close()
        except OSError:
            down.append(f"{what} at {host}:{port}")
    return down


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--embedded",
        action="store_true",
        help="run in one process on the in-memory broker and log, without RabbitMQ or PostgreSQL",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the process logs")
    options = parser.parse_args(argv)
    if options.embedded:
        return main_embedded()
    try:
        settings = Settings()
    except ValidationError as invalid:
        for error in invalid.errors():
            variable = "WAYSTATION_" + "_".join(str(part) for part in error["loc"]).upper()
            print(f"demo: {variable}: {error['msg']}", file=sys.stderr)
        return 2
    down = unreachable(settings)
    if down:
        print(
            f"demo: cannot reach {' or '.join(down)}; running the embedded demo instead "
            "(one process, in-memory broker and log)",
            flush=True,
        )
        return main_embedded()
    return main_services(settings, options.keep_logs)


def main_embedded() -> int:
    logging.getLogger().setLevel(logging.WARNING)  # kept and counted, not printed
    out = Output(time.monotonic())
    demo = embedded.embedded(out)
    failures, error, interrupted = run_guarded(
        lambda: embedded.run(demo), demo.cleanup, lambda: None, name="demo"
    )
    return finish(
        out,
        "Waystation demo (embedded): summary",
        demo.summary,
        failures,
        error,
        interrupted,
        "workers stopped",
    )


def main_services(settings: Settings, keep_logs: bool) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    demo = Demo(settings)
    failures, error, interrupted = run_guarded(
        lambda: run(demo), demo.cleanup, demo.interrupt, name="demo"
    )
    cleaned = (
        f"processes stopped, queues deleted, database {DATABASE} dropped"
        if not demo.cleanup_errors
        else "cleanup incomplete"
    )
    failures = list(failures or []) + [f"cleanup: {e}" for e in demo.cleanup_errors]
    code = finish(
        demo.out, "Waystation demo: summary", demo.summary, failures, error, interrupted, cleaned
    )
    if code == 0 and keep_logs:
        demo.out.print(f"process logs kept in {demo.logs}")
    elif code in (0, 130):
        shutil.rmtree(demo.logs, ignore_errors=True)
    else:
        print(f"  process logs kept in {demo.logs}", file=sys.stderr)
    return code


def finish(
    out: Output,
    title: str,
    summary: list[Line],
    failures: list[str] | None,
    error: BaseException | None,
    interrupted: bool,
    cleaned: str,
) -> int:
    """The summary and the verdict; the exit code (0 only if everything held)."""
    elapsed = time.monotonic() - out.started
    if interrupted:
        print(f"demo: interrupted; {cleaned}", file=sys.stderr)
        return 130
    failures = list(failures or [])
    passed = error is None and not failures
    if summary:
        out.summary(title, summary, elapsed, passed)
    if error is not None:
        print(
            f"\ndemo: FAILED after {elapsed:.1f}s: {type(error).__name__}: {error}", file=sys.stderr
        )
        if not isinstance(error, (TimeoutError, RuntimeError)):
            traceback.print_exception(error)
        return 1
    if failures:
        print(f"\ndemo: FAILED after {elapsed:.1f}s:", file=sys.stderr)
        for failure in failures:
            print(f"  - {failure}", file=sys.stderr)
        return 1
    out.print(f"\ndemo: everything held ({elapsed:.1f}s); {cleaned}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
