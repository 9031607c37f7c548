"""Benchmark: the sparse key index (`ps_core.store.index.KeyIndex`) and table memory.

What is measured, each next to a Python-dict baseline measured in the same run:

(a) Index throughput, 100k-key batches, random uint64 keys (numpy default_rng):

- build: N keys inserted with ``get_or_insert`` in 100k batches (amortised,
  rehashes included); the dict is built with ``d.setdefault(k, len(d))``;
- ``lookup`` of existing keys: a fresh random batch each time, against
  ``[d.get(k, -1) for k in batch.tolist()]``;
- ``get_or_insert`` in steady state: batches of 90% existing and 10% new keys
  (shuffled), and the all-new case, against
  ``[d.setdefault(k, len(d)) for k in batch.tolist()]``;
- ``lookup`` again after those inserts: the index's speed depends on its
  slot load (0.3 to 0.6 between rehashes), which the inserts change.

Per-batch times are taken with ``time.perf_counter``; rates are 100k over the
median batch time. Within a phase, KeyIndex and dict batches alternate, so that
drifts in the load of this shared machine hit both alike; the slot load at the
start and end of each phase is reported. Every query batch is generated up
front, outside the timed region, and each batch is used once (re-querying one
batch flatters caches).

(b) Bytes per feature of an LR table with FTRL state
(``SparseTable(TableConfig("lr", 1, {"name": "ftrl"}, lifecycle=...))``, TTL
and a row cap on: the metadata they read is in every row) filled to N features
by pushes of 100k keys: ``table.memory_bytes()`` (allocated bytes of index,
rows and metadata) over the feature count, with the used part and a
tracemalloc cross-check (settled, and the peak while the table grows, which
sizes a shard's memory). The same for the default linear table (a new
model's, `DEFAULT_LINEAR_OPTIMIZER`: a mixture of five FTRL learners, dim 10,
15 floats a row), keys ``default_table_*``, with its ratio to one FTRL's. Baselines, measured with tracemalloc on a sample of
keys (1M full, 200k quick) and extrapolated per feature:

- dict-of-lists: ``{key: [z, n, updated_at, last_seen, shows, clicks]}``;
- dict index + numpy rows: ``{key: row}`` plus the table's own row arrays.

The dict's hash-table part is taken from the real N-key dict built in (a)
(``sys.getsizeof``), the per-entry objects (key ints, row lists, floats) from
the sample. tracemalloc counts requested bytes, so small objects are
understated by pymalloc's rounding; the RSS growth of the sample build is
printed as a cross-check.

(c) A push's optimizer step, two tables against each other at the same rows
(`STEP_PAIRS`): coin against FTRL at an LR's dim (1) and an embedding's (8),
and LR's default linear table (a mixture of five FTRL learners, dim 10)
against one FTRL learner's (dim 1). Both are filled with the same
`STEP_ROWS` keys, then pushes of 100k existing keys (gradients normal(0,
0.1)) are timed alternately; milliseconds per push (median) and the ratio,
with each table's allocated bytes per feature. A push is the
whole `SparseTable.push` (lookup, duplicate sum, gather, step, write-back),
without a pull before it (so FTRL derives its weights itself).

Run (from the repository root)::

    .venv/bin/python bench/bench_index.py --quick   # 2M keys, < 1 minute
    .venv/bin/python bench/bench_index.py           # 10M keys, a few GB of RAM

Progress goes to stderr, one line per phase; a summary and, as the last line of
stdout, one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log

from ps_core.model.models import LogisticRegression
from ps_core.store.index import KeyIndex
from ps_core.store.lifecycle import Lifecycle
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

U64 = npt.NDArray[np.uint64]
F32 = npt.NDArray[np.float32]

BATCH = 100_000
"""Keys per query batch."""
NEW_FRACTION = 0.1
"""Share of new keys in a steady-state get_or_insert batch."""
LIFECYCLE = Lifecycle(ttl_s=7 * 86400.0, max_rows=100_000_000)
"""The table's rules: TTL and a cap it never reaches (no row is refused)."""
ONE_FTRL = TableConfig("lr", 1, {"name": "ftrl"}, lifecycle=LIFECYCLE)
"""An LR table with one FTRL learner (dim 1)."""
DEFAULT_LINEAR = replace(LogisticRegression().tables()[0], lifecycle=LIFECYCLE)
"""The linear table a model gets when it names no optimizer
(`DEFAULT_LINEAR_OPTIMIZER`), under the same rules."""
AIM_SPEEDUP = 5.0
AIM_BYTES_PER_FEATURE = 36.0
"""At 10M features, with the lifecycle's metadata (issue 17; 48 before)."""
AIM_RATIO_VS_DICT = 1.0 / 3.0
STEP_ROWS = 1_000_000
"""Rows of each table whose pushes (c) times."""
STEP_PAIRS: tuple[tuple[tuple[str, int], tuple[str, int]], ...] = (
    (("ftrl", 1), ("coin", 1)),
    (("ftrl", 8), ("coin", 8)),
    (("ftrl", 1), ("ftrl_mix", 10)),
)
"""(optimizer, dim) pairs whose pushes are timed against each other: coin
against FTRL at an LR's and an embedding's dim, and the default linear
table (a mixture of five FTRL learners: 10 weights from 15 floats a row)
against one FTRL learner's (1 weight from 2)."""


