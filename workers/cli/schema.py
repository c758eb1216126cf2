"""``waystation schema AGENT``: the JSON Schema of an agent's input and result, for publishers
that are not written in Python (or not with this app's models)."""

from __future__ import annotations

import sys
from typing import Any

import click

from waystation.cli.wiring import load_app

__all__ = ["schema"]


@click.command()
@click.argument("agent")
@click.option(
    "--app",
    "app_path",
    envvar="WAYSTATION_APP",
    help="The app the agent belongs to, as module:attribute (imported from the current "
    "directory first); required (env WAYSTATION_APP).",
)
def schema(agent: str, app_path: str | None) -> None:
    """Print the JSON Schema of AGENT's input and of its result, as one JSON object:
    {"agent": ..., "input": schema, "result": schema}.

    The input schema is what a task's body must satisfy (an invalid one is dead-lettered as
    invalid-input); the result schema is what the "result" of an ok answer holds. A side the
    agent declares no model for is null: any JSON. Exit codes: 0 printed, 2 no such agent.
    """
    from waystation.agent import App
    from waystation.events.codec import dumps

    app = load_app(app_path)
    if not isinstance(app, App):
        raise click.BadParameter(
            f"{app_path!r} is a {type(app).__name__}, not a waystation App", param_hint="--app"
        )
    spec = app.agents.get(agent)
    if spec is None:
        known = ", ".join(sorted(app.agents)) or "none"
        click.echo(f"no agent {agent!r} in {app_path} (its agents: {known})", err=True)
        sys.exit(2)
    document: dict[str, Any] = {
        "agent": spec.name,
        "input": spec.input_model.model_json_schema(mode="validation")
        if spec.input_model is not None
        else None,
        "result": spec.result_model.model_json_schema(mode="serialization")
        if spec.result_model is not None
        else None,
    }
    click.echo(dumps(document).decode())
