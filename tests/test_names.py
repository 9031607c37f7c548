"""One name, one class: no two classes of the project share a name, so a
name read anywhere (a traceback, an import, a grep) means one thing."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from ps_core.bodies import published_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ps_core", "consumers", "app")


def _classes() -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return where


def test_no_two_classes_share_a_name() -> None:
    shared = {name: places for name, places in _classes().items() if len(places) > 1}
    assert not shared, "\n".join(f"{name}: {', '.join(places)}" for name, places in sorted(shared.items()))


def test_the_walk_finds_the_classes_of_every_package() -> None:
    # A walk that read nothing would pass forever.
    found = _classes()
    assert {"PSError", "LeaseBody", "Lease"} <= found.keys()
    assert any(place.startswith("consumers/") for places in found.values() for place in places)
    assert any(place.startswith("app/") for places in found.values() for place in places)


def test_a_body_is_published_under_its_name_without_the_suffix() -> None:
    # The documents keep the component names they always published.
    assert published_name("LeaseBody") == "Lease"
    assert published_name("FTRLBody") == "FTRL"
    assert published_name("Error") == "Error"
