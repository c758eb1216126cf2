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
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
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


def _run_service(coroutine: Any) -> None:
    """Run a long-lived process; a port it cannot listen on ends it with a clear line, exit 1."""
    from .metrics import MetricsPortUnavailable

    try:
        _run(coroutine)
    except MetricsPortUnavailable as error:
        log.error("%s", error.strerror)
        sys.exit(1)


@click.group()
@click.option(
    "--log-level",
    envvar="WAYSTATION_LOG_LEVEL",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Least severe log level written (env WAYSTATION_LOG_LEVEL).",
)
@click.option(
    "--log-format",
    envvar="WAYSTATION_LOG_FORMAT",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "json", "text"]),
    help="json: one JSON object per line; text: readable lines; auto: text in a terminal, "
    "JSON otherwise (env WAYSTATION_LOG_FORMAT).",
)
def main(log_level: str, log_format: str) -> None:
    """Waystation: durable pause and resume-anywhere for agents that call other agents.

    Settings come from WAYSTATION_* environment variables (see README, "Configuration").
    Logs go to stderr; results, tables and --json output to stdout.
    """
    from .logs import configure_logging

    configure_logging(log_level, log_format)  # type: ignore[arg-type]
    context = click.get_current_context()
    context.obj = {"log_level": log_level, "log_format": log_format}


def _log_as_worker(worker_id: str) -> None:
    """Put the worker id on every log line of this process from now on."""
    from .logs import configure_logging

    options = click.get_current_context().find_root().obj or {}
    configure_logging(
        options.get("log_level", "INFO"), options.get("log_format", "auto"), worker_id=worker_id
    )


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
    _log_as_worker(settings.worker_id)
    _run_service(_serve(app, settings))


