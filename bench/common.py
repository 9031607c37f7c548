"""What every benchmark shares: its command line's common part (``--quick``,
which ``make bench-quick`` runs, ``--record``, and the promise of a JSON last
line), progress lines on stderr stamped with the seconds since it started,
those seconds and the run's mode for its figures, and the JSON last line
itself, kept with ``--record`` in ``bench/results/<bench>.<mode>.json`` (the
record ``tools/measurements.py`` renders into docs/measurements.md)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS",
    "add_record_option",
    "bench_mode",
    "bench_parser",
    "elapsed_s",
    "print_result",
    "progress_log",
    "write_record",
]

RESULTS = Path(__file__).resolve().parent / "results"
"""Where ``--record`` keeps each benchmark's last run: ``<bench>.<mode>.json``."""

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


def print_result(result: Mapping[str, Any], args: argparse.Namespace | None = None) -> int:
    """Print `result` as the benchmark's last stdout line, one JSON object
    (numpy values as plain numbers and lists). With `args` of a command line
    given ``--record`` (`add_record_option`), also write it with the run's
    command, mode, date and core count (`write_record`). Returns 0, the exit
    status of a run that got this far."""
    line = json.dumps(result, default=_plain)
    print(line, flush=True)
    where = getattr(args, "record", None) if args is not None else None
    if where is not None:
        path = write_record(json.loads(line), quick=bool(getattr(args, "quick", False)), where=where)
        print(f"recorded in {path}", file=sys.stderr, flush=True)
    return 0


def write_record(
    result: Mapping[str, Any],
    *,
    quick: bool,
    where: Path = RESULTS,
    name: str | None = None,
    argv: list[str] | None = None,
) -> Path:
    """Write `where/<name>.<mode>.json` (replacing an older run's): the
    benchmark's figures (``result``, its JSON line) with the command that ran
    it, its mode, the UTC date and the machine's core count. `name` is the
    benchmark (default: the running script's name), `argv` its command line
    (default ``sys.argv``). Returns the file written."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]) if argv else Path("bench")
    name = name or script.stem
    try:  # the command as run from the project's root, whatever the cwd was
        shown = script.resolve().relative_to(RESULTS.parents[1]).as_posix()
    except ValueError:
        shown = str(script)
    mode = bench_mode(quick)
    record = {
        "bench": name,
        "mode": mode,
        "command": shlex.join(["python", shown, *argv[1:]]),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cores": os.cpu_count(),
        "result": dict(result),
    }
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{name}.{mode}.json"
    tmp = path.with_suffix(".json.tmp")  # never a half-written record in place of the last good one
    tmp.write_text(json.dumps(record, indent=2, default=_plain) + "\n")
    tmp.replace(path)
    return path


def add_record_option(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give a benchmark's `parser` ``--record [DIR]``: keep the JSON last line
    in ``DIR/<bench>.<mode>.json`` (default ``bench/results``) when the run's
    `args` reach `print_result`. Returns `parser`."""
    parser.add_argument(
        "--record",
        nargs="?",
        type=Path,
        const=RESULTS,
        metavar="DIR",
        help="also write the JSON line, with the command, mode, date and core count, to "
        "DIR/<bench>.<mode>.json (default DIR: bench/results, which docs/measurements.md is made from)",
    )
    return parser


def progress_log(name: str) -> Callable[[str], None]:
    """A `log(msg)` writing one progress line on stderr: ``[name +seconds] msg``."""

    def log(msg: str) -> None:
        print(f"[{name} +{elapsed_s():6.1f}s] {msg}", file=sys.stderr, flush=True)

    return log


def bench_parser(
    description: str, quick: str, *, seed: int | None = None, out_dir: bool = False, record: bool = False
) -> argparse.ArgumentParser:
    """A benchmark's command line: `description` of what it measures, and
    ``--quick`` (`quick` says how the run shrinks); with `seed`, ``--seed``
    defaulting to it; with `out_dir`, ``--dir`` for the files it writes; with
    `record`, ``--record`` (`add_record_option`)."""
    parser = argparse.ArgumentParser(description=f"{description} The last stdout line is a JSON object.")
    parser.add_argument("--quick", action="store_true", help=quick)
    if record:
        add_record_option(parser)
    if out_dir:
        parser.add_argument("--dir", type=Path, help="where to write (default: the system temp directory)")
    if seed is not None:
        parser.add_argument("--seed", type=int, default=seed, help=f"RNG seed (default {seed})")
    return parser
