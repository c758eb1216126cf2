"""The ``waystation`` command: parses options, builds the settings, wires the parts, runs.

This is the composition root: the only place that reads the environment (through ``Settings``)
and picks concrete backends. The work itself lives in the library. The commands are grouped by
area, one module each:

* :mod:`.serve`: the long-running processes, ``worker`` and ``projections run``;
* :mod:`.agents`: ``agents``, each agent of an app with its policies;
* :mod:`.tasks`: ``submit``, ``cancel``, ``tasks`` and ``status``;
* :mod:`.deadletters`: ``dead-letters list`` and ``dead-letters replay``;
* :mod:`.audit`: ``verify``, ``history``, ``export`` and ``state``;
* :mod:`.admin`: ``db upgrade`` and the one-shot ``projections`` commands;
* :mod:`.schema`: ``schema``, the JSON Schema of an agent's input and result;
* :mod:`.results`: ``result``;
* :mod:`.console`: ``console``, the web console;

and :mod:`.wiring` builds what they share: the settings, the event loop, the backends.
"""

from __future__ import annotations

import inspect

import click

from waystation.cli import (
    admin,
    agents,
    audit,
    console,
    deadletters,
    results,
    schema,
    serve,
    signals,
    tasks,
)
from waystation.cli.exits import EXIT_CODES

__all__ = ["main"]


@click.group()
@click.version_option(package_name="waystation", message="waystation %(version)s")
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

    Settings come from WAYSTATION_* environment variables (see docs/configuration.md);
    one that is no setting is an error. Logs go to stderr; results, tables and --json output
    to stdout. A failure you can cause ends in one line that names the setting to check (its
    traceback at --log-level debug).
    """
    import sys

    from waystation.observability.logs import configure_logging, redacting_excepthook

    configure_logging(log_level, log_format)  # type: ignore[arg-type]
    sys.excepthook = redacting_excepthook  # a bug's traceback shows no password either
    context = click.get_current_context()
    # the long-running commands log again with their worker id, in the same level and format
    context.obj = {"log_level": log_level, "log_format": log_format}


main.help = (
    inspect.cleandoc(main.help or "")
    + "\n\n\b\nExit codes:\n"
    + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items())
)

main.add_command(serve.worker)
main.add_command(agents.agents)
main.add_command(tasks.submit)
main.add_command(tasks.cancel)
main.add_command(signals.signal)
main.add_command(deadletters.dead_letters)
main.add_command(tasks.list_paused_tasks)
main.add_command(tasks.status)
main.add_command(results.result)
main.add_command(audit.verify)
main.add_command(audit.history)
main.add_command(audit.export)
main.add_command(audit.state)
main.add_command(admin.db)
main.add_command(admin.projections_group)
main.add_command(schema.schema)
main.add_command(console.console)
# a long-running process like `worker`, so it lives in serve; the group it belongs to is admin's
admin.projections_group.add_command(serve.run_projections)
