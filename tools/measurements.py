"""Write the "Latest recorded runs" part of docs/measurements.md from the
benchmarks' records, ``bench/results/<bench>.<mode>.json`` (what a benchmark
run with ``--record`` keeps: its JSON line, command, mode, date and cores).
Each record becomes a section between ``<!-- recorded: <bench>.<mode> -->``
and ``<!-- end recorded -->``: its command, mode and date, then its figures
in tables. The hand-written sections above the part stay as they are.

    python tools/measurements.py          # write the part into the page
    python tools/measurements.py --check  # exit 1 when the page is stale or a benchmark has no record

`make docs` runs it before building the site; `make bench-quick` refreshes
the records; tests/test_measurements.py checks that the page in the tree is
what it writes and that every ``bench/bench_*.py`` has a record.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "measurements.md"
RESULTS = ROOT / "bench" / "results"
BENCH = ROOT / "bench"

TITLE = "## Latest recorded runs"
BEGIN = (
    "<!-- recorded runs: written by tools/measurements.py from bench/results/; do not edit, `make docs` writes it -->"
)
END = "<!-- end recorded runs -->"
# A nested object whose members are objects of at most this many figures each
# is one table (a row per figure, a column per member); a bigger one is
# flattened, a row per figure, so no table grows wider than the page.
MAX_COLUMNS = 6


def benchmarks() -> list[str]:
    """The benchmarks in bench/ (``bench_*.py``), by name."""
    return sorted(p.stem for p in BENCH.glob("bench_*.py"))


def records(where: Path = RESULTS) -> list[dict[str, Any]]:
    """Every record in `where`, by benchmark then mode."""
    out = [json.loads(p.read_text()) for p in sorted(where.glob("*.json"))]
    return sorted(out, key=lambda r: (r["bench"], r["mode"]))


def unrecorded(found: list[dict[str, Any]]) -> list[str]:
    """The benchmarks of bench/ with no record among `found`."""
    have = {r["bench"] for r in found}
    return [b for b in benchmarks() if b not in have]


def number(value: Any) -> str:
    """A figure as a table shows it: integers with thousands separators,
    other numbers to 4 significant digits, null as a dash."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:,.0f}" if abs(value) >= 1e5 else f"{value:.3g}"
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(number(v) for v in value) if value else "(none)"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _flat(obj: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) for every figure in `obj`, nested objects flattened."""
    out: list[tuple[str, Any]] = []
    for key, value in obj.items():
        if isinstance(value, Mapping):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _figures(rows: list[tuple[str, Any]]) -> str:
    lines = [f"| `{k}` | {number(v)} |\n" for k, v in rows]
    return "| figure | value |\n|---|---:|\n" + "".join(lines)


def _side_by_side(group: Mapping[str, Any]) -> str | None:
    """The members of `group` that are objects of figures (nested ones
    flattened) as one table, a column per member and a row per figure, then
    its other figures; None when fewer than two or too many members are
    objects."""
    members = {name: dict(_flat(v)) for name, v in group.items() if isinstance(v, Mapping)}
    if not 2 <= len(members) <= MAX_COLUMNS:
        return None
    keys = list(dict.fromkeys(k for member in members.values() for k in member))
    head = "| figure | " + " | ".join(f"`{n}`" for n in members) + " |\n"
    rule = "|---|" + "---:|" * len(members) + "\n"
    rows = [f"| `{k}` | " + " | ".join(number(m.get(k)) for m in members.values()) + " |\n" for k in keys]
    rest = [(k, v) for k, v in group.items() if k not in members]
    return head + rule + "".join(rows) + (f"\n{_figures(rest)}" if rest else "")


def tables(result: Mapping[str, Any]) -> str:
    """A record's figures: one table of its plain figures, then one per
    nested object (members side by side when they are alike and few,
    otherwise flattened to dotted names)."""
    plain = [(k, v) for k, v in result.items() if not isinstance(v, Mapping)]
    parts = [_figures(plain)] if plain else []
    for key, value in result.items():
        if isinstance(value, Mapping) and value:
            parts.append(f"`{key}`:\n\n" + (_side_by_side(value) or _figures(_flat(value))))
    return "\n".join(parts)


def section(record: Mapping[str, Any]) -> str:
    """One record's section, between its markers."""
    name, mode = record["bench"], record["mode"]
    date = record["date"].replace("T", " ").rstrip("Z")
    return (
        f"<!-- recorded: {name}.{mode} -->\n"
        f"### {name} ({mode})\n\n"
        f"`{record['command']}`, {mode} mode, {date} UTC, {record['cores']} cores.\n\n"
        f"{tables(record['result'])}\n"
        "<!-- end recorded -->\n"
    )


def part(found: list[dict[str, Any]]) -> str:
    """The generated part of the page: its intro and a section per record."""
    dates = sorted(r["date"][:10] for r in found)
    modes = sorted({f"`--{r['mode']}`" if r["mode"] == "quick" else "full" for r in found})
    cores = sorted({str(r["cores"]) for r in found})
    when = (dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}") if dates else "never"
    missing = unrecorded(found)
    intro = (
        f"{BEGIN}\n{TITLE}\n\n"
        "The figures each benchmark printed as its JSON last line in its last\n"
        "run with `--record`, written here by `tools/measurements.py` from\n"
        f"`bench/results/`. These are {' and '.join(modes) or 'no'} runs (short, so noisier than the\n"
        f"figures above) on a busy {'/'.join(cores) or '?'}-core machine shared with other\n"
        f"work, recorded {when}: they show that a benchmark still runs and roughly\n"
        "what it gives, not the figures the decisions cite. `make bench-quick`\n"
        "records them all again and `make docs` rewrites this part.\n\n"
    )
    if missing:
        intro += "No record yet: " + ", ".join(f"`{m}`" for m in missing) + ".\n\n"
    return intro + "\n".join(section(r) for r in found) + END + "\n"


def render(page: str, found: list[dict[str, Any]]) -> str:
    """`page` with its generated part written from `found` (added at the end
    when the page has none); the rest of the page as it was."""
    if BEGIN in page:
        head, rest = page.split(BEGIN, 1)
        if END not in rest:
            raise ValueError(f"{PAGE.name}: {BEGIN!r} without {END!r}")
        tail = rest.split(END, 1)[1].lstrip("\n")
    else:
        head, tail = page.rstrip("\n") + "\n\n", ""
    return head + part(found) + (f"\n{tail}" if tail else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when the page differs from the records or a benchmark has none"
    )
    args = parser.parse_args(argv)
    found = records()
    page = PAGE.read_text()
    text = render(page, found)
    if args.check:
        status = 0
        if text != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `make docs` (or python tools/measurements.py)")
            status = 1
        if missing := unrecorded(found):
            print(f"no record in bench/results/ for {', '.join(missing)}: run them with --quick --record")
            status = 1
        return status
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
