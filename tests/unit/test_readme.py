"""The README's configuration and metrics references match the code."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic_core import PydanticUndefined

from workers.cli import main
from workers.metrics import Metrics
from workers.settings import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _table_after(heading: str) -> dict[str, list[str]]:
    """The first table after ``heading``: first cell (without backticks) -> the other cells."""
    section = README[README.index(heading) :]
    rows: dict[str, list[str]] = {}
    started = False
    for line in section.splitlines():
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
        elif started:
            break
    return rows


def _variables(rows: dict[str, list[str]]) -> dict[str, str]:
    """``WAYSTATION_X`` -> its default cell; a row may name several variables."""
    found: dict[str, str] = {}
    for first, rest in rows.items():
        names = re.findall(r"WAYSTATION_[A-Z_]+", first)
        defaults = [d.strip().strip("`") for d in rest[0].split(",")] if rest else []
        for index, name in enumerate(names):
            found[name] = defaults[index] if index < len(defaults) else defaults[-1]
    return found


def test_the_configuration_table_lists_every_setting_with_its_default() -> None:
    documented = _variables(_table_after("## Configuration"))
    for name, field in Settings.model_fields.items():
        variable = f"WAYSTATION_{name.upper()}"
        assert variable in documented, f"{variable} is missing from the README"
        if field.default is PydanticUndefined or field.default is None:
            continue  # computed (worker id) or unset
        default = field.default
        shown = documented[variable]
        if isinstance(default, bool):
            assert shown == str(default).lower(), variable
        elif isinstance(default, float):
            assert float(shown) == default, variable
        else:
            assert shown == str(default), variable
    cli = {p.envvar for p in main.params if isinstance(p.envvar, str)}
    for variable in cli:
        assert variable in documented, f"{variable} (read by the CLI) is missing"
    unknown = set(documented) - cli - {f"WAYSTATION_{n.upper()}" for n in Settings.model_fields}
    assert not unknown, f"documented but read by nothing: {unknown}"


def test_the_metrics_table_lists_every_metric_the_worker_exports() -> None:
    documented = {name.strip("`") for name in _table_after("### Metrics and health")}
    exported = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in Metrics().registry.collect()
    }
    assert exported == documented - {"metric", "---"}
