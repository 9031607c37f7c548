"""Benchmark: compressed pulls and pushes — float32, float16 and int8 values,
with and without key sets (pushes naming their pull's keys) — against plain
float32 frames with every key (frame format 1), in one run.

Per wire format (``ps_core.net.wire.WireFormat``):

- **bytes per mini-batch** on the wire, both directions, counted by the
  worker's client (``WireStats``) while a worker trains the stream;
- **worker events/s**: one worker (one decode process, in this process)
  trains a pre-loaded topic (4 partitions, synthetic Criteo-like events on
  the embedded broker) against 2 fresh shard server processes (``ctrps
  shard``, pulls and pushes over the TCP RPC), from assignment to the last
  event;
- **progressive log loss and AUC** of that run (each event predicted before
  it is learnt from), event-weighted over its windows;
- **100k-key round trip p50**: a pull of 100,000 keys then the push of their
  gradients (``PSClient.pull`` then ``push``, one shard server over the RPC).

float16 and int8 are measured with both unbiased roundings (stochastic,
and error feedback), so the run says which keeps log loss closer to float32.
Ratios are to the float32, format 1 baseline measured in the same run.

Run: ``python bench/bench_compression.py [--quick]``; the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import uvloop
from bench_worker import PARTITIONS, preload, start_shards, stop_shards, wait_healthy
from common import bench_parser, elapsed_s, progress_log

from consumers.broker import EmbeddedBroker, create_topics
from consumers.synthetic import SyntheticStream
from consumers.training import AsyncTraining
from consumers.worker import WindowReport, Worker, WorkerConfig, WorkerStats
from ps_core.checkpoint.control import ControlClient
from ps_core.model.batch import EventBatch
from ps_core.model.hasher import FeatureHasher
from ps_core.model.models import make_model
from ps_core.net.client import PSClient
from ps_core.net.wire import WireFormat
from ps_core.store.table import TableConfig

log = progress_log("bench_compression")

BASE = "f32"
FORMATS: dict[str, WireFormat] = {
    # name: format (the first is the baseline: format 1 frames)
    "f32": WireFormat(),
    "f32_key_sets": WireFormat(key_sets=True, compact_counts=True),
    "f16": WireFormat(push="f16", pull="f16", compact_counts=True),
    "f16_key_sets": WireFormat(push="f16", pull="f16", key_sets=True, compact_counts=True),
    "f16_key_sets_feedback": WireFormat(
        push="f16", pull="f16", key_sets=True, compact_counts=True, rounding="feedback"
    ),
    "int8": WireFormat(push="int8", pull="f16", compact_counts=True),
    "int8_key_sets": WireFormat(push="int8", pull="f16", key_sets=True, compact_counts=True),
    "int8_key_sets_feedback": WireFormat(
        push="int8", pull="f16", key_sets=True, compact_counts=True, rounding="feedback"
    ),
}


def weighted(reports: list[WindowReport], field: str) -> float:
    """`field` of the reports' metrics, weighted by their events."""
    ev = np.array([r.metrics.events for r in reports], dtype=np.float64)
    v = np.array([getattr(r.metrics, field) for r in reports], dtype=np.float64)
    return float((ev * v).sum() / ev.sum())


