"""Commands about tasks: submit and cancel them, the paused tasks, the agents.

``submit`` and ``cancel`` talk to the workers through the broker, as a publisher does;
``tasks`` and ``status`` read the projections.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from waystation.cli.admin import print_projection_status, readable_age
from waystation.cli.wiring import (
    actor_option,
    agent_in_log,
    load_settings,
    run,
    with_projection_engine,
)
from waystation.events.codec import dumps, loads

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from waystation.projections.model import AgentCounts
    from waystation.projections.postgres import ProjectionStatus
    from waystation.settings import Settings

__all__ = ["cancel", "lag_warning", "list_paused_tasks", "status", "submit"]


@click.command()
@click.argument("agent")
@click.argument("input_json", default="null")
@click.option("--task-id", help="Task id (default: a new UUID). Resubmitting an id is idempotent.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait for the result.")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds to wait.")
@click.option(
    "--trace-id",
    help="Trace id the task and all its peer calls carry (default: the task id). Shows in "
    "the events' metadata, the workers' logs and `history`.",
)
@click.option(
    "--delay",
    type=float,
    default=0.0,
    help="Seconds before the task reaches AGENT's queue (waiting in the broker, as a retry "
    "does; rounded up to the next wait step, at most about 19 hours). --timeout counts from "
    "the submission, so give it room.",
)
def submit(
    agent: str,
    input_json: str,
    task_id: str | None,
    wait: bool,
    timeout: float,
    trace_id: str | None,
    delay: float,
) -> None:
    """Submit a task to AGENT with INPUT_JSON and print its result as JSON.

    Exit codes: 0 the task completed ok, 1 it completed with an error, 2 bad input,
    3 no result within --timeout, 7 no queue for AGENT (no worker serving it has started
    under WAYSTATION_QUEUE_PREFIX); 5 the broker cannot be used.
    """
    from waystation.policies import delay_step

    try:
        payload = loads(input_json)
    except Exception as error:
        raise click.BadParameter(f"not JSON: {error}", param_hint="INPUT_JSON") from error
    try:
        delay_step(delay)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--delay") from error
    settings = load_settings()
    code = run(_submit(settings, agent, payload, task_id, wait, timeout, trace_id, delay))
    sys.exit(code)


async def _submit(
    settings: Settings,
    agent: str,
    payload: Any,
    task_id: str | None,
    wait: bool,
    timeout: float,
    trace_id: str | None,
    delay: float = 0.0,
) -> int:
    from waystation.client import Client

    async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        task_id = await client.submit(
            agent, payload, task_id=task_id, trace_id=trace_id, delay=delay
        )
        if not wait:
            click.echo(dumps({"task_id": task_id}).decode())
            return 0
        try:
            result = await client.result(task_id, timeout)
        except TimeoutError:
            click.echo(dumps({"task_id": task_id, "status": "pending"}).decode())
            click.echo(f"no result within {timeout}s", err=True)
            return 3
        click.echo(
            dumps(
                {
                    "task_id": task_id,
                    "status": result.status,
                    "result": result.result,
                    "error": result.error,
                }
            ).decode()
        )
        return 0 if result.ok else 1


@click.command()
@click.argument("task_id")
@click.option("--agent", help="The task's agent (default: looked up in the event log).")
@click.option("--reason", help="Recorded with the cancellation.")
@actor_option("cancels")
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait.")
def cancel(task_id: str, agent: str | None, reason: str | None, actor: str, timeout: float) -> None:
    """Cancel TASK_ID: durable, cascades to every peer call it waits for.

    Prints the task's status afterwards as JSON. Exit codes: 0 cancelled, 1 it had already
    finished (completed or failed), 2 bad arguments or unknown task, 3 no answer in --timeout,
    7 no queue for its agent.
    """
    settings = load_settings()
    sys.exit(run(_cancel(settings, task_id, agent, reason, actor, timeout)))


async def _cancel(
    settings: Settings,
    task_id: str,
    agent: str | None,
    reason: str | None,
    actor: str,
    timeout: float,
) -> int:
    from waystation.client import Client

    if agent is None:
        agent = await agent_in_log(settings, task_id)
        if agent is None:
            click.echo(
                f"task {task_id!r} is not in the event log; name its agent with --agent", err=True
            )
            return 2
    async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        try:
            status = await client.cancel(
                agent, task_id, reason=reason, actor=actor, timeout=timeout
            )
        except TimeoutError:
            click.echo(f"no answer from agent {agent!r} within {timeout}s", err=True)
            return 3
    click.echo(dumps({"task_id": task_id, "status": status}).decode())
    return 0 if status == "cancelled" else 1


@click.command(name="tasks")
@click.option("--agent", help="Only tasks of this agent.")
@click.option(
    "--status",
    type=click.Choice(["paused", "resumed"]),
    help="paused: waiting for results; resumed: running again after a pause.",
)
@click.option(
    "--waiting-for",
    type=click.Choice(["call", "signal", "timer"]),
    help="Only tasks with an open wait of this kind: a peer call, a signal, a timer.",
)
@click.option(
    "--signal",
    metavar="NAME",
    help="Only tasks waiting for the signal NAME (`waystation signal TASK_ID NAME ...`).",
)
@click.option("--limit", type=int, default=100, show_default=True, help="At most this many.")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
def list_paused_tasks(
    agent: str | None,
    status: str | None,
    waiting_for: str | None,
    signal: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List paused tasks (the paused-tasks projection), oldest pause first, with what each
    waits for and until when.

    A task appears from its first pause until it completes, fails or is cancelled. WAITING FOR
    names its open waits (`call researcher ×2`, `signal approval`, `timer`), `first K of:` when
    its pause resumes on the first K successes; EARLIEST DEADLINE is the soonest of their
    deadlines (a timer's is when it fires, a signal's when its wait times out). --json gives
    each wait with its deadline. When the projection has never run, or is behind the log (no
    `waystation projections run` is active, or it lags), a line on stderr says so: the list
    may then miss tasks or show them as they were. --json prints the rows alone on stdout
    either way.
    """
    if signal is not None and waiting_for not in (None, "signal"):
        raise click.UsageError(
            f"--signal waits for a signal; it cannot be combined with --waiting-for {waiting_for}"
        )
    rows, projection = run(
        with_projection_engine(
            load_settings(),
            _paused_tasks_and_projection,
            agent=agent,
            status=status,
            waiting_for=waiting_for,
            signal=signal,
            limit=limit,
        )
    )
    stale = lag_warning(projection, datetime.now(UTC))
    if stale is not None:
        click.echo(stale, err=True)
    if as_json:
        click.echo(dumps([_row_json(row) for row in rows]).decode())
        return
    if not rows:
        click.echo(
            "no paused tasks"
            if stale is None
            else "no paused tasks known: the projection trails the log"
        )
        return
    click.echo(
        f"{'task':<38} {'agent':<16} {'pause':>5} {'results':>8}  {'paused since (UTC)':<19}  "
        f"{'earliest deadline':<19}  {'status':<7}  waiting for"
    )
    for row in rows:
        results = f"{row['waits_recorded']}/{row['waits_expected']}"
        click.echo(
            f"{row['task_id']:<38} {row['agent']:<16} {row['pause']:>5} {results:>8}  "
            f"{_moment(row['paused_since']):<19}  {_moment(row['earliest_deadline']):<19}  "
            f"{row['status']:<7}  {_waiting_for(row)}"
        )


