"""The frame fuzzer's long run: hostile content headers against a real worker (scripts/lab/fuzz).

``--examples N`` messages drawn by hypothesis (derandomized: the same N give the same messages;
``--seed S`` for another sequence), then the fixed cases of the known triggers (``--no-fixed``
to skip them), each published with a raw AMQP client to ``<prefix>echo`` of a worker process of
``tests/apps/fuzz_target.py`` and checked (scripts/lab/fuzz/campaign.py): its fate (the handler ran,
or a dead letter with a reason, or the broker refused it), the worker still on its first broker
connection and answering a normal task, nothing left unsettled. After a failure a new worker
starts on fresh queues and the run goes on (``--stop-at-first-failure`` to stop).

Every message is printed as it goes; a failure in full, with the worker's log records and the
file it was saved to; at the end the broker's verdicts, the fates (reasons included) and the
failures grouped by kind, also written as JSON (``--json``). ``--replay FILE...`` sends saved
messages again, ``--only K,...`` only those examples of the sequence (``--examples 60 --only
17`` is example 17 of the bounded test's run).

Runs in a database and under a queue prefix of its own, both removed at the end; the worker
logs, the saved messages and the JSON figures stay in ``--workdir`` (default: a new temporary
directory). Needs the
local RabbitMQ's ``rabbitmqctl``. Exit status: 0 when every check held, 1 otherwise, 2 when
this machine cannot run it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.lab.fuzz.campaign import AGENT, Campaign, as_json, summary
from scripts.lab.fuzz.messages import FIXED, Draft, Message, drafts
from scripts.lab.harness.broker import delete_topology, fresh_prefix
from scripts.lab.harness.database import fresh_database_url
from waystation import migrations
from waystation.settings import Settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/fuzz", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--examples", type=int, default=300, help="messages drawn (300)")
    parser.add_argument("--seed", type=int, help="draw another sequence (default: derandomized)")
    parser.add_argument("--only", help="only these examples of the sequence: K,K,...")
    parser.add_argument(
        "--no-fixed", dest="fixed", action="store_false", help="skip the fixed cases"
    )
    parser.add_argument(
        "--replay", nargs="+", type=Path, metavar="FILE", help="send saved messages"
    )
    parser.add_argument("--stop-at-first-failure", action="store_true")
    parser.add_argument("--fate-within", type=float, default=20.0, help="seconds (20)")
    parser.add_argument("--probe-within", type=float, default=15.0, help="seconds (15)")
    parser.add_argument(
        "--workdir", type=Path, help="logs, saved messages and figures (default: a new temp dir)"
    )
    parser.add_argument("--json", type=Path, help="the figures (default: WORKDIR/fuzz.json)")
    return parser.parse_args(argv)


def planned(
    args: argparse.Namespace, sequence: list[Draft]
) -> list[tuple[str, Message | None, str]]:
    """(label, a message already written or None, draft key) of everything to send, in order;
    the messages of drafts get their fuzz id from the campaign."""
    if args.replay:
        return [(f"replay {path.name}", Message.load(path), "") for path in args.replay]
    plan: list[tuple[str, Message | None, str]] = []
    only = {int(k) for k in args.only.split(",")} if args.only else None
    plan += [
        (f"#{k}", None, f"draft:{k}") for k in range(len(sequence)) if only is None or k in only
    ]
    if args.fixed and only is None:
        plan += [(f"fixed: {name}", None, f"fixed:{name}") for name in FIXED]
    return plan


async def run(args: argparse.Namespace, workdir: Path) -> int:
    admin_url = os.environ.get(
        "WAYSTATION_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    settings = Settings(
        database_url=fresh_database_url(admin_url, "ws_fuzz_"),
        amqp_url=os.environ.get("WAYSTATION_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
        queue_prefix=fresh_prefix(),
        broker_policy="none",
        outbox_delay=1.0,
        outbox_poll_interval=0.2,
        concurrency=16,
        shutdown_grace=5.0,
    )
    sequence = drafts(args.examples, args.seed) if not args.replay else []
    plan = planned(args, sequence)
    print(f"fuzz: {len(plan)} messages to {settings.queue_prefix}{AGENT}; logs in {workdir}")
    began = time.monotonic()
    await migrations.upgrade(settings.database_url)
    try:
        async with Campaign(
            settings,
            workdir,
            fate_within=args.fate_within,
            probe_within=args.probe_within,
            stop_at_first_failure=args.stop_at_first_failure,
            say=lambda line: print(line, flush=True),
        ) as campaign:
            for position, (label, message, key) in enumerate(plan):
                kind, _, name = key.partition(":")
                if message is None:
                    # (example K's fuzz id ends in K, as in the run --only picked it from)
                    if kind == "draft":
                        message = campaign.message(sequence[int(name)], int(name))
                    else:
                        message = campaign.message(FIXED[name], len(sequence) + position)
                await campaign.send(message, label)
                if campaign.stopped:
                    break
            end = await campaign.finish()
    finally:
        await delete_topology(settings.amqp_url, settings.queue_prefix, [AGENT])
        await migrations.drop_database(settings.database_url)
    outcomes = campaign.outcomes
    print()
    print(summary(outcomes))
    for problem in end:
        print(f"at the end: {problem}")
    print(
        f"the publisher opened {campaign.publisher_connections} connections; "
        f"{campaign.worker_starts} workers started"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "when": datetime.now(UTC).isoformat(timespec="seconds"),
                "examples": args.examples,
                "seed": args.seed,
                "seconds": round(time.monotonic() - began, 1),
                "workdir": str(workdir),
                "at_the_end": end,
                "messages": as_json(outcomes),
            },
            indent=1,
        )
        + "\n"
    )
    failed = sum(not o.ok for o in outcomes) + len(end)
    print(f"\n{time.monotonic() - began:.1f}s; figures in {args.json}")
    print("result: " + ("PASSED" if not failed else f"FAILED ({failed} failures)"))
    return 1 if failed else 0


def main() -> int:
    args = parse_args()
    if shutil.which("rabbitmqctl") is None:
        print("fuzz: needs rabbitmqctl (the local RabbitMQ's) on PATH", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="waystation-fuzz-"))
    args.json = args.json or workdir / "fuzz.json"
    try:
        return asyncio.run(run(args, workdir))
    except KeyboardInterrupt:
        print("fuzz: interrupted", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
