"""What every benchmark shares: its command line's common part (``--quick``,
which ``make bench-quick`` runs, and the promise of a JSON last line),
progress lines on stderr stamped with the seconds since it started, those
seconds and the run's mode for its figures, and the JSON last line itself."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["bench_mode", "bench_parser", "elapsed_s", "print_result", "progress_log"]

_T0 = time.perf_counter()  # the benchmark's start: this module is imported first


def elapsed_s() -> float:
    """Seconds since the benchmark started."""
    return time.perf_counter() - _T0


def bench_mode(quick: bool) -> str:
    """The run's mode, as its JSON figures and progress lines name it:
    ``"quick"`` (``--quick``) or ``"full"``."""
    return "quick" if quick else "full"


def _plain(value: Any) -> Any:
    """A numpy array or scalar in `print_result`'s figures as plain Python (json knows neither)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def print_result(result: Mapping[str, Any]) -> int:
    """Print `result` as the benchmark's last stdout line, one JSON object
    (numpy values as plain numbers and lists). Returns 0, the exit status of a
    run that got this far."""
    print(json.dumps(result, default=_plain), flush=True)
    return 0


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
