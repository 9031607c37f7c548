"""The measured figures are tied to runs: a benchmark given ``--record``
keeps its JSON line with the command, mode, date and cores in
bench/results/, and the "Latest recorded runs" part of docs/measurements.md
is what tools/measurements.py writes from those records, one per benchmark."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from commands import PROJECT, clean_env


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_measured_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _load(PROJECT / "bench" / "common.py")
measurements = _load(PROJECT / "tools" / "measurements.py")


def _read(path: Path) -> dict[str, object]:
    record: dict[str, object] = json.loads(path.read_text())
    return record


def test_record_keeps_the_json_line_with_its_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = [str(PROJECT / "bench" / "bench_tiny.py"), "--quick", "--record", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    args = common.bench_parser("A benchmark.", "a short run", seed=3, record=True).parse_args()
    figures = {"p50_ms": np.float64(1.25), "counts": np.arange(3), "ok": True}
    before = datetime.now(UTC).replace(microsecond=0)
    assert common.print_result(figures, args) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    path = tmp_path / "bench_tiny.quick.json"
    record = _read(path)
    assert record["result"] == json.loads(line) == {"p50_ms": 1.25, "counts": [0, 1, 2], "ok": True}
    assert record["bench"] == "bench_tiny" and record["mode"] == "quick" and record["cores"] == os.cpu_count()
    assert record["command"] == f"python bench/bench_tiny.py --quick --record {tmp_path}"
    date = datetime.strptime(str(record["date"]), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert before <= date <= datetime.now(UTC) + timedelta(seconds=1)
    # A newer run of the same benchmark and mode replaces the record; no temporary file stays.
    common.print_result({"p50_ms": 2.0}, args)
    assert _read(path)["result"] == {"p50_ms": 2.0}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_no_record_without_the_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Bare --record means bench/results, the records the page is made from.
    assert common.RESULTS == measurements.RESULTS == PROJECT / "bench" / "results"
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    parser = common.bench_parser("A benchmark.", "a short run", record=True)
    args = parser.parse_args(["--quick"])
    assert args.record is None
    common.print_result({"x": 1}, args)
    common.print_result({"x": 1})
    assert not list(tmp_path.iterdir())
    assert parser.parse_args(["--record"]).record == tmp_path


def test_write_record_names_the_benchmark_and_its_command(tmp_path: Path) -> None:
    argv = [str(PROJECT / "bench" / "bench_rpc.py"), "--record"]
    path = common.write_record({"rounds": 50}, quick=False, where=tmp_path, argv=argv)
    assert path == tmp_path / "bench_rpc.full.json"
    record = _read(path)
    assert record["bench"] == "bench_rpc" and record["mode"] == "full"
    assert record["command"] == "python bench/bench_rpc.py --record"


@pytest.mark.slow
def test_a_benchmark_run_with_record_writes_its_file(tmp_path: Path) -> None:
    # The smallest real benchmark (fresh interpreters importing the packages; ~6 s).
    out = subprocess.run(
        [sys.executable, "bench/bench_imports.py", "--quick", "--record", str(tmp_path)],
        cwd=PROJECT,
        env=clean_env(PYTHONPATH=str(PROJECT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    record = _read(tmp_path / "bench_imports.quick.json")
    assert record["result"] == json.loads(out.stdout.strip().splitlines()[-1])
    assert record["command"] == f"python bench/bench_imports.py --quick --record {tmp_path}"


RECORD = {
    "bench": "bench_x",
    "mode": "quick",
    "command": "python bench/bench_x.py --quick --record",
    "date": "2026-12-07T14:30:00Z",
    "cores": 2,
    "result": {
        "rows": 1558141,
        "p50_ms": 19.2871,
        "tiny": 0.000123,
        "events_per_s": 52310.4,
        "none": None,
        "formats": {"f32": {"bytes": 400, "logloss": 0.23106}, "f16": {"bytes": 200}, "aims_met": True},
        "wide": {"a": 1, "b": {"c": 2.5}},
        "drills": {f"d{i}": {"resume_s": i / 2, "passed": i != 3} for i in range(7)},
    },
}


def test_a_record_renders_as_tables() -> None:
    text = measurements.section(RECORD)
    assert text.startswith("<!-- recorded: bench_x.quick -->\n### bench_x (quick)\n")
    assert text.endswith("\n<!-- end recorded -->\n")
    assert "`python bench/bench_x.py --quick --record`, quick mode, 2026-12-07 14:30:00 UTC, 2 cores." in text
    for row in (
        "| `rows` | 1,558,141 |",
        "| `p50_ms` | 19.29 |",
        "| `tiny` | 0.000123 |",
        "| `events_per_s` | 52,310 |",
        "| `none` | – |",
        "| figure | `f32` | `f16` |",  # alike members side by side
        "| `bytes` | 400 | 200 |",
        "| `logloss` | 0.2311 | – |",
        "| `aims_met` | yes |",
        "`wide.b`:\n\n| figure | value |\n|---|---:|\n| `c` | 2.5 |",  # otherwise each in turn
        "| figure | `d0` | `d1` | `d2` | `d3` | `d4` |",  # at most MAX_COLUMNS to a table
        "| `passed` | yes | yes | yes | no | yes |",
        "| figure | `d5` | `d6` |\n|---|---:|---:|\n| `resume_s` | 2.5 | 3 |",
    ):
        assert row in text, row


def test_render_keeps_the_hand_written_page() -> None:
    page = "# Measurements\n\nHand figures.\n"
    once = measurements.render(page, [RECORD])
    assert once.startswith(page) and measurements.TITLE in once and "bench_x (quick)" in once
    assert measurements.render(once, [RECORD]) == once
    later = measurements.render(once + "\n## After\n\nMore.\n", [dict(RECORD, date="2026-12-08T09:00:00Z")])
    assert later.startswith(page) and later.endswith("## After\n\nMore.\n") and "recorded 2026-12-08" in later


def test_the_page_is_what_the_records_write() -> None:
    page = measurements.PAGE.read_text()
    assert page == measurements.render(page, measurements.records()), "docs/measurements.md is stale: run `make docs`"


def test_every_benchmark_has_a_record() -> None:
    assert len(measurements.benchmarks()) >= 10
    missing = measurements.unrecorded(measurements.records())
    assert not missing, f"no record in bench/results/ for {missing}: run them with --quick --record"
