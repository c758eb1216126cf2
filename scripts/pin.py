"""The versions the worker image installs: Waystation's runtime dependencies (no extras) and
theirs, as installed beside this Python, written to compose/constraints.txt by ``scripts/pin``.
``tests/unit/test_compose.py`` checks that the file pins every one of them."""

from __future__ import annotations

import sys
from importlib.metadata import distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

CONSTRAINTS = Path(__file__).resolve().parents[1] / "compose" / "constraints.txt"
BUILD_SETUPTOOLS = "84.2.1"
"""The setuptools that builds Waystation in the image (pyproject's build-system)."""


def runtime_versions(package: str = "waystation") -> dict[str, str]:
    """Every distribution ``package`` needs at run time, by canonical name -> installed version:
    its requirements and theirs, with the extras each requirement asks for, for this platform."""
    versions: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [(package, frozenset())]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        for text in distribution(name).requires or []:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is not None and not any(
                marker.evaluate({"extra": extra}) for extra in {"", *extras}
            ):
                continue  # an extra nobody asked for, or another platform's
            needed = canonicalize_name(requirement.name)
            versions[needed] = distribution(needed).version
            wanted = (needed, frozenset(requirement.extras))
            if wanted not in seen:
                seen.add(wanted)
                todo.append(wanted)
    return versions


def pinned(text: str) -> dict[str, str]:
    """The ``name==version`` lines of a constraints file, by canonical name."""
    found = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            found[canonicalize_name(name)] = version.strip()
    return found


def main() -> None:
    lines = [
        "# The versions the image installs (compose/Dockerfile), from scripts/pin; do not edit.",
        f"setuptools=={BUILD_SETUPTOOLS}  # builds waystation itself",
        *(f"{name}=={version}" for name, version in sorted(runtime_versions().items())),
    ]
    CONSTRAINTS.write_text("\n".join(lines) + "\n")
    print(f"pin: wrote {CONSTRAINTS} ({len(lines) - 1} packages)", file=sys.stderr)


if __name__ == "__main__":
    main()