log = progress_log("bench_index")
"""One progress line on stderr."""


@dataclass(frozen=True)
class Sizes:
    """How big a run is."""

    keys: int
    timed_batches: int
    dict_timed_batches: int
    new_batches: int
    warmup_batches: int
    dict_sample: int


# keys, timed batches, timed dict batches, batches of new keys, warm-up batches, dict sample
QUICK = Sizes(2_000_000, 30, 10, 10, 2, 200_000)
FULL = Sizes(10_000_000, 60, 20, 20, 3, 1_000_000)


def rss_bytes() -> int:
    """Resident set size of this process (Linux), 0 when unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def random_keys(rng: np.random.Generator, n: int) -> U64:
    """n random uint64 keys over the whole range."""
    return rng.integers(0, 2**64, size=n, dtype=np.uint64)


def distinct_keys(rng: np.random.Generator, n: int) -> U64:
    """n distinct random uint64 keys, in random (insertion) order."""
    keys = random_keys(rng, n)
    for _ in range(100):
        _, first = np.unique(keys, return_index=True)
        if first.size == n:
            return keys
        # A 64-bit collision (vanishingly rare): redraw the later copies.
        dup = np.ones(n, dtype=bool)
        dup[first] = False
        keys[dup] = random_keys(rng, int(dup.sum()))
    raise RuntimeError("could not draw distinct keys")


def mixed_batch(rng: np.random.Generator, existing: U64, size: int, new_fraction: float) -> U64:
    """A shuffled batch: (1 - new_fraction) drawn from `existing`, the rest fresh."""
    n_new = int(round(size * new_fraction))
    old = existing[rng.integers(0, existing.size, size - n_new)]
    batch = np.concatenate([old, random_keys(rng, n_new)])
    return batch[rng.permutation(size)]


def time_batches(fn: Callable[[U64], object], batches: Sequence[U64]) -> list[float]:
    """Seconds each call of fn took, one call per batch, in order."""
    out: list[float] = []
    for b in batches:
        t0 = time.perf_counter()
        fn(b)
        out.append(time.perf_counter() - t0)
    return out


def time_alternating(
    fn: Callable[[U64], object],
    batches: Sequence[U64],
    dfn: Callable[[U64], object],
    dbatches: Sequence[U64],
) -> tuple[list[float], list[float]]:
    """Seconds per batch of `fn` and of `dfn`, their calls interleaved (the fewer
    `dbatches` spread evenly) so that drifts in machine load hit both alike."""
    t: list[float] = []
    dt: list[float] = []
    j = 0
    for i, b in enumerate(batches):
        t += time_batches(fn, [b])
        while j < len(dbatches) and j * len(batches) <= i * len(dbatches):
            dt += time_batches(dfn, [dbatches[j]])
            j += 1
    dt += time_batches(dfn, dbatches[j:])
    return t, dt


def rate(times: Sequence[float], per_call: int = BATCH) -> float:
    """Items per second from the median call time."""
    return per_call / statistics.median(times)


def fmt_rate(x: float) -> str:
    return f"{x / 1e6:7.2f} M/s"


# -- (a) index throughput ------------------------------------------------------


def bench_throughput(rng: np.random.Generator, keys: U64, sz: Sizes) -> tuple[dict[str, Any], int]:
    """Build, lookup and get_or_insert rates of KeyIndex and of a dict.

    Returns the figures and ``sys.getsizeof`` of the dict right after it held
    exactly the N build keys (its hash-table bytes at N).
    """
    n = keys.size
    batches_build = [keys[i : i + BATCH] for i in range(0, n, BATCH)]
    nb, nd, nw = sz.timed_batches, sz.dict_timed_batches, sz.warmup_batches
    log(f"generating query batches ({nb} timed + {nw} warm-up per phase, {BATCH:,} keys each)")
    lookup_b = [keys[rng.integers(0, n, BATCH)] for _ in range(nw + nb)]
    dict_lookup_b = [keys[rng.integers(0, n, BATCH)] for _ in range(nw + nd)]
    mixed_b = [mixed_batch(rng, keys, BATCH, NEW_FRACTION) for _ in range(nw + nb)]
    dict_mixed_b = [mixed_batch(rng, keys, BATCH, NEW_FRACTION) for _ in range(nw + nd)]
    new_b = [random_keys(rng, BATCH) for _ in range(nw + sz.new_batches)]
    dict_new_b = [random_keys(rng, BATCH) for _ in range(nw + sz.new_batches)]
    lookup2_b = [keys[rng.integers(0, n, BATCH)] for _ in range(nw + nb)]
    dict_lookup2_b = [keys[rng.integers(0, n, BATCH)] for _ in range(nw + nd)]

    # Build.
    index = KeyIndex()
    t_build = time_batches(index.get_or_insert, batches_build)
    assert index.size == n, (index.size, n)
    build_rate = n / sum(t_build)
    log(
        f"KeyIndex build: {n:,} keys in {sum(t_build):.2f}s = {fmt_rate(build_rate)} "
        f"({index.num_slots:,} slots, load {index.size / index.num_slots:.2f})"
    )
    d: dict[int, int] = {}

    def dict_get_or_insert(b: U64) -> list[int]:
        return [d.setdefault(k, len(d)) for k in b.tolist()]

    def dict_lookup(b: U64) -> list[int]:
        return [d.get(k, -1) for k in b.tolist()]

    t_dbuild = time_batches(dict_get_or_insert, batches_build)
    assert len(d) == n
    dict_container_bytes_at_n = sys.getsizeof(d)
    dict_build_rate = n / sum(t_dbuild)
    log(f"dict build:     {n:,} keys in {sum(t_dbuild):.2f}s = {fmt_rate(dict_build_rate)}")

    # Sanity: both agree on which keys are present (outside any timing).
    probe = lookup_b[0]
    rows = index.lookup(probe)
    assert (rows >= 0).all() and (index.row_keys[rows] == probe).all()
    assert all(r >= 0 for r in dict_lookup(probe))
    absent = new_b[0][:1000]
    assert (index.lookup(absent) < 0).all()

    def load() -> float:
        return index.size / index.num_slots

    def phase(
        label: str,
        fn: Callable[[U64], object],
        dfn: Callable[[U64], object],
        batches: Sequence[U64],
        dbatches: Sequence[U64],
    ) -> tuple[list[float], list[float], float, float]:
        """Warm up both, then alternate timed batches of KeyIndex and dict."""
        time_batches(fn, batches[:nw])
        time_batches(dfn, dbatches[:nw])
        load0 = load()
        t, dt = time_alternating(fn, batches[nw:], dfn, dbatches[nw:])
        load1 = load()
        r, dr = rate(t), rate(dt)
        log(
            f"{label:26}KeyIndex {fmt_rate(r)}  dict {fmt_rate(dr)}  ratio {r / dr:5.1f}x"
            f"  (slot load {load0:.2f} -> {load1:.2f})"
        )
        return t, dt, load0, load1

    t_lookup, t_dlookup, lookup_load, _ = phase(
        "lookup (existing):", index.lookup, dict_lookup, lookup_b, dict_lookup_b
    )
    t_mixed, t_dmixed, mixed_load0, mixed_load1 = phase(
        "get_or_insert (90/10):", index.get_or_insert, dict_get_or_insert, mixed_b, dict_mixed_b
    )
    t_new, t_dnew, new_load0, new_load1 = phase(
        "get_or_insert (all new):", index.get_or_insert, dict_get_or_insert, new_b, dict_new_b
    )
    t_lookup2, t_dlookup2, lookup2_load, _ = phase(
        "lookup again (existing):", index.lookup, dict_lookup, lookup2_b, dict_lookup2_b
    )
    assert index.size >= n and len(d) >= n
    lookups, dict_lookups = rate(t_lookup), rate(t_dlookup)
    goi, dict_goi = rate(t_mixed), rate(t_dmixed)
    goi_new, dict_goi_new = rate(t_new), rate(t_dnew)
    lookups2, dict_lookups2 = rate(t_lookup2), rate(t_dlookup2)

    figures: dict[str, Any] = {
        "keys": n,
        "batch_keys": BATCH,
        "build_inserts_per_s": build_rate,
        "dict_build_inserts_per_s": dict_build_rate,
        "build_ratio_vs_dict": build_rate / dict_build_rate,
        "lookups_per_s": lookups,
        "dict_lookups_per_s": dict_lookups,
        "lookup_ratio_vs_dict": lookups / dict_lookups,
        "lookup_batch_p50_ms": 1e3 * statistics.median(t_lookup),
        "lookup_slot_load_ratio": lookup_load,
        "get_or_insert_per_s": goi,
        "dict_get_or_insert_per_s": dict_goi,
        "get_or_insert_ratio_vs_dict": goi / dict_goi,
        "get_or_insert_batch_p50_ms": 1e3 * statistics.median(t_mixed),
        "get_or_insert_slot_load_start_ratio": mixed_load0,
        "get_or_insert_slot_load_end_ratio": mixed_load1,
        "get_or_insert_new_per_s": goi_new,
        "dict_get_or_insert_new_per_s": dict_goi_new,
        "get_or_insert_new_ratio_vs_dict": goi_new / dict_goi_new,
        "get_or_insert_new_mean_per_s": BATCH * len(t_new) / sum(t_new),
        "dict_get_or_insert_new_mean_per_s": BATCH * len(t_dnew) / sum(t_dnew),
        "get_or_insert_new_slot_load_start_ratio": new_load0,
        "get_or_insert_new_slot_load_end_ratio": new_load1,
        "lookups_again_per_s": lookups2,
        "dict_lookups_again_per_s": dict_lookups2,
        "lookup_again_ratio_vs_dict": lookups2 / dict_lookups2,
        "lookup_again_slot_load_ratio": lookup2_load,
    }
    return figures, dict_container_bytes_at_n


# -- (b) memory --------------------------------------------------------------

DictBuilder = Callable[[dict[int, Any], U64, int], None]


def dict_builders(sample: int, seed: int) -> dict[str, DictBuilder]:
    """Chunk builders of the two dict baselines (values drawn from `seed`).

    ``lists``: ``d[key] = [z, n, updated_at, last_seen, shows, clicks]`` with
    z and n distinct float objects per row (as after updates), updated_at,
    shows and clicks small cached ints and last_seen one int per batch: the
    layout most favourable to the dict. ``index``: ``d[key] = row``.
    """
    rng = np.random.default_rng(seed)
    zs = rng.normal(0, 1, sample).astype(np.float32)
    ns = rng.exponential(1.0, sample).astype(np.float32)
    now = int(time.time())

    def build_lists(d: dict[int, Any], chunk: U64, start: int) -> None:
        ts = now + start
        z = zs[start : start + chunk.size].tolist()
        nn = ns[start : start + chunk.size].tolist()
        for k, zz, n2 in zip(chunk.tolist(), z, nn):
            d[k] = [zz, n2, 1, ts, 0, 0]

    def build_index(d: dict[int, Any], chunk: U64, start: int) -> None:
        for k in chunk.tolist():
            d[k] = len(d)

    return {"lists": build_lists, "index": build_index}


def build_dict(sample_keys: U64, build: DictBuilder) -> dict[int, Any]:
    """A dict built chunk by chunk (100k keys) over `sample_keys`."""
    d: dict[int, Any] = {}
    for i in range(0, sample_keys.size, BATCH):
        build(d, sample_keys[i : i + BATCH], i)
    assert len(d) == sample_keys.size
    return d


@dataclass(frozen=True)
class DictMemory:
    """Memory of a dict baseline built on a sample."""

    traced_bytes: int
    """tracemalloc: requested bytes of everything the build kept."""
    container_bytes: int
    """sys.getsizeof of the dict: its hash table."""
    rss_bytes: int
    """RSS growth of the same build in a fresh process (no tracemalloc); 0 if unknown."""
    sample: int

    @property
    def object_bytes_per_feature(self) -> float:
        """Traced bytes of the per-entry objects (all but the hash table)."""
        return (self.traced_bytes - self.container_bytes) / self.sample


def measure_dict(sample_keys: U64, build: DictBuilder, kind: str, seed: int) -> DictMemory:
    """Trace the memory of one dict baseline; RSS is probed in a child process.

    Key ints are created inside the trace (they belong to the dict); the
    temporary lists of a chunk are freed before the reading. tracemalloc's own
    bookkeeping inflates RSS, hence the separate, untraced child for RSS.
    """
    gc.collect()
    gc.disable()
    try:
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        d = build_dict(sample_keys, build)
        traced = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        container = sys.getsizeof(d)
    finally:
        gc.enable()
    del d
    gc.collect()
    return DictMemory(traced, container, rss_probe(kind, sample_keys.size, seed), sample_keys.size)


def rss_probe(kind: str, sample: int, seed: int) -> int:
    """RSS growth of building the `kind` dict in a fresh interpreter (0 on failure)."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--rss-probe",
        kind,
        "--dict-sample",
        str(sample),
        "--seed",
        str(seed),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
        return int(json.loads(proc.stdout.strip().splitlines()[-1])["rss_bytes"])
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError) as exc:
        log(f"RSS probe for {kind} failed: {exc}")
        return 0