async def _serve(app: Any, settings: Any) -> None:
    import migrations
    from events.postgres import PostgresEventStore

    from .metrics import HttpServer, Metrics, database_gauges
    from .runtime import Worker

    metrics = Metrics()
    await migrations.upgrade(settings.database_url)
    store = PostgresEventStore.from_url(settings.database_url, pool_size=settings.db_pool_size)
    instance = Worker(app, settings, store, metrics=metrics)
    server = HttpServer(
        metrics,
        instance.health,
        host=settings.metrics_host,
        port=settings.metrics_port,
        refresh=lambda: database_gauges(metrics, store, deployment=settings.queue_prefix),
        horizon=store.horizon_holder,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await server.start()
        await instance.start()
        await stop.wait()
        log.info("stopping")
    finally:
        await instance.stop()
        await server.stop()
        await store.close()


@main.command()
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
def submit(
    agent: str,
    input_json: str,
    task_id: str | None,
    wait: bool,
    timeout: float,
    trace_id: str | None,
) -> None:
    """Submit a task to AGENT with INPUT_JSON and print its result as JSON.

    Exit codes: 0 the task completed ok, 1 it completed with an error, 2 bad input,
    3 no result within --timeout.
    """
    try:
        payload = loads(input_json)
    except Exception as error:
        raise click.BadParameter(f"not JSON: {error}", param_hint="INPUT_JSON") from error
    settings = _settings()
    code = _run(_submit(settings, agent, payload, task_id, wait, timeout, trace_id))
    sys.exit(code)


async def _submit(
    settings: Any,
    agent: str,
    payload: Any,
    task_id: str | None,
    wait: bool,
    timeout: float,
    trace_id: str | None,
) -> int:
    from .client import Client

    async with Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client:
        task_id = await client.submit(agent, payload, task_id=task_id, trace_id=trace_id)
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
@click.option(
    "--file",
    "export_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Verify this file written by `waystation export`, offline, instead of the database.",
)
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a report.")
def verify(task_id: str | None, export_file: Path | None, as_json: bool) -> None:
    """Verify the hash chains and invariants of TASK_ID's stream, or of the whole log.

    Checks contiguous versions, the hash chain, at most one claim per sub-task and one resume per
    pause, no resume before every result of its pause, no result without its claim, and no event
    after a terminal one (audit-only events aside). With --file the same checks run on an export,
    without the database; a redacted event's content hash cannot be checked (it covers the
    secret), only its links and invariants, and the report counts such events. A stream that the
    file starts past version 1 gets a partial-stream note and is checked from there. Exit codes:
    0 nothing wrong, 1 a problem was found, 2 TASK_ID is not in the log (or the file), or the
    file has a line that is not an exported event.
    """
    if export_file is not None:
        sys.exit(_verify_file(export_file, task_id, as_json))
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
        _print_problems(problems)
        outcome = f"{len(problems)} problem(s)" if problems else "no problems"
        click.echo(f"{len(streams)} streams, {counted} events verified, {outcome}")
    sys.exit(1 if problems else 0)


def _print_problems(problems: list[Any]) -> None:
    for problem in problems:
        click.echo(
            f"stream {problem.stream_id} version {problem.stream_version}: "
            f"{problem.kind}: {problem.message}"
        )


def _verify_file(path: Path, task_id: str | None, as_json: bool) -> int:
    from projections.export import ExportFormatError, read_export, verify_export

    try:
        with path.open("rb") as lines:
            exported = read_export(lines)
            if task_id is not None:
                exported = (e for e in exported if e.event.stream_id == task_id)
            report = verify_export(exported)
    except ExportFormatError as error:
        click.echo(f"{path} {error}", err=True)
        return 2
    except OSError as error:
        click.echo(f"cannot read {path}: {error}", err=True)
        return 2
    if task_id is not None and not report.events:
        click.echo(f"task {task_id!r} is not in {path}", err=True)
        return 2
    if as_json:
        click.echo(dumps({"file": str(path), **report.to_json()}).decode())
    else:
        _print_problems(report.problems)
        for note in report.notes:
            click.echo(
                f"note: stream {note.stream_id} version {note.stream_version}: "
                f"{note.kind}: {note.message}"
            )
        outcome = f"{len(report.problems)} problem(s)" if report.problems else "no problems"
        click.echo(
            f"{report.streams} streams, {report.events} events verified, {report.redacted} "
            f"redacted (content hash not checkable), {outcome}"
        )
    return 0 if report.ok else 1


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
                    "trace_ids": sorted({e.trace_id for e in entries if e.trace_id}),
                    "events": [entry.to_json() for entry in entries],
                    "pauses": [span.to_json() for span in spans],
                }
            ).decode()
        )
        return
    traces = sorted({entry.trace_id for entry in entries if entry.trace_id})
    click.echo(
        f"task {task_id}: {len(entries)} events"
        + (f", trace {', '.join(traces)}" if traces else "")
    )
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


