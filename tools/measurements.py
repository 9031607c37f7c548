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
# Members of a nested object side by side, at most this many to a table, so
# no table grows wider than the page.
MAX_COLUMNS = 5
# An object of more plain figures than this is one cell of its table.
LONG = 12


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
    """A figure as a table shows it: whole numbers from 1,000 up with
    thousands separators, smaller ones to 4 significant digits, null as a
    dash."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}" if 0 < abs(value) < 1e-3 else f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(number(v) for v in value) if value else "(none)"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _long(value: Any) -> bool:
    """Whether `value` is an object of more than `LONG` plain figures (a
    figure per column of a stream, say), shown in one cell."""
    return isinstance(value, Mapping) and len(value) > LONG and not any(isinstance(v, Mapping) for v in value.values())


def _flat(obj: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) for every figure in `obj`, nested objects
    flattened, long ones (`_long`) one figure: "name value, ..."."""
    out: list[tuple[str, Any]] = []
    for key, value in obj.items():
        if _long(value):
            out.append((f"{prefix}{key}", ", ".join(f"{k} {number(v)}" for k, v in value.items())))
        elif isinstance(value, Mapping):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _figures(rows: list[tuple[str, Any]]) -> str:
    lines = [f"| `{k}` | {number(v)} |\n" for k, v in rows]
    return "| figure | value |\n|---|---:|\n" + "".join(lines)


def _alike(members: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether objects of figures (flattened) are alike enough to show side
    by side: at least two, each with at least half its figures in all."""
    if len(members) < 2:
        return False
    common = set.intersection(*(set(m) for m in members.values()))
    return all(2 * len(common) >= len(m) for m in members.values())


def _side_by_side(members: Mapping[str, Mapping[str, Any]]) -> str:
    """Objects of figures side by side: a column per object (at most
    `MAX_COLUMNS` to a table), a row per figure."""
    names = list(members)
    out = []
    for i in range(0, len(names), MAX_COLUMNS):
        cols = [members[n] for n in names[i : i + MAX_COLUMNS]]
        keys = list(dict.fromkeys(k for member in cols for k in member))
        head = "| figure | " + " | ".join(f"`{n}`" for n in names[i : i + MAX_COLUMNS]) + " |\n"
        rule = "|---|" + "---:|" * len(cols) + "\n"
        rows = [f"| `{k}` | " + " | ".join(number(m.get(k)) for m in cols) + " |\n" for k in keys]
        out.append(head + rule + "".join(rows))
    return "\n".join(out)


def tables(result: Mapping[str, Any], path: str = "") -> str:
    """A record's figures: a table of its plain figures, then its nested
    objects, side by side when they are alike (a column each, nested
    figures by dotted names), otherwise each in turn the same way under its
    dotted name."""
    plain = _flat({k: v for k, v in result.items() if _long(v) or not isinstance(v, Mapping)})
    nested = {k: v for k, v in result.items() if isinstance(v, Mapping) and v and not _long(v)}
    parts = [_figures(plain)] if plain else []
    flat = {k: dict(_flat(v)) for k, v in nested.items()}
    if _alike(flat):
        parts.append(_side_by_side(flat))
    else:
        parts += [f"`{path}{k}`:\n\n" + tables(v, f"{path}{k}.") for k, v in nested.items()]
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