def run_rss_probe(kind: str, sample: int, seed: int) -> int:
    """Child side of `rss_probe`: build one dict, print its RSS growth as JSON."""
    rng = np.random.default_rng(seed + 1)
    sample_keys = distinct_keys(rng, sample)
    build = dict_builders(sample, seed)[kind]
    gc.collect()
    gc.disable()
    rss0 = rss_bytes()
    d = build_dict(sample_keys, build)
    rss = rss_bytes() - rss0
    return print_result({"kind": kind, "keys": len(d), "rss_bytes": rss})


def bench_dict_memory(keys: U64, sample: int, seed: int) -> tuple[DictMemory, DictMemory]:
    """Dict-of-lists and dict-index baselines on the first `sample` keys."""
    sample_keys = keys[:sample]
    builders = dict_builders(sample, seed)
    out: list[DictMemory] = []
    for kind, label in (("lists", "dict-of-lists"), ("index", "dict index")):
        m = measure_dict(sample_keys, builders[kind], kind, seed)
        log(
            f"{label} sample ({sample:,} keys): tracemalloc {m.traced_bytes / sample:.1f} B/key "
            f"(hash table {m.container_bytes / sample:.1f}); RSS growth in a fresh process "
            f"{m.rss_bytes / sample:.1f} B/key"
        )
        out.append(m)
    return out[0], out[1]


