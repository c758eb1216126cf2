"""Operating commands: the database schema, and the projections' status and rebuild.

``projections run``, the long-running runner, is in ``serve`` beside ``worker``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING

import click

from waystation import migrations
from waystation.cli.wiring import load_settings, run, with_projection_engine
from waystation.events.codec import dumps

if TYPE_CHECKING:
    from waystation.projections.postgres import ProjectionStatus

__all__ = ["db", "print_projection_status", "projections_group"]


@click.group()
def db() -> None:
    """Database schema commands."""


@db.command()
def upgrade() -> None:
    """Create the database if missing and migrate it to the newest schema."""

    settings = load_settings()
    asyncio.run(migrations.upgrade(settings.database_url))
    click.echo("database is at the newest schema")


@click.group(name="projections")
def projections_group() -> None:
    """Asynchronous projections (paused tasks, agent statistics, agent activity by the minute):
    run, status, rebuild."""


@projections_group.command(name="status")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
def projection_status_command(as_json: bool) -> None:
    """Each projection's checkpoint, how many events it is behind and how old the oldest is."""
    from waystation.projections.postgres import projection_status

    statuses = run(with_projection_engine(load_settings(), projection_status))
    if as_json:
        click.echo(dumps([s.to_json() for s in statuses]).decode())
    else:
        print_projection_status(statuses)


def print_projection_status(statuses: list[ProjectionStatus]) -> None:
    """The projections as a table (also the second table of ``waystation status``)."""
    click.echo(
        f"{'projection':<14} {'position':>10} {'applied':>9} {'behind':>8} {'lag':>7}  runner"
    )
    for s in statuses:
        click.echo(
            f"{s.name:<14} {s.position.global_position:>10} {s.events:>9} {s.behind:>8} "
            f"{readable_age(s.lag_seconds):>7}  {'active' if s.active else 'none'}"
        )
    if statuses and statuses[0].horizon is not None:  # the same for every projection
        click.echo(f"horizon held by {statuses[0].horizon.describe()}")


def readable_age(seconds: float) -> str:
    """``seconds`` as a short age: ``4.2s``, ``3.1m``, ``2.0h``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


@projections_group.command(name="rebuild")
@click.argument("name", type=click.Choice(["paused_tasks", "agent_stats", "agent_minutes"]))
@click.option("--check", is_flag=True, help="Only compare with the live table; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a report.")
def rebuild_projection(name: str, check: bool, as_json: bool) -> None:
    """Rebuild projection NAME from position zero into a shadow table, compare, swap it in.

    The live runner keeps going meanwhile and waits only for the final comparison. Exit codes:
    0 the live table was right (or has been replaced with the rebuilt rows), 1 --check found
    differences.
    """
    from waystation.projections.postgres import PROJECTIONS, rebuild

    report = run(
        with_projection_engine(load_settings(), rebuild, PROJECTIONS[name], check_only=check)
    )
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