def _iso_time(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    """An ISO-8601 time; one without a zone is UTC (as `history` prints times)."""
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not an ISO-8601 time such as 2026-01-31T12:00:00Z"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@main.command()
@click.option(
    "--task", "tasks", multiple=True, metavar="ID", help="Only this task's events (repeatable)."
)
@click.option(
    "--since",
    metavar="ISO-TIME",
    callback=_iso_time,
    help="Only events recorded at or after this time (no zone: UTC).",
)
@click.option(
    "--until",
    metavar="ISO-TIME",
    callback=_iso_time,
    help="Only events recorded at or before this time (no zone: UTC).",
)
@click.option(
    "--after-position",
    type=click.IntRange(min=0),
    metavar="N",
    help="Only events whose global position is greater than N.",
)
@click.option(
    "--to-position",
    type=click.IntRange(min=0),
    metavar="N",
    help="Only events whose global position is at most N.",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Write to this file (replaced only once the export is complete) instead of stdout.",
)
@click.option(
    "--redact-key",
    "redact_keys",
    multiple=True,
    metavar="NAME",
    help="Also redact the values of keys named NAME (repeatable); security_context always is.",
)
@click.option("--no-redact", is_flag=True, help="Export secrets as they are: no redaction.")
def export(
    tasks: tuple[str, ...],
    since: datetime | None,
    until: datetime | None,
    after_position: int | None,
    to_position: int | None,
    output: Path | None,
    redact_keys: tuple[str, ...],
    no_redact: bool,
) -> None:
    """Write events of the log as JSON lines: every column of each event, one event per line.

    Selects by task (--task), by recorded_at (--since, --until) and by global position
    (--after-position, --to-position); bounds combine. Without --task, the log is read in commit
    order, page by page, and written as it is read. Values of keys named security_context (and
    of each --redact-key), anywhere in data or metadata, become {"redacted": "sha256:..."} and
    the line lists their paths under "redacted". `waystation verify --file` checks the result
    offline. Exit codes: 0 written, 2 a --task is not in the log (nothing is written).
    """
    from projections.export import DEFAULT_REDACT_KEYS, Selection

    if no_redact and redact_keys:
        raise click.UsageError("--no-redact and --redact-key contradict each other")
    keys = frozenset() if no_redact else DEFAULT_REDACT_KEYS | set(redact_keys)
    selection = Selection(since, until, after_position, to_position)
    settings = _settings()
    if output is None:
        summary = _run(_export(settings, sys.stdout.buffer.write, tasks, selection, keys))
        sys.stdout.buffer.flush()
    else:
        partial = output.with_name(output.name + ".partial")
        try:
            with partial.open("wb") as file:
                summary = _run(_export(settings, file.write, tasks, selection, keys))
            if not summary.missing_tasks:
                partial.replace(output)
        finally:
            partial.unlink(missing_ok=True)
    for task in summary.missing_tasks:
        click.echo(f"task {task!r} is not in the event log", err=True)
    if summary.missing_tasks:
        sys.exit(2)
    where = f" to {output}" if output is not None else ""
    click.echo(
        f"exported {summary.events} events of {summary.streams} streams{where}, "
        f"{summary.redacted} with redacted values",
        err=True,
    )


async def _export(
    settings: Any,
    write: Callable[[bytes], object],
    tasks: tuple[str, ...],
    selection: Any,
    redact_keys: frozenset[str],
) -> Any:
    from projections.export import export_log

    store = await _open_store(settings)
    try:
        return await export_log(
            store, write, tasks=tasks, selection=selection, redact_keys=redact_keys
        )
    finally:
        await store.close()


@main.command()
@click.argument("task_id")
@click.option(
    "--at-position",
    type=click.IntRange(min=0),
    metavar="N",
    help="Only the task's events whose global position is at most N.",
)
@click.option(
    "--at",
    "at_time",
    metavar="ISO-TIME",
    callback=_iso_time,
    help="Only the task's events recorded at or before this time (no zone: UTC).",
)
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a readable summary.")
def state(task_id: str, at_position: int | None, at_time: datetime | None, as_json: bool) -> None:
    """Show TASK_ID's state as the log said it at a past position or time (default: now).

    Folds the task's events up to that point: status, agent, pause, the agent's state, the calls
    still outstanding, the results recorded, its result or error, and the last event included.
    A time is compared with recorded_at, the start of the transaction that wrote each event.
    Exit codes: 0 shown, 2 TASK_ID is not in the log or has no event at or before that point.
    """
    from projections.audit import state_as_of

    if at_position is not None and at_time is not None:
        raise click.UsageError("give --at-position or --at, not both")
    events = _run(_read_log(_settings(), task_id))[task_id]
    if not events:
        click.echo(f"task {task_id!r} is not in the event log", err=True)
        sys.exit(2)
    past = state_as_of(task_id, events, position=at_position, at=at_time)
    if past.last_event is None:
        point = f"position {at_position}" if at_position is not None else _utc(at_time)
        first = events[0]
        click.echo(
            f"task {task_id!r} has no event at or before {point} (its first is at position "
            f"{first.global_position}, recorded {_utc(first.recorded_at)})",
            err=True,
        )
        sys.exit(2)
    if as_json:
        click.echo(dumps(past.to_json()).decode())
        return
    shown, last = past.state, past.last_event
    point = (
        f"position {at_position}"
        if at_position is not None
        else _utc(at_time)
        if at_time is not None
        else "now"
    )
    click.echo(
        f"task {task_id} as of {point}: {shown.version} of {len(events)} events, the last "
        f"v{last.stream_version} {last.event_type} at position {last.global_position}, "
        f"recorded {_utc(last.recorded_at)}"
    )
    click.echo(f"status       {shown.status}")
    click.echo(f"agent        {shown.agent or '-'}")
    click.echo(f"pause        #{shown.pause}" if shown.pause else "pause        none yet")
    click.echo(f"state        {dumps(dict(shown.state)).decode()}")
    click.echo(f"outstanding  {len(shown.outstanding)} call(s)")
    for call in shown.outstanding:
        deadline = _utc(datetime.fromtimestamp(call.deadline_at, UTC))
        click.echo(f"  {call.subtask_id}  {call.agent}  deadline {deadline}")
    click.echo(f"results      {len(shown.results)}")
    for result in shown.results.values():
        value = result.value if result.ok else result.error
        click.echo(
            f"  {result.subtask_id}  {result.agent}  {result.outcome}  {dumps(value).decode()}"
        )
    if shown.status == "completed":
        click.echo(f"result       {dumps(shown.result).decode()}")
    if shown.error is not None:
        click.echo(f"error        {dumps(shown.error).decode()}")


def _utc(moment: datetime | None) -> str:
    return moment.astimezone(UTC).isoformat() if moment is not None else "?"


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


# ---- projections ---------------------------------------------------------------------------------


def _projection_engine(settings: Any) -> Any:
    from projections.postgres import create_engine

    return create_engine(settings.database_url, pool_size=2)


@main.group(name="projections")
def projections_group() -> None:
    """Asynchronous projections (paused tasks, agent statistics): run, status, rebuild."""


@projections_group.command(name="run")
def run_projections() -> None:
    """Keep every projection up to date until SIGTERM or SIGINT.

    Run it in as many instances as you like: per projection one instance is active (an
    advisory lock) and the others take over within WAYSTATION_PROJECTION_STANDBY_INTERVAL
    seconds when it goes. Migrates the database first.
    """
    settings = _settings()
    _log_as_worker(settings.worker_id)
    _run_service(_run_projections(settings))


async def _run_projections(settings: Any) -> None:
    import migrations
    from events.postgres import horizon_holder
    from projections.postgres import PROJECTIONS, ProjectionRunner, create_engine

    from .metrics import Health, HttpServer, Metrics, projection_gauges

    await migrations.upgrade(settings.database_url)
    # each projection holds a connection while it runs; /healthz and /metrics need their own
    engine = create_engine(settings.database_url, pool_size=len(PROJECTIONS) + 2)
    runner = ProjectionRunner(
        engine,
        batch_size=settings.projection_batch_size,
        poll_interval=settings.projection_poll_interval,
        standby_interval=settings.projection_standby_interval,
    )
    metrics = Metrics()

    async def health() -> Health:
        from sqlalchemy import text

        async with engine.connect() as connection:
            await connection.execute(text("SELECT 1"))
        return Health(True, {"worker_id": settings.worker_id, "database": True})

    server = HttpServer(
        metrics,
        health,
        host=settings.metrics_host,
        port=settings.metrics_port,
        refresh=lambda: projection_gauges(metrics, engine),
        horizon=lambda: horizon_holder(engine),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await server.start()
    log.info("projection runner %s started", settings.worker_id)
    try:
        await runner.run(stop)
    finally:
        await server.stop()
        await engine.dispose()
    log.info("projection runner stopped")


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _print_projection_status(statuses: list[Any]) -> None:
    click.echo(
        f"{'projection':<14} {'position':>10} {'applied':>9} {'behind':>8} {'lag':>7}  runner"
    )
    for s in statuses:
        click.echo(
            f"{s.name:<14} {s.position.global_position:>10} {s.events:>9} {s.behind:>8} "
            f"{_age(s.lag_seconds):>7}  {'active' if s.active else 'none'}"
        )
    if statuses and statuses[0].horizon is not None:  # the same for every projection
        click.echo(f"horizon held by {statuses[0].horizon.describe()}")


@projections_group.command(name="status")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
def projection_status_command(as_json: bool) -> None:
    """Each projection's checkpoint, how many events it is behind and how old the oldest is."""
    statuses = _run(_with_engine(_settings(), "projection_status"))
    if as_json:
        click.echo(dumps([s.to_json() for s in statuses]).decode())
    else:
        _print_projection_status(statuses)


async def _with_engine(settings: Any, function: str, *args: Any, **kwargs: Any) -> Any:
    import projections.postgres

    engine = _projection_engine(settings)
    try:
        return await getattr(projections.postgres, function)(engine, *args, **kwargs)
    finally:
        await engine.dispose()


@projections_group.command(name="rebuild")
@click.argument("name", type=click.Choice(["paused_tasks", "agent_stats"]))
@click.option("--check", is_flag=True, help="Only compare with the live table; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a report.")
def rebuild_projection(name: str, check: bool, as_json: bool) -> None:
    """Rebuild projection NAME from position zero into a shadow table, compare, swap it in.

    The live runner keeps going meanwhile and waits only for the final comparison. Exit codes:
    0 the live table was right (or has been replaced with the rebuilt rows), 1 --check found
    differences.
    """
    from projections.postgres import PROJECTIONS

    report = _run(_with_engine(_settings(), "rebuild", PROJECTIONS[name], check_only=check))
    if as_json:
        click.echo(dumps(report.to_json()).decode())
    else:
        click.echo(
            f"{name}: rebuilt from {report.events} events up to position "
            f"{report.position.global_position} in {report.seconds:.2f}s"
        )
        for d in report.differences:
            click.echo(
                f"  {d.table}: {d.only_live} row(s) only in the live table, {d.only_rebuilt} "
                f"only in the rebuild; keys {', '.join(d.sample_keys)}"
            )
        if report.identical:
            click.echo("  the live table matches the rebuild")
        elif report.swapped:
            click.echo("  the live table now holds the rebuilt rows")
        else:
            click.echo("  --check: the live table was left as it is")
    sys.exit(1 if check and not report.identical else 0)


def _moment(value: Any) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


@main.command()
@click.option("--agent", help="Only tasks of this agent.")
@click.option(
    "--status",
    type=click.Choice(["paused", "resumed"]),
    help="paused: waiting for results; resumed: running again after a pause.",
)
@click.option("--limit", type=int, default=100, show_default=True, help="At most this many.")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
def tasks(agent: str | None, status: str | None, limit: int, as_json: bool) -> None:
    """List paused tasks (the paused-tasks projection), oldest pause first.

    A task appears from its first pause until it completes, fails or is cancelled.
    """
    rows = _run(_with_engine(_settings(), "paused_tasks", agent=agent, status=status, limit=limit))
    if as_json:
        click.echo(dumps(rows).decode())
        return
    if not rows:
        click.echo("no paused tasks")
        return
    click.echo(
        f"{'task':<38} {'agent':<16} {'pause':>5} {'results':>8}  {'paused since (UTC)':<19}  "
        f"{'earliest deadline':<19}  status"
    )
    for row in rows:
        results = f"{row['calls_recorded']}/{row['calls_expected']}"
        click.echo(
            f"{row['task_id']:<38} {row['agent']:<16} {row['pause']:>5} {results:>8}  "
            f"{_moment(row['paused_since']):<19}  {_moment(row['earliest_deadline']):<19}  "
            f"{row['status']}"
        )


@main.command()
@click.option("--json", "as_json", is_flag=True, help="JSON instead of tables.")
def status(as_json: bool) -> None:
    """Per-agent statistics and how far behind the log each projection is.

    Counts come from the log: completed, failed and cancelled tasks (those that paused, or all
    with WAYSTATION_AUDIT_ALL_TASKS), tasks paused now, calls to the agent that timed out, and
    the mean duration of a pause.
    """
    stats, statuses = _run(_status(_settings()))
    if as_json:
        click.echo(
            dumps(
                {
                    "agents": {
                        agent: {
                            "completed": c.completed,
                            "failed": c.failed,
                            "cancelled": c.cancelled,
                            "paused_now": c.paused_now,
                            "timeouts": c.timeouts,
                            "pauses_resumed": c.pauses_resumed,
                            "mean_pause_seconds": c.mean_pause_seconds,
                        }
                        for agent, c in stats.items()
                    },
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
    _print_projection_status(statuses)


async def _status(settings: Any) -> tuple[Any, Any]:
    from projections.postgres import agent_stats, projection_status

    engine = _projection_engine(settings)
    try:
        return await agent_stats(engine), await projection_status(engine)
    finally:
        await engine.dispose()


if __name__ == "__main__":
    main()
