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
Ratios are to the float32, format 1 baseline measured in the same run; the
full run repeats the Kafka runs in 3 rounds (``--rounds``) and reports
medians (events/s: the median of each round's ratio).

With ``--link-mbps M`` the worker reaches the shards through a link of M
megabits a second each way (``link.Link``, as ``bench_modes.py`` has it):
fewer bytes then show in events/s as they would where the network is the
bottleneck (the round trips are measured without it).

Replica figures: the float32 trainer's model (the same events, trained in
process) served from its serving files in each precision (``ReadTable``),
its AUC and log loss on the stream's next 20k events against the trainer's;
and bytes per feature of an LR table at 10M features (1M quick), index
included, against today's replica (a trainer's weights table, 1.5x room).

Run: ``python bench/bench_compression.py [--quick]``; the last line is JSON.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import uvloop
from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log
from link import Link, linked_client
from running import RunningWorkers, each_round, partitions_held, start_shards, stop_shards, wait_healthy

from consumers.training import AsyncTraining
from consumers.worker import WindowReport, Worker, WorkerConfig, WorkerStats
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.serving_files import PRECISIONS, serving_arrays, serving_config, serving_weights
from ps_core.model.batch import EventBatch
from ps_core.model.featurizer import FeatureHasher
from ps_core.model.metrics import evaluate
from ps_core.model.models import make_model, sigmoid
from ps_core.net.client import PSClient
from ps_core.net.wire import WireFormat
from ps_core.replica import ReadTable
from ps_core.shard import Shard
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig
from ps_core.synthetic import SyntheticStream

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
        linked = linked_client(urls, wire, Link(args.link_mbps)) if args.link_mbps else None
        async with linked or PSClient.connect(urls, wire=wire) as client, ControlClient.connect(urls) as control:
            worker = Worker(
                WorkerConfig(
                    bootstrap,
                    topic=topic,
                    group=f"bench-{name}-{uuid.uuid4().hex[:8]}",
                    dlq_topic=topic + ".dlq",
                    window_seconds=3600,
                    window_events=args.window_events,
                    mini_batch=args.mini_batch,
                    mini_batch_ramp=0,  # every step a full mini-batch: bytes per mini-batch are exact
                    decode_processes=1,
                ),
                client,
                control,
                make_model(args.model, "ctr"),
            )
            t0: float | None = None
            async with RunningWorkers(worker) as running:
                async for _ in running.polls(n, name, progress=log):
                    if t0 is None and partitions_held(worker):
                        t0 = time.perf_counter()
                        wire0 = client.wire_stats()
                        trained0 = worker.stats.events_trained
                t1 = time.perf_counter()
                wire1 = client.wire_stats()
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