async def train(
    name: str, wire: WireFormat, bootstrap: str, topic: str, n: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One worker trains the topic against 2 fresh shard servers over `wire`."""
    procs, urls = start_shards(2)
    try:
        await wait_healthy(urls)
        async with PSClient.connect(urls, wire=wire) as client, ControlClient.connect(urls) as control:
            worker = Worker(
                WorkerConfig(
                    bootstrap,
                    topic=topic,
                    group=f"bench-{name}-{uuid.uuid4().hex[:8]}",
                    dlq_topic=topic + ".dlq",
                    window_seconds=3600,
                    window_events=args.window_events,
                    mini_batch=args.mini_batch,
                    decode_processes=1,
                ),
                client,
                control,
                make_model(args.model, "ctr"),
            )
            stop = asyncio.Event()
            task = asyncio.create_task(worker.run(stop))
            deadline = time.monotonic() + 600
            t0: float | None = None
            last_log = 0.0
            try:
                while worker.stats.events_trained + worker.stats.dead_letters < n:
                    if task.done():
                        task.result()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name}: trained {worker.stats.events_trained}/{n}")
                    if t0 is None and worker._consumer is not None and worker._consumer.assignment():
                        t0 = time.perf_counter()
                        wire0 = client.wire_stats()
                        trained0 = worker.stats.events_trained
                    if time.perf_counter() - last_log > 2:
                        log(f"  {name}: trained {worker.stats.events_trained}/{n}")
                        last_log = time.perf_counter()
                    await asyncio.sleep(0.02)  # poll interval
                t1 = time.perf_counter()
                wire1 = client.wire_stats()
            finally:
                stop.set()
                await asyncio.wait_for(task, 60)
    finally:
        stop_shards(procs)
    assert t0 is not None
    reports = worker.stats.history
    # Mini-batches of the measured span: one push (and one pull) each per table.
    steps = max(1, round((n - trained0) / args.mini_batch))
    sent = wire1.bytes_sent - wire0.bytes_sent
    received = wire1.bytes_received - wire0.bytes_received
    out = {
        "events_per_s": (n - trained0) / (t1 - t0),
        "wire_bytes_per_mini_batch": (sent + received) / steps,
        "wire_bytes_sent_per_mini_batch": sent / steps,
        "wire_bytes_received_per_mini_batch": received / steps,
        "key_set_pushes": wire1.key_set_pushes,
        "key_set_misses": wire1.key_set_misses,
        "values_clipped": wire1.values_clipped,
        "kafka_progressive_logloss": weighted(reports, "logloss"),
        "kafka_progressive_auc": weighted(reports, "auc"),
    }
    log(
        f"{name}: {out['events_per_s']:,.0f} events/s, {out['wire_bytes_per_mini_batch']:,.0f} B per mini-batch, "
        f"logloss {out['kafka_progressive_logloss']:.5f} AUC {out['kafka_progressive_auc']:.5f}"
    )
    return out


async def accuracy(wire: WireFormat, batches: list[EventBatch], args: argparse.Namespace) -> dict[str, float]:
    """Progressive log loss and AUC of the worker's own training loop
    (`AsyncTraining`) over the same event batches, in the same order, against
    2 fresh shard servers over `wire`: only the wire's rounding differs from
    one format to the next (the Kafka runs above interleave partitions as
    their fetches come, which moves log loss by ~0.2% from run to run)."""
    procs, urls = start_shards(2)
    try:
        await wait_healthy(urls)
        async with PSClient.connect(urls, wire=wire) as client, ControlClient.connect(urls) as control:
            model = make_model(args.model, "ctr")
            for table in model.tables():
                await control.declare(table)
            training = AsyncTraining(client, model, WorkerStats(), args.mini_batch)
            losses, aucs, sizes = [], [], []
            for batch in batches:  # one window each

                async def pieces(b: EventBatch = batch) -> AsyncIterator[EventBatch]:
                    yield b

                m = await training.train(pieces(), _NO_WINDOW)  # type: ignore[arg-type]
                losses.append(m.logloss)
                aucs.append(m.auc)
                sizes.append(m.events)
    finally:
        stop_shards(procs)
    w = np.array(sizes, np.float64)
    return {
        "progressive_logloss": float((w * losses).sum() / w.sum()),
        "progressive_auc": float((w * aucs).sum() / w.sum()),
    }


class _NoWindow:
    """What `AsyncTraining` reads of a window: the event time of a batch without any."""

    last_ts_ms = 0


_NO_WINDOW = _NoWindow()


def synthetic_batches(n: int, window: int, seed: int) -> list[EventBatch]:
    """`n` synthetic events (the topic's, by seed) hashed in batches of `window`."""
    hasher = FeatureHasher("ctr")
    stream = SyntheticStream(seed=seed, events_per_s=1e6)
    out = []
    for events in stream.iter_batches(n, window):
        batch, errors = hasher.featurize(events)
        if errors:
            raise RuntimeError(f"{len(errors)} synthetic events refused: {next(iter(errors.values()))}")
        out.append(batch)
    return out


async def round_trip_p50(wire: WireFormat, url: str, keys: int, reps: int) -> float:
    """p50 ms of a pull of `keys` keys then the push of their gradients."""
    rng = np.random.default_rng(1)
    async with PSClient.connect([url], wire=wire) as client, ControlClient.connect([url]) as control:
        table = f"rt_{uuid.uuid4().hex[:8]}"  # a fresh table per format: none pays another's growth
        await control.declare(TableConfig(table, 1, {"name": "ftrl", "alpha": 0.05}))
        pool = rng.integers(1, 2**63, keys, dtype=np.uint64)
        counts = np.ones((keys, 2), np.float32)
        times = []
        for _ in range(reps + 2):
            # The same keys every time (the first round trip inserts them), in a new order.
            routed = client.route(rng.permutation(pool))
            grads = rng.normal(0, 0.01, keys).astype(np.float32)
            t = time.perf_counter()
            await client.pull(table, routed)
            await client.push(table, routed, grads, counts=counts)
            times.append(time.perf_counter() - t)
    return float(np.median(times[2:]) * 1e3)  # the first two warm the connection and the table


async def main(args: argparse.Namespace) -> dict[str, Any]:
    n = args.events or (60_000 if args.quick else 400_000)
    if n % args.window_events:
        raise SystemExit(f"--events must be a multiple of --window-events ({args.window_events})")
    names = (
        list(FORMATS)
        if not args.quick
        else ["f32", "f32_key_sets", "f16_key_sets", "int8_key_sets", "int8_key_sets_feedback"]
    )
    broker = EmbeddedBroker()
    await broker.start()
    try:
        topic = f"bench-{uuid.uuid4().hex[:8]}"
        await create_topics(broker.bootstrap, {topic: PARTITIONS, topic + ".dlq": 1})
        log(f"broker {broker.bootstrap}; preloading {n} events into {PARTITIONS} partitions")
        await preload(broker.bootstrap, topic, n, args.seed, events_per_s=1e6)
        runs = {}
        for name in names:
            log(f"{name} ({FORMATS[name].describe()}): 1 worker, 2 shard servers")
            runs[name] = await train(name, FORMATS[name], broker.bootstrap, topic, n, args)
    finally:
        broker.stop()
    log(f"accuracy: the worker's training loop over the same {n} events, in order, per format")
    batches = synthetic_batches(n, args.window_events, args.seed)
    for name in names:
        runs[name].update(await accuracy(FORMATS[name], batches, args))
        log(f"{name}: logloss {runs[name]['progressive_logloss']:.5f} AUC {runs[name]['progressive_auc']:.5f} (in order)")
    procs, urls = start_shards(1)
    try:
        await wait_healthy(urls)
        for name in names:
            runs[name]["round_trip_100k_p50_ms"] = await round_trip_p50(FORMATS[name], urls[0], 100_000, args.reps)
            log(f"{name}: 100k-key pull + push p50 {runs[name]['round_trip_100k_p50_ms']:.1f} ms")
    finally:
        stop_shards(procs)
    base = runs[BASE]
    ratios = {
        name: {
            "ratio_wire_bytes_vs_f32": base["wire_bytes_per_mini_batch"] / r["wire_bytes_per_mini_batch"],
            "ratio_logloss_vs_f32": r["progressive_logloss"] / base["progressive_logloss"],
            "auc_minus_f32": r["progressive_auc"] - base["progressive_auc"],
            "ratio_events_per_s_vs_f32": r["events_per_s"] / base["events_per_s"],
            "ratio_round_trip_vs_f32": r["round_trip_100k_p50_ms"] / base["round_trip_100k_p50_ms"],
        }
        for name, r in runs.items()
    }
    for name, r in ratios.items():
        log(
            f"{name} vs f32: {r['ratio_wire_bytes_vs_f32']:.2f}x fewer bytes, logloss {r['ratio_logloss_vs_f32']:.5f}x, "
            f"events/s {r['ratio_events_per_s_vs_f32']:.2f}x, round trip {r['ratio_round_trip_vs_f32']:.2f}x"
        )
    aims = {
        "f16_key_sets_bytes_ge_1_8x": ratios["f16_key_sets"]["ratio_wire_bytes_vs_f32"] >= 1.8,
        "int8_key_sets_bytes_ge_2_2x": ratios["int8_key_sets"]["ratio_wire_bytes_vs_f32"] >= 2.2,
        "f16_logloss_le_1_002x": ratios["f16_key_sets"]["ratio_logloss_vs_f32"] <= 1.002,
        "int8_logloss_le_1_005x": ratios["int8_key_sets"]["ratio_logloss_vs_f32"] <= 1.005,
        "events_per_s_not_below_f32": min(
            ratios[k]["ratio_events_per_s_vs_f32"] for k in ("f16_key_sets", "int8_key_sets")
        )
        >= 1.0,
    }
    log("aims: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in aims.items()))
    return {
        "mode": "quick" if args.quick else "full",
        "events": n,
        "model": args.model,
        "mini_batch": args.mini_batch,
        "shards": 2,
        "runs": runs,
        "ratios": ratios,
        "aims_met": aims,
        "elapsed_s": elapsed_s(),
    }


def parse_args() -> argparse.Namespace:
    p = bench_parser(
        "Wire formats of pulls and pushes: bytes, speed and accuracy against float32.",
        "60k events, 5 formats, 5 round trips (under a minute)",
        seed=11,
    )
    p.add_argument("--events", type=int, default=0, help="events in the topic (default 400k; 60k with --quick)")
    p.add_argument("--window-events", type=int, default=20_000, help="events per window")
    p.add_argument("--mini-batch", type=int, default=256, help="events per pull/push step")
    p.add_argument("--model", choices=("lr", "fm"), default="lr", help="model trained")
    p.add_argument("--reps", type=int, default=0, help="100k-key round trips per format (default 20; 5 quick)")
    args = p.parse_args()
    args.reps = args.reps or (5 if args.quick else 20)
    return args


if __name__ == "__main__":
    result = uvloop.run(main(parse_args()))
    print(orjson.dumps(result).decode())
