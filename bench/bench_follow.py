"""Benchmark: how far a serving replica (``ctrps serve --follow``) lags the trainer.

A trainer process owns an LR table (FTRL) of N rows and, on command, changes
M rows (90 % existing keys, 10 % new) by real pushes, cuts a delta
(`SparseTable.snapshot`) and writes it (`write_version`: fsynced files, then
the atomic rename). This process runs the replica: a `Follower` polling the
model's directory every ``interval`` seconds behind the real API
(`ApiServer`, loopback), and a probe sending ``POST /v1/predict`` every
~2 ms, noting when each version first answers.

- **Replica lag**: from the moment `write_version` returned (the rename plus
  one fsync of the model directory) to the first prediction carrying that
  version. Deltas are written at random phases of the poll, so the lag is
  about half the interval plus the load, on average; p50, p90 and max.
- **Load**: the follower's own split, per delta: reading and hashing it in a
  thread (``last_load_ms``) and the event loop's pause applying it
  (``last_apply_ms``).
- **Baseline** (same run, same files, from the page cache as the follower
  read them): ``np.load`` of the delta's file alone, no checks. Ratios: the
  follower's load + apply over it, and the lag over it.
- **Model**: with the writes at uniform phases, the mean lag should be half
  the interval plus the load and apply; the ratio of the measured mean to
  that is reported.
- **A new base**: at the end the trainer writes a base of all N rows; its lag
  and the follower's load (a fresh shard, then a swap) against ``np.load``
  of the base file, and against ``np.load`` plus one `KeyIndex` insert of
  its keys (the least a load into a table must do).
- **Memory** (what a replica's pod is sized from): ``ctrps serve --follow``
  as its own process, following a trainer of the default LR model (its
  table of the default linear optimizer, a mixture of FTRL learners; the
  replica reads the serving files, one weight a row): its resident set
  (``/proc``'s VmRSS) before any version (the process's base), after the
  base of N rows, after each of a few deltas and after a new base, and its
  peak (VmHWM) over all of it, when a new base is loaded beside the one
  served. Bytes a row are those over the base, per row held; the tables'
  own count (``GET /v1/model``'s ``bytes``) beside them, and the first
  base's load (the follower's own ``last_load_ms``: read, SHA-256, load).

Run (from the repository root)::

    .venv/bin/python bench/bench_follow.py --quick   # N = 1M, M = 100k, interval 1 s; < 1 minute
    .venv/bin/python bench/bench_follow.py           # N = 5M, M = 500k, intervals 1 s and 0.1 s

Progress goes to stderr; a summary and, as the last line of stdout, one JSON
object with the figures.
"""

from __future__ import annotations

import asyncio
import io
import logging
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log
from running import stop_shards, wait_healthy

from app.api import ApiServer
from app.api.follower import Follower, model_of_exports
from app.config.serve import ApiSettings
from app.config.shard import ShardSettings
from consumers.broker import free_port
from ps_core.checkpoint.export_files import write_version, write_version_to
from ps_core.checkpoint.exportstore import ExportStore, StoredModel, store_for
from ps_core.checkpoint.manifest import MANIFEST_NAME, ExportManifest, version_dir_name
from ps_core.model.models import make_model
from ps_core.store.index import KeyIndex
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench"
TABLE = TableConfig(f"{MODEL}_w", 1, {"name": "ftrl"})
[DEFAULT_TABLE] = make_model("lr", MODEL).tables()
"""The default LR model's one table (the default linear optimizer's): what
the memory phase's replica follows."""
MEMORY_DELTAS = 5
BATCH = 100_000
PROBE_EVERY_S = 0.002
DEFAULT_EXPORT_INTERVAL_S: float = ShardSettings.export_interval_s
"""How often shard 0 cuts an export unless told otherwise: the unit of the
aim for a replica following a bucket (p99 lag at most two of them)."""
WAIT_FACTOR = 10.0
"""A version not served within this many intervals (plus 10 s) is a failure."""


log = progress_log("bench_follow")
"""One progress line on stderr."""


# -- the trainer (a child process) -----------------------------------------------------


