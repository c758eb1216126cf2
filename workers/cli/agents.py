"""``waystation agents``: each agent of an app with its policies."""

from __future__ import annotations

import click

from waystation.cli.wiring import load_app, load_settings
from waystation.events.codec import dumps

__all__ = ["agents"]


@click.command("agents")
@click.option(
    "--app",
    "app_path",
    envvar="WAYSTATION_APP",
    help="The app whose agents to list, as module:attribute; required (env WAYSTATION_APP).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
def agents(app_path: str | None, as_json: bool) -> None:
    """List the agents of the app with their policies: retries (after the first run; the
    default is WAYSTATION_DELIVERY_LIMIT - 1), the backoff between them (spent waiting in the
    broker), the time limit of one run, the most runs at once and starts per period across the
    pool (concurrency, rate; none by default), the default deadline of their calls, and which
    results the log keeps (all: keep_results=True or WAYSTATION_AUDIT_ALL_TASKS; else those of
    tasks that paused or failed); the signals whose payloads it checks (signals=) and the
    version of its code (recorded on each pause). A policy that cannot work fails here, as it
    does when a worker starts."""
    from waystation.agent import App

    app = load_app(app_path)  # a policy that cannot work: a usage error naming it
    if not isinstance(app, App):
        raise click.BadParameter(f"{app_path!r} is not a waystation App", param_hint="--app")
    settings = load_settings()
    rows = [spec.policy(settings.delivery_limit) for spec in app.agents.values()]
    if as_json:
        click.echo(dumps({"agents": rows}).decode())
        return
    header = (
        "agent",
        "retries",
        "backoff (initial×factor≤max ±jitter)",
        "time limit",
        "concurrency",
        "rate",
        "calls",
        "results",
        "signals",
        "version",
    )
    table = [header] + [
        (
            row["agent"],
            str(row["retries"]),
            "{initial:g}s×{factor:g}≤{maximum:g}s ±{jitter:.0%}".format(**row["backoff"]),
            f"{row['time_limit']:g}s" if row["time_limit"] is not None else "none",
            str(row["concurrency"]) if row["concurrency"] is not None else "none",
            str(app.agents[row["agent"]].rate or "none"),
            f"{row['default_call_timeout']:g}s"
            if row["default_call_timeout"] is not None
            else f"{settings.default_call_timeout:g}s (default)",
            "all" if row["keep_results"] or settings.audit_all_tasks else "if paused",
            ", ".join(row["signals"]) or "-",
            row["version"] or "-",
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        cells = (cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        click.echo("  ".join(cells).rstrip())
