"""compose/ cannot run here (no Docker engine): check it against the spec and against the code."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import click
import jsonschema
import yaml

from workers.cli import main
from workers.settings import Settings
from workers.topology import policy_definition
from workers.wire import Names

COMPOSE = Path(__file__).resolve().parents[2] / "compose"


def _compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((COMPOSE / "compose.yaml").read_text())


def test_the_compose_file_follows_the_compose_specification() -> None:
    schema = json.loads((COMPOSE / "spec" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(_compose())]
    assert errors == []


def test_the_schema_check_rejects_a_broken_file() -> None:
    schema = json.loads((COMPOSE / "spec" / "compose-spec.json").read_text())
    broken = _compose()
    broken["services"]["worker"]["depends_on"]["migrate"]["condition"] = "whenever"
    assert list(jsonschema.Draft7Validator(schema).iter_errors(broken))


def test_compose_sets_only_settings_that_exist() -> None:
    known = {f"WAYSTATION_{name.upper()}" for name in Settings.model_fields} | _cli_variables()
    for name, service in _compose()["services"].items():
        for variable in service.get("environment", {}):
            if variable.startswith("WAYSTATION_"):
                assert variable in known, f"{name} sets unknown {variable}"


def test_the_broker_definitions_hold_the_policy_the_workers_would_apply() -> None:
    definitions = json.loads((COMPOSE / "rabbitmq" / "definitions.json").read_text())
    prefix = _compose()["x-waystation-env"]["WAYSTATION_QUEUE_PREFIX"]
    pattern, definition = policy_definition(
        Names(prefix), Settings.model_fields["delivery_limit"].default
    )
    (policy,) = definitions["policies"]
    assert policy["name"] == Names(prefix).policy_name
    assert policy["pattern"] == pattern
    assert policy["definition"] == definition
    assert re.match(pattern, f"{prefix}orchestrator") and not re.match(
        pattern, Names(prefix).dead_letter_queue
    )


def test_the_dockerfile_copies_every_package_it_installs() -> None:
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    root = COMPOSE.parent
    for source in re.findall(r"^COPY (\S+)", dockerfile, flags=re.MULTILINE):
        assert (root / source).exists(), source
    for package in ("events", "workers", "projections", "migrations"):
        assert f"COPY {package} " in dockerfile


def test_the_image_installs_every_package_of_the_source_tree() -> None:
    """``pip install .`` installs only the packages pyproject lists, subpackages included."""
    root = COMPOSE.parent
    listed = set(
        tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(root).parts)
        for top in ("events", "workers", "projections", "migrations")
        for init in (root / top).rglob("__init__.py")
    }
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"


def _cli_variables() -> set[str]:
    """The variables the CLI itself reads (its group's options, e.g. the log format)."""
    return {p.envvar for p in main.params if isinstance(p.envvar, str)}


def test_every_long_running_service_is_health_checked_on_the_port_it_serves() -> None:
    compose = _compose()
    port = compose["x-waystation-env"]["WAYSTATION_METRICS_PORT"]
    assert int(port) != 0, "the endpoint must be on for the health check to reach it"
    for name in ("worker", "projections"):
        service = compose["services"][name]
        check = " ".join(service["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/healthz" in check, name
        assert service["expose"] == [port], name
    assert f"EXPOSE {port}" in (COMPOSE / "Dockerfile").read_text()
    for name in ("postgres", "rabbitmq"):
        assert compose["services"][name]["healthcheck"]["test"], name


def test_the_health_check_command_is_valid_python() -> None:
    test = _compose()["x-waystation-healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    compile(test[3], "healthcheck", "exec")


def test_every_compose_command_is_a_command_of_the_cli() -> None:
    for name, service in _compose()["services"].items():
        if "command" not in service or service.get("image") != "waystation:latest":
            continue
        context = main.make_context("waystation", [], resilient_parsing=True)
        command: click.Command = main
        words = list(service["command"])
        while isinstance(command, click.Group) and words:
            found = command.get_command(context, words.pop(0))
            assert found is not None, f"{name}: {service['command']}"
            command = found
        # what is left must parse as that command's options
        command.make_context(command.name or "", words)


def _rabbitmq_conf() -> dict[str, str]:
    lines = (COMPOSE / "rabbitmq" / "rabbitmq.conf").read_text().splitlines()
    pairs = (line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def test_the_broker_refuses_messages_larger_than_a_worker_accepts() -> None:
    """A worker reads a whole body into memory before it can check its size: the broker's cap
    is what bounds that memory (README, "Configuration"). It is the workers' body limit plus
    their header limit, room for the properties, so nothing a worker accepts is refused."""
    environment = _compose()["x-waystation-env"]
    body, headers = (
        int(environment.get(f"WAYSTATION_{name.upper()}", Settings.model_fields[name].default))
        for name in ("max_message_bytes", "max_header_bytes")
    )
    assert int(_rabbitmq_conf()["max_message_size"]) == body + headers