def trainer_main(conn: Connection, root: str, rows: int, seed: int, table_config: dict[str, Any]) -> None:
    """Build the table `table_config` declares, write base 1 into `root` (a
    directory, or ``s3://bucket/prefix``), then obey:
    ``("delta", m)``, ``("base",)``, ``("stop",)``; each write answers
    ``(version, t_written, rows, write_ms)`` with ``t_written`` on the
    machine-wide monotonic clock."""
    rng = np.random.default_rng(seed)
    config_of_table = TableConfig.from_dict(table_config)
    table = SparseTable(config_of_table, initial_rows=rows * 2)
    keys = np.unique(rng.integers(1, 2**63, size=rows + rows // 50, dtype=np.uint64))[:rows]
    for i in range(0, keys.size, BATCH):
        part = keys[i : i + BATCH]
        table.push(part, rng.normal(size=(part.size, table.dim)).astype(np.float32), event_time=1.0)
    config = {"name": MODEL, "tables": [config_of_table.to_dict()]}

    store = store_for(root) if root.startswith("s3://") else None

    def write(base: bool) -> tuple[int, float, int, float]:
        snap = table.snapshot(None if base else table.last_snapshot)
        t0 = time.perf_counter()
        if store is None:
            write_version(Path(root), MODEL, snap.version, snap.parent, {0: [snap]}, {}, config, 1)
        else:  # the files, then the manifest that makes the version visible
            write_version_to(store, MODEL, snap.version, snap.parent, {0: [snap]}, {}, config, 1)
        t_written = time.monotonic()
        return snap.version, t_written, snap.rows, (time.perf_counter() - t0) * 1000

    conn.send(write(base=True))
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            return
        if cmd[0] == "delta":
            m = int(cmd[1])
            old = rng.choice(keys, size=m - m // 10, replace=False)
            new = rng.integers(1, 2**63, size=m // 10, dtype=np.uint64)
            changed = np.unique(np.concatenate([old, new]))
            for i in range(0, changed.size, BATCH):
                part = changed[i : i + BATCH]
                table.push(part, rng.normal(size=(part.size, table.dim)).astype(np.float32), event_time=2.0)
            keys = np.concatenate([keys, new])  # random 63-bit ids: no duplicates to speak of
        conn.send(write(base=cmd[0] == "base"))


# -- the replica (this process) --------------------------------------------------------------


def raw_load_ms(version_dir: Path, repeats: int = 3, index: bool = False) -> float:
    """Median time of ``np.load`` of every array of a version's data files,
    no checks; with `index`, plus inserting its keys into a fresh `KeyIndex`."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for path in sorted(version_dir.glob("*.npz")):
            with np.load(path) as z:
                arrays = {name: z[name] for name in z.files}
            if index:
                KeyIndex(initial_slots=int(arrays["keys"].size / 0.6) + 16).get_or_insert(arrays["keys"])
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def raw_fetch_ms(store: ExportStore, version: int, repeats: int = 3) -> float:
    """Median time of a GET and ``np.load`` of every serving file of a
    version in a bucket (what a replica reads), no checks."""
    manifest = ExportManifest.from_json(store.read_bytes(MODEL, version, MANIFEST_NAME))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for f in manifest.serving_files:
            with np.load(io.BytesIO(store.read_bytes(MODEL, version, f.name))) as z:
                {name: z[name] for name in z.files}
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


class Probe:
    """Predicts continuously; notes when each model version first answers."""

    def __init__(self, url: str, keys: list[int]) -> None:
        self.url = url
        self.body = orjson.dumps({"events": [{"keys": keys}]})
        self.first_seen: dict[int, float] = {}
        self.requests = 0

    async def run(self) -> None:
        async with aiohttp.ClientSession() as http:
            while True:
                async with http.post(self.url + "/v1/predict", data=self.body) as resp:
                    raw = await resp.read()
                    status = resp.status
                now = time.monotonic()
                self.requests += 1
                if status == 200:
                    self.first_seen.setdefault(orjson.loads(raw)["model_version"], now)
                await asyncio.sleep(PROBE_EVERY_S)

    async def wait_for(self, version: int, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while version not in self.first_seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {version} not served within {timeout_s:.0f} s")
            await asyncio.sleep(PROBE_EVERY_S)
        return self.first_seen[version]


async def recv(conn: Connection) -> tuple[int, float, int, float]:
    got: tuple[int, float, int, float] = await asyncio.to_thread(conn.recv)
    return got


async def run_interval(
    root: Path | str, interval_s: float, rows: int, changed: int, deltas: int, seed: int
) -> dict[str, Any]:
    """One trainer and one replica polling every `interval_s`: `deltas` deltas,
    then a base; the exports in a directory, or in a bucket (``s3://...``)."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    trainer = ctx.Process(target=trainer_main, args=(theirs, str(root), rows, seed, TABLE.to_dict()), daemon=True)
    trainer.start()
    theirs.close()  # the trainer's end is its own: its death is an EOFError here, not a hang
    rng = np.random.default_rng(seed + 1)
    store = store_for(root) if isinstance(root, str) else None
    model_dir: Path | StoredModel = StoredModel(store, MODEL) if store is not None else Path(root) / MODEL

    def raw(version: int, index: bool = False) -> float:
        if isinstance(model_dir, Path):
            return raw_load_ms(model_dir / version_dir_name(version), 3, index)
        assert store is not None
        return raw_fetch_ms(store, version)

    try:
        base_version, _, _, base_write_ms = await recv(ours)
        log(f"interval {interval_s} s: base {base_version} of {rows:,} rows written in {base_write_ms:.0f} ms")
        model = model_of_exports(model_dir, make_model("lr", MODEL))
        follower = Follower(model_dir, model, interval_s=interval_s)
        settings = ApiSettings(port=0)
        async with ApiServer(settings, follower.client, model, follower=follower) as server:
            probe = Probe(server.url, [int(k) for k in rng.integers(1, 2**63, size=20, dtype=np.uint64)])
            probe_task = asyncio.create_task(probe.run())
            try:
                timeout = WAIT_FACTOR * interval_s + 10.0
                await probe.wait_for(base_version, timeout + rows / 1e5)
                lags, loads, applies, raws, writes = [], [], [], [], []
                for _ in range(deltas):
                    # A random phase of the poll, as a trainer's exports would be.
                    await asyncio.sleep(float(rng.uniform(0.0, interval_s)))
                    ours.send(("delta", changed))
                    version, t_written, delta_rows, write_ms = await recv(ours)
                    seen = await probe.wait_for(version, timeout)
                    lags.append((seen - t_written) * 1000)
                    assert follower.last_load_ms is not None and follower.last_apply_ms is not None
                    loads.append(follower.last_load_ms)
                    applies.append(follower.last_apply_ms)
                    raws.append(await asyncio.to_thread(raw, version))
                    writes.append(write_ms)
                log(
                    f"interval {interval_s} s: {deltas} deltas of {delta_rows:,} rows, lag p50 "
                    f"{statistics.median(lags):.0f} ms, load {statistics.median(loads):.1f} ms + apply "
                    f"{statistics.median(applies):.1f} ms, raw np.load {statistics.median(raws):.1f} ms"
                )
                await asyncio.sleep(float(rng.uniform(0.0, interval_s)))
                ours.send(("base",))
                version, t_written, _, _ = await recv(ours)
                seen = await probe.wait_for(version, timeout + rows / 1e5)
                base_lag = (seen - t_written) * 1000
                assert follower.last_load_ms is not None and follower.last_apply_ms is not None
                base_load, base_swap = follower.last_load_ms, follower.last_apply_ms
                base_raw = await asyncio.to_thread(raw, version)
                base_indexed = await asyncio.to_thread(raw, version, True)
                log(f"interval {interval_s} s: new base of {rows:,} rows served {base_lag:.0f} ms after its write")
            finally:
                probe_task.cancel()
                await asyncio.gather(probe_task, return_exceptions=True)
        ours.send(("stop",))
    finally:
        trainer.join(timeout=30)
        if trainer.is_alive():
            trainer.kill()
    lag_p50 = statistics.median(lags)
    load_p50 = statistics.median(loads)
    apply_p50 = statistics.median(applies)
    raw_p50 = statistics.median(raws)
    modelled = interval_s * 1000 / 2 + statistics.fmean(loads) + statistics.fmean(applies)
    return {
        "poll_interval_ms": interval_s * 1000,
        "deltas": deltas,
        "delta_rows": delta_rows,
        "replica_lag_p50_ms": lag_p50,
        "replica_lag_p90_ms": float(np.percentile(lags, 90)),
        "replica_lag_p99_ms": float(np.percentile(lags, 99)),
        "replica_lag_max_ms": max(lags),
        "replica_lag_mean_ms": statistics.fmean(lags),
        "replica_lag_over_interval_ratio": statistics.fmean(lags) / (interval_s * 1000),
        "replica_lag_modelled_ms": modelled,
        "replica_lag_mean_over_modelled_ratio": statistics.fmean(lags) / modelled,
        "delta_write_ms": statistics.median(writes),
        "delta_load_ms": load_p50,
        "delta_apply_ms": apply_p50,
        "delta_apply_max_ms": max(applies),
        "delta_raw_np_load_ms": raw_p50,
        "delta_load_apply_ratio_vs_raw": (load_p50 + apply_p50) / raw_p50,
        "replica_lag_ratio_vs_raw_load": lag_p50 / raw_p50,
        "base_lag_ms": base_lag,
        "base_load_ms": base_load,
        "base_swap_ms": base_swap,
        "base_raw_np_load_ms": base_raw,
        "base_load_ratio_vs_raw": base_load / base_raw,
        "base_np_load_index_ms": base_indexed,
        "base_load_ratio_vs_np_load_index": base_load / base_indexed,
        "probe_requests": probe.requests,
    }


async def run_bucket(on_disk: dict[str, Any], rows: int, changed: int, deltas: int, seed: int) -> dict[str, Any]:
    """`run_interval` with the exports in a bucket of moto's S3 server (a
    subprocess on loopback), at the first directory run's poll interval:
    its lag against that run's, and against the default export interval."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # tests/: the test suite's own starter of the server
    from tests.s3_server import moto_server

    interval_s = on_disk["poll_interval_ms"] / 1000
    with moto_server() as endpoint:
        saved = {k: os.environ.get(k) for k in (*endpoint.env, "AWS_ENDPOINT_URL")}
        os.environ.update({**endpoint.env, "AWS_ENDPOINT_URL": endpoint.url})  # the trainer inherits them
        try:
            run = await run_interval(f"s3://{endpoint.bucket}/bench-follow", interval_s, rows, changed, deltas, seed)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    log(f"bucket: lag p50 {run['replica_lag_p50_ms']:.0f} ms, p99 {run['replica_lag_p99_ms']:.0f} ms")
    keys = ("poll_interval_ms", "replica_lag_p50_ms", "replica_lag_p90_ms", "replica_lag_p99_ms", "replica_lag_max_ms")
    return {
        **{f"bucket_{k}": run[k] for k in keys},
        "bucket_delta_write_ms": run["delta_write_ms"],
        "bucket_delta_load_ms": run["delta_load_ms"],
        "bucket_delta_raw_fetch_ms": run["delta_raw_np_load_ms"],
        "bucket_base_lag_ms": run["base_lag_ms"],
        "bucket_base_load_ms": run["base_load_ms"],
        "bucket_replica_lag_ratio_vs_dir": run["replica_lag_p50_ms"] / on_disk["replica_lag_p50_ms"],
        "bucket_replica_lag_p99_over_export_interval_ratio": run["replica_lag_p99_ms"]
        / (DEFAULT_EXPORT_INTERVAL_S * 1000),
        "aim_bucket_lag_p99_within_two_export_intervals_met": run["replica_lag_p99_ms"]
        <= 2 * DEFAULT_EXPORT_INTERVAL_S * 1000,
    }


def memory_mb(pid: int) -> tuple[float, float]:
    """A process's resident set now and its peak so far (VmRSS, VmHWM), MiB (Linux's /proc)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024  # kB
    return fields["VmRSS"], fields["VmHWM"]


async def served(http: aiohttp.ClientSession, url: str, version: int, timeout_s: float) -> dict[str, Any]:
    """``GET /v1/model`` of the replica at `url` once it serves `version`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with http.get(url + "/v1/model") as resp:
                if resp.status == 200:
                    info: dict[str, Any] = orjson.loads(await resp.read())
                    if info.get("served_version") == version:
                        return info
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replica did not serve version {version} within {timeout_s:.0f} s")
        await asyncio.sleep(0.02)  # poll interval


async def run_memory(root: Path, rows: int, changed: int, seed: int) -> dict[str, Any]:
    """The memory of ``ctrps serve --follow`` (its own process) following the
    default LR model: before any version, after a base of `rows`, after
    `MEMORY_DELTAS` deltas of `changed` rows, after a new base; its peak."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}
    argv = ["serve", "--follow", str(root), "--model-name", MODEL, "--host", "127.0.0.1", "--port", str(port)]
    replica = subprocess.Popen(
        [sys.executable, "-m", "app.cli", *argv, "--follow-interval", "0.2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    trainer = ctx.Process(
        target=trainer_main, args=(theirs, str(root), rows, seed, DEFAULT_TABLE.to_dict()), daemon=True
    )
    samples: list[tuple[int, float, int, int]] = []  # version, RSS MiB, rows held, tables' bytes
    try:
        await wait_healthy([url])
        async with aiohttp.ClientSession() as http:
            # The process as it serves, before any version: its routes answered once.
            for path in ("/healthz", "/readyz", "/metrics", "/v1/model"):
                async with http.get(url + path) as resp:
                    await resp.read()
            base_mb = memory_mb(replica.pid)[0]
            log(f"memory: replica process {base_mb:.0f} MiB before any version")
            trainer.start()
            theirs.close()
            timeout = 60.0 + rows / 1e5

            async def sample(version: int) -> dict[str, Any]:
                info = await served(http, url, version, timeout)
                samples.append((version, memory_mb(replica.pid)[0], int(info["features"]), int(info["bytes"])))
                return info

            version = (await recv(ours))[0]
            info = await sample(version)
            base_load_ms = float(info["follow"]["last_load_ms"])
            for _ in range(MEMORY_DELTAS):
                ours.send(("delta", changed))
                await sample((await recv(ours))[0])
            ours.send(("base",))
            await sample((await recv(ours))[0])
            peak_mb = memory_mb(replica.pid)[1]
        ours.send(("stop",))
    finally:
        stop_shards([replica])
        if trainer.pid is not None:  # started
            trainer.join(timeout=30)
            if trainer.is_alive():
                trainer.kill()
    [table] = info["tables"].values()
    after_base = samples[0]
    held = max(s[2] for s in samples)
    per_row = [(mb - base_mb) * 2**20 / n for _, mb, n, _ in samples]
    log(
        f"memory: {after_base[2]:,} rows: RSS {after_base[1]:.0f} MiB; peak {peak_mb:.0f} MiB "
        f"over {len(samples)} versions (a new base of {samples[-1][2]:,} rows last)"
    )
    return {
        "memory_optimizer": table["optimizer"]["name"],
        "memory_rows": after_base[2],
        "memory_rows_max": held,
        "replica_process_base_mb": base_mb,
        "replica_rss_after_base_mb": after_base[1],
        "replica_peak_rss_mb": peak_mb,
        "replica_bytes_per_row": max(per_row),
        "replica_bytes_per_row_after_base": per_row[0],
        "replica_peak_bytes_per_row": (peak_mb - base_mb) * 2**20 / held,
        "replica_table_bytes_per_row": max(b / n for _, _, n, b in samples),
        # The first base, read, hashed and loaded by the follower (local files, page cache).
        "replica_base_load_ms": base_load_ms,
        "replica_base_load_rows_per_s": after_base[2] / (base_load_ms / 1000),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(
        "Benchmark how far a serving replica lags the trainer's exports, against the raw load of the same files.",
        "N = 1M, M = 100k, interval 1 s, 20 deltas (< 1 minute)",
        seed=12345,
        out_dir=True,
        record=True,
    )
    parser.add_argument("--rows", type=int, help="override N, the table's rows")
    parser.add_argument("--changed", type=int, help="override M, rows changed per delta")
    parser.add_argument("--deltas", type=int, help="deltas per interval")
    parser.add_argument("--interval", type=float, action="append", help="poll interval, s (repeatable)")
    args = parser.parse_args(argv)
    # The probe meets 503 until the first version is loaded: not news here.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("ctrps.api").setLevel(logging.ERROR)
    mode = bench_mode(args.quick)
    rows = args.rows or (1_000_000 if args.quick else 5_000_000)
    changed = args.changed or (100_000 if args.quick else 500_000)
    deltas = args.deltas or (20 if args.quick else 40)
    intervals = args.interval or ([1.0] if args.quick else [1.0, 0.1])
    log(f"mode {mode}: N={rows:,} rows, M={changed:,} changed per delta, {deltas} deltas, intervals {intervals} s")
    runs: list[dict[str, Any]] = []
    for i, interval in enumerate(intervals):
        root = Path(tempfile.mkdtemp(prefix="bench_follow-", dir=args.dir))
        try:
            runs.append(asyncio.run(run_interval(root, interval, rows, changed, deltas, args.seed + i)))
        finally:
            shutil.rmtree(root, ignore_errors=True)

    bucket = asyncio.run(run_bucket(runs[0], rows, changed, deltas, args.seed + len(intervals) + 1))

    root = Path(tempfile.mkdtemp(prefix="bench_follow-memory-", dir=args.dir))
    try:
        memory = asyncio.run(run_memory(root, rows, changed, args.seed + len(intervals)))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    first = runs[0]
    result: dict[str, Any] = {"mode": mode, "rows": rows, "changed_rows": changed, **first, **bucket, **memory}
    for run in runs[1:]:
        tag = f"at_{run['poll_interval_ms']:.0f}ms"
        result.update({f"{k}_{tag}": v for k, v in run.items() if k.startswith("replica_lag")})
    result["elapsed_s"] = elapsed_s()

    print(f"bench_follow ({mode}, N={rows:,} rows, deltas of {first['delta_rows']:,} rows, LR FTRL)")
    for run in runs:
        print(
            f"  poll every {run['poll_interval_ms']:6.0f} ms: replica lag p50 {run['replica_lag_p50_ms']:7.1f} ms, "
            f"p90 {run['replica_lag_p90_ms']:7.1f}, max {run['replica_lag_max_ms']:7.1f} "
            f"(mean {run['replica_lag_over_interval_ratio']:.2f}x the interval; {run['deltas']} deltas)"
        )
        print(
            f"      mean lag {run['replica_lag_mean_ms']:.0f} ms vs interval/2 + load + apply "
            f"{run['replica_lag_modelled_ms']:.0f} ms: {run['replica_lag_mean_over_modelled_ratio']:.2f}x"
        )
        print(
            f"      delta: read + SHA-256 {run['delta_load_ms']:.1f} ms in a thread, apply {run['delta_apply_ms']:.1f} ms "
            f"on the loop (max {run['delta_apply_max_ms']:.1f}); raw np.load {run['delta_raw_np_load_ms']:.1f} ms: "
            f"{run['delta_load_apply_ratio_vs_raw']:.1f}x; lag p50 = {run['replica_lag_ratio_vs_raw_load']:.0f}x raw load"
        )
        print(
            f"      new base of {rows:,} rows: served {run['base_lag_ms']:.0f} ms after its write; load "
            f"{run['base_load_ms']:.0f} ms (swap {run['base_swap_ms']:.3f} ms) vs raw np.load "
            f"{run['base_raw_np_load_ms']:.0f} ms: {run['base_load_ratio_vs_raw']:.1f}x; vs np.load + one index "
            f"insert {run['base_np_load_index_ms']:.0f} ms: {run['base_load_ratio_vs_np_load_index']:.2f}x"
        )
    print(
        f"  from a bucket (moto's S3 server, loopback), poll every {bucket['bucket_poll_interval_ms']:.0f} ms: lag p50 "
        f"{bucket['bucket_replica_lag_p50_ms']:.1f} ms, p99 {bucket['bucket_replica_lag_p99_ms']:.1f}, max "
        f"{bucket['bucket_replica_lag_max_ms']:.1f} ({bucket['bucket_replica_lag_ratio_vs_dir']:.2f}x the directory's "
        f"p50 in this run); p99 {bucket['bucket_replica_lag_p99_over_export_interval_ratio']:.3f}x the default export "
        f"interval ({DEFAULT_EXPORT_INTERVAL_S:.0f} s; aim <= 2); a delta's GET + np.load "
        f"{bucket['bucket_delta_raw_fetch_ms']:.1f} ms; new base served {bucket['bucket_base_lag_ms']:.0f} ms after its write"
    )
    print(
        f"  memory of `ctrps serve --follow` (the default LR model, {memory['memory_optimizer']}; "
        f"{memory['memory_rows']:,} rows, then {MEMORY_DELTAS} deltas and a new base of {memory['memory_rows_max']:,}): "
        f"process {memory['replica_process_base_mb']:.0f} MiB before any version; "
        f"{memory['replica_bytes_per_row']:.1f} B/row held (RSS over that, the most of any version; "
        f"the tables count {memory['replica_table_bytes_per_row']:.1f}), "
        f"peak {memory['replica_peak_bytes_per_row']:.1f} B/row (a new base beside the served one); "
        f"its first base loaded in {memory['replica_base_load_ms']:.0f} ms "
        f"({memory['replica_base_load_rows_per_s'] / 1e6:.2f}M rows/s)"
    )
    return print_result(result, args)


if __name__ == "__main__":
    sys.exit(main())
