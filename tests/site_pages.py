"""The documentation's pages as the tests read them: README.md, and the user
guide's pages in the order mkdocs.yml's nav lists them (the order a reader
follows, and the order their examples run in)."""

from __future__ import annotations

from pathlib import Path

import yaml
from commands import PROJECT

__all__ = ["DOCS", "README", "guide_pages", "guide_section"]

README = PROJECT / "README.md"
DOCS = PROJECT / "docs"


def _nav_files(entries: object) -> list[str]:
    """The files of a nav (sub)tree, in order."""
    out: list[str] = []
    items = entries if isinstance(entries, list) else [entries]
    for item in items:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                out += _nav_files(value)
    return out


def guide_pages() -> list[Path]:
    """The user guide's pages, in nav order."""
    config = yaml.safe_load((PROJECT / "mkdocs.yml").read_text())
    [guide] = [entry["User guide"] for entry in config["nav"] if isinstance(entry, dict) and "User guide" in entry]
    return [DOCS / name for name in _nav_files(guide)]


def guide_section(page: str, heading: str) -> str:
    """The text under `heading` (a ``#`` line's title) of guide page `page`, up to
    the next heading of the same level or above."""
    lines = (DOCS / "guide" / page).read_text().splitlines()
    levels: dict[int, int] = {}  # line number: level, of the headings outside fenced blocks
    fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            levels[i] = len(line) - len(line.lstrip("#"))
    [start] = [i for i in levels if lines[i].lstrip("#").strip() == heading]
    end = next((j for j in sorted(levels) if j > start and levels[j] <= levels[start]), len(lines))
    return "\n".join(lines[start + 1 : end]) + "\n"
