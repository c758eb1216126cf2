"""The chaos run: real worker processes on the real services under mixed faults, every task
checked.

A RabbitMQ vhost of the run's own (the delivery-limit policy applied as in production) and a
scratch PostgreSQL cluster of its own (``pg_createcluster`` on a free port), so that closing every
connection and restarting PostgreSQL hit nothing else on this machine. In them: ``--workers``
worker processes of the chaos app (``tests.apps.chaos``: the example app's agents) and one
``waystation projections run``. ``--tasks`` orchestrator tasks, each 2 rounds of 3 researcher
calls (``work_ms`` of simulated work per call), are kept ``--in-flight`` at a time; their results
come back through a durable reply queue (:class:`_chaos.collector.ChaosCollector`), which outlives a
closed connection.

Meanwhile the faults land, spread over the run by results (:func:`_chaos.plan.plan_faults`):
``--kills`` SIGKILLs of a random worker (a replacement starts at once), ``--connection-closes``
``rabbitmqctl close_all_connections`` in the vhost (every worker and the collector cut off) and
``--pg-restarts`` fast stops of the cluster, down ``--pg-down`` seconds, started again. Each
waits until every worker answers ``/healthz`` (so that it hits a worker with work, not one still
starting) and is logged with the results in, the tasks in flight and the victim's messages in
its handlers. The last ``--in-flight`` tasks are submitted only once every fault has landed, so
no fault can find the run over.

And the broker says no (:func:`_chaos.plan.plan_tasks`, docs/failures.md): a share of the
tasks (``--full-queue-share``) is submitted with a ``reply_to`` queue of ``x-max-length``
``--full-length`` that rejects publishes, kept full: each such queue takes the tasks of
``--full-hold`` seconds and is then drained (a consumer started late), so their results are
refused, retried with backoff by the outbox relay and arrive; ``--never-drained`` of them go to
a queue drained only once the run is over, so their results are dead-lettered (``refused``)
after the workers' ``WAYSTATION_REFUSED_RETRY_SECONDS`` (``--refused-retry``), which is their
answer. A share (``--oversized-share``) has a result larger than the workers'
``WAYSTATION_MAX_MESSAGE_BYTES`` (``--max-message-bytes``: the task fails at once,
``MessageTooLarge``) or, half of them, than RabbitMQ's ``max_message_size``
(``--broker-max-message-size``, set for the run and set back after: dead-lettered as
``too-large``, an ``undeliverable-result`` error to the publisher). A hostile publisher sends
``--hostile-rate`` messages a second to the agents' queues while tasks are submitted, with
content headers no client library writes (:data:`_chaos.hostile.HOSTILE_KINDS`), each body
tagged: each must be dead-lettered with its reason, or refused by RabbitMQ itself.

Then, once nothing is left in any queue or in the outbox, the figures: tasks missing, wrong
(another answer than their kind's, or two different ones) and duplicated; per task in the log,
one terminal event, each pause recorded and resumed once, each sub-task claimed once;
``waystation verify`` and ``waystation projections rebuild paused_tasks|agent_stats|agent_minutes
--check`` as subprocesses; dead letters and their reasons, each explained; the hostile messages'
fates; the publishes refused, the outbox's oldest row; the faults with their times; the wall
time. Printed, and written as JSON (``--json``). Exit 0 only if nothing was lost, stuck,
unsettled or wrong; 1 otherwise (each failure named); 2 when this machine cannot run it (no
rabbitmqctl or PostgreSQL cluster tools). Whatever happens (Ctrl-C included) the processes are
stopped, the broker's ``max_message_size`` set back, the vhost deleted and the cluster dropped;
the process logs are kept when the run failed (or with ``--keep-logs``).

The phases live in ``scripts/_chaos/``: setup (:mod:`_chaos.setup`), drive (:mod:`_chaos.drive`),
faults (:mod:`_chaos.faults`, with what is sampled meanwhile: :mod:`_chaos.sample`), check
(:mod:`_chaos.check`) and report (:mod:`_chaos.report`); this file parses the options and runs
the phases in order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import shutil
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _chaos import ROUNDS, K
from _chaos.check import check
from _chaos.drive import follow, plan_inputs, settle, submit_all
from _chaos.faults import inject, publish_hostile
from _chaos.plan import OVER_BROKER_ROOM, fault_span, plan_faults, plan_tasks, task_mix
from _chaos.report import print_figures
from _chaos.sample import outbox_oldest, sample
from _chaos.setup import Chaos

from scripts.lab.harness.database import PG_TOOLS
from scripts.lab.harness.guarded import run_guarded
from scripts.lab.harness.processes import ROOT

QUICK = {
    "tasks": 50,
    "kills": 2,
    "connection_closes": 1,
    "pg_restarts": 1,
    "in_flight": 10,
    "work_ms": (1000.0, 1800.0),
    "pg_down": 1.0,
    "full_queue_share": 0.12,
    "full_hold": 5.0,
    "refused_retry": 14.0,
    "oversized_share": 0.08,
    "hostile_rate": 2.0,
    "progress_every": 2.0,
}


def _work_ms(value: str) -> tuple[float, float]:
    try:
        low, high = (float(part) for part in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"MIN,MAX in milliseconds, not {value!r}") from None
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError("0 <= MIN <= MAX")
    return low, high


def _share(value: str) -> float:
    try:
        share = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a share from 0 to 1, not {value!r}") from None
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError("a share from 0 to 1")
    return share


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/chaos",
        description="Real worker processes on the real services under mixed faults (SIGKILLs, "
        "every broker connection closed, PostgreSQL restarted) while the broker says no (full "
        "reply queues that reject publishes, results over the size limits, hostile metadata); "
        "every task and every hostile message checked.",
    )
    parser.add_argument("--tasks", type=int, default=5000, help="orchestrator tasks")
    parser.add_argument("--workers", type=int, default=3, help="worker processes")
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs of a random worker")
    parser.add_argument(
        "--connection-closes", type=int, default=3, help="rabbitmqctl close_all_connections"
    )
    parser.add_argument("--pg-restarts", type=int, default=1, help="PostgreSQL restarts")
    parser.add_argument("--pg-down", type=float, default=3.0, help="seconds PostgreSQL stays down")
    parser.add_argument("--in-flight", type=int, default=60, help="tasks outstanding at once")
    parser.add_argument(
        "--work-ms",
        type=_work_ms,
        default=(300.0, 700.0),
        metavar="MIN,MAX",
        help="each researcher call works a random time in this range (ms)",
    )
    parser.add_argument("--delivery-limit", type=int, default=5, help="the broker policy's")
    refusals = parser.add_argument_group("when the broker says no")
    refusals.add_argument(
        "--full-queue-share",
        type=_share,
        default=0.03,
        metavar="SHARE",
        help="tasks whose reply_to is a full queue that rejects publishes (default 0.03)",
    )
    refusals.add_argument(
        "--never-drained",
        type=_share,
        default=0.34,
        metavar="SHARE",
        help="of those, the share whose queue is drained only after the run: their results "
        "end as dead letters (refused) (default 0.34)",
    )
    refusals.add_argument(
        "--full-hold",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="each drained full queue takes the tasks of this long, then its consumer starts "
        "(default 20)",
    )
    refusals.add_argument(
        "--full-length",
        type=int,
        default=2,
        metavar="N",
        help="x-max-length of a full queue, and the fillers that keep it full (default 2)",
    )
    refusals.add_argument(
        "--refused-retry",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="the workers' WAYSTATION_REFUSED_RETRY_SECONDS (default 60)",
    )
    refusals.add_argument(
        "--oversized-share",
        type=_share,
        default=0.01,
        metavar="SHARE",
        help="tasks whose result is too large: half over the workers' limit, half over the "
        "broker's (all over the workers' when the broker's is left alone) (default 0.01)",
    )
    refusals.add_argument(
        "--max-message-bytes",
        type=int,
        default=256 * 1024,
        metavar="BYTES",
        help="the workers' WAYSTATION_MAX_MESSAGE_BYTES (default 262144)",
    )
    refusals.add_argument(
        "--broker-max-message-size",
        type=int,
        default=128 * 1024,
        metavar="BYTES",
        help="RabbitMQ's max_message_size during the run (the whole broker's, set back after); "
        "0 leaves it alone (default 131072)",
    )
    refusals.add_argument(
        "--hostile-rate",
        type=float,
        default=1.0,
        metavar="PER_SECOND",
        help="hostile messages a second to the agents' queues while tasks are submitted; 0: "
        "none (default 1)",
    )
    parser.add_argument("--seed", type=int, default=None, help="the plan's (random)")
    parser.add_argument(
        "--json", default="chaos-results/latest.json", help="where to write the figures"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()),
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the process logs")
    args = parser.parse_args(argv)
    args.progress_every = 10.0
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.seed is None:
        args.seed = random.randrange(2**31)
    if args.tasks < 1 or args.workers < 1 or args.in_flight < 1:
        parser.error("--tasks, --workers and --in-flight must be at least 1")
    if min(args.kills, args.connection_closes, args.pg_restarts) < 0:
        parser.error("fault counts cannot be negative")
    if args.tasks < 3 * args.in_flight:
        parser.error("--tasks must be at least 3 times --in-flight (see fault_span)")
    if not 0 < args.full_hold < args.refused_retry:
        parser.error(
            "--full-hold must be shorter than --refused-retry: a drained queue's results would "
            "be dead-lettered before it is drained"
        )
    if args.full_length < 1 or args.hostile_rate < 0:
        parser.error("--full-length must be at least 1, --hostile-rate not negative")
    if args.broker_max_message_size and not (
        16 * 1024 <= args.broker_max_message_size <= args.max_message_bytes - OVER_BROKER_ROOM
    ):
        parser.error(
            "--broker-max-message-size must be 0, or from 16 KiB to --max-message-bytes less "
            f"{OVER_BROKER_ROOM} (a result between the two limits must fit the workers')"
        )
    try:
        plan_tasks(args.tasks, args.in_flight, task_mix(args), args.seed)
    except ValueError as error:
        parser.error(f"too many special tasks: {error}")
    return args


async def run(chaos: Chaos) -> None:
    """Plan, set up, drive the tasks under the faults, settle, check."""
    args = chaos.args
    print(
        f"Waystation chaos: {args.tasks} orchestrator tasks of {ROUNDS} rounds of {K} calls "
        f"(work {args.work_ms[0]:.0f}-{args.work_ms[1]:.0f} ms a call, {args.in_flight} tasks "
        f"in flight), {args.workers} workers and a projection runner; {args.kills} kills, "
        f"{args.connection_closes} connection closes, {args.pg_restarts} PostgreSQL "
        f"restarts; seed {args.seed}",
        flush=True,
    )
    inputs, mix = plan_inputs(chaos)
    await chaos.prepare()
    await chaos.start()
    await chaos.start_collector(mix)
    plan = plan_faults(
        fault_span(chaos.windowed, args.in_flight),
        args.kills,
        args.connection_closes,
        args.pg_restarts,
        args.seed,
    )
    submitter = asyncio.create_task(submit_all(chaos, inputs))
    injector = asyncio.create_task(inject(chaos, plan))
    background = [
        asyncio.create_task(publish_hostile(chaos)),
        asyncio.create_task(sample(chaos)),
    ]
    try:
        await follow(chaos, submitter, injector, background[0])
        chaos.outbox_oldest_window_end = await outbox_oldest(chaos)
        await settle(chaos)
        chaos.outbox_oldest_end = await outbox_oldest(chaos)
    finally:
        for task in (submitter, injector, *background, *chaos.drainers):
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
    await check(chaos, inputs)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    # the collector's connection is closed on purpose, and the hostile publisher's by RabbitMQ;
    # aio-pika and aiormq log each time as an error
    for noisy in ("aiormq", "aio_pika"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    args = parse_args(argv)
    missing = [tool for tool in ("rabbitmqctl", *PG_TOOLS) if shutil.which(tool) is None]
    if missing:
        print(f"chaos: needs {', '.join(missing)} on this host", file=sys.stderr)
        return 2
    chaos = Chaos(args)
    _, error, interrupted = run_guarded(
        lambda: run(chaos), chaos.cleanup, chaos.interrupt, name="chaos", uvloop=False
    )
    elapsed = chaos.elapsed()
    failures = chaos.failures + [f"cleanup: {e}" for e in chaos.cleanup_errors]
    if interrupted:
        shutil.rmtree(chaos.logs, ignore_errors=True)
        print(
            "chaos: interrupted; processes stopped, broker limit set back, vhost deleted, "
            "cluster dropped",
            file=sys.stderr,
        )
        return 130
    if error is not None:
        failures.append(f"the run stopped: {type(error).__name__}: {error}")
        if not isinstance(error, (TimeoutError, RuntimeError)):
            traceback.print_exception(error)
    if chaos.figures:
        chaos.figures.update(wall_time_s=round(elapsed, 1), failures=failures, ok=not failures)
        print_figures(chaos.figures, failures, elapsed)
        out = Path(args.json) if Path(args.json).is_absolute() else ROOT / args.json
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(chaos.figures, indent=2) + "\n")
        print(f"figures written to {out}")
    if failures:
        print(f"\nchaos: FAILED after {elapsed:.1f}s:", file=sys.stderr)
        for failure in failures:
            print(f"  - {failure}", file=sys.stderr)
        print(f"  process logs kept in {chaos.logs}", file=sys.stderr)
        return 1
    if args.keep_logs:
        print(f"process logs kept in {chaos.logs}")
    else:
        shutil.rmtree(chaos.logs, ignore_errors=True)
    print(
        f"chaos: nothing lost, stuck, unsettled or wrong ({elapsed:.1f}s); processes stopped, "
        "vhost deleted, cluster dropped"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
