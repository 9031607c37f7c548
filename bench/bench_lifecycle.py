"""Benchmark: the feature lifecycle (admission, eviction, a row cap) on a long-tail stream.

A topic on the embedded broker (or ``CTRPS_KAFKA_BOOTSTRAP``) is loaded with
the synthetic stream with a long tail (``SyntheticStream(fresh=...)``: each
categorical value is a brand-new id, seen once, with probability ``--fresh``;
the true weights drift by ``--drift`` radians per hour of event time). Then
a real worker (`consumers.worker.Worker`, LR with FTRL, in-process shard)
trains the whole topic once per table lifecycle, each run in its own process
so its peak RSS is its own:

- ``none``: every id gets a row, none leaves (the baseline, today's behaviour);
- ``count2``: ``admit=count:2``;
- ``score``: ``admit=score:1`` (a click admits at once, a show without one
  with probability 0.1);
- ``ttl``: rows unseen for 120 s of event time go (well over the skew in
  event time between partitions read together);
- ``decay``: shows and clicks decay by 0.9 a pass, rows scoring under 0.3 go;
- ``cap``: ``max_rows`` a quarter of the baseline's final rows.

The shard runs an eviction pass every ``--evict-every`` seconds, as
``ctrps shard --evict-interval`` does. Reported per run: rows and table bytes
at the end, the most rows seen after a pass, peak RSS, RSS growth over the
second half of the run, progressive logloss and AUC (each event predicted
before it is learnt; window averages weighted by events), training
events/s, and eviction pauses; then ratios to the baseline.

Separately, the pause of one pass is timed on an LR/FTRL table of
``--pause-rows`` rows (TTL, decayed score and the cap all on): milliseconds
per million rows scanned.

Aims (issue 17): rows ≤ 0.3× the baseline at logloss ≤ 1.005× with count:2
or score admission; the cap holds RSS flat over the second half; a pass
≤ 50 ms per 1M rows; training events/s within 10 % of the baseline.

Run: ``python bench/bench_lifecycle.py [--quick]``; the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import uvloop
from aiokafka import AIOKafkaProducer
from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from running import RunningWorkers, partitions_held  # noqa: E402

from consumers.broker import EmbeddedBroker, create_topics  # noqa: E402
from consumers.worker import Worker, WorkerConfig  # noqa: E402
from ps_core.checkpoint.control import ControlClient  # noqa: E402
from ps_core.model.models import LogisticRegression  # noqa: E402
from ps_core.net.client import PSClient  # noqa: E402
from ps_core.shard import Shard  # noqa: E402
from ps_core.store.lifecycle import Lifecycle  # noqa: E402
from ps_core.store.table import SparseTable  # noqa: E402
from ps_core.store.table_config import TableConfig  # noqa: E402
from ps_core.synthetic import SyntheticStream  # noqa: E402

PARTITIONS = 2
WINDOW_EVENTS = 20_000
CONFIGS: dict[str, dict[str, Any]] = {
    "none": {},
    "count2": {"admit": "count:2"},
    "score": {"admit": "score:1"},
    "ttl": {"ttl_s": 120.0},
    "decay": {"decay": 0.9, "min_score": 0.3},
    "cap": {},  # max_rows: a quarter of the baseline's rows, set once it ran
}
AIM_ROWS_RATIO = 0.3
AIM_LOGLOSS_RATIO = 1.005
AIM_PAUSE_MS_PER_1M = 50.0
AIM_RATE_RATIO = 0.9

log = progress_log("bench_lifecycle")
"""One progress line on stderr."""


# -- one run, in its own process -------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def run_one(
    bootstrap: str, topic: str, events: int, rules: dict[str, Any], evict_every_s: float
) -> dict[str, Any]:
    """Train the topic once with `rules` on the model's table; the run's figures."""
    shard = Shard(lifecycle=Lifecycle(**rules))
    client, control = PSClient.local([shard]), ControlClient.local([shard])
    config = WorkerConfig(
        bootstrap,
        topic=topic,
        group=f"bench-{uuid.uuid4().hex[:8]}",
        dlq_topic=topic + ".dlq",
        window_seconds=3600,
        window_events=WINDOW_EVENTS,
        decode_processes=1,
    )
    worker = Worker(config, client, control, LogisticRegression("ctr"))
    t_start: float | None = None
    pauses: list[float] = []
    scanned: list[int] = []
    rows_after: list[int] = []
    rows_before: list[int] = []
    rss: list[tuple[int, float, int]] = []  # events trained, RSS MB, table bytes
    next_pass = 0.0
    async with RunningWorkers(worker) as running:
        async for _ in running.polls(events, "worker", timeout_s=900, poll_s=0.01):
            if t_start is None and partitions_held(worker):
                t_start = time.perf_counter()
            now = time.perf_counter()
            table = shard.tables.get("ctr_w")
            if t_start is not None and now >= next_pass and table is not None:
                next_pass = now + evict_every_s
                rows_before.append(len(table))
                for report in shard.evict().values():
                    pauses.append(report.pause_ms)
                    scanned.append(report.scanned)
                rows_after.append(len(table))
                rss.append((worker.stats.events_trained, rss_mb(), table.memory_bytes()))
        t_done = time.perf_counter()
    assert t_start is not None
    table = shard.tables["ctr_w"]
    hist = worker.stats.history
    ev = np.array([r.events for r in hist], dtype=np.float64)
    second = [(mb, nbytes) for trained, mb, nbytes in rss if trained >= events // 2]
    stats = table.lifecycle_stats()
    return {
        "events_per_s": events / (t_done - t_start),
        "rows": len(table),
        "rows_peak": max(rows_before, default=len(table)),
        "rows_peak_after_pass": max(rows_after, default=len(table)),
        "table_bytes": table.memory_bytes(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_growth_second_half_mb": second[-1][0] - second[0][0] if len(second) > 1 else 0.0,
        "table_bytes_growth_second_half": second[-1][1] - second[0][1] if len(second) > 1 else 0,
        "logloss": float((ev * [r.metrics.logloss for r in hist]).sum() / ev.sum()),
        "auc": float((ev * [r.metrics.auc for r in hist]).sum() / ev.sum()),
        "evicted": stats["evicted"],
        "admission": stats.get("admission", {}),
        "eviction_passes": len(pauses),
        "eviction_pause_max_ms": max(pauses, default=0.0),
        "eviction_pause_ms_per_1m_rows": max(
            (p / max(s, 1) * 1e6 for p, s in zip(pauses, scanned) if s >= 10_000), default=0.0
        ),
    }


# -- the pause of one pass -------------------------------------------------------------


def pause_per_million(rows: int, seed: int) -> dict[str, float]:
    """One eviction pass (TTL, decay and score, cap all on) over an LR/FTRL
    table of `rows` rows, at once: ms per million rows scanned; and the
    same pass in steps, as a shard runs it: its longest step."""
    table = pause_table(rows, seed)
    report = table.evict()  # the pass that removes rows: the longest
    again = table.evict()  # one that finds nothing to remove
    stepped = pause_table(rows, seed)
    steps = list(stepped.eviction_steps())
    return {
        "rows": report.scanned,
        "removed": report.removed,
        "pause_ms_per_1m_rows": report.pause_ms / report.scanned * 1e6,
        "pause_ms_per_1m_rows_nothing_removed": again.pause_ms / max(again.scanned, 1) * 1e6,
        "steps": len(steps),
        "step_pause_max_ms": steps[-1].pause_ms,
        "stepped_rows_after": len(stepped),
        "rows_after": len(table),
    }


def pause_table(rows: int, seed: int) -> SparseTable:
    """An LR/FTRL table of about `rows` rows whose rules remove some 40 % of them."""
    # A push of 100k keys a minute of event time: TTL takes the oldest 30 %
    # of the rows, the cap a few % more.
    span_s = (rows // 100_000 - 1) * 60.0
    lc = Lifecycle(ttl_s=0.7 * span_s, decay=0.98, min_score=0.05, max_rows=int(rows * 0.65), low_water=0.9)
    table = SparseTable(TableConfig("t", 1, {"name": "ftrl"}, lifecycle=lc), initial_rows=rows)
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(1, 2**63, size=rows, dtype=np.int64)).astype(np.uint64)
    rows = keys.size  # (a repeat among 2**63 is unlikely, not impossible)
    step = 100_000
    for i in range(0, rows, step):
        k = np.sort(keys[i : i + step])
        counts = np.stack([rng.integers(1, 20, k.size), rng.integers(0, 2, k.size)], 1).astype(np.float32)
        table.push(k, rng.normal(size=k.size).astype(np.float32), counts=counts, event_time=float(i // step * 60))
    return table


# -- the driver -----------------------------------------------------------------------------


async def preload(bootstrap: str, topic: str, n: int, seed: int, fresh: float, drift: float) -> dict[str, float]:
    """Produce the stream; its share of distinct ids seen once."""
    stream = SyntheticStream(seed=seed, fresh=fresh, drift=drift)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=1 << 20)
    await producer.start()
    seen: dict[str, int] = {}
    try:
        sent = 0
        for events in stream.iter_batches(n, 10_000):
            futs = [await producer.send(topic, orjson.dumps(ev)) for ev in events]
            await asyncio.gather(*futs)
            for ev in events:  # building the workload's statistics, outside any timed region
                for name, v in ev["features"].items():
                    if name[0] == "C":
                        seen[v] = seen.get(v, 0) + 1
            sent += len(events)
            log(f"  produced {sent}/{n}")
    finally:
        await producer.stop()
    once = sum(1 for c in seen.values() if c == 1)
    return {"distinct_ids": float(len(seen)), "seen_once_share": once / max(1, len(seen))}


def run_child(name: str, rules: dict[str, Any], args: Any, bootstrap: str, topic: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        json.dumps(rules),
        "--bootstrap",
        bootstrap,
        "--topic",
        topic,
        "--events",
        str(args.events),
        "--evict-every",
        str(args.evict_every),
    ]
    log(f"run {name}: {rules or 'no rules'}")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"run {name} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    log(
        f"  {name}: {result['events_per_s']:.0f} events/s, rows {result['rows']} (peak {result['rows_peak']}), "
        f"logloss {result['logloss']:.5f}, auc {result['auc']:.4f}, peak RSS {result['peak_rss_mb']:.0f} MB, "
        f"RSS growth over the second half {result['rss_growth_second_half_mb']:.1f} MB "
        f"(table {result['table_bytes_growth_second_half'] / 2**20:.1f} MB), "
        f"pause max {result['eviction_pause_max_ms']:.1f} ms ({result['eviction_pause_ms_per_1m_rows']:.0f} ms per 1M rows)"
    )
    return result


async def main(args: Any) -> dict[str, Any]:
    broker = None
    bootstrap = os.environ.get("CTRPS_KAFKA_BOOTSTRAP")
    if not bootstrap:
        broker = EmbeddedBroker()
        await broker.start()
        bootstrap = broker.bootstrap
    topic = f"lifecycle-{uuid.uuid4().hex[:6]}"
    try:
        await create_topics(bootstrap, {topic: PARTITIONS, topic + ".dlq": 1})
        log(f"producing {args.events} events (fresh {args.fresh}, drift {args.drift})")
        tail = await preload(bootstrap, topic, args.events, args.seed, args.fresh, args.drift)
        log(f"  {tail['distinct_ids']:.0f} distinct ids, {tail['seen_once_share']:.0%} seen once")
        runs: dict[str, dict[str, Any]] = {}
        for name, rules in CONFIGS.items():
            if name == "cap":
                rules = {"max_rows": max(1000, runs["none"]["rows"] // 4)}
            runs[name] = run_child(name, rules, args, bootstrap, topic)
            runs[name]["rules"] = rules
    finally:
        if broker is not None:
            broker.stop()
    log(f"timing one pass over {args.pause_rows} rows")
    pause = pause_per_million(args.pause_rows, args.seed)
    log(
        f"  {pause['pause_ms_per_1m_rows']:.1f} ms per 1M rows scanned removing {pause['removed']} rows; "
        f"{pause['pause_ms_per_1m_rows_nothing_removed']:.1f} ms removing none; in {pause['steps']:.0f} steps "
        f"the longest held the table {pause['step_pause_max_ms']:.1f} ms ({pause['stepped_rows_after']:.0f} rows "
        f"left, {pause['rows_after']:.0f} at once)"
    )
    return summarize(runs, tail, pause, args)


def summarize(
    runs: dict[str, dict[str, Any]], tail: dict[str, float], pause: dict[str, float], args: Any
) -> dict[str, Any]:
    base = runs["none"]
    print(f"\n{args.events} events, {tail['seen_once_share']:.0%} of {tail['distinct_ids']:.0f} ids seen once")
    print(
        f"{'run':8} {'rows':>9} {'x base':>7} {'MB table':>9} {'peak RSS':>9} {'logloss':>9} {'x base':>7} "
        f"{'auc':>7} {'events/s':>9} {'x base':>7}"
    )
    out: dict[str, Any] = {"bench": "lifecycle", "mode": bench_mode(args.quick), "events": args.events}
    out.update({f"tail_{k}": v for k, v in tail.items()})
    for name, r in runs.items():
        rows_ratio = r["rows"] / max(1, base["rows"])
        ll_ratio = r["logloss"] / base["logloss"]
        rate_ratio = r["events_per_s"] / base["events_per_s"]
        print(
            f"{name:8} {r['rows']:9d} {rows_ratio:7.3f} {r['table_bytes'] / 2**20:9.1f} {r['peak_rss_mb']:9.0f} "
            f"{r['logloss']:9.5f} {ll_ratio:7.4f} {r['auc']:7.4f} {r['events_per_s']:9.0f} {rate_ratio:7.3f}"
        )
        out[f"{name}_rows"] = r["rows"]
        out[f"{name}_rows_peak"] = r["rows_peak"]
        out[f"{name}_rows_ratio_vs_none"] = rows_ratio
        out[f"{name}_table_bytes"] = r["table_bytes"]
        out[f"{name}_peak_rss_mb"] = r["peak_rss_mb"]
        out[f"{name}_rss_growth_second_half_mb"] = r["rss_growth_second_half_mb"]
        out[f"{name}_table_bytes_growth_second_half"] = r["table_bytes_growth_second_half"]
        out[f"{name}_rows_peak_after_pass"] = r["rows_peak_after_pass"]
        out[f"{name}_logloss"] = r["logloss"]
        out[f"{name}_logloss_ratio_vs_none"] = ll_ratio
        out[f"{name}_auc"] = r["auc"]
        out[f"{name}_events_per_s"] = r["events_per_s"]
        out[f"{name}_events_per_s_ratio_vs_none"] = rate_ratio
        out[f"{name}_eviction_pause_max_ms"] = r["eviction_pause_max_ms"]
    cap = runs["cap"]
    print(
        f"cap of {cap['rules']['max_rows']} rows: at most {cap['rows_peak']} rows before a pass, "
        f"{cap['rows_peak_after_pass']} after; over the second half the table grew "
        f"{cap['table_bytes_growth_second_half'] / 2**20:.1f} MB and RSS {cap['rss_growth_second_half_mb']:.1f} MB "
        f"(none: {base['table_bytes_growth_second_half'] / 2**20:.1f} MB and {base['rss_growth_second_half_mb']:.1f} MB)"
    )
    print(f"one pass: {pause['pause_ms_per_1m_rows']:.1f} ms per 1M rows scanned (aim <= {AIM_PAUSE_MS_PER_1M:g})")
    out.update(
        {
            "cap_max_rows": cap["rules"]["max_rows"],
            "pause_rows": pause["rows"],
            "pause_ms_per_1m_rows": pause["pause_ms_per_1m_rows"],
            "pause_ms_per_1m_rows_nothing_removed": pause["pause_ms_per_1m_rows_nothing_removed"],
            "pause_steps": pause["steps"],
            "pause_step_max_ms": pause["step_pause_max_ms"],
            "aim_rows_ratio": AIM_ROWS_RATIO,
            "aim_logloss_ratio": AIM_LOGLOSS_RATIO,
            "aim_pause_ms_per_1m_rows": AIM_PAUSE_MS_PER_1M,
            "aim_events_per_s_ratio": AIM_RATE_RATIO,
            "elapsed_s": elapsed_s(),
        }
    )
    return out


def parse_args() -> Any:
    parser = bench_parser(
        "Feature lifecycle: rows, memory, logloss and speed with each rule, against none.",
        "300k events and a 1M-row pause (under a minute)",
        seed=3,
        record=True,
    )
    parser.add_argument("--events", type=int, help="events in the stream (default 1,000,000; quick 300,000)")
    parser.add_argument("--fresh", type=float, default=0.05, help="share of brand-new ids per value (default 0.05)")
    parser.add_argument("--drift", type=float, default=0.5, help="weight drift, radians per hour (default 0.5)")
    parser.add_argument("--evict-every", type=float, default=0.25, help="seconds between passes (default 0.25)")
    parser.add_argument("--pause-rows", type=int, help="rows of the pause table (default 4M; quick 1M)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one run, in its own process
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.events is None:
        args.events = 300_000 if args.quick else 1_000_000
    if args.events % WINDOW_EVENTS:
        # Windows close at WINDOW_EVENTS events: a last partial one would wait for events that never come.
        parser.error(f"--events must be a multiple of {WINDOW_EVENTS}")
    if args.pause_rows is None:
        args.pause_rows = 1_000_000 if args.quick else 4_000_000
    return args


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.child is not None:
        print_result(
            uvloop.run(run_one(ARGS.bootstrap, ARGS.topic, ARGS.events, json.loads(ARGS.child), ARGS.evict_every))
        )
    else:
        print_result(uvloop.run(main(ARGS)), ARGS)