def _waiting_for(row: dict[str, Any]) -> str:
    """What a row's task waits for, in a few words: ``call researcher ×2, signal approval``."""
    from waystation.projections.model import OpenWait
    from waystation.projections.waits import describe_waits

    labels = (OpenWait.from_json(wait).label for wait in row["waits"])
    return describe_waits(labels, row["first_k"])


def _row_json(row: dict[str, Any]) -> dict[str, Any]:
    """A row as `tasks --json` prints it: each open wait's deadline as an ISO-8601 time, as the
    row's other moments are."""
    waits = []
    for wait in row["waits"]:
        shown = {k: v for k, v in wait.items() if k != "deadline_at"}
        shown["deadline"] = datetime.fromtimestamp(wait["deadline_at"], UTC)
        waits.append(shown)
    return {**row, "waits": waits}


async def _paused_tasks_and_projection(
    engine: AsyncEngine, **filters: Any
) -> tuple[list[dict[str, Any]], ProjectionStatus]:
    """The rows, and where the projection stood just before they were read (so that a status
    found up to date vouches for them)."""
    from waystation.projections.postgres import paused_tasks, projection_status

    [projection] = await projection_status(engine, ["paused_tasks"])
    return await paused_tasks(engine, **filters), projection


ACTIVE_LAG_TOLERATED = 10.0
"""Seconds an active runner's oldest unapplied event may be old before ``tasks`` warns."""

