"""docs/architecture.md's layout matches the tree: every module of `ps_core`,
`consumers` and `app` is named in its package's table, and every module a
table names exists there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def layout_sections() -> dict[str, set[str]]:
    """Package path (``ps_core/store/``) → the module paths its part of the
    layout names, relative to the package."""
    text = DOC.read_text()
    layout = text[text.index("\n## Layout") : text.index("\n## Where a new feature goes")]
    sections: dict[str, set[str]] = {}
    for chunk in re.split(r"\n(?=\*\*`)", layout)[1:]:
        package = re.match(r"\*\*`([\w/]+/)`", chunk)
        assert package, chunk[:80]
        sections[package.group(1)] = {name for line in chunk.splitlines() for name in named_in(line)}
    return sections


def named_in(line: str) -> list[str]:
    """The modules a line names; in a row ``commands/produce.py`, `export.py``,
    a bare name after a path shares its directory."""
    names, directory = [], ""
    for name in re.findall(r"`([\w/]+\.py)`", line):
        if "/" in name:
            directory = name.rsplit("/", 1)[0] + "/"
            names.append(name)
        else:
            names.append(directory + name)
    return names


def modules_of(package: str, others: set[str]) -> set[str]:
    """The modules of `package` but those of a subpackage with its own section."""
    root = ROOT / package
    found = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" or any(
            rel.startswith(o) for o in others if o != package and o.startswith(package)
        ):
            continue
        found.add(path.relative_to(root).as_posix())
    return found


def test_every_module_is_in_its_packages_table_and_every_named_module_exists() -> None:
    sections = layout_sections()
    assert {"ps_core/", "ps_core/store/", "consumers/", "app/"} <= set(sections)
    covered = set()
    for package, named in sections.items():
        modules = modules_of(package, set(sections))
        assert named == modules, (
            f"{package}: not in the layout {sorted(modules - named)}, not in the tree {sorted(named - modules)}"
        )
        covered |= {package + m for m in modules}
    every = {
        p.relative_to(ROOT).as_posix() for top in ("ps_core", "consumers", "app") for p in (ROOT / top).rglob("*.py")
    }
    assert every - covered == {p for p in every if p.endswith("__init__.py")}
