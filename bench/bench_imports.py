"""Benchmark: what importing one module costs, with the packages' lazy
re-exports against the full packages loaded, measured in the same run.

For each target (``consumers.decode``: what a decoding process imports;
``ps_core``: the library; ``app.cli``: every role's entry point) a fresh
interpreter (``sys.executable``, cwd the project root) runs:

- lazy: ``import <target>``, as the code is;
- full (the baseline): ``import <target>``, then every name of every package's
  ``__all__`` (``ps_core`` and its ``store``, ``model``, ``net`` and
  ``checkpoint``, and ``consumers``) resolved: the modules the packages'
  ``__init__`` loaded when they imported their names eagerly.

Each run reports the seconds of the import itself (``time.perf_counter``
around it, in the child), the child's wall clock seconds from start to exit
(interpreter start-up included, as a process pays it), the modules it added
to ``sys.modules`` (all, and the project's own) and whether ``aiohttp`` and
``ps_core.checkpoint`` were loaded. Lazy and full runs alternate so that the
load of this shared machine hits both alike; figures are medians.

Run:
    .venv/bin/python bench/bench_imports.py --quick   # 3 runs each, ~10 s
    .venv/bin/python bench/bench_imports.py           # 11 runs each
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import bench_mode, bench_parser, print_result, progress_log

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("consumers.decode", "ps_core", "app.cli")
PACKAGES = ("ps_core", "ps_core.store", "ps_core.model", "ps_core.net", "ps_core.checkpoint", "consumers")

# The child: imports the target (and, for the baseline, every re-exported
# name), then prints one JSON line of what that took and loaded.
PROBE = """
import importlib, json, sys, time
target, full, packages = sys.argv[1], sys.argv[2] == "full", sys.argv[3:]
before = set(sys.modules)
t = time.perf_counter()
importlib.import_module(target)
if full:
    for name in packages:
        package = importlib.import_module(name)
        for export in package.__all__:
            getattr(package, export)
seconds = time.perf_counter() - t
added = set(sys.modules) - before
print(json.dumps({
    "seconds": seconds,
    "modules": len(added),
    "project_modules": sum(m.split(".")[0] in ("ps_core", "consumers", "app") for m in added),
    "aiohttp": "aiohttp" in sys.modules,
    "checkpoint": "ps_core.checkpoint" in sys.modules,
}))
"""

log = progress_log("imports")


def probe(target: str, mode: str) -> dict[str, Any]:
    """One fresh interpreter importing `target` (`mode` "lazy" or "full")."""
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, target, mode, *PACKAGES], cwd=ROOT, capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - t
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "wall_seconds": wall}


def measure(target: str, runs: int) -> dict[str, Any]:
    """Medians over `runs` alternating lazy and full imports of `target`."""
    got: dict[str, list[dict[str, Any]]] = {"lazy": [], "full": []}
    for _ in range(runs):
        for mode in got:
            got[mode].append(probe(target, mode))
    out: dict[str, Any] = {}
    for mode, rows in got.items():
        last = rows[-1]  # what is loaded does not vary between runs
        out[mode] = {
            "seconds": statistics.median(r["seconds"] for r in rows),
            "wall_seconds": statistics.median(r["wall_seconds"] for r in rows),
            "modules": last["modules"],
            "project_modules": last["project_modules"],
            "aiohttp": last["aiohttp"],
            "checkpoint": last["checkpoint"],
        }
    out["speedup"] = out["full"]["seconds"] / out["lazy"]["seconds"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(
        "Benchmark the import of consumers.decode, ps_core and app.cli in fresh interpreters, "
        "lazily against the full packages loaded (the baseline), measured in the same run.",
        "3 runs of each instead of 11 (~10 s)",
        record=True,
    )
    args = parser.parse_args(argv)
    runs = 3 if args.quick else 11
    result: dict[str, Any] = {"mode": bench_mode(args.quick), "runs": runs, "python": sys.version.split()[0]}
    for target in TARGETS:
        fig = measure(target, runs)
        lazy, full = fig["lazy"], fig["full"]
        log(
            f"import {target}: lazy {lazy['seconds'] * 1e3:.0f} ms ({lazy['wall_seconds'] * 1e3:.0f} ms process), "
            f"{lazy['modules']} modules ({lazy['project_modules']} of the project), aiohttp {lazy['aiohttp']}; "
            f"full {full['seconds'] * 1e3:.0f} ms ({full['wall_seconds'] * 1e3:.0f} ms process), "
            f"{full['modules']} modules ({full['project_modules']}); {fig['speedup']:.1f}x"
        )
        result[target] = fig
    return print_result(result, args)


if __name__ == "__main__":
    sys.exit(main())