def bench_table_memory(rng: np.random.Generator, keys: U64, config: TableConfig = ONE_FTRL) -> dict[str, Any]:
    """Fill a table of `config` (with eviction rules: the metadata they read
    is in every row anyway) with `keys` by 100k pushes; report its bytes."""
    n = keys.size
    table = SparseTable(config)
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    try:
        for i in range(0, n, BATCH):
            chunk = keys[i : i + BATCH]
            grads = rng.normal(0, 0.1, (chunk.size, table.dim)).astype(np.float32)
            table.push(chunk, grads, event_time=1_700_000_000.0)
        traced, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(table) == n, (len(table), n)
    sample = keys[rng.integers(0, n, 1000)]
    # FTRL's L1 keeps small weights at exactly 0, so check the state instead:
    # every learner's n (a sum of squared gradients) is in some column.
    rows = table.index.lookup(sample)
    assert (rows >= 0).all() and (table.data[rows] > 0).any(axis=1).all(), "every pushed key has state"

    idx = table.index
    allocated = table.memory_bytes()
    row_cap = idx.row_capacity
    rows_alloc = table.memory_bytes() - idx.nbytes()  # state and metadata
    per_row = (rows_alloc + idx.row_keys.nbytes) / row_cap
    slots = idx.nbytes() - idx.row_keys.nbytes
    used = per_row * idx.num_rows + slots
    out: dict[str, Any] = {
        "features": n,
        "bytes_per_feature": allocated / n,
        "used_bytes_per_feature": used / n,
        "slot_bytes_per_feature": slots / n,
        "row_bytes_per_used_row": per_row,
        "row_fill_ratio": idx.num_rows / row_cap,
        "slot_load_ratio": idx.size / idx.num_slots,
        "table_rows_bytes_per_feature": rows_alloc / n,
        "table_traced_bytes_per_feature": (traced - base) / n,
        "table_peak_traced_bytes_per_feature": (peak - base) / n,
    }
    log(
        f"SparseTable {config.optimizer['name']} dim {config.dim}, {n:,} features: {allocated / 2**20:.1f} MiB allocated = "
        f"{out['bytes_per_feature']:.1f} B/feature (used {out['used_bytes_per_feature']:.1f}: "
        f"rows {per_row:.0f} B x fill {out['row_fill_ratio']:.2f} + slots "
        f"{out['slot_bytes_per_feature']:.1f} at load {out['slot_load_ratio']:.2f}); "
        f"tracemalloc {out['table_traced_bytes_per_feature']:.1f}, "
        f"peak while growing {out['table_peak_traced_bytes_per_feature']:.1f}"
    )
    del table
    gc.collect()
    return out


