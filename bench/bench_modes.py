"""Benchmark: the update modes side by side — async (gradients applied as
they arrive), sync (the workers' gradients summed and applied once per
mini-batch step) and geo (local copies, parameter differences pushed every
``--geo-steps`` mini-batches) — on the same stream, with 2 workers and 2
shard server processes (``ctrps shard``, pulls and pushes over the TCP RPC;
shard 0 hosts the coordinator, and exports only on demand).

A topic on the embedded broker (or ``CTRPS_KAFKA_BOOTSTRAP``) is pre-loaded
once with synthetic Criteo-like events (4 partitions). For each mode, fresh
shard servers are started and 2 workers of a fresh group (one decode process
each, in this process) train the whole topic. Per mode it reports:

- events/s, from the moment both workers hold 2 partitions to the last
  event trained. A worker fetches nothing until it holds its 2 partitions
  (the group forms as members join: the first would otherwise train alone
  until the second's rebalance); at the default sizes each worker's share is
  a whole number of windows, so none waits out ``--window-seconds`` for a
  last short one;
- bytes the shard servers read from and wrote to their sockets per event
  (``/proc/<pid>/io``; the shards write no files here), the workers'
  clients sending as ``ctrps worker`` does by default (key sets, compact
  counts);
- the shard servers' CPU microseconds per event (``/proc/<pid>/stat``), and
  the workers' (this process: both workers' consuming and training, their
  decode processes apart);
- progressive log loss and AUC (each event predicted before it is learnt
  from), event-weighted over both workers' windows, and over the second
  half of the stream;
- async: the staleness distribution the shards counted.

With ``--link-mbps M``, each worker reaches the shards through a link of M
megabits a second each way (`link.Link`: serialisation delay of its pull
and push frames, in turn): what each mode sends then limits its events/s as
a network would, where without it this machine's loopback never does.

Async is the baseline: sync's and geo's figures are printed as ratios to it.
The full run repeats the three modes in 3 rounds (``--rounds``) and reports
medians (ratios: the median of each round's ratio); ``--quick`` runs one
round of 160k events.

Run: ``python bench/bench_modes.py [--quick]``; the last line is JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
from typing import Any

import numpy as np
import uvloop
from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log
from link import Link, linked_client
from running import (
    PARTITIONS,
    RunningWorkers,
    cpu_seconds,
    each_round,
    partitions_held,
    start_shards,
    stop_shards,
    wait_healthy,
)

from app.config.worker import WorkerSettings
from consumers.worker import WindowReport, Worker, WorkerConfig
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import make_model
from ps_core.net.client import PSClient
from ps_core.net.wire import WireFormat

log = progress_log("bench_modes")


def io_bytes(pid: int) -> tuple[int, int]:
    """(bytes read, bytes written) by process `pid` through any syscall."""
    got: dict[str, int] = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            name, _, value = line.partition(":")
            got[name] = int(value)
    return got["rchar"], got["wchar"]


def worker_wire() -> WireFormat:
    """How ``ctrps worker`` sends pulls and pushes by default (key sets,
    compact counts): the modes are compared as a user runs them."""
    return WorkerSettings(bootstrap="unused:9092", shards=("http://unused",)).wire()


def start_together(workers: list[Worker]) -> None:
    """Keep the workers from fetching until each holds its even share of the
    partitions: the broker forms the group as members join, so the first
    worker would otherwise train alone until the second one's rebalance,
    and the modes would be compared on different splits of the work."""
    share = PARTITIONS // len(workers)
    ready: dict[int, Any] = {}

    def gate(i: int, worker: Worker) -> None:
        assigned = worker._on_assigned

        async def on_assigned(partitions: Any) -> None:
            ready.pop(i, None)
            if len(partitions) == share:
                await assigned(partitions)  # checks offsets, seeks, resumes
            consumer = worker._consumer
            if consumer is None:
                return
            consumer.pause(*partitions)
            if len(partitions) != share:
                return
            ready[i] = partitions
            if len(ready) == len(workers):
                for j, held in ready.items():
                    c = workers[j]._consumer
                    if c is not None:
                        c.resume(*held)

        worker._on_assigned = on_assigned  # type: ignore[method-assign,assignment]

    for i, w in enumerate(workers):
        gate(i, w)


def weighted(reports: list[WindowReport], field: str) -> float:
    """`field` of the reports' metrics, weighted by their events."""
    ev = np.array([r.metrics.events for r in reports], dtype=np.float64)
    v = np.array([getattr(r.metrics, field) for r in reports], dtype=np.float64)
    return float((ev * v).sum() / ev.sum())


