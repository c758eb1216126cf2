"""The chaos run's checks, once nothing is left in any queue or in the outbox: tasks missing,
wrong and duplicated; per task in the log, one terminal event, each pause recorded and resumed
once, each sub-task claimed once; ``waystation verify`` and ``waystation projections rebuild
paused_tasks|agent_stats|agent_minutes --check``; dead letters and their reasons, each
explained; the hostile messages' fates; the publishes refused, the outbox's oldest row; the
faults. The figures, and every loss or wrongness as a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from sqlalchemy import text

from scripts.lab.harness.checks import LogFigures, log_figures
from scripts.lab.harness.processes import (
    ROOT,
    log_problems,
    stats_counters,
    stop_all,
    waystation_cli,
)
from waystation.brokers.amqp.deadletters import DeadLetter, browse
from waystation.events.codec import loads
from waystation.example import expected_total
from waystation.projections.postgres import projection_status

from . import PREFIX, ROUNDS, K
from .answers import AnswerFigures, answer_figures
from .hostile import HostileFigures, hostile_figures, hostile_tag
from .plan import OVERSIZED_KINDS, expected_answer
from .sample import check_broker_limit, counter_totals, read_counters
from .setup import Chaos

PROJECTIONS = ("paused_tasks", "agent_stats", "agent_minutes")
CLI_TIMEOUT = 300.0
DEAD_LETTERS_READ = 100_000


async def check(chaos: Chaos, inputs: dict[str, dict[str, Any]]) -> None:
    """Every answer, dead letter and event of the run against what each task must get: the
    figures (``chaos.figures``) and the failures."""
    assert chaos.collector is not None
    args = chaos.args
    expected = {
        t: expected_answer(
            chaos.kinds[t], {"n": spec["n"], "total": expected_total(spec["n"], K, ROUNDS)}
        )
        for t, spec in inputs.items()
    }
    async with chaos.engine_().connect() as connection:
        rows = (
            await connection.execute(
                text(
                    "SELECT stream_id, event_type, data->>'subtask_id', "
                    "(data->>'pause')::int, data->>'reason' FROM events "
                    "ORDER BY stream_id, stream_version"
                )
            )
        ).all()
    failing = [t for t, kind in chaos.kinds.items() if kind == "over-worker"]
    finished = {r[0] for r in rows if r[1] in ("TaskCompleted", "TaskFailed", "TaskCancelled")}
    unfinished = [t for t in inputs if t not in finished]
    log = log_figures(
        list(inputs), [(r[0], r[1], r[2], r[3], r[4]) for r in rows], K, ROUNDS, failed=failing
    )
    caught_up = await wait_for_projections(chaos)
    paused_left = await chaos.paused_now()
    cli = await cli_checks(chaos)
    letters = await browse(chaos.amqp_url, chaos.names, limit=DEAD_LETTERS_READ)
    hostile_letters = [letter for letter in letters if hostile_tag(letter.body)]
    task_letters = [letter for letter in letters if not hostile_tag(letter.body)]
    answers = answer_figures(expected, chaos.collector.messages(), task_letters)
    hostile = hostile_figures(chaos.hostile, hostile_letters, chaos.collector.answers)
    if args.broker_max_message_size:
        await check_broker_limit(chaos)
    for worker in chaos.slots:
        await read_counters(chaos, worker)
    codes = stop_all([p for p in chaos.processes() if p.alive()], timeout=30)
    problems, first_problems = log_problems(sorted(chaos.logs.glob("*.log")))
    counters = _stats_counters(chaos.logs)
    kinds = Counter(chaos.kinds.values())
    refusals = counter_totals(chaos, "publish_refusals")
    by_kind = answers.by_kind
    chaos.figures = {
        "date": chaos.started_at.isoformat(timespec="seconds"),
        "commit": _commit(),
        "seed": args.seed,
        "options": {
            "tasks": args.tasks,
            "rounds": ROUNDS,
            "calls_per_round": K,
            "work_ms": list(args.work_ms),
            "in_flight": args.in_flight,
            "workers": args.workers,
            "kills": args.kills,
            "connection_closes": args.connection_closes,
            "pg_restarts": args.pg_restarts,
            "pg_down_s": args.pg_down,
            "delivery_limit": args.delivery_limit,
            "full_queue_share": args.full_queue_share,
            "never_drained": args.never_drained,
            "full_hold_s": args.full_hold,
            "full_length": args.full_length,
            "refused_retry_s": args.refused_retry,
            "oversized_share": args.oversized_share,
            "max_message_bytes": args.max_message_bytes,
            "broker_max_message_size": args.broker_max_message_size,
            "hostile_rate": args.hostile_rate,
        },
        "task_kinds": dict(sorted(kinds.items())),
        "tasks_submitted": chaos.submitted,
        "submits_retried": len(chaos.submit_retries),
        "results": answers.to_json(),
        "full_queues": {
            "drained_queues": len(chaos.full_queues),
            "tasks_per_drained_queue": [q.tasks for q in chaos.full_queues],
            "drained_after_s": [
                None if q.drained is None else round(q.drained - q.opened, 1)
                for q in chaos.full_queues
            ],
            "results_through_full_queues": sum(
                1 for t in chaos.collector.through_full if t in chaos.kinds
            ),
            "answered_by_refused_dead_letter": by_kind.get("full-never", {}).get(
                "by_dead_letter", 0
            ),
            "fillers_taken": chaos.collector.fillers_taken,
        },
        "oversized": {kind: by_kind.get(kind, {}) for kind in OVERSIZED_KINDS},
        "publish_refusals": {
            "metrics": refusals,
            "stats_of_clean_exits": counters.get("publish_refusals", 0),
        },
        "outbox_oldest_s": {
            "max_seen": round(chaos.outbox_oldest_max, 1),
            "when_the_window_was_answered": _rounded(chaos.outbox_oldest_window_end),
            "at_end": _rounded(chaos.outbox_oldest_end),
        },
        "hostile": hostile.to_json(),
        "log": {"events_in_log": len(rows), **log.to_json()},
        "verify_exit": cli["verify"][0],
        "verify": cli["verify"][1],
        **{f"rebuild_{name}_check_exit": cli[name][0] for name in PROJECTIONS},
        "projections_caught_up": caught_up,
        "paused_tasks_left": paused_left,
        "agent_stats_orchestrator_completed": cli["completed"],
        "dead_letters": {
            "count": len(letters),
            "reasons": dict(Counter(letter.reason for letter in letters)),
            "of_tasks": dict(Counter(letter.reason for letter in task_letters)),
            "of_hostile_messages": dict(Counter(letter.reason for letter in hostile_letters)),
            "unexplained": len(answers.unexplained_letters),
            "counted_by_workers": counter_totals(chaos, "dead_letters"),
        },
        "settled": chaos.settled,
        "left_unsettled": chaos.left,
        "lost": len(answers.missing) + len(hostile.missing),
        "stuck": len(unfinished) + (paused_left or 0),
        "unsettled": sum(chaos.left.values()) if not chaos.settled else 0,
        "tasks_unfinished_in_the_log": len(unfinished),
        "broker_max_message_size_seen": sorted(chaos.broker_limit_seen),
        "faults": chaos.faults,
        "faults_injected": dict(Counter(f["kind"] for f in chaos.faults)),
        "processes_started": len(chaos.retired) + len(chaos.processes()),
        "exit_codes_on_sigterm": codes,
        "log_warning_lines": problems,
        "worker_counters_of_clean_exits": counters,
    }
    judge(chaos, answers, hostile, log, cli, caught_up, paused_left, letters, codes)
    if first_problems:
        chaos.figures["log_warning_examples"] = first_problems


async def wait_for_projections(chaos: Chaos) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            statuses = await projection_status(chaos.engine_())
            if all(s.behind == 0 for s in statuses):
                return True
        await asyncio.sleep(0.25)
    return False


async def cli_checks(chaos: Chaos) -> dict[str, Any]:
    env = {
        "WAYSTATION_DATABASE_URL": chaos.database_url,
        "WAYSTATION_AMQP_URL": chaos.amqp_url,
        "WAYSTATION_QUEUE_PREFIX": PREFIX,
    }
    commands = {
        "verify": ["verify"],
        **{name: ["projections", "rebuild", name, "--check"] for name in PROJECTIONS},
        "status": ["status", "--json"],
    }
    # read-only, so at once: on a busy machine each spends seconds starting Python
    outcomes = await asyncio.gather(
        *(waystation_cli(command, env, CLI_TIMEOUT) for command in commands.values())
    )
    found: dict[str, Any] = {
        what: (code, _last_line(output))
        for what, (code, output) in zip(commands, outcomes, strict=True)
    }
    try:
        status = loads(outcomes[-1][1])
        found["completed"] = status["agents"]["orchestrator"]["completed"]
    except Exception:
        found["completed"] = None
    return found


def judge(
    chaos: Chaos,
    answers: AnswerFigures,
    hostile: HostileFigures,
    log: LogFigures,
    cli: dict[str, Any],
    caught_up: bool,
    paused_left: int | None,
    letters: list[DeadLetter],
    codes: dict[str, int | None],
) -> None:
    """Every loss or wrongness found, as a failure."""
    args = chaos.args
    kinds = Counter(chaos.kinds.values())
    completing = args.tasks - kinds["over-worker"]
    refused = sum(chaos.figures["publish_refusals"]["metrics"].values()) + int(
        chaos.figures["publish_refusals"]["stats_of_clean_exits"]
    )
    checks = [
        (chaos.submitted == args.tasks, f"{chaos.submitted} of {args.tasks} tasks submitted"),
        (
            not answers.missing,
            f"{len(answers.missing)} tasks lost (no result, nor the dead letter that answers "
            f"a task whose queue was never drained): {answers.missing[:5]}",
        ),
        (
            not answers.wrong,
            f"{len(answers.wrong)} tasks answered wrong (another answer than their kind's, "
            f"or two different ones): {answers.wrong[:5]}",
        ),
        (not answers.unexpected, f"{answers.unexpected} results of tasks never submitted"),
        (
            not answers.unexplained_letters,
            f"{len(answers.unexplained_letters)} dead letters no kind of task explains: "
            f"{answers.unexplained_letters[:5]}",
        ),
        (
            not hostile.missing,
            f"{len(hostile.missing)} hostile messages taken by the broker and never "
            f"dead-lettered (lost or stuck): {hostile.missing[:5]}",
        ),
        (
            not hostile.wrong_reason,
            f"{len(hostile.wrong_reason)} hostile messages not dead-lettered with their "
            f"reason: {hostile.wrong_reason[:5]}",
        ),
        (
            not hostile.wrong_answers,
            f"{len(hostile.wrong_answers)} answers to hostile messages that are no error of "
            f"their reason: {hostile.wrong_answers[:5]}",
        ),
        (
            not log.not_completed_once,
            f"{len(log.not_completed_once)} tasks without exactly one completion (or, over "
            "the workers' limit, one failure) in the log",
        ),
        (
            not log.pauses_resumed_twice,
            f"{len(log.pauses_resumed_twice)} pauses resumed more than once",
        ),
        (
            not log.pauses_recorded_twice,
            f"{len(log.pauses_recorded_twice)} pauses recorded more than once",
        ),
        (
            not log.claims_not_once,
            f"{len(log.claims_not_once)} sub-tasks not claimed exactly once",
        ),
        (not log.unexpected_streams, f"{len(log.unexpected_streams)} unexpected streams"),
        (cli["verify"][0] == 0, f"waystation verify exited {cli['verify'][0]}"),
        *(
            (cli[name][0] == 0, f"projections rebuild {name} --check exited {cli[name][0]}")
            for name in PROJECTIONS
        ),
        (caught_up, "the projections did not catch up with the log within 60s"),
        (paused_left == 0, f"{paused_left} tasks still paused in the paused_tasks projection"),
        (
            cli["completed"] == completing,
            f"agent_stats counts {cli['completed']} completed orchestrator tasks, not {completing}",
        ),
        (
            len(letters) < DEAD_LETTERS_READ,
            f"{len(letters)} dead letters or more: not all of them were read",
        ),
        (
            refused > 0 or not (kinds["full-drained"] or kinds["full-never"]),
            "no publish was refused: the full queues refused nothing",
        ),
        (
            all(code == 0 for code in codes.values()),
            f"exit codes on SIGTERM: {codes}",
        ),
    ]
    limit = args.broker_max_message_size
    checks.append(
        (
            not limit or chaos.broker_limit_seen <= {limit},
            f"RabbitMQ's max_message_size was changed during the run by something else "
            f"(seen {sorted(chaos.broker_limit_seen)}, set {limit}): the oversized tasks' "
            "answers cannot be judged",
        )
    )
    injected = Counter(f["kind"] for f in chaos.faults)
    wanted = {
        "kill": args.kills,
        "close": args.connection_closes,
        "pg-restart": args.pg_restarts,
    }
    checks.append(
        (
            all(injected[kind] == count for kind, count in wanted.items()),
            f"faults injected {dict(injected)}, planned {wanted}",
        )
    )
    idle = [f for f in chaos.faults if f["tasks_in_flight"] <= 0]
    checks.append((not idle, f"{len(idle)} faults landed with no task in flight"))
    for ok, failure in checks:
        if not ok:
            chaos.failures.append(failure)


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _commit() -> str | None:
    try:
        found = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found.stdout.strip() or None


def _stats_counters(logs: Path) -> dict[str, int]:
    """The counters the workers that stopped cleanly wrote (killed ones write nothing)."""
    return dict(sorted(stats_counters(sorted(logs.glob("w*.stats.json"))).items()))


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)