# -- (c) a push's optimizer step ---------------------------------------------------


def _pusher(table: SparseTable, grads: F32) -> Callable[[U64], object]:
    """A push of `grads` to `table` at the keys it is given."""
    return lambda keys: table.push(keys, grads, event_time=1.7e9)


def _filled(rng: np.random.Generator, keys: U64, name: str, dim: int) -> SparseTable:
    """A `dim` table of optimizer `name` holding a row for each of `keys`."""
    table = SparseTable(TableConfig(f"t_{name}_{dim}", dim, {"name": name}, lifecycle=LIFECYCLE))
    for i in range(0, keys.size, BATCH):
        chunk = keys[i : i + BATCH]
        table.push(chunk, rng.normal(0, 0.1, (chunk.size, dim)).astype(np.float32), event_time=1.7e9)
    return table


def ratio_key(first: tuple[str, int], second: tuple[str, int]) -> str:
    """The result key of `second`'s push time over `first`'s."""
    if first[1] == second[1]:
        return f"push_ratio_{second[0]}_over_{first[0]}_dim{first[1]}"
    return f"push_ratio_{second[0]}_over_{first[0]}"


def bench_push_steps(rng: np.random.Generator, keys: U64, batches: int) -> dict[str, Any]:
    """For each pair of `STEP_PAIRS`: ms per push of `BATCH` existing keys
    to either table at the same rows, pushes alternating; bytes per feature."""
    keys = keys[:STEP_ROWS]
    out: dict[str, Any] = {"step_rows": int(keys.size)}
    for first, second in STEP_PAIRS:
        tables = [_filled(rng, keys, name, dim) for name, dim in (first, second)]
        pushes = [keys[rng.integers(0, keys.size, BATCH)] for _ in range(batches)]
        a, b = (_pusher(t, rng.normal(0, 0.1, (BATCH, t.dim)).astype(np.float32)) for t in tables)
        times = time_alternating(a, pushes, b, pushes)
        for (name, dim), table, took in zip((first, second), tables, times):
            out[f"push_ms_{name}_dim{dim}"] = statistics.median(took) * 1e3
            out[f"bytes_per_feature_{name}_dim{dim}"] = table.memory_bytes() / keys.size
        ratio = statistics.median(times[1]) / statistics.median(times[0])
        out[ratio_key(first, second)] = ratio
        log(
            f"push of {BATCH:,} keys at {keys.size:,} rows: "
            + ", ".join(
                f"{n} dim {d} {out[f'push_ms_{n}_dim{d}']:.1f} ms ({out[f'bytes_per_feature_{n}_dim{d}']:.1f} B/feature)"
                for n, d in (first, second)
            )
            + f"; {second[0]} {ratio:.2f}x"
        )
        del tables, a, b
        gc.collect()
    return out


