"""The ``waystation`` command: parses options, builds the settings, wires the parts, runs.

This is the composition root: the only place that reads the environment (through ``Settings``)
and picks concrete backends. The work itself lives in the library.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import sys
from datetime import UTC
from typing import Any

import click

from events.codec import dumps, loads

__all__ = ["main"]

log = logging.getLogger("waystation")


def _settings(**overrides: Any) -> Any:
    from .settings import Settings

    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _load_app(path: str) -> Any:
    module_name, _, attribute = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute or "app")
    except (ImportError, AttributeError) as error:
        raise click.BadParameter(
            f"cannot load app {path!r}: {error}", param_hint="--app"
        ) from error


def _run(coroutine: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coroutine)
    except ImportError:
        return asyncio.run(coroutine)


@click.group()
@click.option("--log-level", default="INFO", show_default=True, help="Python logging level.")
def main(log_level: str) -> None:
    """Waystation: durable pause and resume-anywhere for agents that call other agents.

    Settings come from WAYSTATION_* environment variables (see README, "Configuration").
    """
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aio_pika").setLevel(logging.WARNING)
    logging.getLogger("aiormq").setLevel(logging.WARNING)


@main.command()
@click.option(
    "--app",
    "app_path",
    default="workers.example:app",
    show_default=True,
    help="The app to serve, as module:attribute.",
)
@click.option("--concurrency", type=int, help="Messages handled at once per queue.")
def worker(app_path: str, concurrency: int | None) -> None:
    """Run a worker serving every agent of the app until SIGTERM or SIGINT.

    Migrates the database first (creating it if needed), declares the queues, and applies the
    delivery-limit policy. On a signal it stops consuming, lets in-flight messages reach their
    next commit within WAYSTATION_SHUTDOWN_GRACE seconds, and exits 0.
    """
    settings = _settings(concurrency=concurrency)
    app = _load_app(app_path)
    _run(_serve(app, settings))


async def _serve(app: Any, settings: Any) -> None:
    import migrations
    from events.postgres import PostgresEventStore

    from .runtime import Worker

    await migrations.upgrade(settings.database_url)
    store = PostgresEventStore.from_url(settings.database_url, pool_size=settings.db_pool_size)
    instance = Worker(app, settings, store)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await instance.start()
        await stop.wait()
        log.info("stopping")
    finally:
        await instance.stop()
        await store.close()


@main.command()
@click.argument("agent")
@click.argument("input_json", default="null")
@click.option("--task-id", help="Task id (default: a new UUID). Resubmitting an id is idempotent.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait for the result.")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds to wait.")
def submit(agent: str, input_json: str, task_id: str | None, wait: bool, timeout: float) -> None:
    """Submit a task to AGENT with INPUT_JSON and print its result as JSON.

    Exit codes: 0 the task completed ok, 1 it completed with an error, 2 bad input,
    3 no result within --timeout.
    """
    try:
        payload = loads(input_json)
    except Exception as error:
        raise click.BadParameter(f"not JSON: {error}", param_hint="INPUT_JSON") from error
    settings = _settings()
    code = _run(_submit(settings, agent, payload, task_id, wait, timeout))
    sys.exit(code)


async def _submit(
    settings: Any, agent: str, payload: Any, task_id: str | None, wait: bool, timeout: float
) -> int:
    from .client import Client

    async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        task_id = await client.submit(agent, payload, task_id=task_id)
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


@main.command()
@click.argument("task_id")
@click.option("--agent", help="The task's agent (default: looked up in the event log).")
@click.option("--reason", help="Recorded with the cancellation.")
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait.")
def cancel(task_id: str, agent: str | None, reason: str | None, timeout: float) -> None:
    """Cancel TASK_ID: durable, cascades to every peer call it waits for.

    Prints the task's status afterwards as JSON. Exit codes: 0 cancelled, 1 it had already
    finished (completed or failed), 2 bad arguments or unknown task, 3 no answer in --timeout.
    """
    settings = _settings()
    sys.exit(_run(_cancel(settings, task_id, agent, reason, timeout)))


async def _cancel(
    settings: Any, task_id: str, agent: str | None, reason: str | None, timeout: float
) -> int:
    from events import fold
    from events.postgres import PostgresEventStore

    from .client import Client

    if agent is None:
        store = PostgresEventStore.from_url(settings.database_url, pool_size=1)
        try:
            agent = fold(task_id, await store.read_stream(task_id)).agent
        finally:
            await store.close()
        if agent is None:
            click.echo(
                f"task {task_id!r} is not in the event log; name its agent with --agent", err=True
            )
            return 2
    async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        try:
            status = await client.cancel(agent, task_id, reason=reason, timeout=timeout)
        except TimeoutError:
            click.echo(f"no answer from agent {agent!r} within {timeout}s", err=True)
            return 3
    click.echo(dumps({"task_id": task_id, "status": status}).decode())
    return 0 if status == "cancelled" else 1


@main.group(name="dead-letters")
def dead_letters() -> None:
    """Inspect and replay the dead-letter queue (see README, "Dead letters")."""


def _print_letters(letters: list[Any], as_json: bool) -> None:
    if as_json:
        click.echo(dumps([letter.to_json() for letter in letters]).decode())
        return
    if not letters:
        click.echo("no dead letters")
        return
    click.echo(f"{'reason':<26} {'from queue':<36} {'message id':<40} detail")
    for letter in letters:
        click.echo(
            f"{letter.reason:<26} {letter.queue or '?':<36} {letter.message_id or '-':<40} "
            f"{letter.detail[:80]}"
        )


@dead_letters.command(name="list")
@click.option("--limit", type=int, default=50, show_default=True, help="At most this many.")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
def list_dead_letters(limit: int, as_json: bool) -> None:
    """Show dead letters with their reasons; they stay in the queue."""
    from .deadletters import browse
    from .wire import Names

    settings = _settings()
    letters = _run(browse(settings.amqp_url, Names(settings.queue_prefix), limit))
    _print_letters(letters, as_json)


@dead_letters.command(name="replay")
@click.option("--reason", help="Only dead letters of this reason (e.g. handler-failed).")
@click.option("--limit", type=int, default=50, show_default=True, help="At most this many.")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
def replay_dead_letters(reason: str | None, limit: int, as_json: bool) -> None:
    """Send dead letters back to the queue they came from (after fixing the cause)."""
    from .deadletters import replay
    from .wire import Names

    settings = _settings()
    letters = _run(
        replay(settings.amqp_url, Names(settings.queue_prefix), reason=reason, limit=limit)
    )
    _print_letters(letters, as_json)
    if not as_json:
        click.echo(f"replayed {len(letters)} message(s)")


async def _open_store(settings: Any) -> Any:
    from events.postgres import PostgresEventStore

    return PostgresEventStore.from_url(settings.database_url, pool_size=1)


async def _read_log(settings: Any, task_id: str | None) -> dict[str, list[Any]]:
    """The events of one task, or of the whole log (paged in commit order), by stream."""
    from events.store import Position

    store = await _open_store(settings)
    try:
        if task_id is not None:
            return {task_id: await store.read_stream(task_id)}
        streams: dict[str, list[Any]] = {}
        after = Position()
        while batch := await store.read_all(after, limit=1000):
            for event in batch:
                streams.setdefault(event.stream_id, []).append(event)
            after = Position.of(batch[-1])
        for events in streams.values():
            events.sort(key=lambda e: e.stream_version)
        return streams
    finally:
        await store.close()


@main.command()
@click.argument("task_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a report.")
def verify(task_id: str | None, as_json: bool) -> None:
    """Verify the hash chains and invariants of TASK_ID's stream, or of the whole log.

    Checks contiguous versions, the hash chain, at most one claim per sub-task and one resume per
    pause, no resume before every result of its pause, no result without its claim, and no event
    after a terminal one (audit-only events aside). Exit codes: 0 nothing wrong, 1 a problem was
    found, 2 TASK_ID is not in the log.
    """
    from projections.audit import verify_stream

    streams = _run(_read_log(_settings(), task_id))
    if task_id is not None and not streams[task_id]:
        click.echo(f"task {task_id!r} is not in the event log", err=True)
        sys.exit(2)
    problems = [p for events in streams.values() for p in verify_stream(events)]
    counted = sum(len(events) for events in streams.values())
    if as_json:
        click.echo(
            dumps(
                {
                    "ok": not problems,
                    "streams": len(streams),
                    "events": counted,
                    "problems": [p.to_json() for p in problems],
                }
            ).decode()
        )
    else:
        for problem in problems:
            click.echo(
                f"stream {problem.stream_id} version {problem.stream_version}: "
                f"{problem.kind}: {problem.message}"
            )
        outcome = f"{len(problems)} problem(s)" if problems else "no problems"
        click.echo(f"{len(streams)} streams, {counted} events verified, {outcome}")
    sys.exit(1 if problems else 0)


@main.command()
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a readable timeline.")
def history(task_id: str, as_json: bool) -> None:
    """Show TASK_ID's history: who did what, when, and how long each pause lasted.

    Exit codes: 0 shown, 2 TASK_ID is not in the log.
    """
    from projections.audit import pauses, timeline

    events = _run(_read_log(_settings(), task_id))[task_id]
    if not events:
        click.echo(f"task {task_id!r} is not in the event log", err=True)
        sys.exit(2)
    entries = timeline(events)
    spans = pauses(events)
    if as_json:
        click.echo(
            dumps(
                {
                    "task_id": task_id,
                    "events": [entry.to_json() for entry in entries],
                    "pauses": [span.to_json() for span in spans],
                }
            ).decode()
        )
        return
    click.echo(f"task {task_id}: {len(entries)} events")
    click.echo(f"{'v':>4}  {'recorded at (UTC)':<26} {'event':<16} {'worker':<20} what")
    for entry in entries:
        moment = (
            entry.recorded_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
            if entry.recorded_at is not None
            else "?"
        )
        click.echo(
            f"{entry.version:>4}  {moment:<26} {entry.event_type:<16} "
            f"{entry.actor or '-':<20} {entry.summary}"
        )
    for span in spans:
        lasted = f"{span.seconds:.3f} s" if span.seconds is not None else "still waiting"
        resumed = f"v{span.resumed_version}" if span.resumed_version is not None else "-"
        click.echo(f"pause #{span.pause}: v{span.paused_version} → {resumed}, {lasted}")


@main.group()
def db() -> None:
    """Database schema commands."""


@db.command()
def upgrade() -> None:
    """Create the database if missing and migrate it to the newest schema."""
    import migrations

    settings = _settings()
    asyncio.run(migrations.upgrade(settings.database_url))
    click.echo("database is at the newest schema")


if __name__ == "__main__":
    main()
