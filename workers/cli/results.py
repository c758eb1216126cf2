"""``waystation result``: a task's recorded outcome, read from the log.

The same answer a ``query`` message gets from a worker (``waystation.runtime.flows.query``), read
here straight from the database, as ``history`` and ``state`` do.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from waystation.cli.wiring import load_settings, open_store, run
from waystation.events.codec import dumps

if TYPE_CHECKING:
    from waystation.events import TaskState
    from waystation.settings import Settings

__all__ = ["result"]


@click.command()
@click.argument("task_id")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='The log\'s record instead: {"task_id", "status": completed, failed, cancelled, '
    'paused, resumed or unknown, "outcome": the result body or null}, as a query message '
    "is answered.",
)
def result(task_id: str, as_json: bool) -> None:
    """Print TASK_ID's recorded outcome as JSON, read from the event log.

    Prints what its publisher was sent, as `submit` prints it: {"task_id", "status": ok, error
    or cancelled, "result", "error"}. A task that completed without calling peers records
    nothing (unless its agent keeps its results, keep_results=True, or
    WAYSTATION_AUDIT_ALL_TASKS is on), so it is not in the log. Exit codes:
    0 completed, 1 failed or cancelled, 2 not in the log, 3 not finished yet (paused or
    resumed; prints {"task_id", "status": "pending"}).
    """
    state = run(_load(load_settings(), task_id))
    sys.exit(_print(state, as_json))


async def _load(settings: Settings, task_id: str) -> TaskState:
    from waystation.events import fold

    store = open_store(settings)
    try:
        return fold(task_id, await store.read_stream(task_id))
    finally:
        await store.close()


def _print(state: TaskState, as_json: bool) -> int:
    from waystation.runtime.flows.query import query_answer

    answer = query_answer(state)
    if as_json:
        click.echo(dumps(answer).decode())
    if not state.exists:
        click.echo(
            f"task {state.task_id!r} is not in the event log (not run yet, or it completed "
            "without calling peers, which records nothing unless its agent keeps its results)",
            err=True,
        )
        return 2
    if not state.finished:
        if not as_json:
            click.echo(dumps({"task_id": state.task_id, "status": "pending"}).decode())
        click.echo(f"task {state.task_id!r} has not finished: it is {state.status}", err=True)
        return 3
    outcome = answer["outcome"]
    if not as_json:
        click.echo(
            dumps(
                {
                    "task_id": state.task_id,
                    "status": outcome["status"],
                    "result": outcome.get("result"),
                    "error": outcome.get("error"),
                }
            ).decode()
        )
    return 0 if state.status == "completed" else 1
