"""The README and docs/ match the code: every setting, metric and command is documented, every
link stays in the repository, and the README stays a ten-minute read in its order."""

from __future__ import annotations

import re
from pathlib import Path

import click
from pydantic_core import PydanticUndefined

from waystation.cli import main
from waystation.observability.metrics import Metrics
from waystation.settings import Settings

from ..documents import DOCS, README, ROOT, anchors, code_blocks, documents, links, table_after

CONFIGURATION = DOCS / "configuration.md"
OBSERVABILITY = DOCS / "observability.md"


def _variables(rows: dict[str, list[str]]) -> dict[str, str]:
    """``WAYSTATION_X`` -> its default cell; a row may name several variables."""
    found: dict[str, str] = {}
    for first, rest in rows.items():
        names = re.findall(r"WAYSTATION_[A-Z_]+", first)
        defaults = [d.strip().strip("`") for d in rest[0].split(",")] if rest else []
        for index, name in enumerate(names):
            found[name] = defaults[index] if index < len(defaults) else defaults[-1]
    return found


def _every_param(command: click.Command) -> list[click.Parameter]:
    """The options of ``command`` and of every command under it (``--app``'s WAYSTATION_APP)."""
    found = list(command.params)
    for sub in getattr(command, "commands", {}).values():
        found += _every_param(sub)
    return found


def test_the_configuration_table_lists_every_setting_with_its_default() -> None:
    documented = _variables(table_after(CONFIGURATION.read_text(), "# Configuration"))
    for name, field in Settings.model_fields.items():
        variable = f"WAYSTATION_{name.upper()}"
        assert variable in documented, f"{variable} is missing from {CONFIGURATION.name}"
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
    cli = {p.envvar for p in _every_param(main) if isinstance(p.envvar, str)}
    for variable in cli:
        assert variable in documented, f"{variable} (read by the CLI) is missing"
    unknown = set(documented) - cli - {f"WAYSTATION_{n.upper()}" for n in Settings.model_fields}
    assert not unknown, f"documented but read by nothing: {unknown}"


def test_the_metrics_table_lists_every_metric_the_worker_exports() -> None:
    rows = table_after(OBSERVABILITY.read_text(), "## Metrics and health")
    documented = {name.strip("`") for name in rows}
    exported = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in Metrics().registry.collect()
    }
    assert exported == documented - {"metric", "---"}


def _commands(group: click.Group, prefix: str) -> list[str]:
    """``waystation X Y`` for every command of the CLI, subcommands included."""
    context = click.Context(group)
    found = []
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        assert command is not None
        if isinstance(command, click.Group):
            found += _commands(command, f"{prefix} {name}")
        else:
            found.append(f"{prefix} {name}")
    return found


def _everything() -> str:
    """Every document's text, with runs of whitespace as one space."""
    return " ".join(" ".join(path.read_text() for path in documents()).split())


def test_every_command_is_documented() -> None:
    text = _everything()
    for command in _commands(main, "waystation"):
        assert command in text, f"`{command}` is documented nowhere"
    scripts = ROOT / "scripts"
    for script in scripts.iterdir():
        if script.is_file() and script.suffix == "" and not script.name.startswith("_"):
            assert f"scripts/{script.name}" in text, f"scripts/{script.name} is documented nowhere"


def test_no_link_leaves_the_repository() -> None:
    for path in documents():
        text = path.read_text()
        assert "../shared" not in text and "DESIGN.md" not in text, path.name
        for target in links(text):
            where = f"{path.relative_to(ROOT)}: {target}"
            assert "://" not in target and not target.startswith("mailto:"), where
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            assert resolved.is_relative_to(ROOT), where
            assert resolved.exists(), f"{where} does not exist"
            if anchor and resolved.suffix == ".md":
                assert anchor in anchors(resolved.read_text()), f"{where}: no such heading"


def test_every_page_of_the_docs_is_linked_from_the_readme() -> None:
    targets = links(README.read_text())
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in targets}
    for page in DOCS.glob("*.md"):
        assert page.resolve() in linked, f"{page.name} is not linked from the README"


def test_the_readme_is_a_ten_minute_read_in_its_order() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    sections = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    assert sections == [
        "The two commands",
        "Writing an agent",
        "Submitting from Python",
        "Submitting from another language",
        "Deploying with compose",
        "Guarantees",
        "Documentation",
    ]
    guarantees = table_after(text, "## Guarantees")
    assert [g for g in guarantees if g.startswith("G")] == [f"G{n}" for n in range(1, 11)]


def test_ci_runs_the_readmes_test_command() -> None:
    (commands, *_) = (b for b in code_blocks(README.read_text()) if b.language == "sh")
    assert [line.split()[0] for line in commands.code.splitlines()] == [
        "scripts/demo",
        "scripts/test",
    ]
    assert re.search(r"^scripts/test\b", (ROOT / ".ci" / "run").read_text(), re.MULTILINE)


def test_the_documents_helpers_find_what_they_look_for(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A title\n\nSee [b](other.md#x) and <https://example.org>.\n\n"
        "```sh\n[not](a-link.md)\n```\n"
    )
    assert links(page.read_text()) == ["other.md#x", "https://example.org"]
    assert anchors(page.read_text()) == {"a-title"}
