"""The layers hold: each package imports only what its docstring allows."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = {
    *("ps_core.errors", "ps_core.hashing", "ps_core.parsing", "ps_core.bodies", "ps_core.rows", "ps_core.lazy"),
    "ps_core.waits",
    "ps_core.slots",
}

# What each part of the tree may import of the project, by module prefix.
ALLOWED: dict[str, tuple[str, ...]] = {
    "ps_core": ("ps_core",),  # the package itself re-exports the public surface
    "ps_core.errors": (),
    "ps_core.hashing": (),
    "ps_core.rows": (),
    "ps_core.lazy": (),
    "ps_core.waits": (),
    "ps_core.parsing": ("ps_core.errors",),
    "ps_core.bodies": ("ps_core.errors", "ps_core.parsing"),
    "ps_core.store": (*SHARED, "ps_core.store"),
    # A table's parts sit under the `SparseTable` that composes them: none imports it.
    "ps_core.store.storage": (*SHARED, "ps_core.store.index", "ps_core.store.growth", "ps_core.store.pull_cache"),
    "ps_core.store.row_meta": (*SHARED, "ps_core.store.storage", "ps_core.store.lifecycle"),
    "ps_core.store.push": (*SHARED, "ps_core.store.storage", "ps_core.store.pull_cache", "ps_core.store.lifecycle"),
    "ps_core.store.eviction": (*SHARED, "ps_core.store.storage", "ps_core.store.row_meta", "ps_core.store.lifecycle"),
    "ps_core.store.snapshot": (
        *SHARED,
        "ps_core.store.storage",
        "ps_core.store.row_meta",
        "ps_core.store.lifecycle",
        "ps_core.store.table_config",
    ),
    "ps_core.store.table_config": (*SHARED, "ps_core.store.lifecycle", "ps_core.store.optim"),
    "ps_core.model": (*SHARED, "ps_core.store", "ps_core.model"),
    # The in-process whole (model, tables, export): `Learner.save` / `load`
    # write and read export versions, importing the checkpoint package when called.
    "ps_core.model.learner": (*SHARED, "ps_core.store", "ps_core.model", "ps_core.checkpoint"),
    # One shard without sockets: over its tables, under the network that serves it.
    "ps_core.shard": (*SHARED, "ps_core.store", "ps_core.shard"),
    "ps_core.net": (*SHARED, "ps_core.store", "ps_core.shard", "ps_core.net"),
    # Everything in ps_core but the replica, which reads what checkpoints write.
    "ps_core.checkpoint": (
        *(*SHARED, "ps_core.store", "ps_core.model", "ps_core.shard", "ps_core.net"),
        *("ps_core.checkpoint", "ps_core.synthetic"),
    ),
    "ps_core.replica": (*SHARED, "ps_core.store", "ps_core.checkpoint", "ps_core.replica"),
    "ps_core.synthetic": ("ps_core.synthetic",),  # numpy only: nothing of the project
    "consumers": ("ps_core", "consumers"),
    "app": ("ps_core", "consumers", "app"),
    # Settings: what roles read; never a role itself (logs' levels, security's secrets).
    "app.config": ("ps_core", "consumers", "app.config", "app.security", "app.logs"),
    # A command: never the CLI that adds it, a role or a composition.
    "app.commands": (
        *("ps_core", "consumers", "app.commands", "app.config"),
        *("app.security", "app.logs", "app.signals", "app.startup"),
    ),
    # The API: never the CLI, a command, a role or a composition.
    "app.api": (
        *("ps_core", "consumers", "app.api", "app.config", "app.security", "app.logs", "app.metrics"),
        *("app.status", "app.failures", "app.background", "app.signals", "app.startup"),
    ),
    # A role: never the CLI that starts it, nor a composition (demo, cluster).
    "app.roles": (
        *("ps_core", "consumers", "app.roles", "app.config", "app.api", "app.failures"),
        *("app.logs", "app.metrics", "app.metrics_site", "app.security", "app.signals", "app.startup", "app.status"),
    ),
}
FOREIGN_FORBIDDEN = {"ps_core": ("aiokafka", "consumers", "app"), "consumers": ("app",)}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            # `from . import codec` names a module too
            found.update(f"{target}.{a.name}" for a in node.names if not node.module)
    return found


def _rule(mod: str) -> tuple[str, ...] | None:
    best = max((k for k in ALLOWED if mod == k or mod.startswith(k + ".")), key=len, default=None)
    return None if best is None else ALLOWED[best]


def _inside(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_every_package_imports_only_the_layers_below_it() -> None:
    broken = []
    for path in sorted([*ROOT.glob("ps_core/**/*.py"), *ROOT.glob("consumers/*.py"), *ROOT.glob("app/**/*.py")]):
        mod = _module_name(path)
        allowed = _rule(mod)
        assert allowed is not None, f"{mod} has no layer rule"
        for name in _imports(path):
            ours = name.split(".")[0] in {"ps_core", "consumers", "app"}
            if ours and name != "ps_core" and not _inside(name, allowed):
                broken.append(f"{mod} imports {name}")
            top = mod.split(".")[0]
            if _inside(name, FOREIGN_FORBIDDEN.get(top, ())) and not _inside(name, allowed):
                broken.append(f"{mod} imports {name}")
    assert not broken, "\n".join(sorted(set(broken)))


def test_the_rule_reads_relative_imports() -> None:
    # A check that found nothing because it misread imports would pass forever.
    found = _imports(ROOT / "ps_core" / "model" / "models.py")
    assert "ps_core.store.table_config" in found and "ps_core.hashing" in found


def test_the_synthetic_streams_import_numpy_and_the_standard_library_only() -> None:
    # A stream is plain data: producers, tests and benchmarks import it without the rest.
    outside = {
        f"{_module_name(path)} imports {name}"
        for path in sorted(ROOT.glob("ps_core/synthetic/*.py"))
        for name in _imports(path)
        if name.split(".")[0] not in {*sys.stdlib_module_names, "numpy", "ps_core"}
        or (name.startswith("ps_core") and not _inside(name, ("ps_core.synthetic",)))
    }
    assert not outside, "\n".join(sorted(outside))
