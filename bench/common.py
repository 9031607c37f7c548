"""What every benchmark shares: its command line's common part (``--quick``,
which ``make bench-quick`` runs, and the promise of a JSON last line),
progress lines on stderr stamped with the seconds since it started, and
those seconds for its final JSON line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["bench_parser", "elapsed_s", "progress_log"]

_T0 = time.perf_counter()  # the benchmark's start: this module is imported first


def elapsed_s() -> float:
    """Seconds since the benchmark started."""
    return time.perf_counter() - _T0


def progress_log(name: str) -> Callable[[str], None]:
    """A `log(msg)` writing one progress line on stderr: ``[name +seconds] msg``."""

    def log(msg: str) -> None:
        print(f"[{name} +{elapsed_s():6.1f}s] {msg}", file=sys.stderr, flush=True)

    return log


def bench_parser(
    description: str, quick: str, *, seed: int | None = None, out_dir: bool = False
) -> argparse.ArgumentParser:
    """A benchmark's command line: `description` of what it measures, and
    ``--quick`` (`quick` says how the run shrinks); with `seed`, ``--seed``
    defaulting to it; with `out_dir`, ``--dir`` for the files it writes."""
    parser = argparse.ArgumentParser(description=f"{description} The last stdout line is a JSON object.")
    parser.add_argument("--quick", action="store_true", help=quick)
    if out_dir:
        parser.add_argument("--dir", type=Path, help="where to write (default: the system temp directory)")
    if seed is not None:
        parser.add_argument("--seed", type=int, default=seed, help=f"RNG seed (default {seed})")
    return parser