# -- main ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(
        "Benchmark the KeyIndex (lookups, get_or_insert) and the bytes per "
        "feature of an LR/FTRL SparseTable, against Python-dict baselines measured "
        "in the same run.",
        "2M keys and fewer batches (< 1 minute)",
        seed=12345,
        record=True,
    )
    parser.add_argument("--keys", type=int, help="override the number of keys N")
    parser.add_argument("--dict-sample", type=int, help="keys in the dict memory sample (default 1M, quick 200k)")
    parser.add_argument("--rss-probe", choices=("lists", "index"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_probe:
        return run_rss_probe(args.rss_probe, args.dict_sample or QUICK.dict_sample, args.seed)

    sz = QUICK if args.quick else FULL
    if args.keys is not None:
        if args.keys < 2 * BATCH:
            parser.error(f"--keys must be at least {2 * BATCH}")
        sz = Sizes(**{**sz.__dict__, "keys": args.keys})
    if args.dict_sample is not None:
        if not BATCH <= args.dict_sample:
            parser.error(f"--dict-sample must be at least {BATCH}")
        sz = Sizes(**{**sz.__dict__, "dict_sample": args.dict_sample})
    sample = min(sz.dict_sample, sz.keys)
    mode = bench_mode(args.quick)
    log(
        f"mode {mode}: N={sz.keys:,} keys, batches of {BATCH:,}, dict memory sample {sample:,}; "
        f"numpy {np.__version__}, Python {sys.version.split()[0]}"
    )

    rng = np.random.default_rng(args.seed)
    t = time.perf_counter()
    keys = distinct_keys(rng, sz.keys)
    log(f"generated {keys.size:,} distinct random uint64 keys in {time.perf_counter() - t:.1f}s")

    # Dict memory first, before the big structures of (a) exist.
    lists_mem, index_mem = bench_dict_memory(keys, sample, args.seed)
    fig, dict_container_at_n = bench_throughput(rng, keys, sz)
    gc.collect()  # the index and dict of that phase, with their closures, before the memory phases
    mem = bench_table_memory(rng, keys)
    default_mem = bench_table_memory(rng, keys, DEFAULT_LINEAR)
    steps = bench_push_steps(rng, keys, sz.timed_batches)

    n = keys.size
    container_per_feature = dict_container_at_n / n
    dict_bpf = lists_mem.object_bytes_per_feature + container_per_feature
    dict_index_bpf = index_mem.object_bytes_per_feature + container_per_feature + mem["table_rows_bytes_per_feature"]
    bpf = mem["bytes_per_feature"]
    log(
        f"dict baselines at N={n:,} (per-entry objects from the {sample:,}-key sample, "
        f"hash table {container_per_feature:.1f} B/feature from the real N-key dict): "
        f"dict-of-lists {dict_bpf:.1f} B/feature, dict index + numpy rows {dict_index_bpf:.1f}"
    )

    result: dict[str, Any] = {
        "mode": mode,
        **fig,
        "bytes_per_feature": bpf,
        "used_bytes_per_feature": mem["used_bytes_per_feature"],
        "slot_bytes_per_feature": mem["slot_bytes_per_feature"],
        "row_fill_ratio": mem["row_fill_ratio"],
        "slot_load_ratio": mem["slot_load_ratio"],
        "table_traced_bytes_per_feature": mem["table_traced_bytes_per_feature"],
        "table_peak_traced_bytes_per_feature": mem["table_peak_traced_bytes_per_feature"],
        "default_table_optimizer": DEFAULT_LINEAR.optimizer["name"],
        "default_table_dim": DEFAULT_LINEAR.dim,
        "default_table_bytes_per_feature": default_mem["bytes_per_feature"],
        "default_table_traced_bytes_per_feature": default_mem["table_traced_bytes_per_feature"],
        "default_table_peak_traced_bytes_per_feature": default_mem["table_peak_traced_bytes_per_feature"],
        "default_table_peak_ratio_vs_one_ftrl": default_mem["table_peak_traced_bytes_per_feature"]
        / mem["table_peak_traced_bytes_per_feature"],
        "dict_bytes_per_feature": dict_bpf,
        "ratio_vs_dict": bpf / dict_bpf,
        "dict_index_numpy_rows_bytes_per_feature": dict_index_bpf,
        "ratio_vs_dict_index_numpy_rows": bpf / dict_index_bpf,
        "dict_sample_keys": sample,
        "dict_sample_traced_bytes_per_feature": lists_mem.traced_bytes / sample,
        "dict_sample_rss_bytes_per_feature": lists_mem.rss_bytes / sample,
        "dict_index_sample_traced_bytes_per_feature": index_mem.traced_bytes / sample,
        "dict_index_sample_rss_bytes_per_feature": index_mem.rss_bytes / sample,
        "dict_hash_table_bytes_per_feature": container_per_feature,
        "dict_extrapolated_from_sample": sample < n,
        "aim_lookup_ratio_met": fig["lookup_ratio_vs_dict"] >= AIM_SPEEDUP,
        "aim_get_or_insert_ratio_met": fig["get_or_insert_ratio_vs_dict"] >= AIM_SPEEDUP,
        "aim_bytes_per_feature_met": bpf <= AIM_BYTES_PER_FEATURE,
        "aim_ratio_vs_dict_met": bpf / dict_bpf <= AIM_RATIO_VS_DICT,
        "aim_ratio_vs_dict_index_numpy_rows_met": bpf / dict_index_bpf <= AIM_RATIO_VS_DICT,
        **steps,
        "elapsed_s": elapsed_s(),
    }

    print(f"bench_index ({mode}, N={n:,}, batches of {BATCH:,} keys, medians)")
    print(
        f"  lookup         {fmt_rate(result['lookups_per_s'])} vs dict "
        f"{fmt_rate(result['dict_lookups_per_s'])}: {result['lookup_ratio_vs_dict']:.1f}x "
        f"(aim >= {AIM_SPEEDUP:.0f}x)"
    )
    print(
        f"  get_or_insert  {fmt_rate(result['get_or_insert_per_s'])} vs dict "
        f"{fmt_rate(result['dict_get_or_insert_per_s'])}: "
        f"{result['get_or_insert_ratio_vs_dict']:.1f}x (90% existing / 10% new)"
    )
    print(
        f"  get_or_insert  {fmt_rate(result['get_or_insert_new_per_s'])} vs dict "
        f"{fmt_rate(result['dict_get_or_insert_new_per_s'])}: "
        f"{result['get_or_insert_new_ratio_vs_dict']:.1f}x (all new)"
    )
    print(
        f"  lookup         {fmt_rate(result['lookups_again_per_s'])} vs dict "
        f"{fmt_rate(result['dict_lookups_again_per_s'])}: "
        f"{result['lookup_again_ratio_vs_dict']:.1f}x (again, after the inserts, slot load "
        f"{result['lookup_again_slot_load_ratio']:.2f} instead of {result['lookup_slot_load_ratio']:.2f})"
    )
    print(
        f"  memory         {bpf:.1f} B/feature allocated ({result['used_bytes_per_feature']:.1f} used) "
        f"vs dict-of-lists {dict_bpf:.1f}: {result['ratio_vs_dict']:.2f}x; vs dict index + numpy "
        f"rows {dict_index_bpf:.1f}: {result['ratio_vs_dict_index_numpy_rows']:.2f}x "
        f"(aims <= {AIM_BYTES_PER_FEATURE:.0f} B and <= 1/3)"
    )
    print(
        f"  default table  {DEFAULT_LINEAR.optimizer['name']} dim {DEFAULT_LINEAR.dim}: "
        f"{result['default_table_bytes_per_feature']:.1f} B/feature allocated, tracemalloc "
        f"{result['default_table_traced_bytes_per_feature']:.1f}, peak while growing "
        f"{result['default_table_peak_traced_bytes_per_feature']:.1f} vs one FTRL's "
        f"{result['table_peak_traced_bytes_per_feature']:.1f}: "
        f"{result['default_table_peak_ratio_vs_one_ftrl']:.2f}x"
    )
    for (a, da), (b, db) in STEP_PAIRS:
        print(
            f"  push           {a} dim {da} {result[f'push_ms_{a}_dim{da}']:.1f} ms, {b} dim {db} "
            f"{result[f'push_ms_{b}_dim{db}']:.1f} ms per {BATCH:,} keys: {b} "
            f"{result[ratio_key((a, da), (b, db))]:.2f}x; {a} "
            f"{result[f'bytes_per_feature_{a}_dim{da}']:.1f} B/feature, {b} "
            f"{result[f'bytes_per_feature_{b}_dim{db}']:.1f} (at {result['step_rows']:,} rows)"
        )
    if sample < n:
        print(f"  (dict memory extrapolated per feature from a {sample:,}-key sample)")
    return print_result(result, args)


if __name__ == "__main__":
    sys.exit(main())