LAG_ADVICE = "start `waystation projections run`, or see `waystation projections status`"


def lag_warning(projection: ProjectionStatus, now: datetime) -> str | None:
    """What to tell a reader of the paused-tasks projection about how far it trails the log,
    or None when it is up to date (or trails only briefly, with a runner active)."""
    name = "the paused-tasks projection"
    if projection.behind == 0:
        return None
    if projection.updated_at is None:
        return (
            f"{name} has never run: none of the {projection.behind} events in the log is "
            f"applied, so paused tasks may be missing; {LAG_ADVICE}"
        )
    applied = readable_age((now - projection.updated_at).total_seconds())
    if not projection.active:
        return (
            f"{name} is {projection.behind} events behind the log (last applied {applied} ago) "
            f"and no runner is active, so paused tasks may be missing or out of date; {LAG_ADVICE}"
        )
    if projection.lag_seconds > ACTIVE_LAG_TOLERATED:
        return (
            f"{name} is {projection.behind} events behind the log (its oldest unapplied event "
            f"is {readable_age(projection.lag_seconds)} old) although a runner is active; see "
            "`waystation projections status`"
        )
    return None


def _moment(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="JSON instead of tables.")
def status(as_json: bool) -> None:
    """Per-agent statistics and how far behind the log each projection is.

    Counts come from the log: completed, failed and cancelled tasks (those that paused, or all
    with WAYSTATION_AUDIT_ALL_TASKS), tasks paused now, calls to the agent that timed out, and
    the mean duration of a pause.
    """
    stats, statuses = run(with_projection_engine(load_settings(), _agents_and_projections))
    if as_json:
        click.echo(
            dumps(
                {
                    "agents": {agent: counts.to_json() for agent, counts in stats.items()},
                    "projections": [s.to_json() for s in statuses],
                }
            ).decode()
        )
        return
    click.echo(
        f"{'agent':<16} {'completed':>9} {'failed':>7} {'cancelled':>9} {'paused':>7} "
        f"{'timeouts':>8} {'mean pause':>10}"
    )
    for agent, c in stats.items():
        mean = c.mean_pause_seconds
        click.echo(
            f"{agent:<16} {c.completed:>9} {c.failed:>7} {c.cancelled:>9} {c.paused_now:>7} "
            f"{c.timeouts:>8} {(f'{mean:.3f}s' if mean is not None else '-'):>10}"
        )
    if not stats:
        click.echo("(no agent has recorded anything yet)")
    click.echo("")
    print_projection_status(statuses)


async def _agents_and_projections(
    engine: AsyncEngine,
) -> tuple[dict[str, AgentCounts], list[ProjectionStatus]]:
    from waystation.projections.postgres import agent_stats, projection_status

    return await agent_stats(engine), await projection_status(engine)
