"""``waystation signal``: send a signal to a paused task, as any publisher can (issue 31).

The signal goes to the queue of the task's agent, through the broker, like ``cancel``; the
worker that takes it records it in the task's stream and answers what became of it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from waystation.cli.wiring import actor_option, agent_in_log, load_settings, run
from waystation.events.codec import dumps, loads

if TYPE_CHECKING:
    from waystation.settings import Settings

__all__ = ["signal"]

EXIT_NOT_APPLIED = 1
EXIT_UNKNOWN_TASK = 2
EXIT_NO_ANSWER = 3


@click.command()
@click.argument("task_id")
@click.argument("name")
@click.argument("payload_json", default="null")
@click.option("--agent", help="The task's agent (default: looked up in the event log).")
@click.option(
    "--signal-id",
    help="The signal's id (default: a new one). Sending again with the same id is harmless: "
    "a signal is applied once.",
)
@actor_option("sends it")
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait.")
def signal(
    task_id: str,
    name: str,
    payload_json: str,
    agent: str | None,
    signal_id: str | None,
    actor: str,
    timeout: float,
) -> None:
    """Send the signal NAME with PAYLOAD_JSON (default null) to the paused task TASK_ID.

    A wait of the task on NAME takes it, and the task resumes once its pause has what it waits
    for; with no such wait yet, the task keeps it for the next one. Prints what became of it as
    JSON with the signal's id: "taken", "kept" or "duplicate" (sent before, with this
    --signal-id). For example:

    \b
        waystation signal 3f2a9c1e approval '{"approved": true}'

    Exit codes: 0 taken, kept or a duplicate; 1 not applied, and stderr says why: the task has
    finished, the log has no record of it (with --agent), it is a task of another agent, or
    the payload does not fit the agent's model of the signal (naming each field; the wait goes
    on); 2 bad arguments, or TASK_ID is not in the event log (without --agent); 3 no answer in
    --timeout (the signal may still be applied: send it again with the --signal-id printed);
    7 no queue for the agent (no worker serving it has started).
    """
    try:
        payload = loads(payload_json)
    except ValueError as error:
        raise click.BadParameter(f"not JSON: {error}", param_hint="PAYLOAD_JSON") from None
    settings = load_settings()
    sys.exit(run(_signal(settings, task_id, name, payload, agent, signal_id, actor, timeout)))


async def _signal(
    settings: Settings,
    task_id: str,
    name: str,
    payload: object,
    agent: str | None,
    signal_id: str | None,
    actor: str,
    timeout: float,
) -> int:
    from waystation.client import Client, SignalNotApplied, new_signal_id

    signal_id = signal_id or new_signal_id()
    if agent is None:
        agent = await agent_in_log(settings, task_id)
        if agent is None:
            click.echo(
                f"task {task_id!r} is not in the event log: a signal reaches a task that has "
                "paused (name its agent with --agent to send it anyway)",
                err=True,
            )
            return EXIT_UNKNOWN_TASK
    async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        try:
            status = await client.signal(
                task_id,
                name,
                payload,
                agent=agent,
                signal_id=signal_id,
                actor=actor,
                timeout=timeout,
            )
        except TimeoutError:
            click.echo(
                f"no answer from agent {agent!r} within {timeout}s; the signal may still be "
                f"applied: send it again with --signal-id {signal_id} to learn what became of "
                "it (a signal is applied once)",
                err=True,
            )
            return EXIT_NO_ANSWER
        except SignalNotApplied as refused:
            _print(task_id, name, signal_id, refused.status)
            click.echo(f"not applied ({refused.status}): {refused.message}", err=True)
            return EXIT_NOT_APPLIED
    _print(task_id, name, signal_id, status)
    return 0


def _print(task_id: str, name: str, signal_id: str, status: str) -> None:
    """What became of the signal, as one line of JSON on stdout."""
    answer = {"task_id": task_id, "signal": name, "signal_id": signal_id, "status": status}
    click.echo(dumps(answer).decode())