async def run_mode(mode: str, bootstrap: str, topic: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """2 workers of a fresh group train the topic in `mode` against 2 fresh
    shard servers (shard 0 hosting the coordinator, whose barrier sync needs)."""
    exports = tempfile.mkdtemp(prefix="bench-modes-")
    procs, urls = start_shards(2, exports=exports)
    try:
        await wait_healthy(urls)
        group = f"bench-{mode}-{uuid.uuid4().hex[:8]}"
        model = make_model(args.model, "ctr", mode=mode)
        clients = [
            linked_client(urls, worker_wire(), Link(args.link_mbps))
            if args.link_mbps
            else PSClient.connect(urls, wire=worker_wire())
            for _ in range(2)
        ]
        controls = [ControlClient.connect(urls) for _ in range(2)]
        workers = [
            Worker(
                WorkerConfig(
                    bootstrap,
                    topic=topic,
                    group=group,
                    dlq_topic=topic + ".dlq",
                    window_seconds=args.window_seconds,
                    window_events=args.window_events,
                    mini_batch=args.mini_batch,
                    mini_batch_ramp=0,  # async at sync's and geo's fixed mini-batches
                    decode_processes=1,
                    mode=mode,
                    geo_steps=args.geo_steps,
                    worker_id=f"{mode}-{i}",
                ),
                clients[i],
                controls[i],
                model,
            )
            for i in range(2)
        ]
        start_together(workers)
        shard_pids = [p.pid for p in procs]
        t0: float | None = None
        trained0 = 0
        cpu0 = own0 = 0.0
        try:
            async with RunningWorkers(*workers) as running:
                async for _ in running.polls(n, mode, progress=log):
                    if t0 is None and all(partitions_held(w) == PARTITIONS // 2 for w in workers):
                        t0, trained0 = time.perf_counter(), running.trained()
                        cpu0 = sum(cpu_seconds(p) for p in shard_pids)
                        own0 = cpu_seconds(os.getpid())
                        io0 = [io_bytes(p) for p in shard_pids]
                t1 = time.perf_counter()
                cpu1 = sum(cpu_seconds(p) for p in shard_pids)
                own1 = cpu_seconds(os.getpid())
                io1 = [io_bytes(p) for p in shard_pids]
                stats = await controls[0].stats()
        finally:
            for c in clients:
                await c.close()
            for control in controls:
                await control.close()
    finally:
        stop_shards(procs)
        shutil.rmtree(exports, ignore_errors=True)
    if t0 is None:
        raise RuntimeError(f"{mode}: the two workers never held {PARTITIONS // 2} partitions each")
    measured = n - trained0
    reports = [r for w in workers for r in w.stats.history]
    reports.sort(key=lambda r: r.window)
    late = [r for w in workers for r in w.stats.history[len(w.stats.history) // 2 :]]
    out: dict[str, Any] = {
        "events_per_s": measured / (t1 - t0),
        "events_measured": measured,
        "bytes_to_shards_per_event": sum(b[0] - a[0] for a, b in zip(io0, io1)) / measured,
        "bytes_from_shards_per_event": sum(b[1] - a[1] for a, b in zip(io0, io1)) / measured,
        "shard_cpu_us_per_event": (cpu1 - cpu0) * 1e6 / measured,
        "workers_cpu_us_per_event": (own1 - own0) * 1e6 / measured,
        "progressive_logloss": weighted(reports, "logloss"),
        "progressive_auc": weighted(reports, "auc"),
        "progressive_logloss_second_half": weighted(late, "logloss"),
        "progressive_auc_second_half": weighted(late, "auc"),
    }
    if mode == "sync":
        out["sync_steps"] = sum(w.stats.sync_steps for w in workers)
    if mode == "geo":
        out["geo_rounds"] = sum(w.stats.geo_rounds for w in workers)
        out["geo_keys_pulled"] = sum(w.geo.pulled_keys for w in workers if w.geo is not None)
        out["geo_keys_pushed"] = sum(w.geo.pushed_keys for w in workers if w.geo is not None)
    if mode == "async":
        buckets: dict[str, int] = {}
        total = count = 0
        for shard in stats:
            s = shard.tables["ctr_w"].staleness
            for bound, k in s.buckets.items():
                buckets[bound] = buckets.get(bound, 0) + k
            total += s.sum
            count += s.count
        out["staleness_buckets"] = buckets
        out["staleness_mean"] = total / count if count else 0.0
        below = np.cumsum(list(buckets.values()))
        out["staleness_p99"] = list(buckets)[int(np.searchsorted(below, 0.99 * below[-1]))]
    log(
        f"{mode}: {out['events_per_s']:,.0f} events/s, {out['bytes_to_shards_per_event']:,.0f} B/event to the "
        f"shards, {out['bytes_from_shards_per_event']:,.0f} back, shard CPU {out['shard_cpu_us_per_event']:.1f} "
        f"us/event, workers' CPU {out['workers_cpu_us_per_event']:.1f} us/event, "
        f"progressive logloss {out['progressive_logloss']:.4f} AUC {out['progressive_auc']:.4f}"
    )
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    n = args.events or (160_000 if args.quick else 600_000)
    rounds = await each_round(
        n,
        args.seed,
        args.rounds,
        ("async", "sync", "geo"),
        lambda mode, bootstrap, topic: run_mode(mode, bootstrap, topic, n, args),
        lambda mode: (
            f"{mode}: 2 workers, 2 shard servers"
            + (f", each worker's link {args.link_mbps:g} Mbit/s each way" if args.link_mbps else "")
        ),
        log,
    )

    def ratio_of(r: dict[str, dict[str, Any]]) -> dict[str, float]:
        a, g, y = r["async"], r["geo"], r["sync"]
        return {
            "sync_ratio_events_per_s_vs_async": y["events_per_s"] / a["events_per_s"],
            "sync_ratio_bytes_to_shards_vs_async": y["bytes_to_shards_per_event"] / a["bytes_to_shards_per_event"],
            "sync_ratio_shard_cpu_vs_async": y["shard_cpu_us_per_event"] / a["shard_cpu_us_per_event"],
            "sync_auc_minus_async": y["progressive_auc"] - a["progressive_auc"],
            "geo_ratio_events_per_s_vs_async": g["events_per_s"] / a["events_per_s"],
            "geo_ratio_bytes_to_shards_vs_async": g["bytes_to_shards_per_event"] / a["bytes_to_shards_per_event"],
            "geo_ratio_bytes_from_shards_vs_async": g["bytes_from_shards_per_event"] / a["bytes_from_shards_per_event"],
            "geo_ratio_shard_cpu_vs_async": g["shard_cpu_us_per_event"] / a["shard_cpu_us_per_event"],
            "geo_auc_minus_async": g["progressive_auc"] - a["progressive_auc"],
        }

    per_round = [ratio_of(r) for r in rounds]
    ratios = {k: float(np.median([r[k] for r in per_round])) for k in per_round[0]}
    result = {
        mode: {
            k: (float(np.median([r[mode][k] for r in rounds])) if isinstance(v, (int, float)) else v)
            for k, v in rounds[-1][mode].items()
        }
        for mode in rounds[-1]
    }
    a = result["async"]
    if args.rounds > 1:
        log(
            "medians of "
            + str(args.rounds)
            + " rounds: "
            + ", ".join(f"{m} {r['events_per_s']:,.0f} events/s" for m, r in result.items())
        )
    log(
        "vs async: "
        + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
        + f"; async staleness mean {a['staleness_mean']:.2f}, p99 <= {a['staleness_p99']}"
    )
    return {
        "mode": bench_mode(args.quick),
        "events": n,
        "model": args.model,
        "workers": 2,
        "shards": 2,
        "mini_batch": args.mini_batch,
        "geo_steps": args.geo_steps,
        "link_mbps": args.link_mbps,
        "window_events": args.window_events,
        "window_seconds": args.window_seconds,
        "rounds": args.rounds,
        **{f"rounds_{m}_events_per_s": [r[m]["events_per_s"] for r in rounds] for m in ("async", "sync", "geo")},
        **{f"{m}_{k}": v for m, r in result.items() for k, v in r.items()},
        **ratios,
        "elapsed_s": elapsed_s(),
    }


if __name__ == "__main__":
    parser = bench_parser(__doc__ or "", "160k events (under a minute)", seed=0, record=True)
    parser.add_argument("--events", type=int, help="override the number of events")
    parser.add_argument("--model", choices=("lr", "fm"), default="lr")
    parser.add_argument("--mini-batch", type=int, default=256, help="events per mini-batch")
    parser.add_argument("--geo-steps", type=int, default=8, help="geo: mini-batches between pushes")
    parser.add_argument("--window-events", type=int, default=10_000, help="events per window")
    parser.add_argument("--window-seconds", type=float, default=1.0, help="wall seconds a window stays open at most")
    parser.add_argument(
        "--rounds", type=int, help="rounds of the three modes; figures are medians (default 3, --quick 1)"
    )
    parser.add_argument(
        "--link-mbps",
        type=float,
        default=0.0,
        help="each worker's link to the shards, megabits a second each way (0: none, the loopback as it is)",
    )
    parsed = parser.parse_args()
    if parsed.rounds is None:
        parsed.rounds = 1 if parsed.quick else 3
    print_result(uvloop.run(main(parsed)), parsed)
