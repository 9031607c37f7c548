"""Benchmark: export cuts, files and restores (`ps_core.checkpoint.export_files`, `SparseTable.snapshot`).

What is measured, each next to a baseline measured in the same run:

(a) The pause of a cut: `SparseTable.snapshot(since)` of a table of N rows of
    which 1M changed since the last cut (900k updated, 100k new, by real
    pushes), for an LR table (FTRL, 8 B of state per row) and an FM table
    (AdaGrad, dim 8: 64 B per row). Baseline: a plain numpy ``.copy()`` of
    arrays of the same sizes as the snapshot's (the memory traffic alone,
    without the selection of changed rows). Median of 3 cuts. Aim <= 200 ms.
(b) Write rate: `write_version` of a base of N LR rows and of the 1M-row
    deltas, in MB/s of file bytes (fsynced, SHA-256 computed while writing).
    Baseline: writing the same arrays' raw bytes to one file and fsyncing it;
    a second figure adds a SHA-256 of those bytes to the raw write (the
    floor of any checksummed format). Runs alternate, medians of 5.
(c) Delta size: file bytes per changed row, against the raw bytes of a row
    (key, state, four uint32 metadata).
    The same for a base of the default linear table (a new model's,
    `DEFAULT_LINEAR_OPTIMIZER`: a mixture of five FTRL learners, 15 floats a
    row): its snapshot's raw bytes per row and its file bytes per row, which
    a restore holds beside the table while it loads, and the rate of that
    base's restore (1M rows, into one shard, SHA-256 checked).
(d) Restore: `restore_shards` of that N-row base written by 2 shards into 3
    fresh shards, SHA-256 checked. Baseline: ``np.load`` of the same files
    (no checks) plus inserting all keys into one fresh `KeyIndex` (the least
    a restore must do). The files were just written, so they are read from
    the page cache. Aim <= 10 s for 10M rows.

Run (from the repository root)::

    .venv/bin/python bench/bench_export.py --quick   # N = 2M rows, < 1 minute
    .venv/bin/python bench/bench_export.py           # N = 10M rows, a few GB of RAM

Files go to a temporary directory under ``--dir`` (default: the system's temp
directory; it should be a real disk for the fsync figures to mean anything)
and are removed at the end. Progress goes to stderr; a summary and, as the
last line of stdout, one JSON object with the figures.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log

from ps_core.checkpoint.export_files import latest_chain, write_version
from ps_core.checkpoint.restore import restore_shards
from ps_core.hashing import shard_of
from ps_core.model.models import LogisticRegression
from ps_core.store.index import KeyIndex
from ps_core.store.snapshot import TableSnapshot
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

U64 = npt.NDArray[np.uint64]
T = TypeVar("T")

CHANGED = 1_000_000
"""Rows changed between two cuts."""
NEW_SHARE = 0.1
"""Share of the changed rows that are new keys."""
BATCH = 100_000
"""Keys per push while changing rows."""
REPEATS = 3
WRITE_REPEATS = 5
AIM_PAUSE_MS = 200.0
AIM_RESTORE_S = 10.0
LR = TableConfig("lr", 1, {"name": "ftrl"})
FM = TableConfig("fm_v", 8, {"name": "adagrad"}, init_scale=0.01)
DEFAULT_LINEAR = LogisticRegression().tables()[0]
"""The linear table a model gets when it names no optimizer."""


log = progress_log("bench_export")
"""One progress line on stderr."""


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """fn's result and the seconds it took."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def distinct_keys(rng: np.random.Generator, n: int) -> U64:
    """n distinct random uint64 keys in random order."""
    keys = np.unique(rng.integers(0, 2**64, size=n + n // 100 + 16, dtype=np.uint64))[:n]
    assert keys.size == n
    rng.shuffle(keys)
    return keys


def filled_table(config: TableConfig, keys: U64, rng: np.random.Generator) -> SparseTable:
    """A table holding `keys` with random state, cut once (version 1 exported)."""
    t = SparseTable(config, initial_rows=keys.size)
    n = keys.size
    for i in range(0, n, 1_000_000):  # bounded temporaries
        k = keys[i : i + 1_000_000]
        m = k.size
        data = np.abs(rng.normal(size=(m, t.width))).astype(np.float32)
        meta = np.ones(m, dtype=np.uint32)
        t.load_rows(k, data, meta, meta * 1_764_000_000, meta * 3, meta)
    t.mark_exported(1)
    return t


def change_rows(t: SparseTable, keys: U64, rng: np.random.Generator) -> None:
    """Push CHANGED rows: (1 - NEW_SHARE) existing keys and NEW_SHARE new ones."""
    n_new = int(CHANGED * NEW_SHARE)
    old = keys[rng.choice(keys.size, CHANGED - n_new, replace=False)]
    batch = np.concatenate([old, rng.integers(0, 2**64, size=n_new, dtype=np.uint64)])
    rng.shuffle(batch)
    for i in range(0, batch.size, BATCH):
        k = batch[i : i + BATCH]
        t.push(k, rng.normal(scale=0.1, size=(k.size, t.dim)).astype(np.float32), event_time=1_764_000_100)


def copy_baseline(snap: TableSnapshot) -> float:
    """Seconds to .copy() arrays of the snapshot's sizes (fresh sources, so no
    cache is warmer than the table's)."""
    sources = [np.ones_like(a) for a in snap.arrays().values()]
    _, dt = timed(lambda: [a.copy() for a in sources])
    return dt


# -- (a) the pause -------------------------------------------------------------------------


def bench_pause(
    config: TableConfig, n: int, rng: np.random.Generator
) -> tuple[dict[str, Any], SparseTable, U64, TableSnapshot]:
    """Median snapshot time of a 1M-row delta and of its copy baseline."""
    keys = distinct_keys(rng, n)
    t, dt = timed(lambda: filled_table(config, keys, rng))
    log(f"{config.name}: {n:,} rows loaded in {dt:.1f}s ({t.memory_bytes() / n:.0f} B/row allocated)")
    pauses: list[float] = []
    copies: list[float] = []
    snaps: list[TableSnapshot] = []
    for _ in range(REPEATS):
        change_rows(t, keys, rng)
        gc.collect()
        snap, dt = timed(lambda: t.snapshot(t.last_snapshot))
        pauses.append(dt)
        copies.append(copy_baseline(snap))
        snaps = [snap]  # keep the last one only
    snap = snaps[0]
    rows = snap.rows
    assert rows >= CHANGED * 0.99, rows
    pause, copy = statistics.median(pauses), statistics.median(copies)
    log(
        f"{config.name}: snapshot of {rows:,} changed rows out of {len(t):,}: {1e3 * pause:.1f} ms "
        f"(runs {', '.join(f'{1e3 * p:.0f}' for p in pauses)}); plain copy of the same bytes "
        f"{1e3 * copy:.1f} ms: {pause / copy:.1f}x"
    )
    figures = {
        "rows": len(t),
        "changed_rows": rows,
        "pause_ms": 1e3 * pause,
        "copy_baseline_ms": 1e3 * copy,
        "pause_ratio_vs_copy": pause / copy,
        "snapshot_bytes": snap.nbytes,
    }
    return figures, t, keys, snap


# -- (b)(c) files ----------------------------------------------------------------------------


def bench_cut(root: Path, n: int, rng: np.random.Generator) -> dict[str, Any]:
    """One whole export through `Exporter`: 2 in-process shards holding N rows,
    CHANGED of them changed; the cut's pause (lease wait + every shard's copy)
    and the fetch-and-write after it."""
    import asyncio

    from ps_core.checkpoint.control import ControlClient
    from ps_core.checkpoint.coordinator import Coordinator
    from ps_core.checkpoint.exporter import Exporter
    from ps_core.hashing import shard_of
    from ps_core.shard import Shard, ShardSpec

    keys = distinct_keys(rng, n)
    owner = shard_of(keys, 2)
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    for i, shard in enumerate(shards):
        shard.tables[LR.name] = filled_table(LR, keys[owner == i], rng)
    changed = keys[rng.choice(keys.size, CHANGED, replace=False)]

    def change() -> None:
        for i, shard in enumerate(shards):
            mine = changed[shard_of(changed, 2) == i]
            t = shard.tables[LR.name]
            for j in range(0, mine.size, BATCH):
                k = mine[j : j + BATCH]
                t.push(k, rng.normal(scale=0.1, size=(k.size, 1)).astype(np.float32), event_time=1_764_000_100)

    async def cut() -> tuple[Any, Any]:
        coordinator = Coordinator()
        exporter = Exporter(coordinator, ControlClient.local(shards, coordinator), root / "e2e", "m")
        base = await exporter.cut()  # every row: version 1
        change()
        gc.collect()
        return base, await exporter.cut()  # the changed rows: version 2

    gc.collect()
    base, report = asyncio.run(cut())
    assert (base.kind, base.rows, report.kind, report.rows) == ("base", n, "delta", CHANGED), report
    log(
        f"exporter: base of {n:,} rows in 2 shards: pause {1e3 * base.pause_s:.1f} ms, fetch + write "
        f"{base.write_s:.2f} s; delta of {report.rows:,} changed rows: pause {1e3 * report.pause_s:.1f} ms, "
        f"fetch + write {1e3 * report.write_s:.0f} ms ({report.bytes / 1e6:.0f} MB)"
    )
    return {
        "cut_base_pause_ms": 1e3 * base.pause_s,
        "cut_base_write_s": base.write_s,
        "cut_pause_ms": 1e3 * report.pause_s,
        "cut_write_ms": 1e3 * report.write_s,
        "cut_write_mb_per_s": report.bytes / 1e6 / report.write_s,
    }


def raw_write(path: Path, arrays: Sequence[npt.NDArray[Any]], hashed: bool) -> None:
    """The baseline: the arrays' bytes into one file, fsynced; with `hashed`,
    a SHA-256 of them too, in 1 MiB slices as the exporter does."""
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for a in arrays:
            view = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data
            for i in range(0, view.nbytes, 1 << 20):
                if hashed:
                    digest.update(view[i : i + (1 << 20)])
                f.write(view[i : i + (1 << 20)])
        f.flush()
        os.fsync(f.fileno())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(".npz"))


def bench_write(
    root: Path, label: str, snapshots: dict[int, list[TableSnapshot]], version: int, parent: int | None
) -> dict[str, Any]:
    """Write the same version WRITE_REPEATS times (fresh model names),
    alternating with the raw baselines; medians."""
    arrays = [a for snaps in snapshots.values() for s in snaps for a in s.arrays().values()]
    raw_bytes = sum(a.nbytes for a in arrays)
    times: list[float] = []
    raw_times: list[float] = []
    hashed_times: list[float] = []
    file_bytes = 0
    for i in range(WRITE_REPEATS):
        path, dt = timed(
            lambda i=i: write_version(
                root, f"w{label}{i}", version, parent, snapshots, {"clicks": {0: 1}}, {}, len(snapshots)
            )
        )
        times.append(dt)
        file_bytes = dir_bytes(path)
        shutil.rmtree(root / f"w{label}{i}")
        for hashed, out in ((False, raw_times), (True, hashed_times)):
            _, dt = timed(lambda hashed=hashed: raw_write(root / f"raw-{label}", arrays, hashed))
            out.append(dt)
            os.unlink(root / f"raw-{label}")
    t, rt, ht = statistics.median(times), statistics.median(raw_times), statistics.median(hashed_times)
    rate, raw_rate, hashed_rate = file_bytes / t / 1e6, raw_bytes / rt / 1e6, raw_bytes / ht / 1e6
    log(
        f"write {label}: {file_bytes / 1e6:.0f} MB in {t:.3f}s = {rate:.0f} MB/s "
        f"(runs {', '.join(f'{x:.3f}' for x in times)}); raw write {raw_rate:.0f} MB/s: "
        f"{rate / raw_rate:.2f}x; raw write + SHA-256 {hashed_rate:.0f} MB/s: {rate / hashed_rate:.2f}x"
    )
    return {
        "file_bytes": file_bytes,
        "raw_bytes": raw_bytes,
        "write_s": t,
        "write_mb_per_s": rate,
        "raw_write_mb_per_s": raw_rate,
        "write_ratio_vs_raw": rate / raw_rate,
        "raw_sha256_write_mb_per_s": hashed_rate,
        "write_ratio_vs_raw_sha256": rate / hashed_rate,
    }


def bench_default_base(root: Path, rng: np.random.Generator) -> dict[str, Any]:
    """A base of CHANGED rows of the default linear table, as its exporter
    writes it: the snapshot's raw bytes and the files' bytes, per row."""
    keys = distinct_keys(rng, CHANGED)
    t = filled_table(DEFAULT_LINEAR, keys, rng)
    t.mark_exported(0)  # so that this cut is version 1
    snap = t.snapshot(None)
    del t
    raw = snap.nbytes
    rows = snap.rows
    write_version(root, "default", 1, None, {0: [snap]}, {"clicks": {0: 1}}, {}, 1)
    del snap
    gc.collect()
    mdir = root / "default"
    file_bytes = dir_bytes(mdir / "0000000001")
    restored, dt = timed(lambda: restore_shards(latest_chain(mdir), 1, verify=True))
    assert len(restored.shards[0].tables[DEFAULT_LINEAR.name]) == rows
    del restored
    shutil.rmtree(mdir)
    log(
        f"{DEFAULT_LINEAR.name} ({DEFAULT_LINEAR.optimizer['name']}, dim {DEFAULT_LINEAR.dim}): a base of "
        f"{rows:,} rows, {raw / rows:.1f} raw B/row, {file_bytes / rows:.1f} file B/row; "
        f"restored (sha256 checked) in {dt:.2f}s = {rows / dt / 1e6:.2f}M rows/s"
    )
    return {
        "default_lr_optimizer": DEFAULT_LINEAR.optimizer["name"],
        "default_lr_raw_bytes_per_row": raw / rows,
        "default_lr_base_file_bytes_per_row": file_bytes / rows,
        "default_lr_restore_rows_per_s": rows / dt,
    }


# -- (d) restore -----------------------------------------------------------------------------


def write_base(root: Path, model: str, keys: U64, rng: np.random.Generator) -> Path:
    """Version 1 of `model` under `root`: a base of `keys`' LR rows cut from 2
    shards (`filled_table`), as an exporter writes it; its directory."""
    owner = shard_of(keys, 2)
    snapshots = {}
    for s in range(2):
        t = filled_table(LR, keys[owner == s], rng)
        t.mark_exported(0)  # so that this cut is version 1
        snapshots[s] = [t.snapshot(None)]
        del t
    gc.collect()
    return write_version(root, model, 1, None, snapshots, {"clicks": {0: 1}}, {}, 2)


def bench_restore(root: Path, keys: U64, rng: np.random.Generator) -> dict[str, Any]:
    """Write a base of `keys` from 2 shards, restore it into 3; and the baseline."""
    write_base(root, "restore", keys, rng)
    gc.collect()
    mdir = root / "restore"
    files = sorted((mdir / "0000000001").glob("*.npz"))
    size = sum(p.stat().st_size for p in files)

    def baseline() -> int:
        parts = []
        for p in files:
            with np.load(p) as z:
                parts.append({name: z[name] for name in z.files})
        index = KeyIndex()
        index.get_or_insert(np.concatenate([p["keys"] for p in parts]))
        return index.size

    restored, dt = timed(lambda: restore_shards(latest_chain(mdir), 3, verify=True))
    n = sum(len(s.tables["lr"]) for s in restored.shards)
    assert n == keys.size, (n, keys.size)
    del restored
    gc.collect()
    count, bt = timed(baseline)
    assert count == keys.size
    log(
        f"restore {keys.size:,} rows ({size / 1e6:.0f} MB, 2 shards -> 3, sha256 checked): {dt:.2f}s "
        f"= {keys.size / dt / 1e6:.2f}M rows/s; np.load + one KeyIndex insert {bt:.2f}s: {dt / bt:.2f}x"
    )
    shutil.rmtree(mdir)
    return {
        "restore_rows": keys.size,
        "restore_file_bytes": size,
        "restore_s": dt,
        "restore_rows_per_s": keys.size / dt,
        "restore_baseline_s": bt,
        "restore_ratio_vs_baseline": dt / bt,
    }


def fs_type(path: Path) -> str:
    """The file system type of `path` (Linux `stat -f`), or '?'."""
    try:
        out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(
        "Benchmark export cuts (the pause), file writes, delta sizes and restores, "
        "against baselines measured in the same run.",
        "N = 2M rows instead of 10M (< 1 minute)",
        seed=12345,
        out_dir=True,
        record=True,
    )
    parser.add_argument("--rows", type=int, help="override N, the rows of the tables and of the restore")
    args = parser.parse_args(argv)
    n = args.rows or (2_000_000 if args.quick else 10_000_000)
    if n < 2 * CHANGED:
        parser.error(f"--rows must be at least {2 * CHANGED}")
    mode = bench_mode(args.quick)
    root = Path(tempfile.mkdtemp(prefix="bench_export-", dir=args.dir))
    fs = fs_type(root)
    log(
        f"mode {mode}: N={n:,} rows, {CHANGED:,} changed per cut; files in {root} ({fs}); "
        f"numpy {np.__version__}, Python {sys.version.split()[0]}"
    )
    rng = np.random.default_rng(args.seed)
    try:
        lr_pause, lr_table, lr_keys, lr_delta = bench_pause(LR, n, rng)
        lr_base = lr_table.base_copy(lr_table.last_snapshot)
        w_base = bench_write(root, "base", {0: [lr_base]}, lr_base.version, None)
        w_delta = bench_write(root, "delta", {0: [lr_delta]}, lr_delta.version, lr_delta.parent)
        del lr_table, lr_base
        gc.collect()
        fm_pause, fm_table, _, fm_delta = bench_pause(FM, n, rng)
        w_fm = bench_write(root, "fmdelta", {0: [fm_delta]}, fm_delta.version, fm_delta.parent)
        del fm_table
        gc.collect()
        default_base = bench_default_base(root, rng)
        gc.collect()
        e2e = bench_cut(root, n, rng)
        gc.collect()
        restore = bench_restore(root, lr_keys, rng)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    lr_row_raw = w_delta["raw_bytes"] / lr_delta.rows
    fm_row_raw = w_fm["raw_bytes"] / fm_delta.rows
    result: dict[str, Any] = {
        "mode": mode,
        "rows": n,
        "changed_rows": CHANGED,
        "file_system": fs,
        "lr_pause_ms": lr_pause["pause_ms"],
        "lr_copy_baseline_ms": lr_pause["copy_baseline_ms"],
        "lr_pause_ratio_vs_copy": lr_pause["pause_ratio_vs_copy"],
        "fm_pause_ms": fm_pause["pause_ms"],
        "fm_copy_baseline_ms": fm_pause["copy_baseline_ms"],
        "fm_pause_ratio_vs_copy": fm_pause["pause_ratio_vs_copy"],
        "base_write_mb_per_s": w_base["write_mb_per_s"],
        "base_raw_write_mb_per_s": w_base["raw_write_mb_per_s"],
        "base_write_ratio_vs_raw": w_base["write_ratio_vs_raw"],
        "base_raw_sha256_write_mb_per_s": w_base["raw_sha256_write_mb_per_s"],
        "base_write_ratio_vs_raw_sha256": w_base["write_ratio_vs_raw_sha256"],
        "base_file_bytes": w_base["file_bytes"],
        "delta_write_mb_per_s": w_delta["write_mb_per_s"],
        "delta_raw_write_mb_per_s": w_delta["raw_write_mb_per_s"],
        "delta_write_ratio_vs_raw": w_delta["write_ratio_vs_raw"],
        "delta_raw_sha256_write_mb_per_s": w_delta["raw_sha256_write_mb_per_s"],
        "delta_write_ratio_vs_raw_sha256": w_delta["write_ratio_vs_raw_sha256"],
        "delta_write_s": w_delta["write_s"],
        "lr_delta_bytes_per_changed_row": w_delta["file_bytes"] / lr_delta.rows,
        "lr_raw_bytes_per_row": lr_row_raw,
        "fm_delta_bytes_per_changed_row": w_fm["file_bytes"] / fm_delta.rows,
        "fm_raw_bytes_per_row": fm_row_raw,
        "fm_delta_write_mb_per_s": w_fm["write_mb_per_s"],
        **default_base,
        **e2e,
        "cut_pause_ratio_vs_table_snapshot": e2e["cut_pause_ms"] / lr_pause["pause_ms"],
        **restore,
        "aim_pause_met": max(lr_pause["pause_ms"], fm_pause["pause_ms"], e2e["cut_pause_ms"]) <= AIM_PAUSE_MS,
        "aim_restore_met": restore["restore_s"] * 10_000_000 / n <= AIM_RESTORE_S,
        "elapsed_s": elapsed_s(),
    }

    print(f"bench_export ({mode}, N={n:,} rows, {CHANGED:,} changed per cut, medians of {REPEATS})")
    print(
        f"  pause, LR (FTRL)        {result['lr_pause_ms']:6.1f} ms vs plain copy "
        f"{result['lr_copy_baseline_ms']:.1f} ms: {result['lr_pause_ratio_vs_copy']:.1f}x (aim <= {AIM_PAUSE_MS:.0f} ms)"
    )
    print(
        f"  pause, FM (AdaGrad, 8)  {result['fm_pause_ms']:6.1f} ms vs plain copy "
        f"{result['fm_copy_baseline_ms']:.1f} ms: {result['fm_pause_ratio_vs_copy']:.1f}x"
    )
    print(
        f"  whole export, 2 shards  pause {result['cut_pause_ms']:6.1f} ms "
        f"({result['cut_pause_ratio_vs_table_snapshot']:.2f}x one table's snapshot), "
        f"fetch + write {result['cut_write_ms']:.0f} ms ({result['cut_write_mb_per_s']:.0f} MB/s)"
    )
    print(
        f"  write base              {result['base_write_mb_per_s']:6.0f} MB/s vs raw write "
        f"{result['base_raw_write_mb_per_s']:.0f} MB/s: {result['base_write_ratio_vs_raw']:.2f}x; "
        f"vs raw + SHA-256 {result['base_raw_sha256_write_mb_per_s']:.0f} MB/s: "
        f"{result['base_write_ratio_vs_raw_sha256']:.2f}x ({result['base_file_bytes'] / 1e6:.0f} MB, fsynced, {fs})"
    )
    print(
        f"  write delta             {result['delta_write_mb_per_s']:6.0f} MB/s vs raw write "
        f"{result['delta_raw_write_mb_per_s']:.0f} MB/s: {result['delta_write_ratio_vs_raw']:.2f}x; "
        f"vs raw + SHA-256 {result['delta_raw_sha256_write_mb_per_s']:.0f} MB/s: "
        f"{result['delta_write_ratio_vs_raw_sha256']:.2f}x ({1e3 * result['delta_write_s']:.0f} ms for {CHANGED:,} rows)"
    )
    print(
        f"  delta size              LR {result['lr_delta_bytes_per_changed_row']:.2f} B/changed row "
        f"(raw {lr_row_raw:.0f}); FM {result['fm_delta_bytes_per_changed_row']:.2f} (raw {fm_row_raw:.0f})"
    )
    print(
        f"  default table base      {result['default_lr_base_file_bytes_per_row']:.2f} B/row in files "
        f"(raw {result['default_lr_raw_bytes_per_row']:.0f}, {result['default_lr_optimizer']}) vs LR (FTRL) "
        f"raw {lr_row_raw:.0f}: {result['default_lr_raw_bytes_per_row'] / lr_row_raw:.2f}x; restored at "
        f"{result['default_lr_restore_rows_per_s'] / 1e6:.2f}M rows/s"
    )
    print(
        f"  restore                 {restore['restore_rows']:,} rows in {restore['restore_s']:.2f}s, 2 -> 3 shards "
        f"(aim <= {AIM_RESTORE_S:.0f} s at 10M); np.load + one index insert {restore['restore_baseline_s']:.2f}s: "
        f"{restore['restore_ratio_vs_baseline']:.2f}x"
    )
    if n < 10_000_000:
        print(f"  ({mode} mode: {n:,} rows, not 10M; the aim is checked scaled to 10M)")
    return print_result(result, args)


if __name__ == "__main__":
    sys.exit(main())
