"""compose/ cannot run here (no Docker engine): check it against the spec and against the code."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import click
import jsonschema
import yaml
from yarl import URL

from waystation.brokers.amqp.topology import management_url_of
from waystation.cli import main
from waystation.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
sys.path.insert(0, str(ROOT / "scripts"))  # scripts/pin.py: what the image must pin


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


def test_the_queue_policy_follows_the_workers_prefix_and_delivery_limit() -> None:
    """No policy is written into the broker's definitions: each worker sets its own through the
    management API, from WAYSTATION_QUEUE_PREFIX and WAYSTATION_DELIVERY_LIMIT."""
    compose = _compose()
    definitions = json.loads((COMPOSE / "rabbitmq" / "definitions.json").read_text())
    assert "policies" not in definitions
    environment = compose["x-waystation-env"]
    assert environment["WAYSTATION_BROKER_POLICY"] == "management"
    assert "WAYSTATION_DELIVERY_LIMIT" in environment
    api = URL(management_url_of(environment["WAYSTATION_AMQP_URL"]))
    assert api.host in compose["services"], "the management API is the broker service's"
    assert compose["services"]["rabbitmq"]["image"].endswith("-management")
    assert compose["services"]["worker"]["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
    (user,) = (u for u in definitions["users"] if u["name"] == api.user)
    assert {"administrator", "policymaker"} & set(user["tags"]), "the user may set policies"


def test_the_broker_keeps_its_node_name_when_recreated() -> None:
    """RabbitMQ names its node (and its data directory) after the host name."""
    assert _compose()["services"]["rabbitmq"]["hostname"] == "rabbitmq"


def _postgres_setting(name: str) -> int:
    command = _compose()["services"]["postgres"]["command"]
    (value,) = (word.split("=", 1)[1] for word in command if word.startswith(f"{name}="))
    return int(value)


def test_the_connection_budget_adds_up_at_the_documented_scale() -> None:
    """Workers × their pool, the projection runners' connections and the one-off ones stay below
    PostgreSQL's max_connections (less the 3 reserved for superusers) at the largest scale the
    docs give."""
    from waystation.projections.postgres import PROJECTIONS

    compose = _compose()
    budget = compose["x-waystation-budget"]
    pool = int(compose["x-waystation-env"]["WAYSTATION_DB_POOL_SIZE"])
    runners = compose["services"]["projections"]["deploy"]["replicas"]
    used = (
        budget["max_workers"] * pool
        + runners * (len(PROJECTIONS) + 2)  # workers/cli/serve.py: one per projection, two more
        + budget["one_off_connections"]
    )
    assert used <= _postgres_setting("max_connections") - 3
    assert compose["services"]["worker"]["deploy"]["replicas"] <= budget["max_workers"]
    documented = " ".join(
        ((ROOT / "README.md").read_text() + (ROOT / "docs" / "deployment.md").read_text()).split()
    )
    assert f"up to {budget['max_workers']}" in documented
    assert f"`max_connections` ({_postgres_setting('max_connections')})" in documented


def test_every_worker_up_to_the_documented_scale_has_a_reply_shard_of_its_own() -> None:
    compose = _compose()
    shards = int(compose["x-waystation-env"]["WAYSTATION_REPLY_SHARDS"])
    assert shards >= compose["x-waystation-budget"]["max_workers"]


def test_the_build_context_leaves_out_local_state() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (\S+)", dockerfile, flags=re.MULTILINE):
        assert source.split("/")[0] not in ignored, f"{source} is left out of the context"


def test_the_image_installs_pinned_versions_of_every_dependency() -> None:
    from pin import pinned, runtime_versions

    constraints = pinned((COMPOSE / "constraints.txt").read_text())
    missing = set(runtime_versions()) - set(constraints)
    assert not missing, f"not pinned (run scripts/pin): {sorted(missing)}"
    assert "setuptools" in constraints, "the build backend, pyproject's build-system"
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    assert "COPY compose/constraints.txt ./" in dockerfile
    assert "PIP_CONSTRAINT=/app/constraints.txt pip install" in dockerfile
    assert re.search(r"^FROM python:\d+\.\d+\.\d+-slim-\w+$", dockerfile, re.MULTILINE)


def _prometheus(name: str) -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((COMPOSE / "prometheus" / name).read_text())


def test_prometheus_scrapes_every_worker_and_projection_runner() -> None:
    compose = _compose()
    port = int(compose["x-waystation-env"]["WAYSTATION_METRICS_PORT"])
    scraped = {
        name
        for job in _prometheus("prometheus.yml")["scrape_configs"]
        for sd in job["dns_sd_configs"]
        if sd["type"] == "A" and sd["port"] == port
        for name in sd["names"]
    }
    assert scraped == {"worker", "projections"}
    mounted = compose["services"]["prometheus"]["volumes"]
    for rules in _prometheus("prometheus.yml")["rule_files"]:
        assert any(volume.endswith(f":{rules}:ro") for volume in mounted), rules


def test_the_alert_rules_watch_what_the_workers_export() -> None:
    from waystation.observability.metrics import Metrics

    exported = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in Metrics().registry.collect()
    }
    rules = [rule for group in _prometheus("alerts.yml")["groups"] for rule in group["rules"]]
    watched: set[str] = set()
    for rule in rules:
        names = set(re.findall(r"\b(waystation_[a-z_]+|up)\b", rule["expr"]))
        assert names - {"up"} <= exported, rule["alert"]
        watched |= names
    assert {
        "waystation_projection_lag_seconds",
        "waystation_outbox_backlog",
        "waystation_dead_letters_total",
        "waystation_healthy",
    } <= watched
    # a publisher that did not wait for its result is normal use: nothing alerts on it
    assert "waystation_results_undelivered_total" in exported
    assert "waystation_results_undelivered_total" not in watched


def test_every_file_compose_mounts_or_builds_from_exists() -> None:
    for name, service in _compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (COMPOSE / source).exists(), f"{name}: {source}"
        if "build" in service:
            context = COMPOSE / service["build"]["context"]
            assert (context / service["build"]["dockerfile"]).exists(), name


def test_the_dockerfile_copies_every_package_it_installs() -> None:
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    root = COMPOSE.parent
    for source in re.findall(r"^COPY (\S+)", dockerfile, flags=re.MULTILINE):
        assert (root / source).exists(), source
    for package in ("events", "workers", "projections", "migrations"):
        assert f"COPY {package} " in dockerfile


def test_the_image_installs_every_package_of_the_source_tree() -> None:
    """``pip install .`` installs only the packages pyproject lists, subpackages included: every
    package folder of the source tree, under the installed name ``package-dir`` gives it."""
    root = COMPOSE.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {folder: name for name, folder in setuptools["package-dir"].items()}
    assert set(folders) == {"events", "workers", "projections", "migrations"}
    found = {
        ".".join((folders[top], *init.parent.relative_to(root / top).parts))
        for top in folders
        for init in (root / top).rglob("__init__.py")
    }
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"
    assert listed - found == set(), "packages listed that the source tree does not have"


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
    is what bounds that memory (docs/configuration.md). It is the workers' body limit plus
    their header limit, room for the properties, so nothing a worker accepts is refused."""
    environment = _compose()["x-waystation-env"]
    body, headers = (
        int(environment.get(f"WAYSTATION_{name.upper()}", Settings.model_fields[name].default))
        for name in ("max_message_bytes", "max_header_bytes")
    )
    assert int(_rabbitmq_conf()["max_message_size"]) == body + headers
