"""Commands that audit the log: verify it, show a task's history or past state, export it.

The checks, the timeline and the export live in ``waystation.projections.audit``,
``waystation.projections.history``, ``waystation.projections.export`` and
``waystation.projections.exported``; here they are read from the database (or a file) and
printed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

from waystation.cli.wiring import load_settings, open_store, run
from waystation.events.codec import dumps

if TYPE_CHECKING:
    from waystation.events.model import RecordedEvent
    from waystation.projections.audit import Problem
    from waystation.projections.export import ExportSummary, Selection
    from waystation.settings import Settings

__all__ = ["export", "history", "state", "verify"]


@click.command()
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

    Checks contiguous versions, the hash chain, at most one claim per wait (peer call, signal or
    timer) and one resume per pause, no resume before its pause's rule is met (every wait has a
    result, or FirstK's k successes or k out of reach) and its abandoned waits exactly those still
    open, no claim of a wait given up, each signal recorded once and taken by one wait of its
    name at most, timers firing ok, no result without its claim, and no event after a terminal
    one (audit-only events aside). With --file the same checks run on an export,
    without the database; a redacted event's content hash cannot be checked (it covers the
    secret), only its links and invariants, and the report counts such events. A stream that the
    file starts past version 1 gets a partial-stream note and is checked from there. Exit codes:
    0 nothing wrong, 1 a problem was found, 2 TASK_ID is not in the log (or the file), or the
    file has a line that is not an exported event.
    """
    if export_file is not None:
        sys.exit(_verify_file(export_file, task_id, as_json))
    from waystation.projections.audit import verify_stream

    if task_id is not None:
        streams = {task_id: _read_task(task_id)}
    else:
        streams = run(_read_streams(load_settings()))
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


def _verify_file(path: Path, task_id: str | None, as_json: bool) -> int:
    from waystation.projections.exported import ExportFormatError, read_export, verify_export

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


def _print_problems(problems: list[Problem]) -> None:
    for problem in problems:
        click.echo(
            f"stream {problem.stream_id} version {problem.stream_version}: "
            f"{problem.kind}: {problem.message}"
        )


@click.command()
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a readable timeline.")
def history(task_id: str, as_json: bool) -> None:
    """Show TASK_ID's history: who did what, when, and how long each pause lasted.

    Each pause says what it waits for (peer calls, signals, timers, the first K of them) and the
    agent version that paused; each signal its sender and the wait that took it, or that it was
    kept for a later one, or refused and why; a resume the waits it gave up.

    Exit codes: 0 shown, 2 TASK_ID is not in the log.
    """
    from waystation.projections.history import pauses, timeline

    events = _read_task(task_id)
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
        version = f", agent version {span.agent_version}" if span.agent_version else ""
        click.echo(f"pause #{span.pause}: v{span.paused_version} → {resumed}, {lasted}{version}")


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


@click.command()
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
    from waystation.projections.export import DEFAULT_REDACT_KEYS, Selection

    if no_redact and redact_keys:
        raise click.UsageError("--no-redact and --redact-key contradict each other")
    keys = frozenset() if no_redact else DEFAULT_REDACT_KEYS | set(redact_keys)
    selection = Selection(since, until, after_position, to_position)
    settings = load_settings()
    if output is None:
        summary = run(_export(settings, sys.stdout.buffer.write, tasks, selection, keys))
        sys.stdout.buffer.flush()
    else:
        partial = output.with_name(output.name + ".partial")
        try:
            with partial.open("wb") as file:
                summary = run(_export(settings, file.write, tasks, selection, keys))
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
    settings: Settings,
    write: Callable[[bytes], object],
    tasks: tuple[str, ...],
    selection: Selection,
    redact_keys: frozenset[str],
) -> ExportSummary:
    from waystation.projections.export import export_log

    store = open_store(settings)
    try:
        return await export_log(
            store, write, tasks=tasks, selection=selection, redact_keys=redact_keys
        )
    finally:
        await store.close()


@click.command()
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

    Folds the task's events up to that point: status, agent, pause (with the agent version that
    paused and its FirstK, if any), the agent's state, the waits still outstanding by kind
    (peer calls, signals, timers) with their deadlines, the results recorded (a signal's with
    its sender), the waits a FirstK resume gave up, the signals kept for a later wait, its
    result or error, and the last event included.
    A time is compared with recorded_at, the start of the transaction that wrote each event.
    Exit codes: 0 shown, 2 TASK_ID is not in the log or has no event at or before that point.
    """
    from waystation.projections.history import state_as_of
    from waystation.projections.waits import state_lines

    if at_position is not None and at_time is not None:
        raise click.UsageError("give --at-position or --at, not both")
    events = _read_task(task_id)
    past = state_as_of(task_id, events, position=at_position, at=at_time)
    point = (
        f"position {at_position}"
        if at_position is not None
        else _utc(at_time)
        if at_time is not None
        else "now"
    )
    if past.last_event is None:
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
    click.echo(
        f"task {task_id} as of {point}: {shown.version} of {len(events)} events, the last "
        f"v{last.stream_version} {last.event_type} at position {last.global_position}, "
        f"recorded {_utc(last.recorded_at)}"
    )
    click.echo(f"status       {shown.status}")
    click.echo(f"agent        {shown.agent or '-'}")
    click.echo(f"pause        #{shown.pause}" if shown.pause else "pause        none yet")
    click.echo(f"state        {dumps(dict(shown.state)).decode()}")
    for line in state_lines(shown):
        click.echo(line)
    if shown.status == "completed":
        click.echo(f"result       {dumps(shown.result).decode()}")
    if shown.error is not None:
        click.echo(f"error        {dumps(shown.error).decode()}")


def _utc(moment: datetime | None) -> str:
    return moment.astimezone(UTC).isoformat() if moment is not None else "?"


def _read_task(task_id: str) -> list[RecordedEvent]:
    """TASK_ID's events; a task that is not in the log ends the command with exit code 2."""
    events = run(_read_streams(load_settings(), task_id))[task_id]
    if not events:
        click.echo(f"task {task_id!r} is not in the event log", err=True)
        sys.exit(2)
    return events


async def _read_streams(
    settings: Settings, task_id: str | None = None
) -> dict[str, list[RecordedEvent]]:
    from waystation.projections.audit import read_streams

    store = open_store(settings)
    try:
        return await read_streams(store, task_id)
    finally:
        await store.close()