async def replica_figures(
    batches: list[EventBatch], holdout: EventBatch, features: int, args: argparse.Namespace
) -> dict[str, Any]:
    """A replica's bytes per feature at `features` features (index included)
    in each precision and as today's replica held them (a trainer's table of
    weights: hash index, rows, 1.5x room), and the AUC and log loss of each
    precision's replica on held-out events against the float32 trainer's."""
    out: dict[str, Any] = {}
    # (1) What the trainer learnt, served in each precision, on the holdout.
    shard = Shard(tables=make_model(args.model, "ctr").tables())
    model = make_model(args.model, "ctr")
    training = AsyncTraining(PSClient.local([shard]), model, WorkerStats(), args.mini_batch)
    for batch in batches:

        async def pieces(b: EventBatch = batch) -> AsyncIterator[EventBatch]:
            yield b

        await training.train(pieces(), _NO_WINDOW)  # type: ignore[arg-type]
    plan = model.plan(holdout)
    snaps = {name: shard.tables[name].snapshot(None) for name in model.table_names}

    def predicted(pull: Any) -> np.ndarray:
        weights = {name: pull(name, plan.keys) for name in model.table_names}
        return sigmoid(model.logits(holdout, plan, weights))

    trainer = evaluate(predicted(lambda t, k: shard.tables[t].pull(k)), holdout.labels)
    out["trainer_auc"], out["trainer_logloss"] = trainer.auc, trainer.logloss
    for precision in PRECISIONS:
        tables = {}
        for name, snap in snaps.items():
            arrays = serving_arrays(snap, precision)
            table = ReadTable(serving_config(snap.config), precision)
            table.apply(arrays["keys"], serving_weights(arrays))
            tables[name] = table
        m = evaluate(predicted(lambda t, k, held=tables: held[t].pull(k)), holdout.labels)
        out[f"replica_{precision}_auc_minus_trainer"] = m.auc - trainer.auc
        out[f"replica_{precision}_logloss_ratio_vs_trainer"] = m.logloss / trainer.logloss
        log(
            f"replica {precision}: AUC {m.auc:.5f} ({m.auc - trainer.auc:+.5f} vs the trainer), logloss {m.logloss:.5f}"
        )
    # (2) Bytes per feature of an LR weights table holding `features` keys.
    rng = np.random.default_rng(5)
    keys = np.unique(rng.integers(0, 2**64, features, dtype=np.uint64, endpoint=False))
    weights = rng.normal(0, 0.1, (keys.size, 1)).astype(np.float32)
    config = serving_config(TableConfig("ctr_w", 1, {"name": "ftrl"}))
    today = SparseTable(config, initial_rows=int(keys.size * 1.5) + 1024)
    zeros32, zerosf = np.zeros(keys.size, np.uint32), np.zeros(keys.size, np.float32)
    today.load_rows(keys, weights, zeros32, zeros32, zerosf, zerosf)
    probe = rng.choice(keys, 100_000)

    def pull_ms(pull: Any) -> float:
        pull(probe)  # warm
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            pull(probe)
            times.append(time.perf_counter() - t0)
        return float(np.median(times) * 1e3)

    out["today_replica_bytes_per_feature"] = today.memory_bytes() / keys.size
    out["today_replica_pull_100k_ms"] = pull_ms(today.pull)
    del today
    for precision in PRECISIONS:
        table = ReadTable(config, precision)
        t0 = time.perf_counter()
        table.apply(keys, weights)
        load_s = time.perf_counter() - t0
        out[f"replica_{precision}_bytes_per_feature"] = table.memory_bytes() / keys.size
        out[f"replica_{precision}_pull_100k_ms"] = pull_ms(table.pull)
        out[f"replica_{precision}_ratio_bytes_vs_today"] = (
            out[f"replica_{precision}_bytes_per_feature"] / out["today_replica_bytes_per_feature"]
        )
        log(
            f"replica {precision}: {out[f'replica_{precision}_bytes_per_feature']:.2f} bytes per feature at "
            f"{keys.size:,} features, {out[f'replica_{precision}_ratio_bytes_vs_today']:.3f}x today's replica "
            f"({out['today_replica_bytes_per_feature']:.2f}); load {load_s:.1f} s; pull of 100k keys "
            f"{out[f'replica_{precision}_pull_100k_ms']:.1f} ms (today's {out['today_replica_pull_100k_ms']:.1f})"
        )
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
    rounds = await each_round(
        n,
        args.seed,
        args.rounds,
        names,
        lambda name, bootstrap, topic: train(name, FORMATS[name], bootstrap, topic, n, args),
        lambda name: (
            f"{name} ({FORMATS[name].describe()}): 1 worker, 2 shard servers"
            + (f", its link {args.link_mbps:g} Mbit/s each way" if args.link_mbps else "")
        ),
        log,
    )
    runs = {name: {k: float(np.median([r[name][k] for r in rounds])) for k in rounds[0][name]} for name in names}
    # The events/s ratio of each round (same load), then their median.
    speed = {
        name: float(np.median([r[name]["events_per_s"] / r[BASE]["events_per_s"] for r in rounds])) for name in names
    }
    log(f"accuracy: the worker's training loop over the same {n} events, in order, per format")
    batches = synthetic_batches(n, args.window_events, args.seed)
    for name in names:
        runs[name].update(await accuracy(FORMATS[name], batches, args))
        log(
            f"{name}: logloss {runs[name]['progressive_logloss']:.5f} AUC {runs[name]['progressive_auc']:.5f} (in order)"
        )
    log(f"replica: trained in process on the same events, served in each precision; {args.features:,} features")
    # The stream's next 20k events (the same seed: the same world), after the trained ones.
    holdout = synthetic_batches(n + args.window_events, args.window_events, args.seed)[-1]
    replica = await replica_figures(batches, holdout, args.features, args)
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
            "ratio_events_per_s_vs_f32": speed[name],
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
        "replica_f16_le_12_bytes_per_feature": replica["replica_f16_bytes_per_feature"] <= 12,
        "replica_int8_le_10_bytes_per_feature": replica["replica_int8_bytes_per_feature"] <= 10,
        "replica_auc_within_0_002": max(abs(replica[f"replica_{p}_auc_minus_trainer"]) for p in ("f16", "int8"))
        <= 0.002,
    }
    log("aims: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in aims.items()))
    return {
        "mode": bench_mode(args.quick),
        "events": n,
        "model": args.model,
        "mini_batch": args.mini_batch,
        "link_mbps": args.link_mbps,
        "shards": 2,
        "runs": runs,
        "ratios": ratios,
        "replica": replica,
        "aims_met": aims,
        "elapsed_s": elapsed_s(),
    }


def parse_args() -> argparse.Namespace:
    p = bench_parser(
        "Wire formats of pulls and pushes: bytes, speed and accuracy against float32.",
        "60k events, 5 formats, 5 round trips (under a minute)",
        seed=11,
        record=True,
    )
    p.add_argument("--events", type=int, default=0, help="events in the topic (default 400k; 60k with --quick)")
    p.add_argument("--window-events", type=int, default=20_000, help="events per window")
    p.add_argument("--mini-batch", type=int, default=256, help="events per pull/push step")
    p.add_argument("--model", choices=("lr", "fm"), default="lr", help="model trained")
    p.add_argument("--reps", type=int, default=0, help="100k-key round trips per format (default 20; 5 quick)")
    p.add_argument("--rounds", type=int, default=0, help="Kafka runs of every format (default 3; 1 quick)")
    p.add_argument("--features", type=int, default=0, help="features of the replica table (default 10M; 1M quick)")
    p.add_argument(
        "--link-mbps",
        type=float,
        default=0.0,
        help="the worker's link to the shards, megabits a second each way (0: none, the loopback as it is)",
    )
    args = p.parse_args()
    args.reps = args.reps or (5 if args.quick else 20)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.features = args.features or (1_000_000 if args.quick else 10_000_000)
    return args


if __name__ == "__main__":
    ARGS = parse_args()
    print_result(uvloop.run(main(ARGS)), ARGS)
