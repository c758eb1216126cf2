"""Reading the README and docs/ as the tests check them: tables, code blocks and links."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def documents() -> list[Path]:
    """The README and every page of docs/."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def table_after(text: str, heading: str) -> dict[str, list[str]]:
    """The first table after ``heading``: first cell (without backticks) -> the other cells."""
    section = text[text.index(heading) :]
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


@dataclass(frozen=True)
class CodeBlock:
    language: str
    code: str


def code_blocks(text: str) -> list[CodeBlock]:
    """The fenced code blocks of a Markdown text, in order."""
    return [
        CodeBlock(language, code)
        for language, code in re.findall(r"^```(\w*)\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    ]


def block_after(text: str, first_line: str) -> tuple[CodeBlock, CodeBlock]:
    """The code block whose first line is ``first_line``, and the block that follows it (its
    output)."""
    blocks = code_blocks(text)
    for index, block in enumerate(blocks):
        if block.code.splitlines()[0] == first_line:
            return block, blocks[index + 1]
    raise AssertionError(f"no code block starts with {first_line!r}")


def links(text: str) -> list[str]:
    """Every link target of a Markdown text, outside code: ``[text](target)``, ``![alt](target)``
    and ``<scheme://...>`` autolinks."""
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.MULTILINE | re.DOTALL)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return re.findall(r"\]\(([^)\s]+)\)", prose) + re.findall(r"<(\w+://[^>]+)>", prose)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown text's headings."""
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.MULTILINE | re.DOTALL)
    found = set()
    for heading in re.findall(r"^#+ (.+)$", prose, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found
