"""compose/ cannot run here (no Docker engine): check it against the spec and against the code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import yaml

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
    known = {f"WAYSTATION_{name.upper()}" for name in Settings.model_fields}
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
